"""Persistent NCCL-EP handles, one per token count, shared by every MoE layer.

Why: a FlashInfer handle is fixed to one token count and top_k and binds its routing
weights at creation. CUDA graphs bake pointers, so a handle created inside a forward
cannot be replayed. The pool creates one handle per size vLLM will capture, outside
any capture (model load), warms each with one eager `update`, and re-targets it with
`update` inside every forward. All layers share the handles through two static
buffers (`topk_ids` int64, `topk_weights` fp32) that each layer copies its routing
into, so memory grows with the number of captured sizes, not layers x sizes.

Collective discipline: handle creation, update, dispatch and combine are collective
over the EP group. The pool only uses a pooled handle when every rank runs the same
token count (`uniform=True`, always the case under DP padding with CUDA graphs);
otherwise every rank creates a fresh handle for the round, so ranks never pair
different handles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import DispatchCapacityError, HandlePoolError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import is_capturing
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.limits import max_top_k
from vllm_flashinfer_ep.runtime.transport import handle_supports_update, moe_ep

logger = get_logger(__name__)

T = TypeVar("T")


def unavailable_reason() -> str | None:
    """Why a persistent pool cannot back CUDA graphs here, or None if it can.

    The one place that decides: the managers warm no pool and the CUDA-graph policy
    turns graphs off, both from this answer.
    """
    if not envs.handle_pool_enabled():
        return f"the persistent handle pool is disabled ({envs.HANDLE_POOL}=0)"
    if not handle_supports_update():
        return (
            "the installed FlashInfer has no Handle.update(), so handles cannot be "
            "re-targeted inside a captured forward (install flashinfer-python==0.7.2.post1)"
        )
    return None


@dataclass
class PoolCounters:
    """What the pool did; tests and the benchmark read these."""

    pooled_created: int = 0
    fresh_created: int = 0
    updates: int = 0
    pooled_rounds: int = 0
    fresh_rounds: int = 0
    created_during_capture: int = 0


class HandlePool:
    """Handles of one fleet, keyed by token count."""

    def __init__(
        self,
        fleet: Any,
        spec: FleetSpec,
        top_k: int,
        device: torch.device | int | str,
        *,
        bind_ids: bool = True,
    ) -> None:
        limit = max_top_k(spec.algorithm == Algorithm.LOW_LATENCY)
        if not 1 <= top_k <= limit:
            raise ValueError(f"top_k must be in [1, {limit}] for {spec.algorithm}, got {top_k}")
        if top_k > spec.num_experts:
            raise ValueError(f"top_k={top_k} exceeds the number of experts {spec.num_experts}")
        self.fleet = fleet
        self.spec = spec
        self.top_k = top_k
        self.capacity = spec.effective_max_tokens_per_rank
        self.device = torch.device(device)
        self.is_ht = spec.algorithm == Algorithm.HIGH_THROUGHPUT
        self.bind_ids = bind_ids
        self.topk_ids = torch.zeros(self.capacity, top_k, dtype=torch.int64, device=self.device)
        self.topk_weights = torch.zeros(
            self.capacity, top_k, dtype=torch.float32, device=self.device
        )
        # HT: NCCL-EP writes the number of received rows here at create/update.
        self.num_received = (
            torch.zeros(1, dtype=torch.int32, device=self.device) if self.is_ht else None
        )
        self.counters = PoolCounters()
        # GPU memory each warm-up creation added (torch allocator or device-wide, whichever
        # grew more). The first handle of a fleet also triggers NCCL-EP's lazy buffer
        # allocation, so `per_handle_bytes` excludes it.
        self.handle_bytes: dict[int, int] = {}
        self._handles: dict[int, Any] = {}
        self._current: Any = None
        self._current_is_fresh = False
        self._handle_stream: torch.cuda.Stream | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def memory_bytes(self) -> int:
        """All memory the pool's warm-up added (fleet buffers included)."""
        return sum(self.handle_bytes.values())

    @property
    def per_handle_bytes(self) -> float:
        """Median memory of a pooled handle, excluding the first (fleet buffers)."""
        values = sorted(list(self.handle_bytes.values())[1:])  # dicts keep creation order
        return float(values[len(values) // 2]) if values else 0.0

    @property
    def first_handle_bytes(self) -> int:
        """Memory added by the pool's first creation (includes NCCL-EP's lazy fleet buffers)."""
        return next(iter(self.handle_bytes.values()), 0)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._handles)

    def warm(self, sizes: Iterable[int]) -> list[int]:
        """Create and warm one handle per size (outside capture, same order on all ranks).

        Sizes above the fleet capacity are dropped with a log line. Returns the sizes
        now pooled.
        """
        if is_capturing():
            raise HandlePoolError("HandlePool.warm() must run outside CUDA-graph capture")
        wanted = sorted({int(s) for s in sizes if int(s) >= 1})
        too_big = [s for s in wanted if s > self.capacity]
        if too_big:
            logger.info(
                "flashinfer_ep: not pooling sizes %s above the fleet capacity %d "
                "(those steps run eagerly with a fresh handle)",
                too_big,
                self.capacity,
            )
        for size in (s for s in wanted if s <= self.capacity):
            if size in self._handles:
                continue
            self._fill_dummy_routing(size)
            before = memory_snapshot(self.device)
            handle = self._create(size)
            self._ordered(lambda h=handle, n=size: h.update(self._params(n)))
            self.handle_bytes[size] = _memory_delta(self.device, before)
            self.counters.updates += 1
            self._handles[size] = handle
            self.counters.pooled_created += 1
        return self.sizes

    # ----------------------------------------------------------------- rounds
    def begin(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, uniform: bool = True
    ) -> Any:
        """Bind this layer's routing to a handle; returns the handle for the round.

        `uniform` must be True only when every EP rank runs the same token count in
        this forward; under CUDA-graph capture it always is.
        """
        num_tokens, top_k = topk_ids.shape
        if top_k != self.top_k:
            raise HandlePoolError(
                f"this pool was built for top_k={self.top_k}, got routing with top_k={top_k}"
            )
        if num_tokens > self.capacity:
            raise DispatchCapacityError(
                f"{num_tokens} tokens on this rank exceed the flashinfer_ep fleet capacity of "
                f"{self.capacity} tokens per rank; raise --max-num-batched-tokens (the fleet is "
                "sized from it) or lower the batch size."
            )
        if num_tokens < 1:
            raise HandlePoolError("a flashinfer_ep round needs at least one token per rank")
        self._end_fresh()
        # Weights are bound to the handle at creation: always copy them. Ids can be
        # bound per call (`update` takes any int64 contiguous CUDA tensor), which saves
        # one copy kernel per layer; other ids are copied into the static buffer.
        self.topk_weights[:num_tokens].copy_(topk_weights, non_blocking=True)
        ids = self._bindable_ids(topk_ids)
        if ids is None:
            self.topk_ids[:num_tokens].copy_(topk_ids, non_blocking=True)
            ids = self.topk_ids[:num_tokens]

        handle = self._handles.get(num_tokens) if uniform else None
        if handle is not None:
            params = moe_ep().HandleParams(topk_ids=ids)
            self._ordered(lambda: handle.update(params))
            self.counters.updates += 1
            self.counters.pooled_rounds += 1
            self._current, self._current_is_fresh = handle, False
            return handle
        if is_capturing():
            self.counters.created_during_capture += 1  # attempts; each is refused below
            raise HandlePoolError(
                f"no warmed flashinfer_ep handle for {num_tokens} tokens (pooled sizes: "
                f"{self.sizes}); a handle cannot be created inside CUDA-graph capture. The "
                "pool is warmed with vLLM's cudagraph capture sizes; if you changed them after "
                "model load, restart, or run with --enforce-eager."
            )
        if ids.data_ptr() != self.topk_ids.data_ptr():
            self.topk_ids[:num_tokens].copy_(ids, non_blocking=True)
        handle = self._create(num_tokens)
        self.counters.fresh_created += 1
        self.counters.fresh_rounds += 1
        self._current, self._current_is_fresh = handle, True
        return handle

    def dispatch(self, x: torch.Tensor) -> Any:
        handle = self._require_current()
        fi = moe_ep()
        return self._ordered(lambda: handle.dispatch(fi.DispatchInputParams(x=[x])))

    def combine(self, expert_out: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Combine into `out` (written in place when given) and end the round."""
        handle = self._require_current()
        fi = moe_ep()
        result = self._ordered(
            lambda: handle.combine(fi.CombineInputParams(x=[expert_out], out=out))
        )
        return result.x

    def end(self) -> None:
        """End the round; a fresh handle is destroyed once its work is ordered."""
        self._end_fresh()
        self._current = None

    # ---------------------------------------------------------------- cleanup
    def destroy(self) -> None:
        self.end()
        for handle in self._handles.values():
            try:
                handle.destroy()
            except Exception:  # noqa: BLE001
                logger.exception("flashinfer_ep: handle.destroy() failed")
        self._handles.clear()

    # ---------------------------------------------------------------- helpers
    def _params(self, num_tokens: int) -> Any:
        return moe_ep().HandleParams(topk_ids=self.topk_ids[:num_tokens])

    def _bindable_ids(self, topk_ids: torch.Tensor) -> torch.Tensor | None:
        if (
            self.bind_ids
            and topk_ids.dtype == torch.int64
            and topk_ids.is_contiguous()
            and topk_ids.device == self.device
        ):
            return topk_ids
        return None

    def _create(self, num_tokens: int) -> Any:
        fi = moe_ep()
        knobs: list[Any] = [fi.HandleAlgoKnobTopKWeights(weights=self.topk_weights[:num_tokens])]
        if self.num_received is not None:
            knobs.append(fi.HandleAlgoKnobNumReceivedTokens(target=self.num_received))
        return self._ordered(lambda: self.fleet.create_handle(self._params(num_tokens), algo_knobs=knobs))

    def _fill_dummy_routing(self, num_tokens: int) -> None:
        rows = torch.arange(num_tokens, device=self.device).unsqueeze(1) * self.top_k
        cols = torch.arange(self.top_k, device=self.device).unsqueeze(0)
        self.topk_ids[:num_tokens].copy_((rows + cols) % self.spec.num_experts)
        self.topk_weights[:num_tokens].fill_(1.0 / self.top_k)

    def _require_current(self) -> Any:
        if self._current is None:
            raise HandlePoolError("dispatch/combine called without HandlePool.begin()")
        return self._current

    def _end_fresh(self) -> None:
        if self._current_is_fresh and self._current is not None:
            handle = self._current
            self._current, self._current_is_fresh = None, False
            # Same as FlashInfer's own eager forward: destroy right after combine;
            # NCCL-EP orders the release after the handle's queued work.
            handle.destroy()

    def _stream(self) -> torch.cuda.Stream | None:
        if self._handle_stream is None and self.device.type == "cuda" and torch.cuda.is_available():
            # Handles run on the fleet's stream outside capture: stream 0 (see fleet.py).
            self._handle_stream = torch.cuda.default_stream(self.device)
        return self._handle_stream

    def _ordered(self, op: Callable[[], T]) -> T:
        """Run a handle op, ordered against torch's current stream.

        Outside capture FlashInfer issues handle work on the handle's own stream, not
        on torch's current one (vLLM's capture warmups run on a side stream), so the
        two are joined explicitly. Under capture FlashInfer uses the capturing stream.
        """
        if is_capturing() or self.device.type != "cuda" or not torch.cuda.is_available():
            return op()
        handle_stream = self._stream()
        current = torch.cuda.current_stream(self.device)
        if handle_stream is None or current.cuda_stream == handle_stream.cuda_stream:
            return op()
        handle_stream.wait_stream(current)
        result = op()
        current.wait_stream(handle_stream)
        return result


def memory_snapshot(device: torch.device) -> tuple[int, int]:
    """(torch-allocated bytes, device-wide used bytes). NCCL-EP allocates through torch's
    caching allocator (FleetAlgoKnobAllocator) and natively; count both."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(torch.cuda.memory_allocated(device)), int(total - free)


def _memory_delta(device: torch.device, before: tuple[int, int]) -> int:
    after = memory_snapshot(device)
    return max(0, after[0] - before[0], after[1] - before[1])
