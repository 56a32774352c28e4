"""Shared test setup.

- vLLM needs VLLM_TARGET_DEVICE=cpu to build configs and parsers on a host without GPUs;
  on a GPU host it must stay unset (vLLM treats the value as final, and servers started
  from the tests would come up on the CPU platform).
- VLLM_CONFIGURE_LOGGING=0 in the test process: otherwise vLLM's dictConfig (run inside
  create_engine_config) stops the `vllm` logger tree, ours included
  (vllm_flashinfer_ep/log.py), from propagating to the root logger caplog listens on.
  Subprocesses started by tests get their own environment.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
