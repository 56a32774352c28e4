"""vLLM prepare/finalize classes over the NCCL-EP transport (thin adapters).

- Low latency: expert-major dispatch -> vLLM's BatchedExperts format
  ([local experts, max_tokens_per_rank * ep_world, hidden] + per-expert counts).
  Combine applies the routing weights bound to the handle and writes straight into
  vLLM's `output`. For BF16 layers nothing is allocated between dispatch and combine
  (FP8 layers allocate their quantized activations); CUDA-graph capturable through the
  persistent handle pool.
- FP8 layers get their activations quantized after receive, as their experts expect
  (vllm/receive_quant.py), unless the experts quantize them themselves (vLLM's
  `defer_input_quant`: the received-rows experts, for the rows that arrived); 128x128
  block-FP8 layers send them in FP8 instead (runtime/fp8_wire.py): LL through NCCL-EP's
  quantizing dispatch, HT quantized here with vLLM's group quantization and forwarded
  with their scales. Everything else dispatches BF16.
- High throughput: flat dispatch -> vLLM's Standard format with global expert ids;
  the received row count is read on the host (not capturable); the experts'
  per-(row, k) output is weighted and reduced per received row before combine.
The transport logic lives in runtime/rounds.py (shared with benchmark and GPU tests).
The prepare/finalize asks its experts questions (do they leave weighting to the combine,
do they quantize their own input) and changes nothing of theirs; which experts an LL
kernel runs is the patch table's `experts_selection` entry (experts/__init__.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceContiguous,
    TopKWeightAndReduceDelegate,
)

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime
from vllm_flashinfer_ep.runtime.fp8_wire import Quantizer
from vllm_flashinfer_ep.runtime.round_plan import LOCAL
from vllm_flashinfer_ep.vllm import receive_quant

AgreementFn = Callable[[int], "int | str | None"]


def _local(num_tokens: int) -> str:
    return LOCAL


class _Base(mk.FusedMoEPrepareAndFinalizeModular):
    """What both backends declare to vLLM; the runtime's round does the transport."""

    def __init__(
        self,
        runtime: EPRuntime,
        agreement_fn: AgreementFn | None = None,
        fp8_dispatch: bool = False,
    ) -> None:
        """`agreement_fn(num_tokens)`: the token count all EP ranks agreed on for the
        current forward (vllm/forward_state.py); by default every rank runs its own.
        `fp8_dispatch`: FP8 on the wire (block-FP8 layers; runtime/fp8_wire.py)."""
        super().__init__()
        self.runtime = runtime
        self._round = runtime.round
        self._agreed = agreement_fn or _local
        self._fp8 = fp8_dispatch
        if fp8_dispatch:
            runtime.enable_fp8_wire(self._wire_quantizer())

    def _wire_quantizer(self) -> Quantizer | None:
        """What quantizes before an FP8 dispatch (None: NCCL-EP's kernel does)."""
        return None

    @property
    def fp8_dispatch(self) -> bool:
        """Whether this layer's activations go over the wire in FP8."""
        return self._fp8

    def sent_per_rank(self) -> int | None:
        """During a round: the tokens every rank dispatched (a pooled round's handle size,
        padding included); None when the transport does not know."""
        return self._round.sent_per_rank

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def num_dispatchers(self) -> int:
        return self.runtime.world_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False

    def prepare(
        self,
        a1: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        num_experts: int,
        expert_map: torch.Tensor | None,
        apply_router_weight_on_input: bool,
        quant_config: FusedMoEQuantConfig,
        defer_input_quant: bool = False,
    ) -> mk.PrepareResultType:
        out = self._round.dispatch(
            a1,
            topk_ids,
            topk_weights,
            agreed_tokens=self._agreed(a1.shape[0]),
            apply_router_weight_on_input=apply_router_weight_on_input,
            fp8=self._fp8 and not defer_input_quant,  # deferring experts quantize BF16 themselves
        )
        return self._prepare_result(out, quant_config, defer_input_quant)

    def _prepare_result(self, out, quant_config, defer: bool) -> mk.PrepareResultType:
        raise NotImplementedError


class FlashInferEPLowLatencyPrepareAndFinalize(_Base):
    """Expert-major NCCL-EP low-latency dispatch/combine for BatchedExperts."""

    activation_format = mk.FusedMoEActivationFormat.BatchedExperts

    def post_init_setup(self, fused_experts) -> None:
        """Once per kernel (vLLM's setup hook): the combine applies the routing weights, so
        the experts must leave weighting to it."""
        impl = fused_experts.finalize_weight_and_reduce_impl()
        if not isinstance(impl, TopKWeightAndReduceDelegate):
            raise FlashInferEPConfigError(
                "flashinfer_ep_low_latency applies routing weights in its combine; the experts "
                f"must leave weighting to it (got {type(impl).__name__})"
            )

    def max_num_tokens_per_rank(self) -> int | None:
        return self.runtime.capacity

    def _prepare_result(self, out, quant_config, defer: bool) -> mk.PrepareResultType:
        meta = mk.ExpertTokensMetadata(
            expert_num_tokens=out.expert_num_tokens, expert_num_tokens_cpu=None
        )
        if out.expert_x_scale is not None:  # quantized on the wire
            x, scales = out.expert_x, out.expert_x_scale
        else:
            x, scales = receive_quant.quantize_expert_buffer(
                out.expert_x, out.expert_num_tokens, quant_config, defer
            )
        return x, scales, meta, None, None

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        self._round.combine(fused_expert_output, output)


class FlashInferEPHighThroughputPrepareAndFinalize(_Base):
    """Flat NCCL-EP high-throughput dispatch/combine for Standard experts (eager only)."""

    activation_format = mk.FusedMoEActivationFormat.Standard

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def _wire_quantizer(self) -> Quantizer | None:
        return receive_quant.group_quantize

    def post_init_setup(self, fused_experts) -> None:
        """FP8 layers need vLLM's Triton experts (the scale layout quantized here)."""
        receive_quant.check_ht_experts(
            fused_experts, "--all2all-backend flashinfer_ep_high_throughput"
        )

    def _prepare_result(self, out, quant_config, defer: bool) -> mk.PrepareResultType:
        if out.x_scale is not None:  # quantized before dispatch, as the experts expect
            return out.x, out.x_scale, None, out.topk_ids, out.topk_weights
        x, scales = receive_quant.quantize_received_rows(out.x, quant_config, defer)
        return x, scales, None, out.topk_ids, out.topk_weights

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        received = topk_ids.shape[0]
        impl = weight_and_reduce_impl
        if isinstance(impl, TopKWeightAndReduceDelegate):
            impl = TopKWeightAndReduceContiguous()
        if received:
            impl.apply(
                output=self._round.combine_buffer(received),
                fused_expert_output=fused_expert_output,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        self._round.combine(output)


PREPARE_FINALIZE: dict[Algorithm, type[_Base]] = {
    Algorithm.LOW_LATENCY: FlashInferEPLowLatencyPrepareAndFinalize,
    Algorithm.HIGH_THROUGHPUT: FlashInferEPHighThroughputPrepareAndFinalize,
}
