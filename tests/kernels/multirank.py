"""Spawn helpers for multi-rank GPU tests (one process per GPU, gloo EP group)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import free_port


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        NCCL_NVLS_ENABLE="0",
    )
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - report to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args, timeout_s: float = 600) -> None:
    """Run fn(rank, world, *args) on `world` GPUs; raise with every rank's traceback."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, fn, args, errors)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if hung or failures or any(p.exitcode for p in procs):
        detail = "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)
        raise AssertionError(
            f"ranks hung: {hung}; exit codes {[p.exitcode for p in procs]}\n{detail}"
        )
