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


def _counting(monkeypatch, module, name: str) -> list:
    """Replace module.name with a wrapper that records each call; returns the record."""
    calls: list = []
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.fixture(params=[False, True], ids=["vllm-activation", "listed-activation"])
def listed_activation(request, monkeypatch):
    """The received-rows experts with vLLM's masked activation and with the listed-rows
    one (block_list.LISTED_ACTIVATION): the received rows must come out the same. With
    the switch on, the listed kernel must have run (not a quiet fallback to vLLM's)."""
    from vllm_flashinfer_ep.vllm import block_list

    monkeypatch.setattr(block_list, "LISTED_ACTIVATION", request.param)
    calls = _counting(monkeypatch, block_list, "listed_silu_and_mul")
    yield request.param
    assert bool(calls) == request.param, f"listed activation calls: {len(calls)}"


@pytest.fixture(params=["vllm-activation", "listed-activation", "listed-quant"])
def fp8_intermediate(request, monkeypatch):
    """The FP8 received-rows experts' intermediate three ways: vLLM's masked activation,
    the listed activation, and the activation and quantization in one kernel
    (listed_quant.ENABLED; block and per-token layers, the others keep the listed
    activation, but for dynamic per-tensor layers under listed_quant.TENSOR_ENABLED, which
    take its two launches every way). The received rows must come out the same, and the
    kernel each way names must have run (not a quiet fallback)."""
    from vllm_flashinfer_ep.vllm import block_list, listed_quant

    mode = request.param
    monkeypatch.setattr(block_list, "LISTED_ACTIVATION", mode != "vllm-activation")
    monkeypatch.setattr(listed_quant, "ENABLED", mode == "listed-quant")
    # and BF16 arrivals quantized by its input kernel (INPUT_ENABLED) in that mode
    monkeypatch.setattr(listed_quant, "INPUT_ENABLED", mode == "listed-quant")
    act = _counting(monkeypatch, block_list, "listed_silu_and_mul")
    fused = _counting(monkeypatch, listed_quant, "silu_mul_quant")
    rows = _counting(monkeypatch, listed_quant, "quantize_rows")
    tensor = _counting(monkeypatch, listed_quant, "tensor_quant")
    yield mode
    spec = getattr(request.node, "callspec", None)
    params = spec.params if spec is not None else {}
    # tests parametrize "kind", or "scheme_kind" (an indirect fixture that sets switches)
    kind = params.get("kind", params.get("scheme_kind", "block"))
    # dynamic per-tensor layers with listed_quant's two-launch kernels (TENSOR_ENABLED, on
    # by default; "tensor-dynamic-kernels" sets it, the SCHEME_ARRIVALS "tensor-dynamic"
    # clears it; still as the test set it here, before monkeypatch undoes it): they take the
    # input and the intermediate (the activation inside) whatever the mode
    if kind == "tensor-dynamic-kernels" or (
        kind == "tensor-dynamic" and listed_quant.TENSOR_ENABLED
    ):
        assert tensor and not act and not fused and not rows, (len(tensor), len(act))
        return
    assert not tensor, len(tensor)
    takes_fused = kind == "block" or kind.startswith("token")
    # BF16 received rows of block and per-token layers: the input kernel, in that mode only
    bf16 = params.get("arrival", "").startswith("bf16")
    if bf16 and takes_fused:
        assert bool(rows) == (mode == "listed-quant"), (mode, len(rows))
    else:
        assert not rows, (mode, len(rows))
    if mode == "vllm-activation":
        assert not act and not fused, (len(act), len(fused))
    elif mode == "listed-quant" and takes_fused:
        assert fused and not act, (len(act), len(fused))
    else:
        assert act and not fused, (len(act), len(fused))
