"""CUDA stream-capture state, safe to ask on hosts without a usable GPU."""

from __future__ import annotations

import torch


def is_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph.

    `torch.cuda.is_current_stream_capturing()` raises on machines whose torch is
    CUDA-built but have no driver; there is nothing to capture there.
    """
    if not torch.cuda.is_available():
        return False
    return bool(torch.cuda.is_current_stream_capturing())
