"""N EP ranks in one process: tokens travel between ranks through the package's rounds.

The fake transport at world size > 1 (tests/fakes/world.py): every rank runs the real
FleetCache/HandlePool/round code on its own thread; outputs must equal the torch
reference MoE of each rank's own tokens, with experts living on other ranks.
"""

from __future__ import annotations

import pytest
import torch

from tests.fakes.compare import assert_same_rows
from tests.fakes.runtime import build_fake_runtime
from tests.fakes.world import run_ranks
from tests.helpers import reduce_received_rows, scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.runtime.round_plan import LOCAL

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN = 2048
NUM_EXPERTS = 8
CPU = torch.device("cpu")


def _inputs(rank: int, num_tokens: int, top_k: int):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, top_k, CPU, gen)
    return x, ids, weights


SCALES = torch.rand(NUM_EXPERTS, generator=torch.Generator().manual_seed(7)) + 0.5


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("uniform", [True, False])
def test_ll_tokens_reach_experts_on_other_ranks_and_come_back(world, uniform):
    top_k = 2
    counts = [5] * world if uniform else [3 + 2 * r for r in range(world)]

    def rank_fn(rank, group):
        rt, fleet = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=HIDDEN,
            top_k=top_k,
            capacity=16,
            sizes=[5],
            world_size=world,
            rank=rank,
            process_group=group,
        )
        x, ids, weights = _inputs(rank, counts[rank], top_k)
        rnd = rt.round
        d = rnd.dispatch(x, ids, weights, agreed_tokens=LOCAL if uniform else None)
        e_local = rt.num_local_experts
        received = d.expert_num_tokens.clone()
        expert_rows = [d.expert_x[e, : int(received[e])].clone() for e in range(e_local)]
        local_scales = SCALES[rank * e_local : (rank + 1) * e_local]
        out = torch.empty_like(x)
        rnd.combine(scale_expert_rows(d.expert_x, local_scales), out)
        return x, ids, weights, out, received, expert_rows, fleet.calls("dispatch")

    results = run_ranks(world, rank_fn)
    all_x = torch.cat([r[0] for r in results])
    all_ids = torch.cat([r[1] for r in results])
    e_local = NUM_EXPERTS // world
    for rank, (x, ids, weights, out, received, expert_rows, dispatches) in enumerate(results):
        torch.testing.assert_close(
            out.float(), reference_moe(x, ids, weights, SCALES).float(), rtol=2e-2, atol=2e-2
        )
        assert len(dispatches) == 1
        for e in range(e_local):
            g = rank * e_local + e
            senders = (all_ids == g).any(dim=1)
            assert int(received[e]) == int((all_ids == g).sum())  # receive counts
            assert_same_rows((expert_rows[e],), (all_x[senders],))


@pytest.mark.parametrize("world", [2, 3])
def test_ht_receive_counts_remote_slots_and_outputs(world):
    top_k = 3
    num_experts = 6 if world == 3 else NUM_EXPERTS
    counts = [4 + r for r in range(world)]
    scales = torch.rand(num_experts, generator=torch.Generator().manual_seed(9)) + 0.5

    def rank_fn(rank, group):
        rt, _ = build_fake_runtime(
            Algorithm.HIGH_THROUGHPUT,
            hidden=HIDDEN,
            top_k=top_k,
            num_experts=num_experts,
            capacity=16,
            world_size=world,
            rank=rank,
            process_group=group,
        )
        gen = torch.Generator().manual_seed(200 + rank)
        x = torch.randn(counts[rank], HIDDEN, generator=gen).to(torch.bfloat16)
        ids, weights = random_routing(counts[rank], num_experts, top_k, CPU, gen)
        rnd = rt.round
        d = rnd.dispatch(x, ids, weights, agreed_tokens=None)
        got = (d.x.clone(), d.topk_ids.clone(), d.topk_weights.clone(), d.remote_slot.clone())
        n = d.x.shape[0]
        reduce_received_rows(d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(n))
        out = torch.empty_like(x)
        rnd.combine(out)
        return x, ids, weights, out, got, int(rt.pool.num_received.item())

    results = run_ranks(world, rank_fn)
    e_local = num_experts // world
    all_x = torch.cat([r[0] for r in results])
    all_ids = torch.cat([r[1] for r in results])
    all_w = torch.cat([r[2] for r in results])
    for rank, (x, ids, weights, out, got, num_received) in enumerate(results):
        # Each token's output sums its experts' contributions from every rank.
        torch.testing.assert_close(
            out.float(), reference_moe(x, ids, weights, scales).float(), rtol=2e-2, atol=2e-2
        )
        here = (all_ids >= rank * e_local) & (all_ids < (rank + 1) * e_local)
        senders = here.any(dim=1)
        assert num_received == int(senders.sum()) == got[0].shape[0]
        rx, r_ids, r_w, remote = got
        # Local slots keep their global id and weight; remote slots weigh 0.
        exp_w = torch.where(here[senders], all_w[senders], torch.zeros_like(all_w[senders]))
        assert_same_rows((rx, r_w, remote), (all_x[senders], exp_w, ~here[senders]))
        assert (r_ids[~remote] // e_local == rank).all()
        assert (r_ids[remote] // e_local == (rank + 1) % world).all()


def test_a_rank_that_skips_a_collective_is_caught():
    def rank_fn(rank, group):
        rt, fleet = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=HIDDEN,
            top_k=2,
            capacity=16,
            sizes=[4],
            world_size=2,
            rank=rank,
            process_group=group,
        )
        x, ids, weights = _inputs(rank, 4, 2)
        # rank 0 re-targets its pooled handle, rank 1 creates a fresh one: a mismatch.
        rt.round.dispatch(x, ids, weights, agreed_tokens=LOCAL if rank == 0 else None)

    with pytest.raises(RuntimeError, match="disagree on the collective"):
        run_ranks(2, rank_fn, timeout_s=20)
