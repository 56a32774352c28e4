"""Limits of FlashInfer's NCCL-EP transport that the package enforces up front.

Every number here has its source next to it, so a reader can re-check it against the
installed FlashInfer / nccl-extensions. Production code (hidden-size round-up, config
validation) and the test matrices read the same constants.
"""

from __future__ import annotations

# NCCL-EP low-latency kernels are specialized for these hidden sizes only.
# Source: flashinfer/moe_ep/core/validation/common.py `_NCCL_EP_LL_HIDDEN_SIZES`
# (checked by `validate_ll_hidden_size` in NcclEpFleet.__init__). Unlike DeepEP-LL,
# 3072 is NOT in the list.
SUPPORTED_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)

# Largest top_k per algorithm. nccl-extensions 0.1.0 `nccl/ep/include/nccl_ep/common.hpp`
# defines MAX_NUM_TOPK 32 and FlashInfer checks nothing (its runbook says LL <= 8).
# Measured on one H200 at world size 1 (tests/kernels/test_transport_gpu.py::
# test_top_k_limit, 128 experts, hidden 2048): LL and HT round trips exact for top_k
# 8, 9, 10, 16; HT exact for 32; LL with 32 is refused by ncclEpInitHandle ("LL top-k
# geometry is unsupported: top-k=32, num_experts=128, comm_sms=132, ...
# forwarding_warps=31"). So LL is capped at the largest measured value, HT at the
# header's cap. Multi-rank behaviour above 9 is unmeasured.
MAX_TOPK_LL: int = 16
MAX_TOPK_HT: int = 32


# Names under which Hugging Face configs carry the number of routed experts per token.
TOPK_CONFIG_KEYS: tuple[str, ...] = (
    "num_experts_per_tok",
    "moe_topk",
    "num_experts_per_token",
    "top_k",
    "moe_k",
)


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


# libnccl_ep.so imports ncclCommQueryProperties / ncclGetPeerDevicePointer /
# ncclWinGetUserPtr, first exported by NCCL 2.30.7 (integration notes, section 1).
MIN_NCCL_VERSION: tuple[int, int, int] = (2, 30, 7)

# NCCL-EP needs a CUDA-13 build of torch and a Hopper-or-newer GPU
# (flashinfer/moe_ep/core/validation/common.py `validate_arch_for_backend`).
MIN_CUDA_MAJOR: int = 13
MIN_COMPUTE_CAPABILITY: tuple[int, int] = (9, 0)

# HT fleets are clamped to this many tokens per rank
# (nccl/ep/include/nccl_ep/common.hpp MAX_SUPPORTED_TOKENS_PER_RANK).
HT_MAX_TOKENS_PER_RANK: int = 8192


def unsupported_hidden_size_reason(hidden_size: int) -> str:
    """The one skip/error reason used by tests and logs for an unsupported LL size."""
    return f"unsupported hidden size {hidden_size} for flashinfer_ep_low_latency"


def round_up_ll_hidden_size(hidden_size: int) -> int:
    """Smallest supported LL hidden size >= ``hidden_size``.

    Raises ValueError when the model is wider than the widest LL kernel.
    """
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
