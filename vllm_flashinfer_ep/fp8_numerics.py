"""vLLM 0.33.0's FP8 constants (its dynamic FP8 kernels, `moe_kernel_quantize_input`) in one
place: the wire, the prepare/finalize and the experts must give vLLM's bytes. No vLLM
import: the runtime reads this too.
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
    """amax / 448 as a true FP32 division, as vLLM's kernels (torch's / by a host scalar
    multiplies by its reciprocal, one ulp off at times)."""
    return amax / torch.full_like(amax, FP8_MAX)


def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """A dynamic per-tensor scale from max |x|; an all-zero input gets the floor."""
    return over_fp8_max(amax.float()).clamp_min(TENSOR_SCALE_FLOOR)
