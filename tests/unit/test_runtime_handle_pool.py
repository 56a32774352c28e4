"""HandlePool on the fake NCCL-EP transport: creation, reuse, binding, capture guard."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import fake_moe_ep
from tests.fakes.fake_moe_ep import Call
from tests.fakes.runtime import (
    build_fake_runtime,
    install_capture_switch,
)
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import (
    DispatchCapacityError,
    FlashInferEPConfigError,
    HandlePoolError,
)
from vllm_flashinfer_ep.runtime import transport
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.handle_pool import HandlePool
from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_HT, MAX_TOPK_LL
from vllm_flashinfer_ep.runtime.round_plan import LOCAL, Planner

HIDDEN = 2048
NUM_EXPERTS = 8
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("fake")


def _layer(num_tokens: int, seed: int, top_k: int = 2, num_experts: int = NUM_EXPERTS):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, num_experts, top_k, CPU, gen)
    scales = torch.rand(num_experts, generator=gen) + 0.5
    return x, ids, weights, scales


def _ll_round(rt, x, ids, weights, scales, *, uniform=True):
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, agreed_tokens=LOCAL if uniform else None)
    out = torch.empty_like(x)
    result = rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    assert result is out
    return out


def _assert_close_to_reference(out, x, ids, weights, scales):
    torch.testing.assert_close(
        out.float(), reference_moe(x, ids, weights, scales).float(), rtol=2e-2, atol=2e-2
    )


# ----------------------------------------------------------------------- warm
def test_warm_creates_one_handle_per_size_with_one_eager_update():
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[16, 4, 8, 8, 0, 64]
    )
    pool = rt.pool
    assert pool.sizes == [4, 8, 16]  # 0 and 64 (> capacity 32) are not pooled
    assert fleet.handles_created == 3 and fleet.handles_alive == 3
    assert fleet.log == [
        Call("create_handle", 0, 4),
        Call("update", 0, 4),
        Call("create_handle", 1, 8),
        Call("update", 1, 8),
        Call("create_handle", 2, 16),
        Call("update", 2, 16),
    ]
    assert pool.counters.pooled_created == 3 and pool.counters.updates == 3
    assert pool.sizes == [4, 8, 16]
    # Warming again with a known size is a no-op, a new size adds exactly one handle.
    pool.warm([8, 12])
    assert fleet.handles_created == 4 and pool.sizes == [4, 8, 12, 16]
    assert fleet.log[-2:] == [Call("create_handle", 3, 12), Call("update", 3, 12)]


def test_warm_call_order_is_the_same_on_every_rank():
    # The same sizes in different orders (as two ranks might list them): the collective
    # sequence must be identical, ascending. {40, 9, 3} iterates unsorted as a set.
    rt_a, fleet_a = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=64, sizes=[40, 9, 3, 24, 9]
    )
    rt_b, fleet_b = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=64, sizes=[3, 24, 40, 9]
    )
    assert fleet_a.log == fleet_b.log
    assert [c.tokens for c in fleet_a.calls("create_handle")] == [3, 9, 24, 40]
    assert rt_a.pool.sizes == rt_b.pool.sizes == [3, 9, 24, 40]


def test_warm_under_capture_raises(monkeypatch):
    switch = install_capture_switch(monkeypatch)
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN)
    with switch.capturing(), pytest.raises(HandlePoolError, match="outside CUDA-graph capture"):
        rt.pool.warm([4])
    assert fleet.handles_created == 0 and fleet.log == []


# ------------------------------------------------------------- reuse by layers
def test_one_native_handle_per_size_however_many_layers():
    sizes = [4, 9, 16]
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=sizes)
    for step, num_tokens in enumerate([9, 4, 16]):
        for layer in range(8):
            x, ids, weights, scales = _layer(num_tokens, seed=100 * step + layer)
            out = _ll_round(rt, x, ids, weights, scales)
            _assert_close_to_reference(out, x, ids, weights, scales)
    assert fleet.handles_created == 3
    assert fleet.handles_alive == 3
    c = rt.pool.counters
    assert (c.pooled_created, c.fresh_created, c.pooled_rounds, c.fresh_rounds) == (3, 0, 24, 0)
    assert c.updates == 3 + 24
    # Every round of a size ran on that size's one handle.
    for n in sizes:
        used = {call.handle for call in fleet.log if call.tokens == n}
        assert len(used) == 1
    assert len(fleet.calls("dispatch")) == len(fleet.calls("combine")) == 24
    assert fleet.calls("destroy") == []


def test_weights_buffer_is_bound_and_layer_weights_are_copied():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[8])
    pool = rt.pool
    (handle,) = fleet.handles
    bound = handle.bound_weights
    # The handle was created with the pool's static weights buffer (not a copy of it).
    assert bound.data_ptr() == pool.topk_weights.data_ptr()
    assert tuple(bound.shape) == (8, pool.top_k) and bound.dtype == torch.float32

    x, ids, weights, scales = _layer(8, seed=1)
    expected = reference_moe(x, ids, weights, scales)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights)
    assert handle.bound_weights is bound  # same binding every round
    assert weights.data_ptr() != bound.data_ptr()
    torch.testing.assert_close(bound, weights)  # ... holding this layer's values
    # The layer's tensor is not bound: changing it after dispatch does not reach combine.
    weights.mul_(0.0).add_(0.25)
    out = torch.empty_like(x)
    rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_int64_contiguous_ids_are_bound_per_call_others_are_copied():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[8])
    pool = rt.pool
    (handle,) = fleet.handles

    x, ids, weights, scales = _layer(8, seed=2)
    rt.round.dispatch(x, ids, weights)
    assert handle.bound_ids is ids  # bound: no copy kernel
    rt.round.end()

    ids32 = ids.to(torch.int32)
    out = _ll_round(rt, x, ids32, weights, scales)
    assert handle.bound_ids.data_ptr() == pool.topk_ids.data_ptr()
    assert handle.bound_ids.dtype == torch.int64
    torch.testing.assert_close(handle.bound_ids, ids)
    _assert_close_to_reference(out, x, ids, weights, scales)

    strided = torch.cat([ids, ids], dim=1)[:, ::2]
    assert not strided.is_contiguous()
    rt.round.dispatch(x, strided, weights)
    assert handle.bound_ids.data_ptr() == pool.topk_ids.data_ptr()
    rt.round.end()


def test_bind_ids_off_always_copies():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN)
    pool = HandlePool(fleet, rt.spec, 2, CPU, bind_ids=False)
    pool.warm([8])
    handle = fleet.handles[-1]
    x, ids, weights, scales = _layer(8, seed=3)
    plan = Planner(pool).plan(x, ids, weights)
    plan.dispatch(x)
    assert handle.bound_ids is not ids
    assert handle.bound_ids.data_ptr() == pool.topk_ids.data_ptr()
    plan.end()


# --------------------------------------------------------------- capture guard
def test_capture_uses_warmed_handles_and_refuses_new_sizes(monkeypatch):
    switch = install_capture_switch(monkeypatch)
    assert {
        "vllm_flashinfer_ep.runtime.handle_pool",
        "vllm_flashinfer_ep.runtime.round_plan",
        "vllm_flashinfer_ep.runtime.streams",
        "vllm_flashinfer_ep.runtime.fault_tolerance",
    } <= set(switch.patched_modules)
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[4])
    log_before = list(fleet.log)
    with switch.capturing():
        # Warmed size: a captured update is fine because warm() ran one eagerly.
        x, ids, weights, scales = _layer(4, seed=4)
        out = _ll_round(rt, x, ids, weights, scales)
        _assert_close_to_reference(out, x, ids, weights, scales)
        # Un-warmed size: refused before any collective.
        x8, ids8, w8, _ = _layer(8, seed=5)
        with pytest.raises(
            HandlePoolError, match=r"no warmed flashinfer_ep handle for 8 tokens"
        ) as exc:
            rt.round.dispatch(x8, ids8, w8)
        assert "cannot be created inside CUDA-graph capture" in str(exc.value)
        assert "[4]" in str(exc.value)
        # Non-uniform counts cannot take a pooled handle either.
        with pytest.raises(HandlePoolError, match="no warmed flashinfer_ep handle for 4 tokens"):
            rt.round.dispatch(x, ids, weights, agreed_tokens=None)
    assert rt.pool.counters.created_during_capture == 2
    assert fleet.handles_created == 1
    assert fleet.log[len(log_before) :] == [
        Call("update", 0, 4),
        Call("dispatch", 0, 4),
        Call("combine", 0, 4),
    ]


# ----------------------------------------------------------- non-uniform rounds
def test_non_uniform_round_uses_a_fresh_handle_destroyed_at_end():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[8])
    n_before = len(fleet.log)
    x, ids, weights, scales = _layer(8, seed=6)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, agreed_tokens=None)
    assert fleet.handles_created == 2 and fleet.handles_alive == 2
    fresh = fleet.handles[-1]
    # The fresh handle also binds the static weights buffer.
    assert fresh.bound_weights.data_ptr() == rt.pool.topk_weights.data_ptr()
    out = torch.empty_like(x)
    rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    _assert_close_to_reference(out, x, ids, weights, scales)
    assert fleet.handles_alive == 1 and fresh.destroyed
    assert fleet.log[n_before:] == [
        Call("create_handle", 1, 8),
        Call("dispatch", 1, 8),
        Call("combine", 1, 8),
        Call("destroy", 1, 8),
    ]
    c = rt.pool.counters
    assert (c.fresh_created, c.fresh_rounds, c.pooled_rounds) == (1, 1, 0)


def test_size_above_every_pooled_size_runs_eagerly_on_a_fresh_handle():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[8])
    x, ids, weights, scales = _layer(9, seed=7)
    out = _ll_round(rt, x, ids, weights, scales)
    _assert_close_to_reference(out, x, ids, weights, scales)
    assert fleet.handles_created == 2 and fleet.handles_alive == 1
    assert rt.pool.sizes == [8]  # a fresh round does not grow the pool
    assert rt.pool.counters.fresh_created == 1


def test_fresh_handle_is_destroyed_by_end_without_combine():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN)
    x, ids, weights, _ = _layer(6, seed=8)
    rt.round.dispatch(x, ids, weights, agreed_tokens=None)
    assert fleet.handles_alive == 1
    rt.round.end()
    assert fleet.handles_alive == 0
    with pytest.raises(HandlePoolError, match="without a dispatch in flight"):
        rt.round.combine(torch.zeros(1, 6, HIDDEN), torch.empty_like(x))


# ------------------------------------------------------------------ limits
@pytest.mark.parametrize("algorithm", [Algorithm.LOW_LATENCY, Algorithm.HIGH_THROUGHPUT])
def test_over_capacity_names_max_num_batched_tokens(algorithm):
    rt, fleet = build_fake_runtime(algorithm, hidden=HIDDEN, capacity=16, sizes=[16])
    n_before = len(fleet.log)
    x, ids, weights, _ = _layer(17, seed=9)
    with pytest.raises(DispatchCapacityError, match="--max-num-batched-tokens") as exc:
        rt.round.planner.plan(x, ids, weights)
    assert isinstance(exc.value, FlashInferEPConfigError)
    assert "17 tokens" in str(exc.value) and "16 tokens per rank" in str(exc.value)
    assert len(fleet.log) == n_before  # refused before any collective


def test_top_k_limits_per_algorithm():
    _, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=64)
    ll = FleetSpec(Algorithm.LOW_LATENCY, 64, 32, HIDDEN)
    ht = FleetSpec(Algorithm.HIGH_THROUGHPUT, 64, 32, HIDDEN)
    assert HandlePool(fleet, ll, MAX_TOPK_LL, CPU).top_k == MAX_TOPK_LL
    with pytest.raises(ValueError, match=rf"top_k must be in \[1, {MAX_TOPK_LL}\] for low_latency"):
        HandlePool(fleet, ll, MAX_TOPK_LL + 1, CPU)
    assert HandlePool(fleet, ht, MAX_TOPK_LL + 1, CPU).top_k == MAX_TOPK_LL + 1
    assert HandlePool(fleet, ht, MAX_TOPK_HT, CPU).top_k == MAX_TOPK_HT
    with pytest.raises(ValueError, match=rf"top_k must be in \[1, {MAX_TOPK_HT}\]"):
        HandlePool(fleet, ht, MAX_TOPK_HT + 1, CPU)
    with pytest.raises(ValueError, match="top_k must be in"):
        HandlePool(fleet, ll, 0, CPU)
    with pytest.raises(ValueError, match="exceeds the number of experts 8"):
        HandlePool(fleet, FleetSpec(Algorithm.LOW_LATENCY, 8, 32, HIDDEN), 9, CPU)


def test_routing_with_another_top_k_is_refused():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, top_k=2, sizes=[4])
    x, ids, weights, _ = _layer(4, seed=10, top_k=3)
    with pytest.raises(HandlePoolError, match="built for top_k=2, got routing with top_k=3"):
        rt.round.dispatch(x, ids, weights)


def test_destroy_releases_every_handle():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[2, 4])
    rt.destroy()
    assert fleet.handles_alive == 0
    assert [c.handle for c in fleet.calls("destroy")] == [0, 1]
    assert rt.pool.sizes == []


# ------------------------------------------------ the fake enforces the contract
def test_fake_transport_enforces_nccl_ep_contracts(monkeypatch):
    assert transport.handle_supports_update()
    switch = install_capture_switch(monkeypatch)
    fi = fake_moe_ep
    boot = fi.BootstrapConfig(world_size=1, rank=0)
    with pytest.raises(fi.MoEEpConfigError, match="token_hidden_size=3072"):
        fi.create_fleet(boot, fi.FleetParams(8, 16, 3072))
    with pytest.raises(KeyError, match="unknown backend"):
        fi.create_fleet(boot, fi.FleetParams(8, 16, HIDDEN), backend="nope")
    fleet = fi.create_fleet(boot, fi.FleetParams(8, 16, HIDDEN))
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    w = torch.full((4, 2), 0.5)
    knobs = [fi.HandleAlgoKnobTopKWeights(weights=w)]
    with switch.capturing(), pytest.raises(RuntimeError, match="outside CUDA-graph capture"):
        fleet.create_handle(fi.HandleParams(topk_ids=ids), algo_knobs=knobs)
    h = fleet.create_handle(fi.HandleParams(topk_ids=ids), algo_knobs=knobs)
    with switch.capturing(), pytest.raises(RuntimeError, match="first update on this handle"):
        h.update(fi.HandleParams(topk_ids=ids))
    with pytest.raises(ValueError, match="cannot change the token count"):
        h.update(fi.HandleParams(topk_ids=ids[:3]))
    with pytest.raises(ValueError, match="cannot change top_k"):
        h.update(fi.HandleParams(topk_ids=ids[:, :1]))
    with pytest.raises(ValueError, match="must be contiguous"):
        h.update(fi.HandleParams(topk_ids=ids.t().contiguous().t()))
    h.update(fi.HandleParams(topk_ids=ids))
    with switch.capturing():
        h.update(fi.HandleParams(topk_ids=ids))  # after one eager update: allowed
    x = torch.ones(4, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before dispatch"):
        h.combine(fi.CombineInputParams(x=[torch.zeros(8, 16, HIDDEN, dtype=torch.bfloat16)]))
    with pytest.raises(fi.MoEEpConfigError, match="3 activation rows"):
        h.dispatch(fi.DispatchInputParams(x=[x[:3]]))
    d = h.dispatch(fi.DispatchInputParams(x=[x]))
    assert d.expert_counts.tolist() == [1] * 8
    out = h.combine(fi.CombineInputParams(x=[d.expert_tensors])).x
    torch.testing.assert_close(out.float(), x.float())  # 0.5 + 0.5
    big_ids = torch.zeros(17, 2, dtype=torch.int64)
    big = fleet.create_handle(fi.HandleParams(topk_ids=big_ids), algo_knobs=knobs)
    with pytest.raises(fi.MoEEpConfigError, match="exceeding max_tokens_per_rank"):
        big.dispatch(fi.DispatchInputParams(x=[torch.ones(17, HIDDEN, dtype=torch.bfloat16)]))
    h.destroy()
    assert fleet.handles_alive == 1
    for op in (
        lambda: h.update(fi.HandleParams(topk_ids=ids)),
        lambda: h.dispatch(fi.DispatchInputParams(x=[x])),
        lambda: h.combine(fi.CombineInputParams(x=[d.expert_tensors])),
    ):
        with pytest.raises(RuntimeError, match="destroyed handle"):
            op()


def test_stream_state_joins_side_streams_and_skips_the_capture_query_on_stream_0(monkeypatch):
    """The per-round stream decision (GPU logic, driven here with the CUDA queries
    stubbed): torch's legacy default stream is the handles' own and cannot be captured, so
    it needs neither a join nor a capture query; a side stream joins outside capture and
    never under it."""
    from vllm_flashinfer_ep.runtime import streams as hs

    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=2048, sizes=[4])
    streams = rt.pool.streams
    streams.cuda, streams.raw = True, 0
    queries = []
    state = {"stream": 0, "capturing": False}
    monkeypatch.setattr(hs, "current_raw_stream", lambda device: state["stream"])
    monkeypatch.setattr(
        hs, "current_stream_capturing", lambda: queries.append(1) or state["capturing"]
    )
    assert streams.state() == (False, False) and queries == []
    state["stream"] = 7
    assert streams.state() == (False, True)
    state["capturing"] = True
    assert streams.state() == (True, False) and len(queries) == 2
