"""EP ranks that built different transports are refused before they pair collectives,
on every rank alike, naming the item and the ranks (runtime/rank_agreement.py), and a
round above the capacity is refused by every rank before its first collective."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.fakes.runtime import build_fake_runtime
from tests.fakes.world import run_ranks
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import DispatchCapacityError
from vllm_flashinfer_ep.runtime.rank_agreement import (
    RankMismatchError,
    library_versions,
    require_same,
)


def _thread_exchange(world: int):
    """An Exchange per rank over threads: every rank's payload, in rank order."""
    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=20)

    def make(rank: int):
        def exchange(payload, what):
            slots[rank] = payload
            barrier.wait()
            got = list(slots)
            barrier.wait()
            return got

        return exchange

    return make


def _run(world: int, items_of_rank) -> list:
    make = _thread_exchange(world)
    results: list = [None] * world

    def body(rank: int) -> None:
        try:
            require_same(make(rank), items_of_rank(rank))
            results[rank] = "ok"
        except RankMismatchError as exc:
            results[rank] = str(exc)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_equal_items_pass_on_every_rank():
    assert _run(3, lambda r: {"capacity": 256, "sizes": [1, 2, 4]}) == ["ok"] * 3


def test_a_mismatch_fails_every_rank_with_the_same_message_naming_item_and_ranks():
    results = _run(4, lambda r: {"sizes": [1, 2, 4], "capacity": 128 if r == 2 else 256})
    assert len(set(results)) == 1, results  # every rank raises, with the same words
    message = results[0]
    assert "capacity" in message and "sizes" not in message
    assert "ranks 0, 1, 3: 256" in message and "rank 2: 128" in message


def test_an_item_one_rank_lacks_is_a_mismatch():
    results = _run(2, lambda r: {"a": 1} if r == 0 else {"a": 1, "b": 2})
    assert all("the b" in m and "not set on this rank" in m for m in results), results


def test_library_versions_names_every_collective_library():
    versions = library_versions()
    assert set(versions) >= {"flashinfer-python", "nccl-extensions", "vllm"}
    assert versions["vllm"] == "0.33.0"


# ------------------------------------------- the manager's check over a real gloo group
def _manager_rank(rank: int, world: int, port: int, case: str, results) -> None:
    os.environ.pop("VLLM_FLASHINFER_EP_FP8_DISPATCH", None)
    if case == "variable" and rank == 1:
        os.environ["VLLM_FLASHINFER_EP_FP8_DISPATCH"] = "0"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from vllm_flashinfer_ep.runtime.exchange import cpu_exchange
        from vllm_flashinfer_ep.runtime.fleet import FleetSpec
        from vllm_flashinfer_ep.vllm.managers import FlashInferEPLowLatencyManager
        from vllm_flashinfer_ep.vllm.rank_checks import RankChecks

        manager = FlashInferEPLowLatencyManager.__new__(FlashInferEPLowLatencyManager)
        manager._vllm_config = None
        manager._checks = RankChecks(cpu_exchange(dist.group.WORLD), None)
        capacity = 128 if (case == "capacity" and rank == 1) else 256
        spec = FleetSpec(Algorithm.LOW_LATENCY, 8, capacity, 2048)
        try:
            manager._require_ranks_agree(spec, 2, [1, 2, 4, 8])
            results[rank] = "ok"
        except RankMismatchError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("case", ["same", "capacity", "variable"])
def test_the_manager_refuses_ranks_that_differ_over_a_real_cpu_group(case):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        results = m.list([None, None])
        port = _free_port()
        procs = [
            ctx.Process(target=_manager_rank, args=(r, 2, port, case, results)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        results = list(results)
    if case == "same":
        assert results == ["ok", "ok"]
        return
    assert results[0] == results[1], results
    want = {"capacity": "fleet capacity", "variable": "package variables"}[case]
    assert want in results[0] and "rank 0:" in results[0] and "rank 1:" in results[0]
    if case == "variable":
        assert "'VLLM_FLASHINFER_EP_FP8_DISPATCH': False" in results[0]


# ---------------------------------------- the exchange's deadline over a real gloo group
def _late_rank(rank: int, world: int, port: int, late_s: float, results) -> None:
    """Rank 1 reaches the exchange `late_s` after rank 0 (the deadline: 2 s, from the
    package variable, as the managers build their exchange)."""
    import time

    from vllm_flashinfer_ep.runtime.exchange import ExchangeTimeoutError, cpu_exchange

    os.environ["VLLM_FLASHINFER_EP_EXCHANGE_TIMEOUT_S"] = "2"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    if rank == 1:
        time.sleep(late_s)
    start = time.monotonic()
    try:
        got = cpu_exchange(dist.group.WORLD)({"rank": rank}, "test items")
        results[rank] = ("ok", got, time.monotonic() - start)
    except ExchangeTimeoutError as exc:
        results[rank] = ("timeout", str(exc), time.monotonic() - start)
    os._exit(0)  # a rank left with a pending gloo op must not wait for it at exit


@pytest.mark.parametrize("late_s", [0.0, 6.0], ids=["in-time", "late"])
def test_a_gloo_exchange_waits_no_longer_than_its_deadline(late_s):
    """A peer that never comes in time leaves rank 0 a named error after its 2 s deadline,
    not gloo's 1,800 s; the late peer, arriving after rank 0 gave up, ends named too."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        results = m.list([None, None])
        port = _free_port()
        procs = [
            ctx.Process(target=_late_rank, args=(r, 2, port, late_s, results)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        results = list(results)
    if late_s == 0.0:
        assert [r[0] for r in results] == ["ok", "ok"], results
        assert results[0][1] == [{"rank": 0}, {"rank": 1}] == results[1][1]
        return
    status, message, waited = results[0]
    assert status == "timeout" and 1.5 < waited < 5, results
    assert "EP rank 0 of 2 gave up on the exchange of the test items" in message
    assert "VLLM_FLASHINFER_EP_EXCHANGE_TIMEOUT_S" in message
    status, message, waited = results[1]
    assert status == "timeout" and waited < 5, results  # its peer is gone: no long wait
    assert "EP rank 1 of 2 gave up" in message


# --------------------------------------------- a refusal every rank makes before a collective
@pytest.mark.usefixtures("fake")
def test_a_forward_above_the_capacity_is_refused_by_every_rank_before_any_collective():
    """vLLM's DP metadata says one rank runs more tokens than the fleet holds: the ranks
    with few tokens refuse too (reading the same count), so nobody waits in a dispatch."""
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    from vllm_flashinfer_ep.vllm.forward_state import agreed_token_count

    dp = DPMetadata(num_tokens_across_dp_cpu=torch.tensor([3, 40], dtype=torch.int32))
    context = ForwardContext(
        no_compile_layers={}, attn_metadata={}, slot_mapping={}, dp_metadata=dp
    )
    own = [3, 40]

    def rank_fn(rank, group):
        rt, fleet = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=2048,
            capacity=32,
            sizes=[4, 8, 32],
            world_size=2,
            rank=rank,
            process_group=group,
        )
        calls = len(fleet.log)
        ids = torch.zeros(own[rank], 2, dtype=torch.int64)
        x = torch.zeros(own[rank], 2048, dtype=torch.bfloat16)
        try:
            # What the prepare does: the agreement, then the round.
            agreed = agreed_token_count(own[rank], capacity=rt.capacity)
            rt.round.dispatch(x, ids, torch.ones(own[rank], 2), agreed_tokens=agreed)
        except DispatchCapacityError as exc:
            return str(exc), len(fleet.log) - calls
        return "dispatched", len(fleet.log) - calls

    with override_forward_context(context):
        results = run_ranks(2, rank_fn, timeout_s=30)
    for message, collectives in results:
        assert (
            "40 tokens on the largest EP rank" in message and "--max-num-batched-tokens" in message
        )
        assert collectives == 0


@pytest.mark.usefixtures("fake")
def test_the_pool_refuses_an_agreed_count_above_the_capacity_on_a_small_rank():
    """The same rule in the pool, for callers that hand it the agreed count directly."""
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=2048, capacity=32, sizes=[4, 8, 32]
    )
    calls = len(fleet.log)
    with pytest.raises(DispatchCapacityError, match="40 tokens on the largest EP rank"):
        rt.round.dispatch(
            torch.zeros(3, 2048, dtype=torch.bfloat16),
            torch.zeros(3, 2, dtype=torch.int64),
            torch.ones(3, 2),
            agreed_tokens=40,
        )
    assert len(fleet.log) == calls
