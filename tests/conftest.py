"""Shared test setup.

- vLLM needs VLLM_TARGET_DEVICE=cpu to build configs and parsers on a host without GPUs;
  on a GPU host it must stay unset (vLLM treats the value as final, and servers started
  from the tests would come up on the CPU platform).
- VLLM_CONFIGURE_LOGGING=0 in the test process: otherwise vLLM's dictConfig (run inside
  create_engine_config) stops the `vllm` logger tree, ours included
  (vllm_flashinfer_ep/log.py), from propagating to the root logger caplog listens on.
  Subprocesses started by tests get their own environment.
- FLASHINFER_EP_REQUIRE_GPU=1 turns every "environment missing" skip (GPU, NCCL-EP, vLLM
  runtime, models) into a failure (tests/environment_gate.py).
"""

from __future__ import annotations

import os

import torch

from tests.environment_gate import MARKER, REQUIRE_ENV, fail_if_marked

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}(reason): environment missing; fails at setup under {REQUIRE_ENV}=1",
    )


def pytest_runtest_setup(item):
    fail_if_marked(item)
