"""vLLM prepare/finalize classes over the NCCL-EP transport.

- Low latency: expert-major dispatch -> vLLM's BatchedExperts format
  ([local experts, max_tokens_per_rank * ep_world, hidden] + per-expert counts).
  Combine applies the routing weights bound to the handle and writes straight into
  vLLM's `output`. Nothing is allocated between dispatch and combine; CUDA-graph
  capturable through the persistent handle pool.
- High throughput: flat dispatch -> vLLM's Standard format. The received row count
  is read on the host (hence not capturable), received expert ids are translated to
  global ids that vLLM's expert_map understands, the experts' per-(token, k) output
  is weighted and reduced per received row, and combine returns rows to their owners.
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

from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime

UniformFn = Callable[[], bool]


def _always_uniform() -> bool:
    return True


def _check_input(a1: torch.Tensor, runtime: EPRuntime) -> None:
    if a1.dtype != torch.bfloat16:
        raise FlashInferEPConfigError(
            f"flashinfer_ep dispatches BF16 activations only, got {a1.dtype}; use --dtype bfloat16"
        )
    if a1.shape[-1] != runtime.spec.hidden_size:
        raise FlashInferEPConfigError(
            f"activation hidden size {a1.shape[-1]} != fleet hidden size {runtime.spec.hidden_size}"
        )


def _router_weights(
    a1: torch.Tensor,
    topk_weights: torch.Tensor,
    apply_router_weight_on_input: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations to send, weights the combine applies)."""
    if not apply_router_weight_on_input:
        return a1, topk_weights
    if topk_weights.shape[1] != 1:
        raise FlashInferEPConfigError(
            "apply_router_weight_on_input is only supported with top_k == 1"
        )
    return (a1 * topk_weights.to(a1.dtype)), torch.ones_like(topk_weights)


class _Base(mk.FusedMoEPrepareAndFinalizeModular):
    def __init__(self, runtime: EPRuntime, uniform_fn: UniformFn | None = None) -> None:
        super().__init__()
        self.runtime = runtime
        self._uniform = uniform_fn or _always_uniform

    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int64

    def num_dispatchers(self) -> int:
        return self.runtime.world_size

    def output_is_reduced(self) -> bool:
        return True

    def supports_async(self) -> bool:
        return False


class FlashInferEPLowLatencyPrepareAndFinalize(_Base):
    """Expert-major NCCL-EP low-latency dispatch/combine for BatchedExperts."""

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self) -> int | None:
        return self.runtime.capacity

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
        _check_input(a1, self.runtime)
        a1, weights = _router_weights(a1, topk_weights, apply_router_weight_on_input)
        pool = self.runtime.pool
        pool.begin(topk_ids, weights, uniform=self._uniform())
        out = pool.dispatch(a1)
        meta = mk.ExpertTokensMetadata(
            expert_num_tokens=out.expert_counts, expert_num_tokens_cpu=None
        )
        return out.expert_tensors, None, meta, None, None

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise FlashInferEPConfigError(
                "flashinfer_ep_low_latency applies routing weights in its combine; the experts "
                f"must leave weighting to it (got {type(weight_and_reduce_impl).__name__})"
            )
        pool = self.runtime.pool
        try:
            pool.combine(fused_expert_output, output)
        finally:
            pool.end()


class FlashInferEPHighThroughputPrepareAndFinalize(_Base):
    """Flat NCCL-EP high-throughput dispatch/combine for Standard experts (eager only)."""

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def max_num_tokens_per_rank(self) -> int | None:
        return None

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
        rt = self.runtime
        _check_input(a1, rt)
        a1, weights = _router_weights(a1, topk_weights, apply_router_weight_on_input)
        pool = rt.pool
        pool.begin(topk_ids, weights, uniform=self._uniform())
        out = pool.dispatch(a1)
        assert pool.num_received is not None and rt.ht_ids is not None
        # Host read of the received-row count: the reason HT cannot be captured.
        received = int(pool.num_received.item())
        hidden = rt.spec.hidden_size
        x = out.expert_tensors.reshape(-1, hidden)[:received]
        recv_ids = out.recv_topk_idx[:received]
        ids = rt.ht_ids[:received]
        weights_out = rt.ht_weights[:received]
        negative = rt.ht_negative[:received]
        # NCCL-EP returns local expert ids, -1 where the slot's expert lives elsewhere.
        torch.lt(recv_ids, 0, out=negative)
        torch.add(recv_ids, rt.rank * rt.num_local_experts, out=ids)
        # -1 slots point at an expert of another rank, which expert_map maps to -1
        # (skipped); their weight is zeroed as well.
        other = ((rt.rank + 1) % rt.world_size) * rt.num_local_experts
        ids.masked_fill_(negative, other)
        weights_out.copy_(out.recv_topk_weights[:received])
        weights_out.masked_fill_(negative, 0.0)
        return x, None, None, ids, weights_out

    def finalize(
        self,
        output: torch.Tensor,
        fused_expert_output: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        apply_router_weight_on_input: bool,
        weight_and_reduce_impl: mk.TopKWeightAndReduce,
    ) -> None:
        rt = self.runtime
        assert rt.ht_combine_in is not None
        received = topk_ids.shape[0]
        impl = weight_and_reduce_impl
        if isinstance(impl, TopKWeightAndReduceDelegate):
            impl = TopKWeightAndReduceContiguous()
        reduced = rt.ht_combine_in[:received]
        if received:
            impl.apply(
                output=reduced,
                fused_expert_output=fused_expert_output,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                apply_router_weight_on_input=apply_router_weight_on_input,
            )
        try:
            rt.pool.combine(rt.ht_combine_in, output)
        finally:
            rt.pool.end()
