"""The LL memory estimate (runtime/buffer_sizes.py) on shapes it was not calibrated on.

It was calibrated at hidden 2048/7168, 128 experts, top_k 8, 256 tokens (world 1). Its
documented formula must hold elsewhere: parts that add up to the total, each part its
formula (receive buffer local experts x capacity x world rows x hidden BF16; pool staging
2 x capacity x hidden BF16; NCCL-EP buffers 2 (experts + top_k) x capacity x hidden x 2
bytes x the measured factor), monotone and proportional in every dimension, and the
capacity that fits a budget exactly the largest one whose total fits. test_ll_capacity.py
holds the calibration checks (measurements, bench-memory rows).
"""

from __future__ import annotations

import itertools
import math

import pytest

from vllm_flashinfer_ep.runtime import buffer_sizes as bs

HIDDEN = (2048, 4096, 7168)
CAPACITY = (256, 512, 4096)
EXPERTS = (64, 128, 256)
TOP_K = 8
GRID = list(itertools.product(CAPACITY, HIDDEN, EXPERTS))
BF16 = 2


def _parts(tokens, hidden, experts, top_k=TOP_K, handles=0):
    return bs.ll_memory_parts(tokens, hidden, experts, top_k, handles)


def _total(tokens, hidden, experts, top_k=TOP_K, handles=0):
    return bs.ll_memory_bytes(tokens, hidden, experts, top_k, handles)


@pytest.mark.parametrize("handles", [0, 1, 37])
@pytest.mark.parametrize(("tokens", "hidden", "experts"), GRID)
def test_parts_add_up_to_the_total(tokens, hidden, experts, handles):
    parts = _parts(tokens, hidden, experts, handles=handles)
    assert set(parts) == {"fixed", "buffers", "receive", "pool"}
    assert all(isinstance(v, int) and v > 0 for v in parts.values())
    total = bs.ll_memory_bytes(tokens, hidden, experts, TOP_K, handles)
    assert total == sum(parts.values())


@pytest.mark.parametrize(("tokens", "hidden", "experts"), GRID)
def test_each_part_is_its_documented_formula(tokens, hidden, experts):
    parts = _parts(tokens, hidden, experts, handles=5)
    assert parts["fixed"] == bs.LL_FLEET_FIXED_BYTES
    assert parts["receive"] == experts * tokens * hidden * BF16
    assert parts["pool"] == 5 * bs.LL_HANDLE_BYTES + 2 * tokens * hidden * BF16
    assert parts["receive"] == bs.ll_receive_buffer_bytes(tokens, hidden, experts)
    assert parts["pool"] - 5 * bs.LL_HANDLE_BYTES == bs.ll_pad_staging_bytes(tokens, hidden)
    # NCCL-EP's buffers: 2 slots x (experts + top_k) x tokens x BF16 rows x the factor,
    # rounded up to whole bytes.
    exact = 2 * (experts + TOP_K) * tokens * hidden * BF16 * bs.LL_OVERHEAD_FACTOR
    assert parts["buffers"] == bs.ll_fleet_bytes(tokens, hidden, experts, TOP_K)
    assert exact <= parts["buffers"] < exact + 1 + exact * 1e-12
    assert bs.ll_bytes_per_token(hidden, experts, TOP_K) == pytest.approx(exact / tokens, rel=1e-12)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize(("tokens", "hidden", "experts"), GRID)
def test_receive_buffer_is_local_experts_by_capacity_times_world_rows(
    tokens, hidden, experts, world
):
    """FlashInfer's [local experts, capacity x world, hidden] BF16: the same bytes at any
    EP world that splits the experts evenly."""
    local = experts // world
    assert local * world == experts
    want = local * (tokens * world) * hidden * BF16
    assert bs.ll_receive_buffer_bytes(tokens, hidden, experts) == want


def _along(dim: str):
    """Pairs of shapes differing in one dimension only, smaller first."""
    values = {"tokens": CAPACITY, "hidden": HIDDEN, "experts": EXPERTS}
    others = [d for d in values if d != dim]
    for fixed in itertools.product(*(values[d] for d in others)):
        base = dict(zip(others, fixed))
        for lo, hi in itertools.pairwise(values[dim]):
            yield {**base, dim: lo}, {**base, dim: hi}


@pytest.mark.parametrize("dim", ["tokens", "hidden", "experts"])
def test_monotone_in_capacity_hidden_and_experts(dim):
    for small, big in _along(dim):
        a, b = _parts(**small, handles=3), _parts(**big, handles=3)
        assert _total(**small, handles=3) < _total(**big, handles=3)
        assert a["buffers"] < b["buffers"] and a["receive"] < b["receive"]
        assert a["fixed"] == b["fixed"]
        if dim == "experts":  # staging holds tokens, not experts
            assert a["pool"] == b["pool"]
        else:
            assert a["pool"] < b["pool"]


def test_monotone_in_top_k_and_handles():
    for tokens, hidden, experts in GRID:
        totals = [bs.ll_memory_bytes(tokens, hidden, experts, k) for k in (1, 2, 4, 8, 10)]
        assert totals == sorted(set(totals))
        pools = [_parts(tokens, hidden, experts, handles=h)["pool"] for h in (0, 1, 2, 100)]
        assert pools == sorted(set(pools))


@pytest.mark.parametrize("dim", ["tokens", "hidden", "experts"])
def test_each_part_scales_as_its_formula(dim):
    """Proportional where the formula is: tokens and hidden scale every shape-dependent
    part; experts scale the receive buffer exactly and the NCCL-EP buffers as
    (experts + top_k)."""
    for small, big in _along(dim):
        a, b = _parts(**small), _parts(**big)
        ratio = big[dim] / small[dim]
        if dim == "experts":
            assert b["receive"] == a["receive"] * ratio
            want = (big["experts"] + TOP_K) / (small["experts"] + TOP_K)
            assert b["buffers"] / a["buffers"] == pytest.approx(want, rel=1e-6)
        else:
            assert b["receive"] == a["receive"] * ratio
            assert b["pool"] == a["pool"] * ratio
            assert b["buffers"] / a["buffers"] == pytest.approx(ratio, rel=1e-6)


@pytest.mark.parametrize(("tokens", "hidden", "experts"), GRID)
def test_capacity_within_a_budget_is_the_largest_whose_total_fits(tokens, hidden, experts):
    total = bs.ll_memory_bytes(tokens, hidden, experts, TOP_K)
    assert bs.ll_max_tokens_within(total, hidden, experts, TOP_K) == tokens
    assert bs.ll_max_tokens_within(total - 1, hidden, experts, TOP_K) == tokens - 1
    for budget in (total - 1, total, total + 10**6, 3 * total):
        fit = bs.ll_max_tokens_within(budget, hidden, experts, TOP_K)
        assert bs.ll_memory_bytes(fit, hidden, experts, TOP_K) <= budget
        assert bs.ll_memory_bytes(fit + 1, hidden, experts, TOP_K) > budget


@pytest.mark.parametrize(("tokens", "hidden", "experts"), GRID)
def test_the_estimate_covers_nccl_ep_s_layout_at_world_1(tokens, hidden, experts):
    """The measured-factor estimate of NCCL-EP's buffers is at least the buffer NCCL-EP's
    own layout needs (ll_layout_bytes), on every shape, not just the calibrated ones."""
    layout = bs.ll_layout_bytes(tokens, hidden, experts, TOP_K, 1)
    assert layout % bs.NCCL_EP_BUFFER_ALIGNMENT == 0
    assert layout <= bs.ll_fleet_bytes(tokens, hidden, experts, TOP_K) <= layout * 1.01


def test_the_layout_grows_with_every_dimension():
    for dim in ("tokens", "hidden", "experts"):
        for small, big in _along(dim):
            a = bs.ll_layout_bytes(small["tokens"], small["hidden"], small["experts"], TOP_K, 1)
            b = bs.ll_layout_bytes(big["tokens"], big["hidden"], big["experts"], TOP_K, 1)
            assert a < b, (dim, small, big)
    worlds = [bs.ll_layout_bytes(256, 2048, 8, 1, w) for w in (1, 8, 16, 64)]
    assert worlds == sorted(worlds) and worlds[0] < worlds[-1]  # dispatch slots grow with world


def test_measured_fleets_exceed_the_layout_slightly():
    """The docstring's claim: measured first-handle growths exceed NCCL-EP's layout by
    well under 1 % (NCCL-EP's own small allocations)."""
    for m in bs.LL_MEASUREMENTS:
        layout = bs.ll_layout_bytes(m.tokens_per_rank, m.hidden, m.num_experts, m.top_k, 1)
        assert layout < m.fleet_bytes < layout * 1.01


@pytest.mark.usefixtures("fake")
@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
def test_the_estimate_s_receive_and_staging_are_what_an_ll_runtime_allocates(hidden):
    """On the fake: the pool's padding staging is ll_pad_staging_bytes, the receive buffer
    a round hands the experts is ll_receive_buffer_bytes."""
    import torch

    from tests.fakes.runtime import build_fake_runtime
    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.bench.reference import random_routing

    experts, capacity = 8, 16
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=hidden,
        num_experts=experts,
        capacity=capacity,
        top_k=2,
        sizes=(2, 4),
    )
    staged = sum(t.numel() * t.element_size() for t in rt.pool.staged.values())
    assert staged == bs.ll_pad_staging_bytes(capacity, hidden)
    gen = torch.Generator().manual_seed(hidden)
    ids, weights = random_routing(3, experts, 2, torch.device("cpu"), gen)
    d = rt.round.dispatch(torch.randn(3, hidden, generator=gen).to(torch.bfloat16), ids, weights)
    received = d.expert_x.numel() * d.expert_x.element_size()
    rt.round.end()
    assert received == bs.ll_receive_buffer_bytes(capacity, hidden, experts)
    assert math.prod(d.expert_x.shape) == experts * capacity * hidden
