"""The package's all2all managers, one per fake-world rank, over one `FakeGroup`.

Each manager is the real class built as vLLM builds it, less vLLM's distributed state:
the base constructor only records the group, rank and world size, the worker's
environment checks are skipped, the EP CPU exchange is `FakeCpuExchange` over the same
group (with the package's deadline, `VLLM_FLASHINFER_EP_EXCHANGE_TIMEOUT_S`), and
tensors stay on the CPU. The fleets pair through the group as the fake NCCL-EP's do.
Run the ranks with `tests.fakes.world.run_ranks(world, fn, group=world.group)`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from tests.fakes.cpu_exchange import FakeCpuExchange
from tests.fakes.fake_moe_ep import FakeGroup
from vllm_flashinfer_ep import envs

_local = threading.local()


def this_rank() -> int | None:
    """The fake rank of the calling thread (set by `ManagerWorld.run`), or None."""
    return getattr(_local, "rank", None)


@dataclass
class ManagerWorld:
    group: FakeGroup
    managers: list[Any]
    exchanges: list[FakeCpuExchange]

    def run(self, fn, timeout_s: float = 60.0) -> list:
        """`fn(rank, manager)` on every rank's thread; results in rank order."""
        from tests.fakes.world import run_ranks

        def body(rank: int, group: FakeGroup) -> Any:
            _local.rank = rank
            try:
                return fn(rank, self.managers[rank])
            finally:
                _local.rank = None

        return run_ranks(len(self.managers), body, timeout_s=timeout_s, group=self.group)

    def outcomes(self, fn, timeout_s: float = 60.0) -> list:
        """Like `run`, but every rank's result or exception, in rank order (a failing
        rank does not end the others' wait early: each meets its own deadline)."""

        def guarded(rank: int, manager: Any) -> Any:
            try:
                return fn(rank, manager)
            except Exception as exc:  # noqa: BLE001 - returned to the test
                return exc

        return self.run(guarded, timeout_s)


@contextmanager
def manager_world(
    backend: str, configs: Sequence[Any], group_timeout_s: float = 30.0
) -> Iterator[ManagerWorld]:
    """One manager per config (rank = index), built in this thread; destroyed on exit."""
    import vllm.config as vllm_config_mod
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
    )

    from vllm_flashinfer_ep.vllm import managers as managers_mod

    world = len(configs)
    group = FakeGroup(world, timeout_s=group_timeout_s)
    building: dict[str, Any] = {}
    exchanges: list[FakeCpuExchange] = []

    def base_init(self, cpu_group, tcp_store_group=None):
        self.cpu_group = cpu_group
        self.rank, self.world_size = building["rank"], world
        self.support_fault_tolerance = False

    def exchange_of(cpu_group, timeout_s=None):
        made = FakeCpuExchange(cpu_group, building["rank"], envs.exchange_timeout_s())
        exchanges.append(made)
        return made

    made = []
    with (
        mock.patch.object(All2AllManagerBase, "__init__", base_init),
        mock.patch.object(managers_mod, "cpu_exchange", exchange_of),
        mock.patch.dict("os.environ", {envs.SKIP_ENV_CHECKS: "1"}),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
    ):
        try:
            for rank, config in enumerate(configs):
                building["rank"] = rank
                with mock.patch.object(
                    vllm_config_mod, "get_current_vllm_config_or_none", lambda c=config: c
                ):
                    manager = managers_mod.MANAGERS[backend](group)
                manager._device = torch.device("cpu")  # the fake's GPU on CPU hosts
                made.append(manager)
            yield ManagerWorld(group, made, exchanges)
        finally:
            for manager in made:
                manager.destroy()
