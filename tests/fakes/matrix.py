"""The (backend x hidden size) test matrix, shared by the CPU and the GPU kernel tests.

LL cases with a hidden size NCCL-EP's low-latency kernels were not built for are
skipped with exactly `limits.unsupported_hidden_size_reason(K)`; HT runs every size.
Use `backend_hidden_params()` in `pytest.mark.parametrize(("backend", "hidden"), ...)`.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from vllm_flashinfer_ep.backends import BACKENDS, LOW_LATENCY, Algorithm
from vllm_flashinfer_ep.runtime import limits

# Two sizes NCCL-EP LL rejects (256: tiny test models; 3072: DeepEP-LL has it, NCCL-EP
# does not) and two it supports.
MATRIX_HIDDEN_SIZES: tuple[int, ...] = (256, 2048, 3072, 7168)

# vLLM backend name -> runtime algorithm.
ALGORITHM = {a.backend: a for a in Algorithm}


def skip_reason(backend: str, hidden: int) -> str | None:
    """Why (backend, hidden) cannot run, or None when it can."""
    if backend == LOW_LATENCY and hidden not in limits.SUPPORTED_HIDDEN_SIZES:
        return limits.unsupported_hidden_size_reason(hidden)
    return None


def backend_hidden_params(
    hidden_sizes: Iterable[int] = MATRIX_HIDDEN_SIZES, backends: Iterable[str] = BACKENDS
) -> list:
    """pytest params (backend, hidden), unsupported LL sizes marked skip with the reason."""
    params = []
    for backend in backends:
        for hidden in hidden_sizes:
            reason = skip_reason(backend, hidden)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(pytest.param(backend, hidden, marks=marks, id=f"{backend}-h{hidden}"))
    return params
