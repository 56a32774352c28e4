"""One MoE layer's transport round (dispatch, then combine), engine-agnostic.

The vLLM prepare/finalize classes are thin adapters over these; the benchmark and
the GPU tests drive the same code without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime


@dataclass
class LowLatencyDispatch:
    expert_x: torch.Tensor  # [local experts, capacity * ep_world, hidden], fleet-owned
    expert_num_tokens: torch.Tensor  # [local experts] int32


@dataclass
class HighThroughputDispatch:
    x: torch.Tensor  # [received, hidden]
    topk_ids: torch.Tensor  # [received, top_k] int64 global ids (other-rank slots remapped)
    topk_weights: torch.Tensor  # [received, top_k] fp32, 0 for other-rank slots
    remote_slot: torch.Tensor  # [received, top_k] bool, True where the expert is on another rank


def check_activations(a1: torch.Tensor, runtime: EPRuntime) -> None:
    if a1.dtype != torch.bfloat16:
        raise FlashInferEPConfigError(
            f"flashinfer_ep dispatches BF16 activations only, got {a1.dtype}; use --dtype bfloat16"
        )
    if a1.dim() != 2 or a1.shape[-1] != runtime.spec.hidden_size:
        raise FlashInferEPConfigError(
            f"activations of shape {tuple(a1.shape)} do not match the fleet hidden size "
            f"{runtime.spec.hidden_size}"
        )


def router_weights(
    a1: torch.Tensor, topk_weights: torch.Tensor, apply_router_weight_on_input: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(activations to send, weights the combine applies)."""
    if not apply_router_weight_on_input:
        return a1, topk_weights
    if topk_weights.shape[1] != 1:
        raise FlashInferEPConfigError("apply_router_weight_on_input needs top_k == 1")
    return a1 * topk_weights.to(a1.dtype), torch.ones_like(topk_weights)


def _begin_and_dispatch(
    rt: EPRuntime,
    a1: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    uniform: bool,
    apply_router_weight_on_input: bool,
) -> Any:
    """Checks, routing bound to a handle, dispatch: the first half of every round."""
    check_activations(a1, rt)
    if not a1.is_contiguous():  # NCCL-EP reads rows by pointer arithmetic
        a1 = a1.contiguous()
    a1, weights = router_weights(a1, topk_weights, apply_router_weight_on_input)
    rt.pool.begin(topk_ids, weights, uniform=uniform)
    return rt.pool.dispatch(a1)


class LowLatencyRound:
    """Expert-major dispatch into the batched-experts layout; weighted combine."""

    def __init__(self, runtime: EPRuntime) -> None:
        self.runtime = runtime

    def dispatch(
        self,
        a1: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        uniform: bool = True,
        apply_router_weight_on_input: bool = False,
    ) -> LowLatencyDispatch:
        out = _begin_and_dispatch(
            self.runtime, a1, topk_ids, topk_weights, uniform, apply_router_weight_on_input
        )
        return LowLatencyDispatch(out.expert_tensors, out.expert_counts)

    def combine(self, expert_out: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        """Weighted combine into `output` (in place when given); ends the round."""
        _check_output(output)
        pool = self.runtime.pool
        try:
            return pool.combine(expert_out, output)
        finally:
            pool.end()


class HighThroughputRound:
    """Flat dispatch into received rows; combine of per-row reduced outputs."""

    def __init__(self, runtime: EPRuntime) -> None:
        self.runtime = runtime

    def dispatch(
        self,
        a1: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        uniform: bool = True,
        apply_router_weight_on_input: bool = False,
    ) -> HighThroughputDispatch:
        rt = self.runtime
        out = _begin_and_dispatch(rt, a1, topk_ids, topk_weights, uniform, apply_router_weight_on_input)
        pool = rt.pool
        assert pool.num_received is not None
        # Host read of the received-row count: the reason HT cannot be captured.
        received = int(pool.num_received.item())
        x = out.expert_tensors.reshape(-1, rt.spec.hidden_size)[:received]
        ids, weights_out, local = globalize_received_routing(
            out.recv_topk_idx[:received], out.recv_topk_weights[:received], rt, received
        )
        return HighThroughputDispatch(x, ids, weights_out, local)

    def combine_buffer(self, received: int) -> torch.Tensor:
        """Where the caller writes each received row's reduced output before combine."""
        assert self.runtime.ht_combine_in is not None
        return self.runtime.ht_combine_in[:received]

    def combine(self, output: torch.Tensor | None) -> torch.Tensor:
        _check_output(output)
        rt = self.runtime
        assert rt.ht_combine_in is not None
        try:
            return rt.pool.combine(rt.ht_combine_in, output)
        finally:
            rt.pool.end()


def _check_output(output: torch.Tensor | None) -> None:
    if output is not None and not output.is_contiguous():
        raise FlashInferEPConfigError(
            "flashinfer_ep combine writes its output in place and needs a contiguous tensor "
            f"(got strides {output.stride()} for shape {tuple(output.shape)})"
        )


def globalize_received_routing(
    recv_ids: torch.Tensor, recv_weights: torch.Tensor, rt: EPRuntime, received: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NCCL-EP HT routing (local expert ids, -1 = expert on another rank) -> global ids.

    Other-rank slots point at the first expert of the next rank, which vLLM's
    expert_map maps to -1 (skipped), and get weight 0. Written into persistent
    buffers: nothing is allocated between dispatch and combine.
    """
    assert rt.ht_ids is not None and rt.ht_weights is not None and rt.ht_negative is not None
    ids = rt.ht_ids[:received]
    weights = rt.ht_weights[:received]
    negative = rt.ht_negative[:received]
    torch.lt(recv_ids, 0, out=negative)
    torch.add(recv_ids, rt.rank * rt.num_local_experts, out=ids)
    ids.masked_fill_(negative, ((rt.rank + 1) % rt.world_size) * rt.num_local_experts)
    weights.copy_(recv_weights)
    weights.masked_fill_(negative, 0.0)
    return ids, weights, negative
