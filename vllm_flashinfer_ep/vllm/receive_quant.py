"""FP8 MoE layers: what the experts get, quantized after receive or before dispatch.
128x128 block-FP8 layers send FP8 on the wire where NCCL-EP can (`fp8_dispatch_reason`,
runtime/fp8_wire.py). Others dispatch BF16 and get vLLM's own quantization
(`moe_kernel_quantize_input`) here:
- HT: the received rows, exactly (their count is known on the host).
- LL: the expert-major buffer, whose rows past each expert's count hold stale data. Per-row
  scales never mix rows; a dynamic per-tensor scale is taken over the received rows only
  (a masked max, graph-capturable). Only for experts that want quantized inputs: the
  received-rows experts quantize their own rows (`expects_unquantized_inputs`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.errors import FlashInferEPConfigError

GROUP = num.GROUP  # the activation group size of 128x128 block checkpoints


def carries_block(block: Any) -> bool:
    """Whether a layer's FP8 block shape (None: not block-quantized) is [*, 128]: the
    activation groups this package quantizes into."""
    return block is None or (len(block) == 2 and block[1] == GROUP)


def fp8_dtype() -> torch.dtype:
    try:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    except Exception:  # noqa: BLE001 - no platform (CPU tests): the CUDA type
        return torch.float8_e4m3fn


def refusal(quant_config: Any, flag: str) -> str | None:
    """Why this package cannot carry the layer's quantization (None: it can)."""
    if quant_config is None or getattr(quant_config, "quant_dtype", None) is None:
        return None
    dtype = quant_config.quant_dtype
    if dtype != fp8_dtype():
        return (
            f"{flag} supports BF16 and FP8 MoE layers; this layer quantizes activations to "
            f"{dtype}. Serve a BF16 or FP8 checkpoint, or pick another --all2all-backend."
        )
    block = quant_config.block_shape
    if not carries_block(block):
        return (
            f"{flag} carries FP8 activation groups of {GROUP} elements (128x128 block "
            f"checkpoints); this layer uses blocks {list(block)}. Pick another --all2all-backend."
        )
    return None


def fp8_dispatch_reason(quant_config: Any, hidden: int) -> str | None:
    """Why a layer keeps BF16 on the wire (None: NCCL-EP's FP8 dispatch carries it). Only
    128x128 block-FP8 layers qualify: other scales span more than 128 elements (vLLM's
    DeepEP backends draw the same line)."""
    from vllm_flashinfer_ep import envs
    from vllm_flashinfer_ep.runtime import fp8_wire

    if quant_config is None or getattr(quant_config, "quant_dtype", None) != torch.float8_e4m3fn:
        return "not an E4M3 FP8 layer"
    block = quant_config.block_shape
    if block is None or not carries_block(block) or quant_config.per_act_token_quant:
        return "not a 128x128 block-FP8 layer (its scales span more than 128 elements)"
    if quant_config.a1_scale is not None:
        return "the layer has a static activation scale"
    reason = fp8_wire.hidden_reason(hidden)
    if reason is not None:
        return reason
    if not envs.fp8_dispatch_enabled():
        return f"{envs.FP8_DISPATCH}=0"
    return None


def group_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] BF16 -> (E4M3, FP32 scales [tokens, hidden / 128]) as a 128x128
    block-FP8 layer's Triton experts quantize it, before an HT FP8 dispatch. Apart from
    runtime/fp8_wire.group_quantize (no vLLM there): this one follows vLLM's platform
    (E8M0 scales under DeepGEMM, the platform's FP8 type, amax floored)."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    return moe_kernel_quantize_input(
        x, None, quant_dtype=fp8_dtype(), per_act_token_quant=False, block_shape=[GROUP, GROUP]
    )


def quantize_received_rows(
    x: torch.Tensor, quant_config: Any, defer: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HT: x [received, hidden] BF16 -> (activations, scales) for the experts. No rows: as
    is (vLLM's per-tensor kernels would launch an empty grid; the experts do not run)."""
    if defer or quant_config is None or quant_config.quant_dtype is None or x.shape[0] == 0:
        return x, None
    return _vllm_quantize(x, quant_config.a1_scale, quant_config)


def quantize_expert_buffer(
    x: torch.Tensor, counts: torch.Tensor, quant_config: Any, defer: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LL: x [experts, rows, hidden] BF16 -> (activations, scales as vLLM's batched experts
    read them)."""
    if defer or quant_config is None or quant_config.quant_dtype is None:
        return x, None
    experts, rows, hidden = x.shape
    scale = quant_config.a1_scale
    if scale is None and not quant_config.per_act_token_quant and quant_config.block_shape is None:
        scale = num.tensor_scale(received_amax(x, counts)).reshape(1)
    xq, xs = _vllm_quantize(x.view(experts * rows, hidden), scale, quant_config)
    from vllm.model_executor.layers.fused_moe.utils import normalize_batched_scales_shape

    return xq.view(experts, rows, hidden), normalize_batched_scales_shape(xs, experts)


def received_amax(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """max |x| over the rows each expert received (FP32 scalar tensor, no host sync).
    Unreceived rows (anything, NaN included) are masked, not multiplied; a received NaN
    counts as zero, an infinity stays one, as in vLLM's dynamic per-tensor kernel."""
    rows = x.shape[1]
    row_max = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1)  # [experts, rows]
    row_max = torch.nan_to_num(row_max, nan=0.0, posinf=float("inf"))
    received = torch.arange(rows, device=x.device)[None, :] < counts.to(torch.int64)[:, None]
    return torch.where(received, row_max, torch.zeros_like(row_max)).amax().float()


def _vllm_quantize(
    x: torch.Tensor, scale: torch.Tensor | None, quant_config: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    return moe_kernel_quantize_input(
        x,
        scale,
        quant_dtype=quant_config.quant_dtype,
        per_act_token_quant=quant_config.per_act_token_quant,
        block_shape=quant_config.block_shape,
    )


def check_ht_experts(fused_experts: Any, flag: str) -> None:
    """HT FP8 layers' experts must be vLLM's Triton experts, which read the scale layouts
    above; others expect other layouts: refused at load rather than computing wrong."""
    qc = fused_experts.quant_config
    if qc is None or qc.quant_dtype is None:
        return
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    if not isinstance(fused_experts, TritonExperts):
        raise FlashInferEPConfigError(
            f"{flag} runs FP8 MoE layers with vLLM's Triton experts; the selected experts are "
            f"{type(fused_experts).__name__}. Pass --moe-backend triton."
        )
