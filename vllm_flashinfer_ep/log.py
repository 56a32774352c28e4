"""Loggers that print where vLLM's do.

vLLM configures only the `vllm` logger (INFO, its own handler, propagate=False), so a
logger outside that namespace stays silent at INFO inside `vllm serve`. Ours live under
`vllm.flashinfer_ep.*`; nothing here imports vLLM (the runtime stays engine-agnostic).
"""

from __future__ import annotations

import logging

ROOT = "vllm.flashinfer_ep"


def get_logger(module_name: str) -> logging.Logger:
    short = module_name.removeprefix("vllm_flashinfer_ep").lstrip(".")
    return logging.getLogger(f"{ROOT}.{short}" if short else ROOT)
