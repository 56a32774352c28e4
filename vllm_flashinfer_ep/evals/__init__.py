"""Accuracy evals for the FlashInfer-EP all2all backends.

`vllm-flashinfer-ep eval gsm8k --config FILE` serves a model with `vllm serve`, runs
lm-eval's gsm8k task against it and compares the score with the config's threshold.
The configs (configs/gsm8k/) use vLLM's own gsm8k eval schema so that vLLM's
tests/evals/gsm8k harness can run them unchanged too.
"""
