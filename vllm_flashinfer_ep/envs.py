"""Environment variables read by the package.

vLLM's own `vllm.envs` raises AttributeError for names it does not know, so the plugin
reads its variables from os.environ here, in one place, with their defaults.
"""

from __future__ import annotations

import os

# Transport under flashinfer.moe_ep: "nccl_ep" (default) or "nixl_ep" (needs a FlashInfer
# built with NIXL-EP; the PyPI wheel is not).
TRANSPORT = "VLLM_FLASHINFER_EP_TRANSPORT"
# "0" turns the persistent handle pool off (every forward creates a fresh handle; the
# low-latency backend then runs without CUDA graphs).
HANDLE_POOL = "VLLM_FLASHINFER_EP_HANDLE_POOL"
# NCCL-EP fault-tolerance timeout in milliseconds (low latency only). NCCL-EP's own
# default is ~100 s, above vLLM's fault-detection deadline, hence our lower default.
FT_TIMEOUT_MS = "VLLM_FLASHINFER_EP_FT_TIMEOUT_MS"
# Size of the NCCL-EP RDMA buffer in bytes; 0 = computed from the fleet shape.
RDMA_BUFFER_BYTES = "VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES"
# "1" skips the worker-side environment checks (nvcc, libnccl version). For experts only.
SKIP_ENV_CHECKS = "VLLM_FLASHINFER_EP_SKIP_ENV_CHECKS"

DEFAULT_TRANSPORT = "nccl_ep"
DEFAULT_FT_TIMEOUT_MS = 20_000


def transport() -> str:
    return os.environ.get(TRANSPORT, DEFAULT_TRANSPORT).strip() or DEFAULT_TRANSPORT


def handle_pool_enabled() -> bool:
    return os.environ.get(HANDLE_POOL, "1").strip().lower() not in ("0", "false", "no", "off")


def ft_timeout_ms() -> int:
    raw = os.environ.get(FT_TIMEOUT_MS, "").strip()
    if not raw:
        return DEFAULT_FT_TIMEOUT_MS
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"{FT_TIMEOUT_MS} must be an integer number of ms, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"{FT_TIMEOUT_MS} must be > 0, got {value}")
    return value


def rdma_buffer_bytes() -> int:
    raw = os.environ.get(RDMA_BUFFER_BYTES, "").strip()
    return int(raw) if raw else 0


def skip_env_checks() -> bool:
    return os.environ.get(SKIP_ENV_CHECKS, "0").strip() == "1"


_BOOLEAN = ("0", "1", "true", "false", "yes", "no", "on", "off")
_TRANSPORTS = ("nccl_ep", "nixl_ep")
KNOWN = (TRANSPORT, HANDLE_POOL, FT_TIMEOUT_MS, RDMA_BUFFER_BYTES, SKIP_ENV_CHECKS)


def validate_env(environ) -> None:
    """Raise ValueError naming the first VLLM_FLASHINFER_EP_* variable with a bad value
    (or an unknown name: a typo would silently fall back to the default)."""
    for name in sorted(k for k in environ if k.startswith("VLLM_FLASHINFER_EP_")):
        raw = str(environ[name]).strip()
        if name not in KNOWN:
            raise ValueError(f"{name} is not a vllm-flashinfer-ep variable; known: {', '.join(KNOWN)}")
        if name == TRANSPORT and raw not in _TRANSPORTS:
            raise ValueError(f"{name} must be one of {', '.join(_TRANSPORTS)}, got {raw!r}")
        if name in (HANDLE_POOL, SKIP_ENV_CHECKS) and raw.lower() not in _BOOLEAN:
            raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
        if name in (FT_TIMEOUT_MS, RDMA_BUFFER_BYTES):
            floor = 1 if name == FT_TIMEOUT_MS else 0
            if not raw.isdigit() or int(raw) < floor:
                raise ValueError(f"{name} must be an integer >= {floor}, got {raw!r}")
