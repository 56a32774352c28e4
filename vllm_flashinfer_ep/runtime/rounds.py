"""One MoE layer's transport round (dispatch, then combine), engine-agnostic: a runtime's
one Round, shared by its layers; it reads the runtime through `RoundRuntime`, so this
module does not import ep_runtime (which imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, HandlePoolError
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.fp8_wire import Fp8Wire, HtFp8Received, HtFp8Wire
from vllm_flashinfer_ep.runtime.handle_pool import HandlePool
from vllm_flashinfer_ep.runtime.round_plan import LOCAL, Planner, RoundPlan


class RoundRuntime(Protocol):
    """What a round reads of its runtime (ep_runtime.EPRuntime is one)."""

    spec: FleetSpec
    pool: HandlePool
    rank: int
    world_size: int
    fp8_wire: Fp8Wire | HtFp8Wire | None

    @property
    def num_local_experts(self) -> int: ...


@dataclass
class LowLatencyDispatch:
    expert_x: torch.Tensor  # [local experts, capacity * ep_world, hidden], fleet-owned
    expert_num_tokens: torch.Tensor  # [local experts] int32
    expert_x_scale: torch.Tensor | None = None  # FP8 dispatch: FP32 scales per 128; else None


@dataclass
class HighThroughputDispatch:
    x: torch.Tensor  # [received, hidden]
    topk_ids: torch.Tensor  # [received, top_k] int64 global ids (other-rank slots remapped)
    topk_weights: torch.Tensor  # [received, top_k] fp32, 0 for other-rank slots
    remote_slot: torch.Tensor  # [received, top_k] bool, True where the expert is on another rank
    x_scale: torch.Tensor | None = None  # FP8 dispatch: [received, hidden / 128] FP32; else None


def check_activations(a1: torch.Tensor, runtime: RoundRuntime) -> None:
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


class Round:
    """One transport round over a runtime, layer after layer; at most one in flight."""

    def __init__(self, runtime: RoundRuntime) -> None:
        self.runtime, self.planner = runtime, Planner(runtime.pool)
        self._hidden = runtime.spec.hidden_size
        self._inflight: RoundPlan | None = None

    @property
    def in_flight(self) -> RoundPlan | None:
        return self._inflight

    @property
    def sent_per_rank(self) -> int | None:
        """Rows every EP rank dispatched in the round in flight (None: unknown)."""
        plan = self._inflight
        return plan.sent_per_rank if plan is not None else None

    def dispatch(
        self,
        a1: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        agreed_tokens: int | None | str = LOCAL,
        apply_router_weight_on_input: bool = False,
        fp8: bool = False,
    ) -> Any:
        """Plan this layer's round, bind its routing and dispatch; returns what arrived.
        `fp8`: on the runtime's `fp8_wire` (HT quantizes a1 here, after the router weights)."""
        # Host-bound in eager mode: the checks run in full only when one fails.
        if a1.dtype != torch.bfloat16 or a1.dim() != 2 or a1.shape[1] != self._hidden:
            check_activations(a1, self.runtime)
        if not a1.is_contiguous():  # NCCL-EP reads rows by pointer arithmetic
            a1 = a1.contiguous()
        weights = topk_weights
        if apply_router_weight_on_input:
            a1, weights = router_weights(a1, topk_weights, True)
        wire = scales = None
        if fp8:
            wire = self.runtime.fp8_wire
            if wire is None:
                raise FlashInferEPConfigError("FP8 dispatch asked of a runtime without an FP8 wire")
            quantize = getattr(wire, "quantize", None)  # HT: forwarded as quantized here
            if quantize is not None:
                a1, scales = quantize(a1)
        if self._inflight is not None:  # a layer failed between its dispatch and combine
            self.end()
        plan = self._inflight = self.planner.plan(a1, topk_ids, weights, agreed_tokens, wire)
        try:
            return self._received(plan.dispatch(a1, scales))
        except BaseException:
            self.end()  # no round state (padding, a fresh handle) outlives a failed dispatch
            raise

    def end(self) -> None:
        """Abandon the round in flight, if any (a fresh handle is destroyed)."""
        plan, self._inflight = self._inflight, None
        if plan is not None:
            plan.end()

    def _received(self, out: Any) -> Any:
        raise NotImplementedError

    def _combine(self, expert_out: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        plan, self._inflight = self._inflight, None
        if plan is None:
            raise HandlePoolError("combine called without a dispatch in flight")
        if output is not None and not output.is_contiguous():
            plan.end()
            _refuse_output(output)
        return plan.combine(expert_out, output)


class LowLatencyRound(Round):
    """Expert-major dispatch into the batched-experts layout; weighted combine."""

    def _received(self, out: Any) -> LowLatencyDispatch:
        if isinstance(out, tuple):  # FP8 dispatch: (E4M3 tokens, scales, counts)
            return LowLatencyDispatch(out[0], out[2], out[1])
        return LowLatencyDispatch(out.expert_tensors, out.expert_counts)

    def combine(self, expert_out: torch.Tensor, output: torch.Tensor | None) -> torch.Tensor:
        return self._combine(expert_out, output)


class HighThroughputRound(Round):
    """Flat dispatch into received rows; combine of per-row reduced outputs (its staging)."""

    def __init__(self, runtime: RoundRuntime) -> None:
        super().__init__(runtime)
        pool = runtime.pool
        rows, top_k, dev = pool.capacity * runtime.world_size, pool.top_k, pool.device
        self.ids = torch.empty(rows, top_k, dtype=torch.int64, device=dev)
        self.weights = torch.empty(rows, top_k, dtype=torch.float32, device=dev)
        self.remote = torch.empty(rows, top_k, dtype=torch.bool, device=dev)
        self.combine_in = torch.zeros(
            rows, runtime.spec.hidden_size, dtype=torch.bfloat16, device=dev
        )

    def _received(self, out: Any) -> HighThroughputDispatch:
        pool = self.runtime.pool
        assert pool.num_received is not None
        # Host read of the received-row count: the reason HT cannot be captured.
        received = int(pool.num_received.item())
        x = out.expert_tensors.reshape(-1, self.runtime.spec.hidden_size)[:received]
        ids, weights, remote = self.globalize(
            out.recv_topk_idx[:received], out.recv_topk_weights[:received], received
        )
        scales = out.scales[:received] if isinstance(out, HtFp8Received) else None
        return HighThroughputDispatch(x, ids, weights, remote, scales)

    def combine_buffer(self, received: int) -> torch.Tensor:
        """Where the caller writes each received row's reduced output before combine."""
        return self.combine_in[:received]

    def combine(self, output: torch.Tensor | None) -> torch.Tensor:
        return self._combine(self.combine_in, output)

    def globalize(
        self, recv_ids: torch.Tensor, recv_weights: torch.Tensor, received: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """NCCL-EP HT routing (local ids, -1 = another rank's) -> global ids, in staging; other
        ranks' slots get weight 0 and the next rank's first expert (vLLM's expert_map: -1)."""
        rt = self.runtime
        ids, weights, remote = self.ids[:received], self.weights[:received], self.remote[:received]
        torch.lt(recv_ids, 0, out=remote)
        torch.add(recv_ids, rt.rank * rt.num_local_experts, out=ids)
        ids.masked_fill_(remote, ((rt.rank + 1) % rt.world_size) * rt.num_local_experts)
        weights.copy_(recv_weights)
        weights.masked_fill_(remote, 0.0)
        return ids, weights, remote


def make_round(runtime: RoundRuntime) -> Round:
    if runtime.spec.algorithm == Algorithm.HIGH_THROUGHPUT:
        return HighThroughputRound(runtime)
    return LowLatencyRound(runtime)


def _refuse_output(output: torch.Tensor) -> None:
    raise FlashInferEPConfigError(
        "flashinfer_ep combine writes its output in place and needs a contiguous tensor "
        f"(got strides {output.stride()} for shape {tuple(output.shape)})"
    )
