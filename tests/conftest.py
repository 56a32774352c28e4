"""Shared test setup.

vLLM needs VLLM_TARGET_DEVICE=cpu to build configs and parsers on a host without GPUs;
on a GPU host it must stay unset (vLLM treats the value as final, and servers started
from the tests would come up on the CPU platform).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
