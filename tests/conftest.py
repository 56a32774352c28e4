"""Shared test setup: vLLM on a host without GPUs needs VLLM_TARGET_DEVICE=cpu."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
