"""LL and HT transport rounds on the fake transport vs the torch reference MoE."""

from __future__ import annotations

import pytest
import torch

from tests.fakes.compare import assert_same_rows
from tests.fakes.runtime import build_fake_runtime
from tests.helpers import reduce_received_rows, scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.round_plan import LOCAL

HIDDEN = 2048
NUM_EXPERTS = 8
CAPACITY = 32
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("fake")


def _inputs(num_tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, top_k, CPU, gen)
    scales = torch.rand(NUM_EXPERTS, generator=gen) + 0.5
    return x, ids, weights, scales


def _close(out, expected):
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def run_ll(rt, x, ids, weights, scales, *, uniform=True, on_input=False):
    rnd = rt.round
    d = rnd.dispatch(
        x,
        ids,
        weights,
        agreed_tokens=LOCAL if uniform else None,
        apply_router_weight_on_input=on_input,
    )
    out = torch.empty_like(x)
    assert rnd.combine(scale_expert_rows(d.expert_x, scales), out) is out
    return d, out


def run_ht(rt, x, ids, weights, scales, *, uniform=True, on_input=False):
    rnd = rt.round
    d = rnd.dispatch(
        x,
        ids,
        weights,
        agreed_tokens=LOCAL if uniform else None,
        apply_router_weight_on_input=on_input,
    )
    received = d.x.shape[0]
    reduce_received_rows(d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(received))
    out = torch.empty_like(x)
    assert rnd.combine(out) is out
    return d, out


# ------------------------------------------------------------------------ LL
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 7, 32])
@pytest.mark.parametrize("uniform", [True, False])
def test_ll_round_matches_reference(top_k, num_tokens, uniform):
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[1, 7, 32]
    )
    x, ids, weights, scales = _inputs(num_tokens, top_k, seed=num_tokens * 10 + top_k)
    d, out = run_ll(rt, x, ids, weights, scales, uniform=uniform)
    _close(out, reference_moe(x, ids, weights, scales))
    # vLLM's batched layout: [local experts, capacity * world, hidden] + int32 counts.
    assert tuple(d.expert_x.shape) == (NUM_EXPERTS, CAPACITY, HIDDEN)
    assert d.expert_num_tokens.dtype == torch.int32
    assert (
        d.expert_num_tokens.tolist()
        == torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).tolist()
    )
    assert fleet.handles_alive == 3  # fresh handles of non-uniform rounds are gone


def test_ll_expert_rows_are_the_routed_tokens():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, top_k=2, sizes=[6])
    x, ids, weights, _ = _inputs(6, 2, seed=3)
    d = rt.round.dispatch(x, ids, weights)
    for e in range(NUM_EXPERTS):
        tokens = (ids == e).any(dim=1).nonzero().flatten()
        n = int(d.expert_num_tokens[e])
        assert n == tokens.numel()
        assert_same_rows((d.expert_x[e, :n],), (x[tokens],))
    rt.round.end()


def test_ll_apply_router_weight_on_input_top_1():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, top_k=1, sizes=[9])
    x, ids, weights, scales = _inputs(9, 1, seed=4)
    weights = weights * (torch.rand(9, 1, generator=torch.Generator().manual_seed(5)) + 0.2)
    d, out = run_ll(rt, x, ids, weights, scales, on_input=True)
    _close(out, reference_moe(x, ids, weights, scales))
    # Weights went onto the activations; the combine weighs by one.
    assert torch.equal(rt.pool.topk_weights[:9], torch.ones(9, 1))
    # Each expert received its tokens already weighted (in any row order).
    for e in ids.unique().tolist():
        tokens = (ids[:, 0] == e).nonzero().flatten()
        n = int(d.expert_num_tokens[e])
        assert_same_rows((d.expert_x[e, :n],), (x[tokens] * weights[tokens].to(x.dtype),))


def test_apply_router_weight_on_input_needs_top_1():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, top_k=2, sizes=[4])
    x, ids, weights, _ = _inputs(4, 2, seed=6)
    n_before = len(fleet.log)
    with pytest.raises(FlashInferEPConfigError, match="top_k == 1"):
        rt.round.dispatch(x, ids, weights, apply_router_weight_on_input=True)
    assert len(fleet.log) == n_before


@pytest.mark.parametrize("algorithm", [Algorithm.LOW_LATENCY, Algorithm.HIGH_THROUGHPUT])
def test_activations_must_be_bf16_of_the_fleet_hidden_size(algorithm):
    rt, fleet = build_fake_runtime(algorithm, hidden=HIDDEN, sizes=[4])
    rnd = rt.round
    x, ids, weights, _ = _inputs(4, 2, seed=7)
    n_before = len(fleet.log)
    with pytest.raises(FlashInferEPConfigError, match="BF16 activations only"):
        rnd.dispatch(x.float(), ids, weights)
    with pytest.raises(FlashInferEPConfigError, match="fleet hidden size 2048"):
        rnd.dispatch(x[:, :1024], ids, weights)
    assert len(fleet.log) == n_before


# ------------------------------------------------------------------------ HT
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 7, 32])
@pytest.mark.parametrize("uniform", [True, False])
def test_ht_round_matches_reference(top_k, num_tokens, uniform):
    rt, fleet = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[1, 7, 32]
    )
    x, ids, weights, scales = _inputs(num_tokens, top_k, seed=num_tokens * 20 + top_k)
    d, out = run_ht(rt, x, ids, weights, scales, uniform=uniform)
    _close(out, reference_moe(x, ids, weights, scales))
    # World size 1: every token is received once, with its own global routing.
    assert int(rt.pool.num_received.item()) == num_tokens
    # Each token arrives once with its own routing (rows in any order).
    assert_same_rows((d.x, d.topk_ids, d.topk_weights), (x, ids, weights))
    assert not d.remote_slot.any()
    # Routing lands in the runtime's persistent buffers: nothing allocated per layer.
    assert d.topk_ids.data_ptr() == rt.round.ids.data_ptr()
    assert d.topk_weights.data_ptr() == rt.round.weights.data_ptr()
    assert fleet.handles_alive == 3


def test_ht_apply_router_weight_on_input_top_1():
    rt, _ = build_fake_runtime(Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, top_k=1, sizes=[5])
    x, ids, weights, scales = _inputs(5, 1, seed=8)
    weights = weights * 0.5
    d, out = run_ht(rt, x, ids, weights, scales, on_input=True)
    _close(out, reference_moe(x, ids, weights, scales))
    assert torch.equal(d.topk_weights, torch.ones(5, 1))
    assert_same_rows((d.x, d.topk_ids), (x * weights.to(x.dtype), ids))


def test_ht_layers_share_one_handle_and_staging():
    rt, fleet = build_fake_runtime(Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, sizes=[8])
    ptrs = set()
    for layer in range(4):
        x, ids, weights, scales = _inputs(8, 2, seed=50 + layer)
        d, out = run_ht(rt, x, ids, weights, scales)
        _close(out, reference_moe(x, ids, weights, scales))
        ptrs.add((d.topk_ids.data_ptr(), d.topk_weights.data_ptr(), d.remote_slot.data_ptr()))
    assert len(ptrs) == 1
    assert fleet.handles_created == 1


# ----------------------------------------------------- HT remote-slot routing
def _ht_runtime_of_rank(rank: int, world: int, top_k: int = 2):
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT,
        hidden=HIDDEN,
        num_experts=NUM_EXPERTS,
        top_k=top_k,
        world_size=world,
        rank=rank,
    )
    assert rt.num_local_experts == NUM_EXPERTS // world
    return rt


def test_globalize_remote_slots_rank_0_of_2():
    rt = _ht_runtime_of_rank(0, 2)  # local experts 0..3; rank 1 owns 4..7
    recv_ids = torch.tensor([[0, -1], [-1, 3], [2, 1], [-1, -1]])
    recv_w = torch.tensor([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5], [0.9, 0.1]])
    ids, weights, remote = rt.round.globalize(recv_ids, recv_w, 4)
    # Other-rank slots -> first expert of the next rank (vLLM's expert_map: -1), weight 0.
    assert ids.tolist() == [[0, 4], [4, 3], [2, 1], [4, 4]]
    assert ids.dtype == torch.int64
    torch.testing.assert_close(
        weights, torch.tensor([[0.6, 0.0], [0.0, 0.7], [0.5, 0.5], [0.0, 0.0]])
    )
    assert remote.tolist() == [[False, True], [True, False], [False, False], [True, True]]
    assert (
        ids.data_ptr() == rt.round.ids.data_ptr()
        and weights.data_ptr() == rt.round.weights.data_ptr()
    )
    assert torch.equal(recv_w[0], torch.tensor([0.6, 0.4]))  # input untouched


def test_globalize_remote_slots_last_rank_wraps_to_rank_0():
    rt = _ht_runtime_of_rank(1, 2)  # local experts 4..7
    recv_ids = torch.tensor([[3, -1], [-1, 0]])
    recv_w = torch.tensor([[0.2, 0.8], [0.4, 0.6]])
    ids, weights, remote = rt.round.globalize(recv_ids, recv_w, 2)
    assert ids.tolist() == [[7, 0], [0, 4]]
    torch.testing.assert_close(weights, torch.tensor([[0.2, 0.0], [0.0, 0.6]]))
    assert remote.tolist() == [[False, True], [True, False]]


def test_globalized_remote_slots_are_dropped_by_an_expert_map():
    """What vLLM does with the result: rank 0's expert_map sends remote slots to -1."""
    rt = _ht_runtime_of_rank(0, 4, top_k=3)  # 2 local experts
    recv_ids = torch.tensor([[1, -1, 0], [-1, -1, 1]])
    recv_w = torch.full((2, 3), 1 / 3)
    ids, weights, _ = rt.round.globalize(recv_ids, recv_w, 2)
    expert_map = torch.full((NUM_EXPERTS,), -1, dtype=torch.int64)
    expert_map[:2] = torch.arange(2)
    local = expert_map[ids]
    assert ((local >= 0) == (recv_ids >= 0)).all()
    assert (weights[local < 0] == 0).all()


def test_strided_activations_work_and_strided_output_is_refused():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, top_k=2, sizes=[6])
    x, ids, weights, scales = _inputs(6, 2, seed=11)
    wide = torch.zeros(6, 2 * HIDDEN, dtype=torch.bfloat16)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    out = torch.empty_like(x)
    rnd = rt.round
    d = rnd.dispatch(strided, ids, weights)
    rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    _close(out, reference_moe(x, ids, weights, scales))
    d = rnd.dispatch(x, ids, weights)
    bad_out = torch.empty(HIDDEN, 6, dtype=torch.bfloat16).t()
    with pytest.raises(FlashInferEPConfigError, match="contiguous"):
        rnd.combine(d.expert_x, bad_out)
    rt.round.end()
