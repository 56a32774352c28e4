"""Loggers under `vllm.flashinfer_ep.*`: vLLM configures only the `vllm` logger (its own
handler, propagate=False), so others stay silent in `vllm serve`. No vLLM import."""

from __future__ import annotations

import logging

ROOT = "vllm.flashinfer_ep"


def get_logger(module_name: str) -> logging.Logger:
    short = module_name.removeprefix("vllm_flashinfer_ep").lstrip(".")
    return logging.getLogger(f"{ROOT}.{short}" if short else ROOT)
