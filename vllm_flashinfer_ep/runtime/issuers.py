"""Who issues a round's transport calls, one issuer per round (round_plan.py picks it):

- `FlashInferIssuer`: FlashInfer's handle methods (captured, padded, fresh rounds, HT).
- `NativeEager` (native_handle.py): direct nccl.ep calls for pooled eager LL rounds.
- `WireIssuer`: FP8 dispatch through a wire (fp8_wire.py), the rest through its base.
- `JoinedIssuer`: any of these, joined with torch's current stream around each call.
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
        self, handle: Any, expert_out: torch.Tensor, out: torch.Tensor | None, weights: torch.Tensor
    ) -> torch.Tensor: ...


class FlashInferIssuer:
    """FlashInfer's handle methods. `record`: told each dispatch's output (NativeEager)."""

    def __init__(self, fi: Any, record: Callable[[Any], None] | None = None) -> None:
        self._fi, self._record = fi, record

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
        return handle.combine(self._fi.CombineInputParams(x=[expert_out], out=out)).x


class WireIssuer:
    """FP8 dispatch through `wire`; update and combine (BF16) through `base`."""

    def __init__(self, wire: Any, base: Issuer) -> None:
        self.wire, self.base = wire, base
        self.update, self.combine = base.update, base.combine

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        return self.wire.dispatch(handle, x, scales)


class JoinedIssuer:
    """`inner`'s calls, each joined with torch's current stream on both sides."""

    def __init__(self, inner: Issuer, streams: HandleStreams) -> None:
        self.inner, self._streams = inner, streams

    def update(self, handle: Any, ids: torch.Tensor) -> None:
        self._streams.ordered(True, self.inner.update, handle, ids)

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None) -> Any:
        return self._streams.ordered(True, self.inner.dispatch, handle, x, scales)

    def combine(
        self, handle: Any, expert_out: torch.Tensor, out: torch.Tensor | None, weights: Any
    ) -> torch.Tensor:
        return self._streams.ordered(True, self.inner.combine, handle, expert_out, out, weights)
