"""Spawn helpers for multi-rank GPU tests (one process per GPU, gloo EP group).

Every rank reports to the parent (None for success, or its traceback) and then leaves with
os._exit (a rank may also leave with os._exit(0) unreported: a peer killed on purpose):
NCCL/NCCL-EP teardown with a peer gone (the fault-tolerance tests) is not what these tests
check, and a teardown that waits on a dead peer would read as a hang. The
parent waits on one deadline for all ranks, and once a rank has failed it gives the others
a short grace before it kills them (a peer left waiting in a collective never returns).
The deadline counts from the moment every rank joined the process group: starting a
rank (an interpreter importing torch) is slow wherever the CPUs are busy, which no
test's deadline is about; start-up has its own, generous limit.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import NO_MULTICAST, free_port

RENDEZVOUS_TIMEOUT_S = 120  # gloo's default is 30 min when a peer dies before it joins
JOINED = "joined"  # a rank's first report: it is in the process group


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        **NO_MULTICAST,
    )
    code = 1
    try:
        if torch.cuda.is_available():  # (the CPU tests of this helper run without)
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        )
        results.put((rank, JOINED))
        fn(rank, world, *args)
        results.put((rank, None))
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, traceback.format_exc()[-8000:]))
    finally:
        sys.stdout.flush()  # os._exit skips the interpreter's flush: keep the rank's output
        sys.stderr.flush()
        os._exit(code)


def run_ranks(world: int, fn: Callable, *args, timeout_s: float = 180, grace_s: float = 15):
    """Run fn(rank, world, *args) on `world` GPUs; raise with every failed rank's traceback,
    and name the ranks that neither reported nor exited (hung). `timeout_s` counts from
    when every rank joined the process group (start-up: RENDEZVOUS_TIMEOUT_S and a margin)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()  # put() is written before the rank goes on to os._exit
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    reports: dict[int, str | None] = {}
    joined: set[int] = set()
    deadline, failed_at = time.monotonic() + RENDEZVOUS_TIMEOUT_S + 30, None
    started = False

    def drain() -> None:  # read while waiting: a large traceback must not block its rank
        while not results.empty():
            rank, tb = results.get()
            if tb == JOINED:
                joined.add(rank)
            else:
                reports[rank] = tb

    try:
        while True:
            drain()
            if all(not p.is_alive() for p in procs):
                break
            now = time.monotonic()
            if not started and len(joined) == world:
                started, deadline = True, now + timeout_s
            failing = any(tb is not None for tb in reports.values()) or any(
                p.exitcode not in (None, 0) for p in procs
            )
            if failing and failed_at is None:
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace_s):
                break
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs) if p.is_alive() and r not in reports]
    finally:  # also on an interrupt: interpreter exit would wait for live ranks
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    drain()
    failures = {r: tb for r, tb in reports.items() if tb is not None}
    # A rank may leave on purpose with os._exit(0) (a peer killed abruptly); any other exit
    # without a report is a crash (a signal, a native abort).
    silent = [
        r for r, p in enumerate(procs) if r not in reports and r not in hung and p.exitcode != 0
    ]
    if hung or failures or silent:
        detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(
            f"ranks hung: {hung}; ranks that died without a report: {silent}; exit codes "
            f"{[p.exitcode for p in procs]}\n{detail}"
        )
