"""gsm8k accuracy of a served config: `vllm-flashinfer-ep eval gsm8k --config FILE`.

config.py reads vLLM's gsm8k eval YAML schema (configs/gsm8k/), gsm8k.py serves it,
runs lm-eval's local-completions against it, judges and tears down; server.py is the
server process lifecycle (shared with tests/fault_tolerance).
"""
