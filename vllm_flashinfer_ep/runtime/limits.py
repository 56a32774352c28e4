"""Limits of FlashInfer's NCCL-EP transport that the package enforces up front, each with
its source so it can be re-checked against the installed FlashInfer / nccl-extensions."""

from __future__ import annotations

# flashinfer/moe_ep/core/validation/common.py `_NCCL_EP_LL_HIDDEN_SIZES` (no 3072).
SUPPORTED_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)

# Largest top_k: HT at nccl_ep common.hpp's MAX_NUM_TOPK; LL at the largest value that
# tests/kernels/test_transport_gpu.py::test_top_k_limit passes (docs/backends.md).
MAX_TOPK_LL: int = 16
MAX_TOPK_HT: int = 32


# Hugging Face config names of the routed experts per token.
TOPK_CONFIG_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")


def config_top_k(get) -> int | None:
    """top_k of a model config, `get(name)` reading one field (dict.get or getattr)."""
    for name in TOPK_CONFIG_KEYS:
        value = get(name)
        if isinstance(value, int) and value > 0:
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            return max(value)
    return None


def max_top_k(algorithm_is_low_latency: bool) -> int:
    return MAX_TOPK_LL if algorithm_is_low_latency else MAX_TOPK_HT


# libnccl_ep.so imports symbols first exported by NCCL 2.30.7 (ncclWinGetUserPtr, ...).
MIN_NCCL_VERSION: tuple[int, int, int] = (2, 30, 7)

# flashinfer/moe_ep/core/validation/common.py `validate_arch_for_backend`.
MIN_CUDA_MAJOR: int = 13
MIN_COMPUTE_CAPABILITY: tuple[int, int] = (9, 0)

# nccl_ep common.hpp MAX_SUPPORTED_TOKENS_PER_RANK: HT fleets are clamped to it.
HT_MAX_TOKENS_PER_RANK: int = 8192


def unsupported_hidden_size_reason(hidden_size: int) -> str:
    """The one skip/error reason used by tests and logs for an unsupported LL size."""
    return f"unsupported hidden size {hidden_size} for flashinfer_ep_low_latency"


def round_up_ll_hidden_size(hidden_size: int) -> int:
    """Smallest supported LL hidden size >= `hidden_size`; ValueError above the widest."""
    for size in SUPPORTED_HIDDEN_SIZES:
        if size >= hidden_size:
            return size
    raise ValueError(
        f"hidden size {hidden_size} is larger than the largest hidden size the "
        f"NCCL-EP low-latency kernels support ({SUPPORTED_HIDDEN_SIZES[-1]}); use "
        "--all2all-backend flashinfer_ep_high_throughput for this model."
    )


def format_version(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)
