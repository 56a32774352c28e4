"""CUDA stream-capture state, safe to ask on hosts without a usable GPU, and the
engine's capture phase.

The capture phase is the span in which the engine captures its CUDA graphs (vLLM: its
`graph_capture` context). When it opens, the EP ranks agree on the capture plan and pool
the counts it adds (vllm/rank_checks.py). Before each capture the engine runs one eager
warm-up forward of the same token count on every rank; a handle pool seeing a count it
still lacks there learns it (runtime/round_plan.py), so the pool holds exactly what the
engine captures, whatever the engine's sizing rules (speculative decoding,
sequence-parallel MoE, drafter graphs) made of the configured sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_phase_depth = 0


@contextmanager
def capture_phase() -> Iterator[bool]:
    """Mark the engine's capture phase (re-entrant); yields True for the outermost entry."""
    global _phase_depth
    _phase_depth += 1
    try:
        yield _phase_depth == 1
    finally:
        _phase_depth -= 1


def in_capture_phase() -> bool:
    return _phase_depth > 0


def is_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph.

    `torch.cuda.is_current_stream_capturing()` raises on machines whose torch is
    CUDA-built but have no driver; there is nothing to capture there.
    """
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def current_stream_capturing() -> bool:
    """`torch.cuda.is_current_stream_capturing()` in one C call (the per-round query of
    host-bound eager rounds); only for callers that know CUDA is usable."""
    if _capturing is not None:
        return bool(_capturing())
    return bool(torch.cuda.is_current_stream_capturing())


def current_raw_stream(device_index: int) -> int:
    """The cudaStream_t of torch's current stream on a device, as an int.

    One C call (`torch.cuda.current_stream()` builds a Stream object through several
    Python calls); falls back to that where this torch lacks the binding.
    """
    if _raw_stream is not None:
        return int(_raw_stream(device_index))
    return torch.cuda.current_stream(device_index).cuda_stream


def capture_graph(step, between=None) -> torch.cuda.CUDAGraph:
    """Capture `step()` into a CUDA graph the way vLLM does: one eager warm-up on a side
    stream first, then the capture. `between()` runs after the warm-up (e.g. a barrier)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if between is not None:
        between()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph
