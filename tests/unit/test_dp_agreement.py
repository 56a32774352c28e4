"""The per-step token agreement of DP ranks, driven through vLLM 0.33.0's own DP code.

Each fake-world rank (a thread, tests/fakes/world.py) is one DP rank of an eager
(--enforce-eager) engine with EP: every step it syncs its batch with vLLM's real DP
coordination (the V2 runner's `dispatch_cg_and_sync_dp`, default in 0.33.0, or V1's
`coordinate_batch_across_dp`), an idle rank runs vLLM's dummy batch (`Worker.
execute_dummy_batch`), and each rank enters vLLM's real `set_forward_context` with the
synced counts, which builds the forward's `DPMetadata`. Inside it runs one MoE layer:
vLLM's modular kernel around the package's prepare/finalize, made by the package's
manager (so its agreement is `forward_state.agreed_token_count`, as in an engine), over
the fake NCCL-EP. Only the DP process group, the process-global forward context and the
GPU model runner are stood in for (tests/fakes/dp_world.py says how).

Checked: every rank issued the identical collective sequence (op, handle, size, from the
fake's log; the fake also refuses mispaired calls as they happen), the pooled handle is
the one of the largest rank's count, and every rank's output equals a MoE computed
without EP.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

from tests.fakes import dp_world
from tests.fakes.dp_world import IDLE, decode, prefill
from tests.fakes.fake_moe_ep import Call
from tests.fakes.matrix import ALGORITHM
from tests.fakes.runtime import build_fake_runtime
from tests.unit.test_prepare_finalize_cpu import (
    TorchActNaiveBatchedExperts,
    TorchStandardExperts,
    reference_moe,
)
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.vllm import managers
from vllm_flashinfer_ep.vllm.config_rules import round_capacity
from vllm_flashinfer_ep.vllm.rank_checks import RankChecks

HIDDEN = 2048
INTER = 64
NUM_EXPERTS = 8
TOP_K = 2
CAPACITY = 256  # tokens per rank (the engine's --max-num-batched-tokens)
CPU = torch.device("cpu")

# Per step, what each DP rank's scheduler gives it: a prefill of 200 tokens, decodes of
# 3 and 1 requests, an idle rank (vLLM runs its 1-token dummy batch there).
STEPS = {
    2: [[prefill(200), IDLE], [decode(3), prefill(40)]],
    4: [[prefill(200), decode(3), IDLE, decode(1)], [decode(2), IDLE, prefill(40), IDLE]],
}


@pytest.fixture(autouse=True)
def cpu_experts(monkeypatch, fake):
    # No driver: NaiveBatchedExperts' capture probe, and the HT reduce's ops.moe_sum.
    import vllm._custom_ops as vllm_ops

    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    monkeypatch.setattr(
        vllm_ops, "moe_sum", lambda input, output, *a, **k: output.copy_(input.sum(dim=1))
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def _weights():
    """Every expert's weights, the same on every rank (each uses its own slice)."""
    gen = torch.Generator().manual_seed(1234)
    w1 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w1.to(torch.bfloat16), w2.to(torch.bfloat16)


def _moe_config(backend: str, world: int, rank: int) -> FusedMoEConfig:
    parallel = dataclasses.replace(
        FusedMoEParallelConfig.make_no_parallel(),
        dp_size=world,
        dp_rank=rank,
        ep_size=world,
        ep_rank=rank,
        use_ep=True,
        all2all_backend=backend,
    )
    return FusedMoEConfig(
        num_experts=NUM_EXPERTS,
        experts_per_token=TOP_K,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=NUM_EXPERTS // world,
        num_logical_experts=NUM_EXPERTS,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        max_num_tokens=CAPACITY,
    )


class MoELayer:
    """One rank's MoE layer: the package's P/F from its manager, inside vLLM's kernel."""

    def __init__(self, backend: str, world: int, rank: int, ep_group, config) -> None:
        cls = managers.MANAGERS[backend]
        manager = cls.__new__(cls)  # no vLLM distributed state here
        manager._vllm_config = config
        manager._checks = RankChecks(None, config)  # every rank driven alike: no exchange
        capacity = round_capacity(CAPACITY, backend)  # one round's tokens, as the manager's
        self.sizes = manager._pool_sizes(capacity)  # what the manager pools for this engine
        self.rt, self.fleet = build_fake_runtime(
            ALGORITHM[backend],
            hidden=HIDDEN,
            num_experts=NUM_EXPERTS,
            capacity=capacity,
            top_k=TOP_K,
            sizes=self.sizes,
            world_size=world,
            rank=rank,
            process_group=ep_group,
        )
        manager.get_handle = lambda kwargs: self.rt
        moe = _moe_config(backend, world, rank)
        pf = manager.make_prepare_finalize(moe, None)
        if backend == LOW_LATENCY:
            experts = TorchActNaiveBatchedExperts(
                moe,
                FUSED_MOE_UNQUANTIZED_CONFIG,
                max_num_tokens=pf.max_num_tokens_per_rank(),
                num_dispatchers=pf.num_dispatchers(),
            )
        else:
            experts = TorchStandardExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
        self.kernel = mk.FusedMoEKernel(pf, experts)
        e_local = NUM_EXPERTS // world
        w1, w2 = _weights()
        self.w1, self.w2 = (
            w1[rank * e_local : (rank + 1) * e_local],
            w2[rank * e_local : (rank + 1) * e_local],
        )
        self.expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
        self.expert_map[rank * e_local : (rank + 1) * e_local] = torch.arange(
            e_local, dtype=torch.int32
        )
        self.rank, self.calls = rank, 0

    def __call__(self, num_tokens: int):
        """The forward's MoE layer on `num_tokens` tokens (vLLM's forward context is set)."""
        self.calls += 1
        gen = torch.Generator().manual_seed(1000 * self.calls + self.rank)
        x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(num_tokens, NUM_EXPERTS, TOP_K, CPU, gen)
        before = len(self.fleet.log)
        out = self.kernel.apply(
            hidden_states=x,
            w1=self.w1,
            w2=self.w2,
            topk_weights=weights,
            topk_ids=ids,
            activation=MoEActivation.SILU,
            global_num_experts=NUM_EXPERTS,
            expert_map=self.expert_map,
            apply_router_weight_on_input=False,
        )
        return x, ids, weights, out, self.fleet.log[before:]


def _run(backend: str, runner: str, world: int):
    """Every step of STEPS[world] on every rank: (steps, fleet log, pool counters, sizes)."""
    configs = [dp_world.vllm_config(world, rank) for rank in range(world)]

    def rank_fn(rank, ep_group):
        layer = MoELayer(backend, world, rank, ep_group, configs[rank])
        engine = dp_world.RUNNERS[runner](configs[rank], layer)
        for loads in STEPS[world]:
            engine.step(loads[rank])
        counters = layer.rt.pool.counters
        layer.rt.destroy()
        return engine.steps, layer.fleet.log, counters, layer.sizes

    with dp_world.dp_world():
        return dp_world.run_dp_ranks(world, rank_fn)


def _count(load) -> int:
    """The tokens a rank runs for `load` in an eager step: an idle rank's dummy batch is
    one token (one request of one token: no speculative decoding)."""
    return 1 if load.idle else sum(load.tokens_per_request)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_dp_ranks_with_different_loads_agree_through_vllm_and_match_the_reference(
    backend, runner, world
):
    results = _run(backend, runner, world)
    w1, w2 = _weights()
    logs = [log for _, log, _, _ in results]
    sizes = results[0][3]
    assert all(r[3] == sizes for r in results)
    # (1) one collective sequence on every rank (op, handle, size); the fake also
    # refused any mispaired call as it happened.
    assert all(log == logs[0] for log in logs[1:])
    for step, loads in enumerate(STEPS[world]):
        counts = [_count(load) for load in loads]
        pooled = min(s for s in sizes if s >= max(counts))  # the largest rank's count, pooled
        handle = sizes.index(pooled)  # pooled handles are created in size order
        for rank, (steps, _, _, _) in enumerate(results):
            got = steps[step]
            # vLLM's own sync: every rank's forward context holds every rank's count.
            assert got.dummy == loads[rank].idle
            assert got.num_tokens_across_dp == counts and got.forward_tokens == counts[rank]
            x, ids, weights, out, calls = got.result
            assert calls == [
                Call("update", handle, pooled),
                Call("dispatch", handle, pooled),
                Call("combine", handle, pooled),
            ]
            # (2) the rank's output is the MoE of its own tokens computed without EP.
            assert out.shape == x.shape and torch.isfinite(out).all()
            expected = reference_moe(x, w1, w2, ids, weights, False)
            scale = expected.abs().max().item()
            torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * scale)
    for rank, (_, _, counters, _) in enumerate(results):
        padded = sum(
            _count(loads[rank]) < min(s for s in sizes if s >= max(map(_count, loads)))
            for loads in STEPS[world]
        )
        # every step pooled, plus the first round at load (a BF16 first layer)
        assert (counters.fresh_created, counters.pooled_rounds) == (0, len(STEPS[world]) + 1)
        assert counters.padded_rounds == padded


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.usefixtures("round_split_row")
def test_ll_rounds_split_alike_on_every_rank_and_match_the_reference(monkeypatch, runner, world):
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS=64 under a 256-token budget: the step with a
    200-token prefill runs every rank's MoE layer as rounds of 64, 64, 64 and 8 (the largest
    rank's count cut at 64), idle and decoding ranks included; smaller steps stay one
    round; every output is the MoE computed without EP."""
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "64")
    results = _run(LOW_LATENCY, runner, world)
    w1, w2 = _weights()
    logs = [log for _, log, _, _ in results]
    sizes = results[0][3]
    assert max(sizes) == 64 and all(log == logs[0] for log in logs[1:])
    for step, loads in enumerate(STEPS[world]):
        largest = max(_count(load) for load in loads)
        rounds = [min(64, largest - start) for start in range(0, largest, 64)]
        pooled = [min(s for s in sizes if s >= count) for count in rounds]
        for steps, _, _, _ in results:
            x, ids, weights, out, calls = steps[step].result
            assert [c.tokens for c in calls if c.op == "dispatch"] == pooled
            expected = reference_moe(x, w1, w2, ids, weights, False)
            scale = expected.abs().max().item()
            torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * scale)
    assert all(counters.fresh_created == 0 for _, _, counters, _ in results)


def test_rounds_below_a_final_capture_size_are_refused_at_load(monkeypatch):
    """Config time may not see vLLM's final capture sizes; the manager checks them when a
    layer's prepare/finalize is made, before any fleet or handle exists."""
    from vllm_flashinfer_ep.errors import FlashInferEPConfigError

    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "64")
    monkeypatch.setattr(managers, "pool_sizes_from_config", lambda config: [1, 8, 128])
    cls = managers.MANAGERS[LOW_LATENCY]
    manager = cls.__new__(cls)
    manager._vllm_config = dp_world.vllm_config(2, 0)
    manager.get_handle = lambda kwargs: pytest.fail("a fleet was asked for")
    with pytest.raises(FlashInferEPConfigError, match="largest CUDA graph capture size, 128"):
        manager.make_prepare_finalize(_moe_config(LOW_LATENCY, 2, 0), None)


def test_the_forward_context_is_per_rank_thread_and_the_global_stays_unset():
    """What dp_world replaces: each thread sees its own forward context; vLLM's process
    global is never set; the DP all-reduces pair across ranks."""
    import vllm.forward_context as fc

    world = 2
    configs = [dp_world.vllm_config(world, rank) for rank in range(world)]

    def rank_fn(rank, ep_group):
        seen = []

        def forward(n):
            ctx = fc.get_forward_context()
            seen.append((id(ctx), ctx.dp_metadata.num_tokens_across_dp_cpu.tolist(), n))
            assert fc._forward_context is None

        engine = dp_world.V2Runner(configs[rank], forward)
        engine.step([prefill(7), IDLE][rank])
        assert not fc.is_forward_context_available()  # left again after the step
        return seen, dp_world.dp_group().all_reduces

    with dp_world.dp_world():
        (seen0, reduces0), (seen1, reduces1) = dp_world.run_dp_ranks(world, rank_fn)
    assert seen0[0][1:] == ([7, 1], 7) and seen1[0][1:] == ([7, 1], 1)
    assert seen0[0][0] != seen1[0][0]  # two contexts, one per rank
    assert reduces0 == reduces1 and len(reduces0) == 1  # one sync per step, seen alike
    assert fc.get_forward_context is not dp_world._get  # restored on exit
