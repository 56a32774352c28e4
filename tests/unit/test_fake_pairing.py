"""The fake NCCL-EP polices how collectives pair across ranks (tests/fakes/fake_moe_ep.py).

Two ranks drive the fake directly (no package code): every collective (create_handle,
update, dispatch, combine) must name the same op, the same handle (its creation index on
its fleet) and the same token count on every rank. Real NCCL-EP checks none of it and
would hang or exchange garbage; the fake raises the same RuntimeError on every rank,
naming the op, the ranks and what differs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.fakes import fake_moe_ep as fi
from tests.fakes.world import run_ranks
from vllm_flashinfer_ep.bench.reference import random_routing

pytestmark = pytest.mark.usefixtures("fake")

WORLD = 2
HIDDEN = 2048
NUM_EXPERTS = 8
TOP_K = 2
CPU = torch.device("cpu")


def _fleet(rank: int, group: fi.FakeGroup) -> fi.FakeFleet:
    boot = fi.BootstrapConfig(world_size=WORLD, rank=rank, process_group=group)
    return fi.create_fleet(boot, fi.FleetParams(NUM_EXPERTS, 16, HIDDEN))


class _Handle:
    """A fake handle with its own routing, weights and activations."""

    def __init__(self, fleet: fi.FakeFleet, num_tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        self.ids, self.weights = random_routing(num_tokens, NUM_EXPERTS, TOP_K, CPU, gen)
        knobs = [fi.HandleAlgoKnobTopKWeights(self.weights)]
        self.handle = fleet.create_handle(fi.HandleParams(self.ids), knobs)

    def update(self) -> None:
        self.handle.update(fi.HandleParams(self.ids))

    def dispatch(self) -> fi.DispatchOutput:
        return self.handle.dispatch(fi.DispatchInputParams(x=[self.x]))

    def combine(self) -> torch.Tensor:
        e_local = NUM_EXPERTS // WORLD
        expert_out = torch.zeros(e_local, 16 * WORLD, HIDDEN, dtype=torch.bfloat16)
        return self.handle.combine(fi.CombineInputParams(x=[expert_out])).x


def _errors_on_every_rank(rank_fn) -> list[str]:
    """Run `rank_fn(rank, group)` on both ranks; each must raise RuntimeError: messages."""
    caught: list[BaseException | None] = [None] * WORLD

    def body(rank, group):
        try:
            rank_fn(rank, group)
        except RuntimeError as exc:
            caught[rank] = exc

    run_ranks(WORLD, body, timeout_s=20)
    assert all(isinstance(e, RuntimeError) for e in caught), caught
    assert not any(isinstance(e, threading.BrokenBarrierError) for e in caught)
    messages = [str(e) for e in caught]
    assert messages[0] == messages[1]  # every rank reports the same disagreement
    assert "disagree on the collective" in messages[0]
    return messages


def test_updating_handles_of_different_sizes_fails_on_every_rank():
    """Both ranks pool a 4- and an 8-token handle; rank 0 re-targets its 8-token one,
    rank 1 its 4-token one (the mispairing this check exists for)."""

    def rank_fn(rank, group):
        fleet = _fleet(rank, group)
        small, big = _Handle(fleet, 4, seed=rank), _Handle(fleet, 8, seed=10 + rank)
        (big if rank == 0 else small).update()

    [msg, _] = _errors_on_every_rank(rank_fn)
    assert "rank 0: update on handle 1 of fleet 0 with 8 tokens" in msg
    assert "rank 1: update on handle 0 of fleet 0 with 4 tokens" in msg
    assert "differ in the handle (creation index on its fleet) and the token count" in msg


def test_pooled_handles_of_different_sizes_fail_on_every_rank():
    """The same creation position, different token counts, re-targeted with `update`
    (a pooled handle, which the package pairs at one agreed size): only the size differs."""

    def rank_fn(rank, group):
        _Handle(_fleet(rank, group), 4 if rank == 0 else 6, seed=rank).update()

    [msg, _] = _errors_on_every_rank(rank_fn)
    assert "rank 0: update on handle 0 of fleet 0 with 4 tokens" in msg
    assert "rank 1: update on handle 0 of fleet 0 with 6 tokens" in msg
    assert msg.count("differ in the token count.") == 1 and "the handle (" not in msg


def test_per_forward_handles_of_different_sizes_pair_as_nccl_ep_pairs_them():
    """A handle created for one round carries each rank's own count (NCCL-EP's topk_idx
    is per rank): created, dispatched and combined at 4 and 6 tokens, no error."""

    def rank_fn(rank, group):
        h = _Handle(_fleet(rank, group), 4 if rank == 0 else 6, seed=rank)
        h.dispatch()
        h.combine()
        return "paired"

    assert run_ranks(2, rank_fn, timeout_s=20) == ["paired", "paired"]


@pytest.mark.parametrize("op", ["update", "dispatch", "combine"])
def test_a_different_handle_of_the_same_size_fails_on_every_rank(op):
    """Two 4-token handles on each rank, in step until `op`, where rank 0 uses its
    second handle and rank 1 its first: only the identity differs."""

    def rank_fn(rank, group):
        fleet = _fleet(rank, group)
        first, second = _Handle(fleet, 4, seed=rank), _Handle(fleet, 4, seed=20 + rank)
        for step in ("update", "dispatch", "combine"):
            if step == op:
                getattr(second if rank == 0 else first, step)()
                return
            getattr(first, step)()
            getattr(second, step)()

    [msg, _] = _errors_on_every_rank(rank_fn)
    assert f"rank 0: {op} on handle 1 of fleet 0 with 4 tokens" in msg
    assert f"rank 1: {op} on handle 0 of fleet 0 with 4 tokens" in msg
    assert "differ in the handle (creation index on its fleet)." in msg


def test_different_ops_fail_on_every_rank():
    """Rank 0 dispatches while rank 1 re-targets the same handle."""

    def rank_fn(rank, group):
        h = _Handle(_fleet(rank, group), 4, seed=rank)
        h.update()
        h.dispatch() if rank == 0 else h.update()

    [msg, _] = _errors_on_every_rank(rank_fn)
    assert "rank 0: dispatch on handle 0 of fleet 0 with 4 tokens" in msg
    assert "rank 1: update on handle 0 of fleet 0 with 4 tokens" in msg
    assert "differ in the op." in msg


def test_a_handle_of_another_fleet_fails_on_every_rank():
    """Two fleets per rank on one group: rank 0 uses its second fleet's handle 0, rank 1
    its first fleet's handle 0."""

    def rank_fn(rank, group):
        fleets = [_fleet(rank, group), _fleet(rank, group)]
        handles = [_Handle(f, 4, seed=rank + 5 * i) for i, f in enumerate(fleets)]
        handles[1 if rank == 0 else 0].update()

    [msg, _] = _errors_on_every_rank(rank_fn)
    assert "rank 0: update on handle 0 of fleet 1 with 4 tokens" in msg
    assert "differ in the fleet (creation index on the group)." in msg


def test_matching_collectives_pair_and_move_tokens():
    """Same ops on the same handles with the same sizes: a full round on both of two
    pooled handles, and a logged sequence identical on both ranks."""

    def rank_fn(rank, group):
        fleet = _fleet(rank, group)
        handles = [_Handle(fleet, 4, seed=rank), _Handle(fleet, 8, seed=10 + rank)]
        received = []
        for h in reversed(handles):  # the second one first: order is free, pairing is not
            h.update()
            received.append(int(h.dispatch().expert_counts.sum()))
            h.combine()
        return fleet.log, received

    (log0, got0), (log1, got1) = run_ranks(WORLD, rank_fn, timeout_s=20)
    assert log0 == log1
    assert [(c.op, c.handle, c.tokens) for c in log0[2:]] == [
        ("update", 1, 8),
        ("dispatch", 1, 8),
        ("combine", 1, 8),
        ("update", 0, 4),
        ("dispatch", 0, 4),
        ("combine", 0, 4),
    ]
    # Every (token, slot) of both ranks arrived at exactly one rank.
    assert [a + b for a, b in zip(got0, got1)] == [2 * 8 * TOP_K, 2 * 4 * TOP_K]


def test_the_handle_op_still_reads_as_its_name():
    """HandleOp carries the pairing key but compares as the op name (code that wraps
    FakeFleet._exchange and tests `op == "combine"` keeps working)."""
    op = fi.HandleOp("combine", 3, 8)
    assert op == "combine" and str(op) == "combine" and (op.handle, op.tokens) == (3, 8)
