"""GPU test plumbing: skip without a usable GPU + NCCL-EP, and a world-size-1 EP group."""

from __future__ import annotations

import os

import pytest
import torch

from tests.environment_gate import mark_missing
from tests.helpers import free_port
from vllm_flashinfer_ep.runtime import env_checks


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (sm_90+); none visible"
    if torch.cuda.get_device_capability(0) < (9, 0):
        return "needs compute capability >= 9.0"
    load = env_checks.check_nccl_ep_loads()
    if not load.ok:
        return f"NCCL-EP unavailable: {load.detail}"
    nccl = env_checks.check_nccl_version()
    if not nccl.ok:
        return f"libnccl too old for NCCL-EP: {nccl.detail}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            if not checked:
                reason, checked = gpu_skip_reason(), True
            if reason:
                mark_missing(item, reason)
            elif "multigpu" in item.keywords and torch.cuda.device_count() < 2:
                mark_missing(item, "needs >= 2 GPUs")


@pytest.fixture(scope="session")
def ep_group_world1():
    """A gloo process group of one rank, as vLLM's EP CPU group would be."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield dist.group.WORLD
