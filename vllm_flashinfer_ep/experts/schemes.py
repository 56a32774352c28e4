"""The scheme table: how the received-rows experts run each (weight, activation) key.

One row per scheme vLLM 0.33.0's batched Triton experts take, with their keys
(`BatchedTritonExperts._supports_quant_scheme`). Per-tensor rows hand vLLM's fused kernel
per-row scales (`per_channel`), each its expert's: the same FP32 product as the one scale
per expert of vLLM's batched experts, which its tensor-wise branch cannot read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)

from vllm_flashinfer_ep import fp8_numerics as num


class Quantizer(enum.Enum):
    """How the received rows of one GEMM's input are quantized (experts/kernels/quantize.py)."""

    GROUP = "per 128-element group, dynamic"
    TOKEN = "per row, dynamic"
    TENSOR_STATIC = "the checkpoint's per-tensor scale"
    TENSOR_ONE = "one dynamic scale over every received row"
    # vLLM's batched experts take it per expert when eager, over the whole buffer when
    # captured or compiled: the experts ask vLLM which, per call.
    TENSOR_PER_EXPERT_EAGER = "one dynamic scale per expert when eager, one when captured"


class Arrivals(enum.Enum):
    """How FP8 arrivals' scales are laid out (the FP8 wire's, or vLLM's batched prepare's)."""

    ROW_SCALES = "[experts, rows, groups] FP32, one row of scales per received row"
    EXPERT_SCALES = "one FP32 scale per expert ([E, 1, 1]) or one for all"


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_key: QuantKey | None
    activation_key: QuantKey | None
    input: Quantizer | None = None  # None: 16-bit GEMMs
    intermediate: Quantizer | None = None
    arrivals: Arrivals | None = None
    per_channel: bool = False  # the fused kernel reads A's scales per row
    block_shape: tuple[int, int] | None = None

    @property
    def fp8(self) -> bool:
        return self.input is not None

    def scale_groups(self, width: int) -> int:
        """Scales per row of an activation `width` elements wide."""
        return width // num.GROUP if self.input is Quantizer.GROUP else 1


SCHEMES: tuple[Scheme, ...] = (
    Scheme("bf16", None, None),
    Scheme(
        "block",
        kFp8Static128BlockSym,
        kFp8Dynamic128Sym,
        Quantizer.GROUP,
        Quantizer.GROUP,
        Arrivals.ROW_SCALES,
        block_shape=num.BLOCK_SHAPE,
    ),
    Scheme(
        "channel",
        kFp8StaticChannelSym,
        kFp8DynamicTokenSym,
        Quantizer.TOKEN,
        Quantizer.TOKEN,
        Arrivals.ROW_SCALES,
        per_channel=True,
    ),
    Scheme(
        "tensor_weights_token_activations",
        kFp8StaticTensorSym,
        kFp8DynamicTokenSym,
        Quantizer.TOKEN,
        Quantizer.TOKEN,
        Arrivals.ROW_SCALES,
        per_channel=True,
    ),
    Scheme(
        "tensor_static",
        kFp8StaticTensorSym,
        kFp8StaticTensorSym,
        Quantizer.TENSOR_STATIC,
        Quantizer.TENSOR_STATIC,
        Arrivals.EXPERT_SCALES,
        per_channel=True,
    ),
    Scheme(
        "tensor_dynamic",
        kFp8StaticTensorSym,
        kFp8DynamicTensorSym,
        Quantizer.TENSOR_ONE,
        Quantizer.TENSOR_PER_EXPERT_EAGER,
        Arrivals.EXPERT_SCALES,
        per_channel=True,
    ),
)
BY_KEYS: dict[tuple[Any, Any], Scheme] = {(s.weight_key, s.activation_key): s for s in SCHEMES}


def supports(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
    return (weight_key, activation_key) in BY_KEYS


def quant_keys(quant_config: Any) -> tuple[QuantKey | None, QuantKey | None] | None:
    """The (weight, activation) keys of a FusedMoEQuantConfig (None: no key names it)."""
    if quant_config.quant_dtype is None:
        return None if quant_config.w1_scale is not None else (None, None)
    if quant_config.quant_dtype != num.FP8 or not quant_config.use_fp8_w8a8:
        return None
    block = quant_config.block_shape
    static = quant_config.a1_scale is not None or quant_config.a2_scale is not None
    if block is not None:
        if tuple(block) != num.BLOCK_SHAPE or static:
            return None
        return kFp8Static128BlockSym, kFp8Dynamic128Sym
    weights = kFp8StaticChannelSym if quant_config.per_out_ch_quant else kFp8StaticTensorSym
    if quant_config.per_act_token_quant:
        return (weights, kFp8DynamicTokenSym) if not static else None
    return weights, kFp8StaticTensorSym if static else kFp8DynamicTensorSym


def describe(quant_config: Any) -> str:
    """A layer's quantization in a user's words, for refusals."""
    return (
        f"activations {quant_config.quant_dtype}, block {quant_config.block_shape}, "
        f"per-token {quant_config.per_act_token_quant}, per-channel weights "
        f"{quant_config.per_out_ch_quant}, static input scale {quant_config.a1_scale is not None}"
    )


def scheme_of(quant_config: Any) -> Scheme | None:
    """The row that runs this layer (None: no row does)."""
    keys = quant_keys(quant_config)
    return None if keys is None else BY_KEYS.get(keys)
