"""gsm8k of a served config (`vllm-flashinfer-ep eval gsm8k`); server.py is shared with tests."""
