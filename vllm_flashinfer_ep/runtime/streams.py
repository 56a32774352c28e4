"""The stream a pool's handle work runs on, and its ordering against torch's: outside
capture FlashInfer issues on the handle's stream (0), so vLLM's capture warm-ups, on a
side stream, need the handle work joined with theirs; under capture it uses theirs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm_flashinfer_ep.runtime.capture import (
    current_raw_stream,
    current_stream_capturing,
    is_capturing,
)

T = TypeVar("T")


class HandleStreams:
    """The handle stream of one device (none without CUDA) and the per-round decision."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device_index = (
            device.index
            if device.index is not None
            else (torch.cuda.current_device() if self.cuda else -1)
        )
        self.stream = torch.cuda.default_stream(self.device_index) if self.cuda else None
        self.raw = self.stream.cuda_stream if self.stream is not None else 0

    def state(self) -> tuple[bool, bool]:
        """(capturing, join) for torch's current stream. On the legacy default stream
        nothing can be captured, so the common eager case asks no capture query."""
        if not self.cuda:
            return is_capturing(), False
        current = current_raw_stream(self.device_index)
        if current == self.raw == 0:
            return False, False
        capturing = current_stream_capturing()
        return capturing, not capturing and current != self.raw

    def ordered(self, join: bool, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if not join:
            return op(*args, **kwargs)
        assert self.stream is not None
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        result = op(*args, **kwargs)
        current.wait_stream(self.stream)
        return result
