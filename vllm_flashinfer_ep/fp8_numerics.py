"""The FP8 numbers every quantization in the package uses, in one place.

Each constant is vLLM 0.33.0's (its dynamic FP8 kernels and `moe_kernel_quantize_input`):
the wire, the prepare/finalize and the received-rows experts must give the bytes vLLM's
own path would give, so none of them may carry a copy. No vLLM import: the runtime reads
this too.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(FP8).max: what the dynamic kernels divide max |x| by
GROUP = 128  # activation elements per FP32 scale of 128x128 block layers
BLOCK_SHAPE = (GROUP, GROUP)  # their weight blocks
GROUP_AMAX_FLOOR = 1e-10  # per-group quantization floors max |x| here
TOKEN_SCALE_FLOOR = 1.0 / (FP8_MAX * 512.0)  # per-token quantization floors the scale here
TENSOR_SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)  # a dynamic per-tensor scale's


def over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as a true FP32 division, as vLLM's kernels divide (torch multiplies by
    the reciprocal of a host scalar, one ulp off at times, which moves E4M3 roundings)."""
    return amax / torch.full_like(amax, FP8_MAX)


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """A dynamic per-tensor scale from max |x|: an all-zero input gets the floor, not a
    division by zero."""
    return over_fp8_max(amax.float()).clamp_min(TENSOR_SCALE_FLOOR)
