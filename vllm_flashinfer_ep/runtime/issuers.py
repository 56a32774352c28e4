"""Who issues a round's transport calls: exactly one issuer per round.

- `FlashInferIssuer`: FlashInfer's handle methods: captured, padded, joined and fresh
  rounds, HT, and pooled eager LL rounds when the direct calls are off or have no receive
  buffer recorded yet.
- `NativeEager` (runtime/native_handle.py): direct nccl.ep calls for pooled eager LL
  rounds of exactly their size on the handles' stream, which are host-bound.
- `WireIssuer`: FP8 on the wire (runtime/fp8_wire.py) dispatches; the BF16 update and
  combine go through the issuer it wraps.
- `JoinedIssuer`: any of these, joined with torch's current stream around each call
  (runtime/streams.py).

Every issuer has `update(handle, ids)`, `dispatch(handle, x, scales)` and
`combine(handle, expert_out, out, weights)`; runtime/round_plan.py picks one per round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from vllm_flashinfer_ep.runtime.streams import HandleStreams


class Issuer(Protocol):
    def update(self, handle: Any, ids: torch.Tensor) -> None: ...

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any: ...

    def combine(
        self,
        handle: Any,
        expert_out: torch.Tensor,
        out: torch.Tensor | None,
        weights: torch.Tensor,
    ) -> torch.Tensor: ...


class FlashInferIssuer:
    """FlashInfer's handle methods. `record`: told each BF16 dispatch's output (the direct
    calls write into the receive buffer FlashInfer's dispatch returned)."""

    def __init__(self, fi: Any, record: Callable[[Any], None] | None = None) -> None:
        self._fi = fi
        self._record = record

    def update(self, handle: Any, ids: torch.Tensor) -> None:
        handle.update(self._fi.HandleParams(topk_ids=ids))

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        out = handle.dispatch(self._fi.DispatchInputParams(x=[x]))
        if self._record is not None:
            self._record(out)
        return out

    def combine(
        self, handle: Any, expert_out: torch.Tensor, out: torch.Tensor | None, weights: Any
    ) -> torch.Tensor:
        # The handle applies the weights it bound at creation: `weights` is those rows.
        return handle.combine(self._fi.CombineInputParams(x=[expert_out], out=out)).x


class WireIssuer:
    """FP8 dispatch through `wire`; update and combine (BF16) through `base`."""

    def __init__(self, wire: Any, base: Issuer) -> None:
        self.wire = wire
        self.base = base
        self.update = base.update
        self.combine = base.combine

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        return self.wire.dispatch(handle, x, scales)


class JoinedIssuer:
    """`inner`'s calls, each joined with torch's current stream on both sides."""

    def __init__(self, inner: Issuer, streams: HandleStreams) -> None:
        self.inner = inner
        self._streams = streams

    def update(self, handle: Any, ids: torch.Tensor) -> None:
        self._streams.ordered(True, self.inner.update, handle, ids)

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        return self._streams.ordered(True, self.inner.dispatch, handle, x, scales)

    def combine(
        self, handle: Any, expert_out: torch.Tensor, out: torch.Tensor | None, weights: Any
    ) -> torch.Tensor:
        return self._streams.ordered(True, self.inner.combine, handle, expert_out, out, weights)
