"""vLLM's batched Triton experts, computing only the rows that arrived.

vLLM 0.33.0's `BatchedTritonExperts` launches programs over every row of the expert-major
LL buffer, and those empty programs set a decode step's time. These run vLLM's fused-MoE
kernel over the blocks of received rows (kernels/row_blocks.py): fixed shapes, so CUDA
graphs replay them for any routing. Per-layer decisions are made at construction.
Expert biases (gpt-oss) go where vLLM's no-EP Triton experts add them: w1's to GEMM1's
FP32 accumulator and w2's to GEMM2's, after the dequantization, in the fused kernel, so
only received rows get them (vLLM's batched experts drop them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
    BatchedTritonExperts,
    _is_capturing_or_compiling,
)
from vllm.model_executor.layers.fused_moe.fused_moe import (
    invoke_fused_moe_triton_kernel,
    try_get_optimal_moe_config,
)
from vllm.model_executor.layers.fused_moe.utils import _resize_cache

from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.experts import activations, schemes
from vllm_flashinfer_ep.experts.activations import Kind
from vllm_flashinfer_ep.experts.kernels import activation as act_kernel
from vllm_flashinfer_ep.experts.kernels import quantize
from vllm_flashinfer_ep.experts.kernels.row_blocks import RowBlocks, max_blocks, row_blocks
from vllm_flashinfer_ep.experts.schemes import Arrivals, Quantizer

SentPerRank = Callable[[], "int | None"]


def senders_tokens(local: int, senders: int, capacity: int, sent_per_rank: int | None) -> int:
    """The most tokens any sender dispatches in this forward: the transport's count when it
    knows; else this rank's at one sender; else vLLM's DP metadata's largest, at most the
    LL capacity; else that capacity."""
    if sent_per_rank is not None:
        return sent_per_rank
    if senders == 1:
        return local
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if is_forward_context_available():
        dp = get_forward_context().dp_metadata
        if dp is not None:
            return min(int(dp.num_tokens_across_dp_cpu.max()), capacity)
    return capacity


class ReceivedRowsExperts(BatchedTritonExperts):
    """`BatchedTritonExperts` over the received rows. `quantizes_input`: an FP8 layer's
    BF16 arrivals (no FP8 wire) are quantized here, received rows only. `sent_per_rank()`:
    see `senders_tokens`."""

    def __init__(
        self,
        moe_config: Any,
        quant_config: Any,
        max_num_tokens: int,
        num_dispatchers: int,
        *,
        quantizes_input: bool = False,
        sent_per_rank: SentPerRank | None = None,
    ) -> None:
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        scheme = schemes.scheme_of(quant_config)
        if scheme is None:
            raise FlashInferEPConfigError(
                "flashinfer_ep_low_latency's experts take the FP8 schemes of vLLM's batched "
                f"Triton experts; this layer has no row ({schemes.describe(quant_config)}). "
                "Serve it with --all2all-backend flashinfer_ep_high_throughput."
            )
        self._w1_bias = _bias(quant_config.w1_bias, "w1", moe_config)
        self._w2_bias = _bias(quant_config.w2_bias, "w2", moe_config)
        if moe_config.in_dtype not in (torch.bfloat16, torch.float16):
            raise FlashInferEPConfigError(
                f"the received-rows experts take 16-bit activations, got {moe_config.in_dtype}"
                " (pass --dtype bfloat16)"
            )
        static = [s for s in (quant_config.a1_scale, quant_config.a2_scale) if s is not None]
        if any(s.numel() != 1 for s in static):
            raise FlashInferEPConfigError(
                "the received-rows experts take one static activation scale per layer; "
                f"this layer has {[tuple(s.shape) for s in static]}. Serve it with "
                "--all2all-backend flashinfer_ep_high_throughput (or a checkpoint with one "
                "input scale per layer)."
            )
        self.scheme = scheme
        self._quantizes_input = quantizes_input and scheme.fp8
        self._sent_per_rank = sent_per_rank
        self._row_activation = activations.for_layer(moe_config.activation, self.activation_config)
        self._fused_activation = self._row_activation.kind is Kind.SILU
        self._ue8m0 = scheme.input is Quantizer.GROUP and _e8m0_scales()

    @classmethod
    def in_place_of(
        cls, experts: Any, *, fp8_wire: bool, sent_per_rank: SentPerRank, options: Any
    ) -> ReceivedRowsExperts:
        """Built as vLLM built `experts`; an FP8 layer off the FP8 wire quantizes here."""
        qc = experts.quant_config
        return cls(
            experts.moe_config,
            qc,
            experts.max_num_tokens,
            experts.num_dispatchers,
            quantizes_input=qc.quant_dtype is not None and not fp8_wire,
            sent_per_rank=sent_per_rank,
        )

    @property
    def expects_unquantized_inputs(self) -> bool:
        return self._quantizes_input

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return schemes.supports(weight_key, activation_key) and (
            BatchedTritonExperts._supports_quant_scheme(weight_key, activation_key)
        )

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: Any,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        assert expert_tokens_meta is not None
        experts, rows, k = hidden_states.shape
        total, n, top_k = experts * rows, w1.shape[1], topk_ids.shape[1]
        sent = self._sent_per_rank() if self._sent_per_rank is not None else None
        tokens = senders_tokens(
            topk_ids.shape[0], self.num_dispatchers, self.max_num_tokens or rows, sent
        )
        received = min(tokens * self.num_dispatchers, total)
        # vLLM's lookup for this kernel at the forward's size ("fp8_w8a8" tables for FP8)
        config = try_get_optimal_moe_config(
            w1.size(),
            w2.size(),
            top_k,
            self.quant_config.config_name(hidden_states.dtype),
            max(1, received),
            block_shape=self.block_shape,
        )
        block_m = config["BLOCK_SIZE_M"]
        counts = expert_tokens_meta.expert_num_tokens
        blocks = row_blocks(
            counts, rows, block_m, max_blocks(received * top_k, experts, rows, block_m)
        )
        act_n = self.adjust_N_for_activation(n, activation)
        cache1 = _resize_cache(workspace13, (total, n))
        cache2 = _resize_cache(workspace2, (total, act_n))
        x, out = hidden_states.view(total, k), output.view(total, k)
        if not self.scheme.fp8:
            ctype = tl.float16 if x.dtype == torch.float16 else tl.bfloat16
            _gemm(x, w1, cache1, blocks, config, ctype, bias=self._w1_bias)
            self._activation(activation, cache2, cache1, counts, blocks, experts)
            _gemm(cache2, w2, out, blocks, config, ctype, bias=self._w2_bias)
            return
        a1, a1_scale = self._gemm1_input(x, a1q_scale, blocks, rows, experts)
        fp8 = self._fp8(a1_scale, self.w1_scale)
        _gemm(a1, w1, cache1, blocks, config, tl.bfloat16, fp8, self._w1_bias)
        how = self.scheme.intermediate
        if self._fused_activation:  # activation and quantization in one launch
            a2, a2_scale = self._quantize(how, cache1, blocks, rows, True, a2_scale, True)
        else:
            self._activation(activation, cache2, cache1, counts, blocks, experts)
            a2, a2_scale = self._quantize(how, cache2, blocks, rows, False, a2_scale, True)
        fp8 = self._fp8(a2_scale, self.w2_scale)
        _gemm(a2, w2, out, blocks, config, tl.bfloat16, fp8, self._w2_bias)

    def _gemm1_input(
        self, x: torch.Tensor, scales: Any, blocks: RowBlocks, rows: int, experts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """E4M3 rows and [rows, groups] FP32 scales for GEMM1: quantized here, or as arrived."""
        if x.dtype != num.FP8:
            static = self.quant_config.a1_scale
            return self._quantize(self.scheme.input, x, blocks, rows, False, static, False)
        if self.scheme.arrivals is Arrivals.EXPERT_SCALES:  # one per expert, or one
            per_expert = (
                scales.reshape(-1).float().expand(experts) if scales.numel() == 1 else scales
            )
            return x, per_expert.reshape(experts, 1).expand(experts, rows).reshape(-1, 1)
        return x, scales.reshape(x.shape[0], self.scheme.scale_groups(x.shape[1]))

    def _quantize(
        self,
        how: Quantizer,
        x: torch.Tensor,
        blocks: RowBlocks,
        rows: int,
        act: bool,
        static: torch.Tensor | None,
        intermediate: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The received rows of x (activated first when `act`) as E4M3 with [rows, groups]
        FP32 scales. A per-tensor row without a static scale takes a dynamic one as vLLM
        would: one over the input, per expert for the intermediate when eager."""
        if how is Quantizer.GROUP:
            return quantize.quantize_rows(x, blocks, num.GROUP, self._ue8m0, act)
        if how is Quantizer.TOKEN:
            return quantize.quantize_rows(x, blocks, None, False, act)
        if how is Quantizer.TENSOR_STATIC:
            if static is not None:
                return quantize.tensor_quant(x, blocks, rows, False, act, static)
            how = Quantizer.TENSOR_PER_EXPERT_EAGER if intermediate else Quantizer.TENSOR_ONE
        per_expert = how is Quantizer.TENSOR_PER_EXPERT_EAGER and not _is_capturing_or_compiling()
        return quantize.tensor_quant(x, blocks, rows, per_expert, act)

    def _activation(self, activation, out, x, counts, blocks, experts) -> None:
        """SiLU-and-mul or gpt-oss's clamped SwiGLU over the received rows, or vLLM's masked
        activation for others."""
        row = self._row_activation
        if self._fused_activation and act_kernel.buffers_reason(out, x) is None:
            act_kernel.silu_and_mul(out, x, blocks)
        elif row.kind is Kind.SWIGLU_OAI:
            act_kernel.swiglu_oai(out, x, blocks, row.alpha, row.limit)
        else:
            shape = (experts, x.shape[0] // experts, -1)
            self.activation(activation, out.view(shape), x.view(shape), valid_token_counts=counts)

    def _fp8(self, a_scale: torch.Tensor, w_scale: torch.Tensor) -> tuple:
        block = list(self.scheme.block_shape) if self.scheme.block_shape else None
        return a_scale, w_scale, self.scheme.per_channel, block


def _gemm(
    a, w, c, blocks: RowBlocks, config: dict, compute_type, fp8: tuple | None = None, bias=None
):
    """c[row] = a[row] @ w[expert].T (+ bias[expert]) for the received rows: vLLM's fused-MoE
    kernel with the blocks as its sorted ids. `fp8`: (A scales, B scales, per_channel,
    block_shape); `bias` [experts, N], added in FP32 after the dequantization."""
    a_scale, w_scale, per_channel, block_shape = fp8 if fp8 is not None else (None,) * 4
    invoke_fused_moe_triton_kernel(
        a,
        w,
        c.view(c.shape[0], 1, c.shape[-1]),
        a_scale,
        w_scale,
        None,
        blocks.sorted_ids,
        blocks.expert_ids,
        blocks.blocks_rows,
        mul_routed_weight=False,
        top_k=1,
        config=config,
        compute_type=compute_type,
        use_fp8_w8a8=fp8 is not None,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=bool(per_channel),
        block_shape=block_shape,
        B_bias=bias,
    )


def _bias(bias: torch.Tensor | None, which: str, moe_config: Any) -> torch.Tensor | None:
    """A layer's expert bias as the fused kernel reads it: [local experts, N]."""
    if bias is None:
        return None
    experts = moe_config.num_local_experts
    if bias.dim() != 2 or bias.shape[0] != experts:
        raise FlashInferEPConfigError(
            f"the received-rows experts take {which}_bias as [local experts ({experts}), N]; "
            f"this layer's is {tuple(bias.shape)}. Serve it with --all2all-backend "
            "flashinfer_ep_high_throughput."
        )
    return bias


def _e8m0_scales() -> bool:
    """Whether vLLM's group quantization rounds block scales to powers of two here."""
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    return bool(is_deep_gemm_e8m0_used())
