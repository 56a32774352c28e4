"""Eager rounds on pooled handles: bucket sizes, padding to the agreed size, agreement.

The fake transport refuses what NCCL-EP refuses (an `update` or `dispatch` whose row
count differs from the handle's), and fills the LL receive buffer's unused rows with NaN,
so a padded row that leaked into an output, or a pad of the wrong size, fails here.
"""

from __future__ import annotations

import pytest
import torch
from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

from tests.fakes.fake_moe_ep import Call
from tests.fakes.runtime import build_fake_runtime
from tests.fakes.world import run_ranks
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import DispatchCapacityError, HandlePoolError
from vllm_flashinfer_ep.runtime import pool_sizes, round_plan
from vllm_flashinfer_ep.runtime.pool_sizes import bucket_sizes
from vllm_flashinfer_ep.runtime.round_plan import LOCAL
from vllm_flashinfer_ep.vllm.forward_state import agreed_token_count

HIDDEN = 2048
NUM_EXPERTS = 8
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("fake")


def _layer(num_tokens: int, seed: int, top_k: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, top_k, CPU, gen)
    scales = torch.rand(NUM_EXPERTS, generator=gen) + 0.5
    return x, ids, weights, scales


def _round(rt, x, ids, weights, scales, agreed=LOCAL, out=True):
    rnd = rt.round  # the runtime's own, as every layer of its shape uses it
    d = rnd.dispatch(x, ids, weights, agreed_tokens=agreed)
    target = torch.full_like(x, float("nan")) if out else None
    result = rnd.combine(scale_expert_rows(d.expert_x, scales), target)
    return result, d


def _close(out, x, ids, weights, scales):
    torch.testing.assert_close(
        out.float(), reference_moe(x, ids, weights, scales).float(), rtol=2e-2, atol=2e-2
    )


# ----------------------------------------------------------------- buckets
@pytest.mark.parametrize(
    ("above", "capacity"), [(0, 32), (0, 100), (512, 8192), (256, 256), (8, 33)]
)
def test_buckets_cover_every_count_up_to_capacity_with_less_than_half_padding(above, capacity):
    sizes = bucket_sizes(above, capacity)
    assert sizes == sorted(set(sizes)) and all(above < s <= capacity for s in sizes)
    assert len(sizes) <= 2 * capacity.bit_length() + 1
    for n in range(above + 1, capacity + 1):
        fit = min(s for s in sizes if s >= n)
        assert fit - n < max(1, n / 2) or fit == capacity, (n, fit)


def test_bucket_examples():
    assert bucket_sizes(512, 8192) == [768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert bucket_sizes(0, 32) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert bucket_sizes(0, 100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert bucket_sizes(256, 256) == []


@pytest.mark.parametrize(
    "above,capacity,max_pad", [(0, 8192, 256), (0, 3000, 256), (512, 8192, 100), (0, 64, 16)]
)
def test_max_pad_bounds_the_padding_in_rows(above, capacity, max_pad):
    """HT: every count in (above, capacity] pads by at most max_pad rows and by less than
    half its size; the geometric sizes stay."""
    sizes = bucket_sizes(above, capacity, max_pad=max_pad)
    assert set(bucket_sizes(above, capacity)) <= set(sizes)
    for n in range(above + 1, capacity + 1):
        pooled = min(s for s in sizes if s >= n)
        assert pooled - n < max_pad and (pooled - n) * 2 < max(n, 2)


# ----------------------------------------------------------------- padding
@pytest.mark.parametrize("num_tokens", [1, 5, 7])
@pytest.mark.parametrize("with_out", [True, False])
def test_a_count_between_pooled_sizes_pads_to_the_next_and_matches_the_reference(
    num_tokens, with_out
):
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[4, 8])
    before = len(fleet.log)
    x, ids, weights, scales = _layer(num_tokens, seed=num_tokens)
    out, _ = _round(rt, x, ids, weights, scales, out=with_out)
    assert out.shape == x.shape
    _close(out, x, ids, weights, scales)
    size = 4 if num_tokens <= 4 else 8
    handle = 0 if size == 4 else 1
    assert fleet.log[before:] == [
        Call("update", handle, size),
        Call("dispatch", handle, size),
        Call("combine", handle, size),
    ]
    c = rt.pool.counters
    assert (c.fresh_created, c.pooled_rounds) == (0, 1)
    assert c.padded_rounds == (0 if num_tokens == size else 1)
    assert fleet.handles_created == 2


def test_padded_rows_carry_zeros_weight_zero_and_this_rank_s_experts():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    x, ids, weights, scales = _layer(3, seed=3)
    _, d = _round(rt, x, ids, weights, scales)
    pool = rt.pool
    # Rows 3..7 of the bound routing are the pad pattern, with weight 0.
    assert torch.equal(pool.topk_ids[:3], ids)
    assert torch.equal(pool.topk_ids[3:8], pool.pad_ids[3:8])
    assert torch.all(pool.topk_weights[3:8] == 0)
    # Every padded (token, slot) reached an expert as a zero row: the received rows of
    # the experts hold 3 real tokens x top_k 2 + 5 pad tokens x 2 = 16 rows.
    assert int(d.expert_num_tokens.sum()) == 16
    rows = [d.expert_x[e, : int(d.expert_num_tokens[e])] for e in range(NUM_EXPERTS)]
    zero_rows = sum(int((r.float().abs().sum(dim=1) == 0).sum()) for r in rows)
    assert zero_rows == 10


def test_pad_routing_stays_on_the_rank_when_it_has_top_k_experts():
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        capacity=16,
        num_experts=8,
        top_k=2,
        world_size=2,
        rank=1,
    )
    pad = rt.pool.pad_ids
    assert pad.min() >= 4 and pad.max() <= 7  # rank 1 owns experts 4..7
    assert all(len(set(row.tolist())) == 2 for row in pad)  # distinct experts per row
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        capacity=16,
        num_experts=8,
        top_k=6,
        world_size=2,
        rank=1,
    )
    pad = rt.pool.pad_ids  # 4 local experts < top_k 6: spread over all experts, still distinct
    assert all(len(set(row.tolist())) == 6 for row in pad) and pad.max() <= 7


def test_a_later_smaller_padded_round_is_not_touched_by_an_earlier_larger_one():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[16])
    big = _layer(15, seed=1)
    _round(rt, *big)
    small = _layer(2, seed=2)
    out, _ = _round(rt, *small)
    _close(out, *small)


def test_under_capture_a_size_must_be_pooled_exactly(monkeypatch):
    from tests.fakes.runtime import install_capture_switch

    switch = install_capture_switch(monkeypatch)
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    x, ids, weights, _ = _layer(5, seed=5)
    with (
        switch.capturing(),
        pytest.raises(HandlePoolError, match="no warmed flashinfer_ep handle for 5"),
    ):
        rt.round.dispatch(x, ids, weights)
    assert fleet.handles_created == 1


# --------------------------------------------------------------- agreement
def test_ranks_with_different_counts_share_the_handle_of_the_agreed_count():
    """Two simulated EP ranks with 3 and 6 tokens and the agreed count 6 both run on the
    pooled 8-token handle (the fake checks they pair the same collective)."""
    counts = [3, 6]

    def rank_fn(rank, group):
        rt, fleet = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=HIDDEN,
            top_k=2,
            capacity=16,
            sizes=[4, 8],
            world_size=2,
            rank=rank,
            process_group=group,
        )
        x, ids, weights, _ = _layer(counts[rank], seed=10 + rank)
        out, _ = _round(rt, x, ids, weights, torch.ones(NUM_EXPERTS // 2), agreed=max(counts))
        _close(out, x, ids, weights, torch.ones(NUM_EXPERTS))
        c = rt.pool.counters
        return c.fresh_created, c.padded_rounds, [op.tokens for op in fleet.log[-3:]]

    results = run_ranks(2, rank_fn, timeout_s=30)
    assert results == [(0, 1, [8, 8, 8]), (0, 1, [8, 8, 8])]


def test_without_agreement_every_rank_creates_a_fresh_handle_logged_once(monkeypatch):
    # The pool's own logger, recorded directly: vLLM's logging config may disable or
    # re-route loggers depending on which tests ran before.
    said: list[str] = []
    monkeypatch.setattr(round_plan.logger, "info", lambda msg, *args: said.append(msg % args))
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    for seed in range(3):
        x, ids, weights, scales = _layer(5, seed=seed)
        out, _ = _round(rt, x, ids, weights, scales, agreed=None)
        _close(out, x, ids, weights, scales)
    assert rt.pool.counters.fresh_created == 3 and fleet.handles_alive == 1
    fresh = [m for m in said if "per-forward handle" in m]
    assert len(fresh) == 1 and "no token count agreed" in fresh[0]


def test_an_agreed_count_above_every_pooled_size_runs_fresh():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    x, ids, weights, scales = _layer(5, seed=5)
    out, _ = _round(rt, x, ids, weights, scales, agreed=20)
    _close(out, x, ids, weights, scales)
    assert rt.pool.counters.fresh_created == 1 and rt.pool.counters.pooled_rounds == 0


def _context(dp_sizes=None, local_sizes=None):
    dp = None
    if dp_sizes is not None:
        dp = DPMetadata(num_tokens_across_dp_cpu=torch.tensor(dp_sizes, dtype=torch.int32))
        dp.local_sizes = local_sizes
    return ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, dp_metadata=dp)


def test_agreement_is_the_largest_rank_count_from_vllm_s_forward_context():
    assert agreed_token_count(5) == LOCAL  # outside a vLLM forward
    with override_forward_context(_context()):
        assert agreed_token_count(5) == LOCAL  # one DP rank: every EP rank has these tokens
    with override_forward_context(_context([3, 7, 5])):
        assert agreed_token_count(3) == 7 and agreed_token_count(7) == 7
        # This rank has more than vLLM agreed: an error, not a per-rank fallback that
        # would pair a new handle with the other ranks' pooled one.
        with pytest.raises(HandlePoolError, match="cannot agree on a handle"):
            agreed_token_count(9)
    with override_forward_context(_context([16, 16], local_sizes=[8, 6])):
        assert agreed_token_count(6) == 8  # sequence-parallel chunk sizes win


def test_ht_ranks_far_apart_in_tokens_all_run_per_forward_handles():
    """HT's agreement (max_spread): an idle rank does not pad up to a busy rank's prefill;
    every rank reads the same counts, so all of them run fresh handles together."""
    with override_forward_context(_context([1, 2000])):
        assert agreed_token_count(1, max_spread=pool_sizes.HT_MAX_PAD) is None
        assert agreed_token_count(2000, max_spread=pool_sizes.HT_MAX_PAD) is None
        assert agreed_token_count(1) == 2000  # LL (and graphs) keep the largest count
    with override_forward_context(_context([1800, 2000])):
        assert agreed_token_count(1800, max_spread=pool_sizes.HT_MAX_PAD) == 2000


def test_the_ht_prepare_takes_the_spread_bound():
    from vllm_flashinfer_ep.vllm import managers
    from vllm_flashinfer_ep.vllm.rank_checks import RankChecks

    rt, _ = build_fake_runtime(Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=512, sizes=[8])
    mgr = managers.FlashInferEPHighThroughputManager.__new__(
        managers.FlashInferEPHighThroughputManager
    )
    mgr.algorithm, mgr.get_handle = Algorithm.HIGH_THROUGHPUT, lambda kw: rt
    mgr._checks = RankChecks(None, None)  # one rank: nothing to exchange
    pf = mgr.make_prepare_finalize(
        type(
            "Moe",
            (),
            dict(num_experts=8, max_num_tokens=512, hidden_dim=HIDDEN, experts_per_token=2),
        )(),
        None,
    )
    with override_forward_context(_context([1, 400])):
        assert pf._agreed(1) is None
    # Above the capacity every rank refuses alike, spread or not (nobody waits in NCCL-EP).
    with override_forward_context(_context([1, 600])), pytest.raises(DispatchCapacityError):
        pf._agreed(1)


def test_a_round_that_failed_before_its_combine_leaves_no_padding_behind():
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    x5, ids5, w5, _ = _layer(5, seed=1)
    rt.round.dispatch(x5, ids5, w5)  # padded 5 -> 8, then the layer fails before its combine
    for n in (8, 3, 1):  # an exact round, a fresh one and a padded one still come out right
        x, ids, weights, scales = _layer(n, seed=n)
        out, _ = _round(rt, x, ids, weights, scales, agreed=None if n == 3 else LOCAL)
        _close(out, x, ids, weights, scales)


def test_a_failing_dispatch_ends_the_round(monkeypatch):
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[8])
    x, ids, weights, scales = _layer(5, seed=2)
    issuer = rt.round.planner.flashinfer
    real = issuer.dispatch
    monkeypatch.setattr(
        issuer, "dispatch", lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        rt.round.dispatch(x, ids, weights, agreed_tokens=None)  # a fresh handle
    assert rt.round.in_flight is None and rt.round.sent_per_rank is None
    assert fleet.handles_alive == 1  # the fresh handle was destroyed
    monkeypatch.setattr(issuer, "dispatch", real)
    out, _ = _round(rt, x, ids, weights, scales)
    _close(out, x, ids, weights, scales)


def test_pad_rows_are_written_with_the_pad_routing_on_every_round():
    """Rank 1 of 2: the pad pattern (experts 4..7) differs from the warm-up's dummy routing,
    so a pool that skipped writing it would leave other ids in the padded rows."""
    counts = [3, 6]

    def rank_fn(rank, group):
        rt, _ = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=HIDDEN,
            top_k=2,
            capacity=16,
            sizes=[8],
            world_size=2,
            rank=rank,
            process_group=group,
        )
        x, ids, weights, _ = _layer(counts[rank], seed=30 + rank)
        _round(rt, x, ids, weights, torch.ones(NUM_EXPERTS // 2), agreed=6)
        pool, n = rt.pool, counts[rank]
        return (
            torch.equal(pool.topk_ids[n:8], pool.pad_ids[n:8]),
            int(pool.pad_ids.min()),
            int(pool.pad_ids.max()),
        )

    assert run_ranks(2, rank_fn, timeout_s=30) == [(True, 0, 3), (True, 4, 7)]


def test_padded_rounds_stage_through_persistent_buffers():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=32, sizes=[4, 8])
    pool = rt.pool
    staged = {k: v.data_ptr() for k, v in pool.staged.items()}
    assert set(staged) == {
        "x:torch.bfloat16",
        "out:torch.bfloat16",
    }  # made at warm-up, before any round
    for n in (3, 5, 6):
        x, ids, weights, scales = _layer(n, seed=n)
        out, _ = _round(rt, x, ids, weights, scales, out=False)
        _close(out, x, ids, weights, scales)
    assert {k: v.data_ptr() for k, v in pool.staged.items()} == staged


@pytest.mark.parametrize("num_tokens", [3, 5, 8])
def test_ht_rounds_pad_to_the_next_pooled_size_and_match_the_reference(num_tokens):
    """HT receives the padded rows too (world 1: every row once): zeros with weight 0,
    reduced and combined with the rest, and dropped from the output."""
    from tests.helpers import reduce_received_rows

    rt, fleet = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=32, sizes=[4, 8]
    )
    x, ids, weights, scales = _layer(num_tokens, seed=num_tokens)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights)
    size = 4 if num_tokens <= 4 else 8
    assert d.x.shape[0] == size == rnd.sent_per_rank
    # Received rows come in the transport's order: count the padded (all-zero) ones.
    assert int((d.x == 0).all(dim=1).sum()) == size - num_tokens
    reduce_received_rows(d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(size))
    out = torch.full_like(x, float("nan"))
    rnd.combine(out)
    _close(out, x, ids, weights, scales)
    c = rt.pool.counters
    assert (c.fresh_created, c.padded_rounds) == (0, int(num_tokens != size))
    assert fleet.handles_created == 2
