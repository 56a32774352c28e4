"""Run N EP ranks of the package on the fake transport in one process, one thread each.

Each rank builds its own runtime (FleetCache, pool) over one `FakeGroup`; the fake's
collectives wait for every rank, so tokens really travel between ranks. A failure on
one rank breaks the group's barrier, so the others fail fast instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar
from unittest import mock

import torch

from tests.fakes.fake_moe_ep import FakeGroup

T = TypeVar("T")


def run_ranks(
    world_size: int,
    fn: Callable[[int, FakeGroup], T],
    timeout_s: float = 60.0,
    group: FakeGroup | None = None,
) -> list[T]:
    """`fn(rank, group)` on `world_size` threads; results in rank order, first error raised.
    `group`: the ranks' group when it was made first (e.g. for managers built before)."""
    group = group if group is not None else FakeGroup(world_size, timeout_s=timeout_s / 2)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, group)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = exc
            group._barrier.abort()

    # bootstrap_config asks torch.cuda.current_device(); patched once, outside the threads.
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks still running after {timeout_s} s")
    first = next(
        (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
        None,
    )
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
