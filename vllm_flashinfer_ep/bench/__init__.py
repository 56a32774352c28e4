"""Decode-step all2all benchmark (`vllm-flashinfer-ep bench`)."""
