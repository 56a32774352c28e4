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

# Largest top_k the package accepts. nccl-extensions 0.1.0
# `nccl/ep/include/nccl_ep/common.hpp` defines MAX_NUM_TOPK 32 and FlashInfer checks
# nothing. FlashInfer's runbook says LL <= 8 and `ll_ep.cuh` has kCombineMaxTopk = 9,
# but LL and HT round trips with top_k 8, 9, 10, 16 were exact on one H200 at world
# size 1 (integration notes, section 8), and tests/kernels/test_transport_gpu.py
# re-measures top_k up to this value on the device. Multi-rank behaviour above 9 is
# unmeasured, so the limit is the header's cap.
MAX_TOPK: int = 32

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


def is_supported_ll_hidden_size(hidden_size: int) -> bool:
    return hidden_size in SUPPORTED_HIDDEN_SIZES


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
