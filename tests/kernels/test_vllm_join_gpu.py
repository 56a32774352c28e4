"""The join: vLLM 0.33.0's FusedMoEKernel with this package's prepare/finalize, on a GPU.

LL: `FlashInferEPLowLatencyPrepareAndFinalize` + vLLM's `BatchedTritonExperts`, eager and
captured in one CUDA graph over several layers (the persistent handle pool), against
vLLM's own non-EP batched path on the same weights and routing and a torch reference.
HT: `FlashInferEPHighThroughputPrepareAndFinalize` + vLLM's `TritonExperts`, eager.

Needs the real vLLM 0.33.0 runtime (its compiled ops, torch 2.14) and a GPU with NCCL-EP;
on the device machine that is ../shared/gpu/stage-engine.sh (docs/contributing/gpu_runs.md).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.environment_gate import missing
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu

NUM_EXPERTS, TOP_K, INTERMEDIATE, LAYERS = 128, 8, 512, 4
POOL_SIZES = [1, 8, 64]


@pytest.fixture(scope="module")
def vllm_env(ep_group_world1):
    if (
        importlib.util.find_spec("vllm") is None
        or importlib.util.find_spec("vllm._C_stable_libtorch") is None
    ):
        missing("needs vLLM 0.33.0 with its compiled ops (vllm._C_stable_libtorch)")
    import vllm_flashinfer_ep

    vllm_flashinfer_ep.register()
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cuda", 0))
    with set_current_vllm_config(VllmConfig()):
        yield ep_group_world1


def _modules():
    from vllm.model_executor.layers.fused_moe import config as cfg
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import (
        BatchedPrepareAndFinalize,
    )

    return cfg, mk, MoEActivation, BatchedTritonExperts, TritonExperts, BatchedPrepareAndFinalize


def _moe_config(hidden: int, max_num_tokens: int, num_experts: int = NUM_EXPERTS):
    cfg, _, act, *_ = _modules()
    return cfg.FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=TOP_K,
        hidden_dim=hidden,
        intermediate_size=INTERMEDIATE,
        num_local_experts=num_experts,
        num_logical_experts=num_experts,
        activation=act.SILU,
        device=torch.device("cuda", 0),
        routing_method=cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=cfg.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        max_num_tokens=max_num_tokens,
    )


def _weights(hidden: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1 = (
        torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, hidden, device="cuda", generator=gen)
        / hidden**0.5
    ).bfloat16()
    w2 = (
        torch.randn(NUM_EXPERTS, hidden, INTERMEDIATE, device="cuda", generator=gen)
        / INTERMEDIATE**0.5
    ).bfloat16()
    return w1, w2


def _routing(num_tokens: int, hidden: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(num_tokens, hidden, device="cuda", generator=gen) / 4).bfloat16()
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int64)


def _torch_moe(x, w1, w2, weights, ids):
    out = torch.zeros_like(x, dtype=torch.float32)
    xf = x.float()
    for e in ids.unique().tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        h = xf[rows] @ w1[e].float().t()
        y = (torch.nn.functional.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:]) @ w2[
            e
        ].float().t()
        out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(-1))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    rel = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-9))
    assert rel < 2e-2, f"{what}: relative L2 error {rel:.3g}"


def _apply(kernel, x, w1, w2, weights, ids):
    _, _, act, *_ = _modules()
    return kernel.apply(
        hidden_states=x,
        w1=w1,
        w2=w2,
        topk_weights=weights,
        topk_ids=ids,
        activation=act.SILU,
        global_num_experts=NUM_EXPERTS,
        expert_map=None,
        apply_router_weight_on_input=False,
    )


def _ll_kernel(group, hidden: int, capacity: int, pool_sizes):
    _, mk, _, batched_experts, *_ = _modules()
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
    from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
    from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

    cache = FleetCache(0, 1, group)
    rt = build_runtime(
        cache,
        FleetSpec(Algorithm.LOW_LATENCY, NUM_EXPERTS, capacity, hidden),
        TOP_K,
        torch.device("cuda", 0),
        pool_sizes,
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    experts = batched_experts(
        moe_config=_moe_config(hidden, capacity),
        quant_config=FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    return mk.FusedMoEKernel(pf, experts), rt, cache


def _vllm_batched_reference(hidden: int, capacity: int):
    _, mk, _, batched_experts, _, batched_pf = _modules()
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    pf = batched_pf(
        max_num_tokens=capacity, num_local_experts=NUM_EXPERTS, num_dispatchers=1, rank=0
    )
    experts = batched_experts(
        moe_config=_moe_config(hidden, capacity),
        quant_config=FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=capacity,
        num_dispatchers=1,
    )
    return mk.FusedMoEKernel(pf, experts)


@pytest.mark.parametrize("experts_path", ["received_rows", "batched_kernel"])
@pytest.mark.parametrize("hidden", [2048, 4096])
def test_ll_join_eager_and_graph(vllm_env, hidden, experts_path, monkeypatch):
    from vllm_flashinfer_ep.vllm import compact_experts

    # received_rows: the package's experts over the received rows (vllm/compact_experts.py);
    # batched_kernel: vLLM's batched kernel with the package's per-batch tile.
    monkeypatch.setattr(compact_experts, "ENABLED", experts_path == "received_rows")
    capacity = max(POOL_SIZES)
    kernel, rt, cache = _ll_kernel(vllm_env, hidden, capacity, POOL_SIZES)
    installed = getattr(kernel.fused_experts.apply, "_flashinfer_ep_compact", False)
    assert installed == (experts_path == "received_rows")
    reference_kernel = _vllm_batched_reference(hidden, capacity)
    layers = [_weights(hidden, seed=10 + i) for i in range(LAYERS)]
    for num_tokens in POOL_SIZES:
        routes = [_routing(num_tokens, hidden, seed=100 * i + num_tokens) for i in range(LAYERS)]
        outs = [
            torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
            for _ in range(LAYERS)
        ]

        def step(routes=routes, outs=outs):
            for (w1, w2), (x, w, ids), out in zip(layers, routes, outs):
                out.copy_(_apply(kernel, x, w1, w2, w, ids))

        step()  # eager through the pool
        torch.cuda.synchronize()
        for (w1, w2), (x, w, ids), out in zip(layers, routes, outs):
            _close(
                out,
                _apply(reference_kernel, x, w1, w2, w, ids),
                f"LL eager vs vLLM non-EP, T={num_tokens}",
            )
            _close(out, _torch_moe(x, w1, w2, w, ids), f"LL eager vs torch, T={num_tokens}")

        fresh = rt.pool.counters.fresh_created
        graph = capture_graph(step)
        assert rt.pool.counters.fresh_created == fresh, "a handle was created during capture"
        for i, (x, w, ids) in enumerate(routes):
            nx, nw, nids = _routing(num_tokens, hidden, seed=7777 + i)
            x.copy_(nx), w.copy_(nw), ids.copy_(nids)
        graph.replay()
        torch.cuda.synchronize()
        for (w1, w2), (x, w, ids), out in zip(layers, routes, outs):
            _close(out, _torch_moe(x, w1, w2, w, ids), f"LL graph replay vs torch, T={num_tokens}")
        del graph
    rt.destroy()
    cache.destroy()


def test_ht_join_eager(vllm_env):
    _, mk, _, _, triton_experts, _ = _modules()
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
    from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
    from vllm_flashinfer_ep.vllm.prepare_finalize import (
        FlashInferEPHighThroughputPrepareAndFinalize,
    )

    hidden = 2048
    cache = FleetCache(0, 1, vllm_env)
    rt = build_runtime(
        cache,
        FleetSpec(Algorithm.HIGH_THROUGHPUT, NUM_EXPERTS, 256, hidden),
        TOP_K,
        torch.device("cuda", 0),
        [],
    )
    pf = FlashInferEPHighThroughputPrepareAndFinalize(rt)
    kernel = mk.FusedMoEKernel(
        pf,
        triton_experts(
            moe_config=_moe_config(hidden, 256), quant_config=FUSED_MOE_UNQUANTIZED_CONFIG
        ),
    )
    w1, w2 = _weights(hidden, seed=3)
    for num_tokens in (1, 8, 200):
        x, w, ids = _routing(num_tokens, hidden, seed=num_tokens)
        out = _apply(kernel, x, w1, w2, w, ids)
        torch.cuda.synchronize()
        _close(out, _torch_moe(x, w1, w2, w, ids), f"HT eager vs torch, T={num_tokens}")
    rt.destroy()
    cache.destroy()
