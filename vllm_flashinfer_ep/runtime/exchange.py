"""CPU exchanges among the EP ranks, each bounded by its own deadline.

Why: the package pairs its ranks over the EP CPU (gloo) group before collectives that
cannot be undone (the load check, the FP8 wire decision per layer, the capture plan).
vLLM creates that group with gloo's timeout (1,800 s unless
`--cpu-distributed-timeout-seconds`), and a rank that stopped would leave its peers
waiting that long and then end in a generic gloo error. Every exchange here waits at
most `VLLM_FLASHINFER_EP_EXCHANGE_TIMEOUT_S` from the moment this rank enters it, and
then raises `ExchangeTimeoutError` naming what was exchanged and the variable.

An exchange hands every rank's payload back in rank order, one collective per call:
ranks pair their calls by order, as gloo does, whatever `what` each passes.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.errors import FlashInferEPConfigError

# (this rank's payload, what it is) -> every rank's payload, in rank order.
Exchange = Callable[[Any, str], list[Any]]


class ExchangeTimeoutError(FlashInferEPConfigError):
    """Some EP rank did not reach a CPU exchange within the deadline."""


def deadline_error(
    what: str,
    timeout_s: float,
    rank: int,
    world_size: int,
    silent: Sequence[int] | None = None,
    cause: str = "",
) -> ExchangeTimeoutError:
    """The error of an exchange that did not complete (the same words on every rank)."""
    who = (
        f"EP rank(s) {', '.join(map(str, silent))} did not answer"
        if silent
        else "not every EP rank answered"
    )
    return ExchangeTimeoutError(
        f"flashinfer_ep: EP rank {rank} of {world_size} gave up on the exchange of the {what} "
        f"(deadline {timeout_s:g} s, {envs.EXCHANGE_TIMEOUT_S}): {who}{cause}. A rank stopped "
        "(its log says why) or reached this point later than the deadline; raise "
        f"{envs.EXCHANGE_TIMEOUT_S} if the ranks load or capture that far apart."
    )


class GlooExchange:
    """An Exchange over a torch.distributed gloo group: two all-gathers (sizes, then the
    pickled payloads), each waited for only until the call's deadline."""

    def __init__(self, group: Any, timeout_s: float) -> None:
        import torch.distributed as dist

        self.group = group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def __call__(self, payload: Any, what: str) -> list[Any]:
        import torch
        import torch.distributed as dist

        deadline = time.monotonic() + self.timeout_s
        data = pickle.dumps(payload)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(dist.all_gather(sizes, mine, group=self.group, async_op=True), deadline, what)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._wait(dist.all_gather(bufs, buf, group=self.group, async_op=True), deadline, what)
        return [
            pickle.loads(b[: int(n.item())].numpy().tobytes())  # noqa: S301 - our own ranks
            for b, n in zip(bufs, sizes)
        ]

    def _wait(self, work: Any, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            work.wait(timeout=datetime.timedelta(seconds=left))
        except (RuntimeError, TimeoutError) as exc:
            # gloo: "Operation timed out!", or a peer's connection closed (it died).
            cause = f" (gloo: {exc})" if str(exc) else ""
            raise deadline_error(
                what, self.timeout_s, self.rank, self.world_size, cause=cause
            ) from exc


def cpu_exchange(cpu_group: Any, timeout_s: float | None = None) -> Exchange:
    """The package's exchange over vLLM's EP CPU group (deadline: the package variable)."""
    return GlooExchange(cpu_group, envs.exchange_timeout_s() if timeout_s is None else timeout_s)
