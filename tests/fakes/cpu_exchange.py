"""The package's CPU exchange among fake-world ranks (threads of one process).

What runtime/exchange.GlooExchange does over vLLM's gloo group, over a `FakeGroup`'s
store: every rank's payload back in rank order, calls paired by their order on each rank
(as gloo pairs its collectives, whatever each rank says it exchanges), payloads that must
survive pickling (as the real one pickles them), and the same deadline and error: a rank
that has not posted its payload when the deadline passes leaves the others with
`ExchangeTimeoutError`, whose words are the real one's (it names no silent rank either).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from tests.fakes.fake_moe_ep import FakeGroup
from vllm_flashinfer_ep.runtime.exchange import deadline_error


class FakeCpuExchange:
    def __init__(self, group: FakeGroup, rank: int, timeout_s: float) -> None:
        self.group, self.rank, self.timeout_s = group, rank, timeout_s
        self.calls: list[str] = []  # what each call exchanged, in order
        self.waited_s: list[float] = []

    def __call__(self, payload: Any, what: str) -> list[Any]:
        key = ("cpu_exchange", len(self.calls))
        self.calls.append(what)
        world = self.group.world_size
        self.group.post(key, self.rank, pickle.loads(pickle.dumps(payload)))
        start = time.monotonic()
        got = self.group.collect(key, range(world), self.timeout_s)
        self.waited_s.append(time.monotonic() - start)
        if len(got) < world:
            raise deadline_error(what, self.timeout_s, self.rank, world)
        return [got[r] for r in range(world)]
