"""The multi-rank spawn helper (tests/kernels/multirank.py) on CPU processes: what the
multi-GPU tests report when a rank fails, hangs, crashes or leaves on purpose, and that a
failure ends the wait early instead of after the whole timeout."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from multirank import run_ranks  # noqa: E402

# A rank slow to start (a busy host): the spawned ranks import this module, and sleep here.
SLOW_START = "FLASHINFER_EP_TEST_SLOW_RANK_START_S"
_SPAWNED = __import__("multiprocessing").current_process().name != "MainProcess"
if os.environ.get(SLOW_START) and _SPAWNED:
    time.sleep(float(os.environ[SLOW_START]))


def _ok(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.barrier()


def _one_fails_one_waits(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 found a wrong result")
    time.sleep(600)  # a peer left waiting in a collective never returns


def _one_hangs(rank: int, world: int) -> None:
    import torch.distributed as dist

    # Both ranks joined first: rank 0 hosts the rendezvous store, and leaving while rank 1
    # still connects would make rank 1 die at start-up instead of hanging.
    dist.barrier()
    if rank == 1:
        time.sleep(600)


def _huge_traceback(rank: int, world: int) -> None:
    raise AssertionError("x" * 200_000)  # more than a pipe holds


def _one_leaves(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.barrier()  # both ranks joined: the peer's rendezvous is done before rank 1 goes
    if rank == 1:
        os._exit(0)  # killed on purpose, as the fault-tolerance tests do


def _one_crashes(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 1:
        os.abort()


def test_every_rank_succeeds():
    run_ranks(2, _ok, timeout_s=60)


def test_a_failure_ends_the_wait_after_the_grace():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(2, _one_fails_one_waits, timeout_s=70, grace_s=2)
    assert time.monotonic() - start < 60  # not the whole timeout
    text = str(info.value)
    assert "rank 1 found a wrong result" in text and "ranks hung: [0]" in text


def test_a_hang_is_named_at_the_deadline():
    with pytest.raises(AssertionError, match=r"ranks hung: \[1\]"):
        run_ranks(2, _one_hangs, timeout_s=15)  # counted from the join: start-up is apart


def test_a_slow_start_does_not_count_against_the_deadline(monkeypatch):
    """Ranks that take longer to start than the deadline still get the whole deadline for
    their work: only the rank that hangs after the join is named."""
    monkeypatch.setenv(SLOW_START, "6")
    with pytest.raises(AssertionError, match=r"ranks hung: \[1\]"):
        run_ranks(2, _one_hangs, timeout_s=4)


def test_a_huge_traceback_does_not_block_its_rank():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="xxxx") as info:
        run_ranks(2, _huge_traceback, timeout_s=60)
    assert "ranks hung: []" in str(info.value)
    assert time.monotonic() - start < 50


def test_a_rank_may_leave_on_purpose_but_not_crash():
    run_ranks(2, _one_leaves, timeout_s=60)
    with pytest.raises(AssertionError, match=r"died without a report: \[1\]"):
        run_ranks(2, _one_crashes, timeout_s=60, grace_s=2)
