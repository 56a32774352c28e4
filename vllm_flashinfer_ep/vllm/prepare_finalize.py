"""vLLM prepare/finalize classes: thin adapters over the NCCL-EP rounds (runtime/rounds.py).
- Low latency: expert-major dispatch -> vLLM's BatchedExperts format; the combine applies
  the routing weights bound to the handle, into vLLM's `output`. CUDA-graph capturable
  through the persistent handle pool.
- High throughput: flat dispatch -> vLLM's Standard format (global expert ids); the row
  count is read on the host (not capturable); rows are weighted and reduced before combine.
FP8 layers: quantized after receive (vllm/receive_quant.py) unless the experts defer, or
FP8 on the wire for 128x128 block layers (runtime/fp8_wire.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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
from vllm_flashinfer_ep.vllm.round_chunks import RoundSplit

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
        round_split: RoundSplit | None = None,
    ) -> None:
        """`agreement_fn(num_tokens)`: the token count all EP ranks agreed on for this
        forward (vllm/forward_state.py; default: each its own). `fp8_dispatch`: FP8 wire.
        `round_split`: set where forwards above the fleet capacity run as several rounds
        (vllm/round_chunks.py; the kernel's `apply` reads it, patch row `round_split`)."""
        super().__init__()
        self.runtime = runtime
        self._round = runtime.round
        self._agreed = agreement_fn or _local
        self._round_agreed: int | None = None  # one round of a split forward (round_chunks.py)
        self.round_split = round_split
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
        """During a round: the tokens every rank dispatched (None: the transport can't tell)."""
        return self._round.sent_per_rank

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def num_dispatchers(self) -> int:
        return self.runtime.world_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False

    @contextlib.contextmanager
    def agreed_as(self, count: int) -> Iterator[None]:
        """While one round of a forward split into rounds runs (vllm/round_chunks.py): the
        count every EP rank agreed on for that round, in place of the forward's."""
        self._round_agreed = count
        try:
            yield
        finally:
            self._round_agreed = None

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
            agreed_tokens=self._agreed(a1.shape[0])
            if self._round_agreed is None
            else self._round_agreed,
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
        """The combine applies the routing weights: the experts must leave weighting to it."""
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
