"""One round in flight, planned once: handle, size, padding, stream, wire and issuer.

Handle work is collective, so every EP rank picks the same handle: the pooled size of the
count all ranks agreed on (`agreed_tokens`), else a fresh handle. A round that is not
pooled runs padded (zero rows, weight 0, routed to this rank) on the next pooled size.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.errors import DispatchCapacityError, HandlePoolError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import current_raw_stream, in_capture_phase, is_capturing
from vllm_flashinfer_ep.runtime.handle_pool import HandlePool
from vllm_flashinfer_ep.runtime.issuers import FlashInferIssuer, Issuer, JoinedIssuer, WireIssuer
from vllm_flashinfer_ep.runtime.native_handle import NativeEager

logger = get_logger(__name__)

# `agreed_tokens` where every rank runs this rank's count (benchmarks, tests, one rank).
LOCAL = "local"

LARGEST_RANK = "the largest EP rank (every rank refuses this forward)"


def over_capacity(num_tokens: int, capacity: int, whose: str) -> DispatchCapacityError:
    """The error of a round above the fleet capacity, raised before any collective."""
    return DispatchCapacityError(
        f"{num_tokens} tokens on {whose} exceed the flashinfer_ep fleet capacity of "
        f"{capacity} tokens per rank; raise --max-num-batched-tokens (the fleet is sized "
        "from it) or lower the batch size."
    )


class RoundPlan:
    """The round in flight: one per layer's dispatch, ended by its combine."""

    __slots__ = tuple("pool handle issuer ids weights rows size fresh sent_per_rank".split())

    def __init__(
        self,
        pool: HandlePool,
        handle: Any,
        issuer: Issuer,
        ids: Any,
        weights: torch.Tensor,
        rows: int,
        size: int,
        fresh: bool,
    ) -> None:
        self.pool, self.handle, self.issuer = pool, handle, issuer
        self.ids = ids  # what `update` binds (None: a fresh handle bound them at creation)
        self.weights = weights  # the pool's rows [:size], bound to the handle
        self.rows = rows  # this rank's rows
        self.size = size  # rows the handle routes, padding included
        self.fresh = fresh  # a handle for this round only, destroyed at its end
        # Rows every EP rank dispatches (experts/received_rows.py bounds its work by it).
        self.sent_per_rank = None if fresh else size

    def dispatch(self, x: torch.Tensor, scales: torch.Tensor | None = None) -> Any:
        if self.ids is not None:
            self.issuer.update(self.handle, self.ids)
        if self.size != self.rows:
            x = self._padded("x", x)
            if scales is not None:
                scales = self._padded("scales", scales)
        return self.issuer.dispatch(self.handle, x, scales)

    def combine(self, expert_out: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Combine into `out` (in place when given; padded rows dropped); ends the round."""
        try:
            if not expert_out.is_contiguous():  # NCCL-EP reads it by pointer, without strides
                expert_out = expert_out.contiguous()
            if self.size == self.rows:
                return self.issuer.combine(self.handle, expert_out, out, self.weights)
            dtype = out.dtype if out is not None else expert_out.dtype
            staging = self.pool.staging("out", self.pool.spec.hidden_size, dtype)[: self.size]
            self.issuer.combine(self.handle, expert_out, staging, self.weights)
            if out is None:
                return staging[: self.rows].clone()  # the staging is the next round's too
            out.copy_(staging[: self.rows])
            return out
        finally:
            self.end()

    def end(self) -> None:
        """End the round; a fresh handle is destroyed (NCCL-EP orders it after its work)."""
        if self.fresh:
            self.fresh = False
            self.handle.destroy()

    def _padded(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        padded = self.pool.staging(name, rows.shape[1], rows.dtype)[: self.size]
        padded[: self.rows].copy_(rows)
        padded[self.rows :].zero_()
        return padded


class Planner:
    """Plans each round of one pool; owns the pool's issuers."""

    def __init__(self, pool: HandlePool) -> None:
        self.pool = pool
        # Direct nccl.ep calls for eager LL rounds; None: FlashInfer's methods only.
        self.native = (
            NativeEager(pool.streams.raw)
            if not pool.is_ht and envs.native_eager_enabled()
            else None
        )
        self.flashinfer = FlashInferIssuer(pool.fi)
        # Records FlashInfer's receive buffer for the direct calls (NativeEager.record).
        self._recording = (
            FlashInferIssuer(pool.fi, self.native.record)
            if self.native is not None
            else self.flashinfer
        )
        self._issuers: dict[tuple, Issuer] = {}
        self._fresh_logged = False
        streams = pool.streams
        self._cuda, self._device_index, self._raw = streams.cuda, streams.device_index, streams.raw

    def plan(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        agreed_tokens: int | None | str = LOCAL,
        wire: Any = None,
    ) -> RoundPlan:
        """The plan of one round, this layer's routing bound into the pool's buffers.
        `agreed_tokens`: the largest EP rank's count, LOCAL, or None (fresh handles)."""
        pool = self.pool
        num_tokens, top_k = topk_ids.shape
        handle = pool.handles.get(num_tokens)
        # The common eager round first, in few Python calls (host-bound).
        if (
            handle is not None
            and top_k == pool.top_k
            and (agreed_tokens is LOCAL or agreed_tokens == num_tokens)
            and self._binds(topk_ids)
            and x.shape[0] == num_tokens  # FlashInfer's dispatch refuses a mismatch; NCCL-EP not
            and (not self._cuda or current_raw_stream(self._device_index) == self._raw)
        ):
            weights = pool.weights_view(num_tokens)
            weights.copy_(topk_weights)
            counters = pool.counters
            counters.updates += 1
            counters.pooled_rounds += 1
            native = self.native
            direct = (
                native is not None
                and (wire is not None or native.recv is not None)
                and (self._cuda or not is_capturing())  # on a GPU: stream 0, never captured
                and native.usable(handle)
            )
            if wire is None:
                issuer = native if direct else self._recording
            else:
                issuer = self.issuer(direct, False, wire)
            return RoundPlan(pool, handle, issuer, topk_ids, weights, num_tokens, num_tokens, False)
        return self._plan_general(topk_ids, topk_weights, agreed_tokens, wire)

    def _binds(self, topk_ids: torch.Tensor) -> bool:
        """Whether `update` may bind these ids as they are, saving their copy."""
        return (
            self.pool.bind_ids
            and topk_ids.dtype == torch.int64
            and topk_ids.is_contiguous()
            and topk_ids.get_device() == self._device_index
        )

    def issuer(self, direct: bool, join: bool, wire: Any) -> Issuer:
        """The issuer of a round (made once per combination of its three choices)."""
        key = (direct, join, id(wire))
        found = self._issuers.get(key)
        if found is None:
            found = self.native if direct else self.flashinfer
            if wire is not None:
                found = WireIssuer(wire, found)
            if join:
                found = JoinedIssuer(found, self.pool.streams)
            self._issuers[key] = found
        return found

    def _plan_general(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, agreed_tokens: Any, wire: Any
    ) -> RoundPlan:
        pool = self.pool
        num_tokens, top_k = topk_ids.shape
        if top_k != pool.top_k or not 1 <= num_tokens <= pool.capacity:
            self._refuse_shape(num_tokens, top_k)
        capturing, join = pool.streams.state()
        agreed = num_tokens if agreed_tokens == LOCAL else agreed_tokens
        handle = pool.handles.get(agreed) if agreed == num_tokens else None
        size = num_tokens
        if handle is None and isinstance(agreed, int) and agreed >= num_tokens:
            if agreed > pool.capacity:  # every rank reads the same count: all refuse alike
                raise over_capacity(agreed, pool.capacity, LARGEST_RANK)
            if agreed not in pool.handles and not capturing and in_capture_phase():
                pool.learn(agreed)
            size = pool.pooled_size(agreed)
            handle = pool.handles.get(size) if size is not None else None
        if capturing and (handle is None or size != num_tokens):
            pool.counters.created_during_capture += 1
            raise HandlePoolError(
                f"no warmed flashinfer_ep handle for {num_tokens} tokens (pooled sizes: "
                f"{pool.sizes}); a handle cannot be created inside CUDA-graph capture. The "
                "pool learns each captured size from the engine's eager warm-up forward of "
                "that size; this capture had none (or ran outside the engine's capture "
                "phase). Please report this with the vLLM command line; --enforce-eager "
                "avoids it."
            )
        issuer = self.issuer(False, join, wire)
        if handle is None:
            return self._plan_fresh(topk_ids, topk_weights, agreed, issuer, join)
        # Weights are bound at creation: always copied. Ids are bound per call where they can be.
        pool.weights_view(num_tokens).copy_(topk_weights)
        if size == num_tokens and self._binds(topk_ids):
            ids = topk_ids
        else:
            pool.topk_ids[:num_tokens].copy_(topk_ids, non_blocking=True)
            ids = pool.topk_ids[:size]
            if size != num_tokens:
                pool.write_pad_routing(num_tokens, size)
                pool.counters.padded_rounds += 1
        pool.counters.updates += 1
        pool.counters.pooled_rounds += 1
        return RoundPlan(
            pool, handle, issuer, ids, pool.weights_view(size), num_tokens, size, False
        )

    def _plan_fresh(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        agreed: Any,
        issuer: Issuer,
        join: bool,
    ) -> RoundPlan:
        """A handle for this round only (destroyed at its end), on every rank alike."""
        pool = self.pool
        num_tokens = topk_ids.shape[0]
        if not self._fresh_logged and pool.handles:
            self._fresh_logged = True
            why = (
                "no token count agreed across EP ranks for this forward"
                if not isinstance(agreed, int)
                else f"no pooled size fits the agreed {agreed} tokens (pooled: {pool.sizes})"
            )
            logger.info(
                "flashinfer_ep: a round of %d tokens runs on a per-forward handle: %s "
                "(logged once; PoolCounters.fresh_created counts them)",
                num_tokens,
                why,
            )
        pool.topk_weights[:num_tokens].copy_(topk_weights, non_blocking=True)
        pool.topk_ids[:num_tokens].copy_(topk_ids, non_blocking=True)
        handle = pool.create(num_tokens, join)
        pool.counters.fresh_created += 1
        pool.counters.fresh_rounds += 1
        weights = pool.weights_view(num_tokens)
        return RoundPlan(pool, handle, issuer, None, weights, num_tokens, num_tokens, True)

    def _refuse_shape(self, num_tokens: int, top_k: int) -> None:
        pool = self.pool
        if top_k != pool.top_k:
            raise HandlePoolError(
                f"this pool was built for top_k={pool.top_k}, got routing with top_k={top_k}"
            )
        if num_tokens > pool.capacity:
            raise over_capacity(num_tokens, pool.capacity, "this rank")
        raise HandlePoolError("a flashinfer_ep round needs at least one token per rank")
