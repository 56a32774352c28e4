"""Engine-level GPU tests: the real vLLM 0.33.0 engine with the plugin, at EP world size 1.

They need a GPU (sm_90+), vLLM's compiled runtime (`vllm._C`) and NCCL-EP; elsewhere they
skip with the reason. tests/engine is on sys.path (rootdir-less test directory), so the
helpers here import as top-level modules, as they do inside the engine processes.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from tests.environment_gate import mark_missing
from vllm_flashinfer_ep.runtime import env_checks


def engine_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (sm_90+); none visible"
    if torch.cuda.get_device_capability(0) < (9, 0):
        return "needs compute capability >= 9.0"
    if (
        importlib.util.find_spec("vllm") is None
        or importlib.util.find_spec("vllm._C_stable_libtorch") is None
    ):
        return "needs vLLM 0.33.0 with its compiled ops (vllm._C_stable_libtorch)"
    load = env_checks.check_nccl_ep_loads()
    if not load.ok:
        return f"NCCL-EP unavailable: {load.detail}"
    nccl = env_checks.check_nccl_version()
    if not nccl.ok:
        return f"libnccl too old for NCCL-EP: {nccl.detail}"
    return None


def pytest_collection_modifyitems(config, items):
    reason, checked = None, False
    for item in items:
        if "tests/engine/" not in str(item.fspath).replace("\\", "/"):
            continue
        if not checked:
            reason, checked = engine_skip_reason(), True
        if reason:
            mark_missing(item, reason)
        elif "multigpu" in item.keywords and torch.cuda.device_count() < 2:
            mark_missing(item, "needs >= 2 GPUs")


@pytest.fixture(scope="session")
def engines(tmp_path_factory):
    from engine_runner import EngineRunner

    return EngineRunner(tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Generated tiny checkpoints, keyed by hidden size."""
    from engine_models import write_tiny_model

    # A fixed folder (FLASHINFER_EP_TEST_MODEL_DIR) keeps the same paths, so engine results
    # kept across device calls (engine_runner.CACHE_ENV) match; the models are seeded.
    fixed = os.environ.get("FLASHINFER_EP_TEST_MODEL_DIR")
    root = Path(fixed) if fixed else tmp_path_factory.mktemp("models")
    cache: dict[int, str] = {}

    def get(hidden: int) -> str:
        if hidden not in cache:
            cache[hidden] = write_tiny_model(root / f"qwen3moe-h{hidden}", hidden)
        return cache[hidden]

    return get
