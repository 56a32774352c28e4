"""Persistent NCCL-EP handles, one per token count, shared by every MoE layer.

Why: a FlashInfer handle is fixed to one token count and top_k and binds its routing
weights at creation. CUDA graphs bake pointers, so a handle created inside a forward
cannot be replayed. The pool creates one handle per size vLLM will capture, outside
any capture (model load), warms each with one eager `update`, and re-targets it with
`update` inside every forward. All layers share the handles through two static
buffers (`topk_ids` int64, `topk_weights` fp32) that each layer copies its routing
into, so memory grows with the number of captured sizes, not layers x sizes.

Eager steps: besides the captured sizes the pool holds a bounded set of bucket sizes up
to the fleet capacity (`bucket_sizes`), so every eager step also runs on a pooled handle.
A round whose token count is not pooled is padded to the next pooled size: padded rows
carry zero activations, weight 0 and routing to this rank's own experts, and their
combined rows are dropped, so no output changes (zero rows cannot raise a per-tensor
FP8 scale, and experts without biases map them to zero).

Collective discipline: handle creation, update, dispatch and combine are collective
over the EP group. Every rank must pick the same handle, so the pooled size comes from
the token count all ranks agreed on for the forward (`agreed_tokens`: the largest
rank's count, from vLLM's DP metadata; a rank with fewer tokens pads more). Without an
agreement every rank creates a fresh handle for the round (counted, logged once), so
ranks never pair different handles.
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
from vllm_flashinfer_ep.runtime.capture import (
    current_raw_stream,
    current_stream_capturing,
    in_capture_phase,
    is_capturing,
)
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.limits import max_top_k
from vllm_flashinfer_ep.runtime.memory import memory_growth, memory_snapshot
from vllm_flashinfer_ep.runtime.native_handle import NativeEager
from vllm_flashinfer_ep.runtime.transport import handle_supports_update, moe_ep

logger = get_logger(__name__)

T = TypeVar("T")

# `agreed_tokens` for callers that drive every rank with the same token count (benchmarks,
# kernel tests, a single rank): the agreed count is this rank's own.
LOCAL = "local"


LARGEST_RANK = "the largest EP rank (every rank refuses this forward)"


def over_capacity(num_tokens: int, capacity: int, whose: str) -> DispatchCapacityError:
    """The error of a round above the fleet capacity. Raised before any collective; when
    `whose` is the largest rank's count (read alike by every rank), every rank raises it
    and none is left waiting in NCCL-EP."""
    return DispatchCapacityError(
        f"{num_tokens} tokens on {whose} exceed the flashinfer_ep fleet capacity of "
        f"{capacity} tokens per rank; raise --max-num-batched-tokens (the fleet is sized "
        "from it) or lower the batch size."
    )


def bucket_sizes(above: int, capacity: int, max_pad: int | None = None) -> list[int]:
    """Pooled sizes for eager steps above `above` (the largest captured size, 0 without
    graphs) up to `capacity`: 2^k and 3*2^(k-1), plus the capacity itself.

    Any count in (above, capacity] pads by less than half its size, with at most
    2*log2(capacity) + 1 handles. `max_pad` also bounds the padding in rows: where two
    sizes lie further apart, sizes `max_pad` apart fill the gap (HT, whose experts
    compute every received row, padding included).
    """
    sizes: set[int] = set()
    power = 1
    while power <= capacity:
        sizes |= {s for s in (power, 3 * power // 2) if s >= 1 and above < s <= capacity}
        power *= 2
    if capacity > above:
        sizes.add(capacity)
    if max_pad is not None and max_pad >= 1:
        previous = above
        for size in sorted(sizes):
            sizes |= set(range(previous + max_pad, size, max_pad))
            previous = size
    return sorted(sizes)


# HT pads by at most this many rows per round: its experts compute every received row,
# padded ones included (zeros, weight 0), so the geometric buckets alone could add up to
# half a prefill's expert work. What an HT handle costs: docs/benchmarks.md (HT section).
HT_MAX_PAD = 256


def pool_sizes(
    algorithm: Algorithm | str, capacity: int, captured: Iterable[int] = ()
) -> list[int]:
    """The token counts a pool is warmed with at load: the one policy of managers, doctor's
    estimate and the benchmarks.

    LL: the engine's configured capture sizes that fit the capacity, then the eager
    buckets above the largest of them (counts vLLM captures beyond these are learned at
    capture, runtime/capture.py). HT is never captured: buckets from 1, at most
    HT_MAX_PAD rows apart, since its experts compute padded rows too."""
    if Algorithm(algorithm) != Algorithm.LOW_LATENCY:
        return bucket_sizes(0, capacity, max_pad=HT_MAX_PAD)
    fits = {int(s) for s in captured if 1 <= int(s) <= capacity}
    return sorted(fits | set(bucket_sizes(max(fits, default=0), capacity)))


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
    padded_rounds: int = 0  # pooled rounds padded up to the next pooled size
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
        rank: int = 0,
        world_size: int = 1,
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
        # Routing of padded rows: this rank's own experts where top_k distinct ones exist
        # (padding then never crosses ranks), else spread over all experts.
        self.pad_ids = _pad_routing(
            self.capacity, top_k, spec.num_experts, rank, world_size, self.device
        )
        self.counters = PoolCounters()
        self._fi = moe_ep()  # looked up once: eager rounds are host-bound
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._device_index = (
            self.device.index
            if self.device.index is not None
            else (torch.cuda.current_device() if self._cuda else -1)
        )
        # Handles run on the fleet's stream outside capture: stream 0 (see fleet.py).
        self._handle_stream = torch.cuda.default_stream(self._device_index) if self._cuda else None
        self._handle_raw_stream = (
            self._handle_stream.cuda_stream if self._handle_stream is not None else 0
        )
        self._join = False  # this round's handle work is joined with torch's current stream
        # Eager LL rounds on the nccl.ep handle underneath FlashInfer's (native_handle.py);
        # None: through FlashInfer's handle methods. `_native_round`: this round is direct.
        self._native = (
            NativeEager(self._handle_raw_stream)
            if not self.is_ht and envs.native_eager_enabled()
            else None
        )
        self._native_round = False
        self._padded: tuple[int, int] | None = None  # (real rows, pooled size) of this round
        # Tokens every EP rank dispatches in the current round when known: a pooled round's
        # handle size (padding included); None for per-forward rounds and between rounds.
        # The received-rows experts bound their work by it (vllm/compact_experts.py).
        self.sent_per_rank: int | None = None
        self._fresh_logged = False
        self._weight_views: dict[int, torch.Tensor] = {}  # topk_weights[:n], made once per n
        self._pad_buffers: dict[str, torch.Tensor] = {}
        # GPU memory each warm-up creation added (torch allocator or device-wide, whichever
        # grew more). The first handle of a fleet also triggers NCCL-EP's lazy buffer
        # allocation, so `per_handle_bytes` excludes it.
        self.handle_bytes: dict[int, int] = {}
        # Device-wide (and torch-allocator) use before the first and after the last warm-up.
        self.warm_before: tuple[int, int] | None = None
        self.warm_after: tuple[int, int] | None = None
        self._handles: dict[int, Any] = {}
        self._current: Any = None
        self._current_is_fresh = False
        # Called with (item, value) before a size learned in the capture phase is created:
        # every EP rank must learn the same size at the same round, and a rank that would
        # not is refused there, before the collective creation (runtime/rank_agreement.py).
        # None: a single rank, or callers that drive every rank alike (benchmarks, tests).
        self.agree: Callable[[str, Any], None] | None = None
        self.learned: list[int] = []  # sizes learned in the engine's capture phase

    # ------------------------------------------------------------------ sizes
    @property
    def memory_bytes(self) -> int:
        """Memory the pool's warm-up added, device-wide: NCCL-EP's lazy fleet buffers
        (allocated at the first handle) plus every handle. The larger of the device-wide
        and the torch-allocator growth (NCCL-EP allocates through both)."""
        if self.warm_before is None or self.warm_after is None:
            return 0
        return max(0, *(a - b for a, b in zip(self.warm_after, self.warm_before)))

    @property
    def average_handle_bytes(self) -> float:
        """Average memory per handle beyond the first (whose growth includes the fleet
        buffers): (total - first) / (handles - 1), device-wide."""
        if len(self.handle_bytes) < 2:
            return 0.0
        return max(0, self.memory_bytes - self.first_handle_bytes) / (len(self.handle_bytes) - 1)

    @property
    def per_handle_bytes(self) -> float:
        """Median growth around one creation, excluding the first. NCCL-EP reserves some
        handle memory in larger steps than one handle, so this can read far below
        `average_handle_bytes`; the average is the figure to plan with."""
        values = sorted(list(self.handle_bytes.values())[1:])  # dicts keep creation order
        return float(values[len(values) // 2]) if values else 0.0

    @property
    def first_handle_bytes(self) -> int:
        """Memory added by the pool's first creation (includes NCCL-EP's lazy fleet buffers)."""
        return next(iter(self.handle_bytes.values()), 0)

    @property
    def sizes(self) -> list[int]:
        return sorted(self._handles)

    def memory_summary(self) -> str:
        """One line for the logs: what the pool holds and what it costs, device-wide."""
        return (
            f"{len(self._handles)} handles, {self.memory_bytes / 1e6:.1f} MB device memory in "
            f"all (first handle with NCCL-EP's fleet buffers {self.first_handle_bytes / 1e6:.1f} "
            f"MB, {self.average_handle_bytes / 1e6:.2f} MB per further handle on average)"
        )

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
        if self.warm_before is None:
            self.warm_before = memory_snapshot(self.device)
        for size in (s for s in wanted if s <= self.capacity):
            if size in self._handles:
                continue
            self._fill_dummy_routing(size)
            before = memory_snapshot(self.device)
            self._join = self._stream_state()[1]
            handle = self._create(size)
            self._ordered(handle.update, self._params(size))
            self.handle_bytes[size] = memory_growth(self.device, before)
            self.counters.updates += 1
            self._handles[size] = handle
            self.counters.pooled_created += 1
        # Some count will pad: its staging exists before vLLM sizes the KV cache.
        for name in ("x", "out"):
            self.stage_padding(name, self.spec.hidden_size, torch.bfloat16)
        self.warm_after = memory_snapshot(self.device)
        return self.sizes

    def _learn(self, size: int) -> None:
        """Pool `size`, the agreed count of an eager warm-up forward in the engine's capture
        phase: the engine captures that count next, and a handle cannot be created inside
        the capture. Every rank runs the same warm-ups, so every rank learns alike; `agree`
        checks that before the collective creation. `begin` has refused a count above
        the capacity already."""
        if self.agree is not None:
            self.agree("token count learned in the capture phase", size)
        self.warm([size])
        self.learned.append(size)
        logger.info(
            "flashinfer_ep: pooled a handle for %d tokens, a size the engine captures beyond "
            "its configured capture sizes (speculative decoding, sequence-parallel MoE or "
            "a drafter's graphs)",
            size,
        )

    def any_handle(self) -> Any:
        """A warmed handle (to check what the installed FlashInfer offers), or None."""
        return next(iter(self._handles.values()), None)

    def pooled_size(self, agreed_tokens: int) -> int | None:
        """The pooled handle size a round of `agreed_tokens` runs on (the smallest pooled
        size that fits), or None if none fits."""
        if agreed_tokens in self._handles:
            return agreed_tokens
        fits = [s for s in self._handles if s >= agreed_tokens]
        return min(fits) if fits else None

    # ----------------------------------------------------------------- rounds
    def begin(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        agreed_tokens: int | None | str = LOCAL,
    ) -> Any:
        """Bind this layer's routing to a handle; returns the handle for the round.

        `agreed_tokens`: the token count every EP rank agreed on for this forward (the
        largest rank's), LOCAL when every rank runs this rank's count, None when no
        agreement is available (every rank then creates a fresh handle). Under CUDA-graph
        capture the count is uniform and must be pooled exactly.
        """
        # Eager rounds are host-bound (docs/benchmarks.md): this path keeps its Python
        # calls few; the checks and rare cases branch off it.
        num_tokens, top_k = topk_ids.shape
        if top_k != self.top_k or not 1 <= num_tokens <= self.capacity:
            self._refuse_shape(num_tokens, top_k)
        if self._current_is_fresh:
            self._end_fresh()
        # A round that failed before its combine left its state behind: start clean.
        self._padded = self.sent_per_rank = None
        self._native_round = False
        # One stream decision per round (see _stream_state).
        capturing, self._join = self._stream_state()
        agreed = num_tokens if agreed_tokens == LOCAL else agreed_tokens
        handle = self._handles.get(agreed) if agreed == num_tokens else None
        size = num_tokens
        if handle is None and isinstance(agreed, int) and agreed >= num_tokens:
            if agreed > self.capacity:  # every rank reads the same count: all refuse alike
                raise over_capacity(agreed, self.capacity, LARGEST_RANK)
            if agreed not in self._handles and not capturing and in_capture_phase():
                self._learn(agreed)
            size = self.pooled_size(agreed)
            handle = self._handles.get(size) if size is not None else None
        if capturing and (handle is None or size != num_tokens):
            self.counters.created_during_capture += 1  # attempts; each is refused here
            raise HandlePoolError(
                f"no warmed flashinfer_ep handle for {num_tokens} tokens (pooled sizes: "
                f"{self.sizes}); a handle cannot be created inside CUDA-graph capture. The "
                "pool learns each captured size from the engine's eager warm-up forward of "
                "that size; this capture had none (or ran outside the engine's capture "
                "phase). Please report this with the vLLM command line; --enforce-eager "
                "avoids it."
            )
        if handle is None:
            return self._begin_fresh(topk_ids, topk_weights, agreed)
        # Weights are bound to the handle at creation: always copy them. Ids can be
        # bound per call (`update` takes any int64 contiguous CUDA tensor), which saves
        # one copy kernel per layer; other ids, and padded rounds, use the static buffer.
        self._copy_weights(num_tokens, topk_weights)
        if (
            size == num_tokens
            and self.bind_ids
            and topk_ids.dtype == torch.int64
            and (topk_ids.is_contiguous() and topk_ids.get_device() == self._device_index)
        ):
            ids = topk_ids
        else:
            self.topk_ids[:num_tokens].copy_(topk_ids, non_blocking=True)
            ids = self.topk_ids[:size]
            if size != num_tokens:
                self._pad_routing(num_tokens, size)
        if self._join:
            self._ordered(handle.update, self._fi.HandleParams(topk_ids=ids))
        else:  # the common case, without the wrapper's call
            handle.update(self._fi.HandleParams(topk_ids=ids))
        counters = self.counters
        counters.updates += 1
        counters.pooled_rounds += 1
        self._current = handle
        self.sent_per_rank = size
        return handle

    def begin_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        agreed_tokens: int | None | str = LOCAL,
        fp8_wire: Any = None,
        scales: torch.Tensor | None = None,
    ) -> Any:
        """`begin` then `dispatch`, in one call; a failed dispatch ends the round.
        `fp8_wire`, `scales`: see `dispatch`.

        The common round runs inline here: a pooled handle of exactly this round's size,
        routing ids it can bind, and handle work on torch's current stream (no join).
        Outside capture (LL) it issues the nccl.ep calls directly (native_handle.py): an
        eager step is host-bound, and FlashInfer's methods cost more host time than the
        calls they make (docs/benchmarks.md). Anything else (padding, a fresh
        handle, a join, refusals) takes the general path.
        """
        num_tokens, top_k = topk_ids.shape
        handle = self._handles.get(num_tokens)
        if (
            handle is not None
            and top_k == self.top_k
            and (agreed_tokens is LOCAL or agreed_tokens == num_tokens)
            and not self._current_is_fresh
            and self.bind_ids
            and topk_ids.dtype == torch.int64
            and topk_ids.is_contiguous()
            and topk_ids.get_device() == self._device_index
            and x.shape[0] == num_tokens  # FlashInfer's dispatch refuses a mismatch; NCCL-EP not
            and (
                not self._cuda or current_raw_stream(self._device_index) == self._handle_raw_stream
            )
        ):
            self._padded = None
            self._join = False
            self._copy_weights(num_tokens, topk_weights)
            self._current = handle
            self.sent_per_rank = num_tokens
            counters = self.counters
            counters.updates += 1
            counters.pooled_rounds += 1
            native = self._native
            self._native_round = False
            try:
                # On a GPU this round is on the handles' own stream 0, which cannot be
                # captured; without CUDA ask (the simulated capture of the CPU tests).
                direct = self._native_round = (
                    native is not None
                    and (fp8_wire is not None or native.recv is not None)
                    and (self._cuda or not is_capturing())
                    and native.usable(handle)
                )
                if direct:
                    native.update(handle, topk_ids)
                else:
                    handle.update(self._fi.HandleParams(topk_ids=topk_ids))
                if fp8_wire is not None:
                    return fp8_wire.dispatch(handle, x, scales)
                if direct:
                    return native.dispatch(handle, x)
                out = handle.dispatch(self._fi.DispatchInputParams(x=[x]))
                if native is not None:
                    native.record(out)
                return out
            except BaseException:
                self.end()
                raise
        self.begin(topk_ids, topk_weights, agreed_tokens=agreed_tokens)
        try:
            return self.dispatch(x, fp8_wire, scales)
        except BaseException:
            self.end()  # no round state (padding, a fresh handle) outlives a failed dispatch
            raise

    def combine_end(self, expert_out: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """`combine` then `end`, in one call (the round ends also when combine fails);
        inline for a round without padding, fresh handle or join (see begin_dispatch)."""
        if not expert_out.is_contiguous():  # NCCL-EP reads it by pointer, without strides
            expert_out = expert_out.contiguous()
        handle = self._current
        if (
            handle is not None
            and self._padded is None
            and not self._join
            and not self._current_is_fresh
        ):
            rows = self.sent_per_rank
            self._current = self.sent_per_rank = None
            if self._native_round:
                self._native_round = False
                if out is None:
                    out = expert_out.new_empty(rows, self.spec.hidden_size)
                return self._native.combine(handle, expert_out, out, self._weight_views[rows])
            return handle.combine(self._fi.CombineInputParams(x=[expert_out], out=out)).x
        try:
            return self.combine(expert_out, out)
        finally:
            self.end()

    def dispatch(
        self, x: torch.Tensor, fp8_wire: Any = None, scales: torch.Tensor | None = None
    ) -> Any:
        """Dispatch on this round's handle: FlashInfer's BF16 dispatch, or NCCL-EP's FP8
        one when `fp8_wire` (runtime/fp8_wire.py) is given: LL quantizes x (BF16) in the
        kernel, HT forwards x (E4M3) with its `scales`. Padded rows are zeros (weight 0)."""
        handle = self._current
        if handle is None:
            self._require_current()
        if self._padded is not None:
            x = self._padded_rows(x)
            if scales is not None:
                scales = self._padded_rows(scales, "scales")
        if fp8_wire is not None:
            return self._ordered(fp8_wire.dispatch, handle, x, scales)
        if self._join:
            return self._ordered(handle.dispatch, self._fi.DispatchInputParams(x=[x]))
        return handle.dispatch(self._fi.DispatchInputParams(x=[x]))

    def combine(self, expert_out: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """Combine into `out` (written in place when given) and end the round."""
        handle = self._current
        if handle is None:
            self._require_current()
        if self._padded is None:
            params = self._fi.CombineInputParams(x=[expert_out], out=out)
            if self._join:
                return self._ordered(handle.combine, params).x
            return handle.combine(params).x
        real, size = self._padded
        dtype = out.dtype if out is not None else expert_out.dtype
        staging = self._pad_buffer(f"out:{dtype}", self.spec.hidden_size, dtype, expert_out.device)[
            :size
        ]
        params = self._fi.CombineInputParams(x=[expert_out], out=staging)
        self._ordered(handle.combine, params)
        if out is None:
            return staging[:real].clone()  # the staging buffer is the next round's too
        out.copy_(staging[:real])  # the padded rows' output is dropped
        return out

    def end(self) -> None:
        """End the round; a fresh handle is destroyed once its work is ordered."""
        if self._current_is_fresh:
            self._end_fresh()
        self._current = None
        self._padded = None
        self.sent_per_rank = None
        self._native_round = False

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
    def _begin_fresh(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, agreed: Any) -> Any:
        """A handle for this round only (destroyed at its end), on every rank alike."""
        num_tokens = topk_ids.shape[0]
        if not self._fresh_logged and self._handles:
            self._fresh_logged = True
            why = (
                "no token count agreed across EP ranks for this forward"
                if not isinstance(agreed, int)
                else f"no pooled size fits the agreed {agreed} tokens (pooled: {self.sizes})"
            )
            logger.info(
                "flashinfer_ep: a round of %d tokens runs on a per-forward handle: %s "
                "(logged once; PoolCounters.fresh_created counts them)",
                num_tokens,
                why,
            )
        self.topk_weights[:num_tokens].copy_(topk_weights, non_blocking=True)
        self.topk_ids[:num_tokens].copy_(topk_ids, non_blocking=True)
        handle = self._create(num_tokens)
        self.counters.fresh_created += 1
        self.counters.fresh_rounds += 1
        self._current, self._current_is_fresh = handle, True
        return handle

    def _refuse_shape(self, num_tokens: int, top_k: int) -> None:
        if top_k != self.top_k:
            raise HandlePoolError(
                f"this pool was built for top_k={self.top_k}, got routing with top_k={top_k}"
            )
        if num_tokens > self.capacity:
            raise over_capacity(num_tokens, self.capacity, "this rank")
        raise HandlePoolError("a flashinfer_ep round needs at least one token per rank")

    def _pad_buffer(
        self, name: str, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """[capacity, hidden] staging of padded rounds (activations in, combined rows out).

        Persistent: the same address every round (FlashInfer memoizes small tensors' FFI
        wrappers by address; a new buffer per round would miss and stay pinned in that
        memo). Created at warm-up when the pool can pad, so its memory is there before vLLM
        sizes the KV cache."""
        buf = self._pad_buffers.get(name)
        if buf is None or buf.shape[1] != hidden or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(self.capacity, hidden, dtype=dtype, device=device)
            self._pad_buffers[name] = buf
        return buf

    def stage_padding(self, name: str, width: int, dtype: torch.dtype) -> None:
        """Allocate the staging of padded rows of `name` now (at model load, before vLLM
        sizes the KV cache) if some token count of this pool will pad."""
        if len(self._handles) > 1 or (self._handles and min(self._handles) > 1):
            self._pad_buffer(f"{name}:{dtype}", width, dtype, self.device)

    def _padded_rows(self, rows: torch.Tensor, name: str = "x") -> torch.Tensor:
        """This round's rows followed by zero rows up to its pooled size (one staging
        buffer per name and dtype: BF16 and FP8 layers may share a runtime)."""
        real, size = self._padded
        padded = self._pad_buffer(f"{name}:{rows.dtype}", rows.shape[1], rows.dtype, rows.device)[
            :size
        ]
        padded[:real].copy_(rows)
        padded[real:].zero_()
        return padded

    def _copy_weights(self, num_tokens: int, topk_weights: torch.Tensor) -> None:
        """This layer's weights into the rows the handle of `num_tokens` has bound."""
        view = self._weight_views.get(num_tokens)
        if view is None:  # a slice costs more host time than a dict lookup
            view = self._weight_views[num_tokens] = self.topk_weights[:num_tokens]
        view.copy_(topk_weights)

    def _pad_routing(self, num_tokens: int, size: int) -> None:
        """Rows num_tokens..size of the static routing: the pad pattern, weight 0."""
        self.topk_ids[num_tokens:size].copy_(self.pad_ids[num_tokens:size], non_blocking=True)
        self.topk_weights[num_tokens:size].zero_()
        self._padded = (num_tokens, size)
        self.counters.padded_rounds += 1

    def _params(self, num_tokens: int) -> Any:
        return self._fi.HandleParams(topk_ids=self.topk_ids[:num_tokens])

    def _create(self, num_tokens: int) -> Any:
        fi = self._fi
        knobs: list[Any] = [fi.HandleAlgoKnobTopKWeights(weights=self.topk_weights[:num_tokens])]
        if self.num_received is not None:
            knobs.append(fi.HandleAlgoKnobNumReceivedTokens(target=self.num_received))
        return self._ordered(self.fleet.create_handle, self._params(num_tokens), algo_knobs=knobs)

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

    def _stream_state(self) -> tuple[bool, bool]:
        """(capturing, join) for this round: whether torch's current stream is being
        captured, and whether handle work must be joined with it.

        Outside capture FlashInfer issues handle work on the handle's own stream (stream
        0, see fleet.py), not on torch's current one (vLLM's capture warmups run on a side
        stream); under capture it uses the capturing stream itself. Decided once per round:
        eager rounds are host-bound, and the streams do not change between a layer's
        dispatch and its combine. On the legacy default stream (stream 0) nothing can be
        captured (CUDA refuses it), so the common eager case needs no capture query.
        """
        if not self._cuda:
            return is_capturing(), False
        current = current_raw_stream(self._device_index)
        if current == self._handle_raw_stream == 0:
            return False, False
        capturing = current_stream_capturing()
        return capturing, not capturing and current != self._handle_raw_stream

    def _ordered(self, op: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a handle op, ordered against torch's current stream when this round needs it
        (under capture FlashInfer uses the capturing stream itself)."""
        if not self._join:
            return op(*args, **kwargs)
        assert self._handle_stream is not None
        current = torch.cuda.current_stream()
        self._handle_stream.wait_stream(current)
        result = op(*args, **kwargs)
        current.wait_stream(self._handle_stream)
        return result


def _pad_routing(
    capacity: int, top_k: int, num_experts: int, rank: int, world_size: int, device: torch.device
) -> torch.Tensor:
    """[capacity, top_k] routing for padded rows: top_k distinct experts per row, this
    rank's own when it has that many (padding then stays on the rank)."""
    local = num_experts // max(1, world_size)
    first, span = (rank * local, local) if top_k <= local else (0, num_experts)
    rows = torch.arange(capacity, device=device).unsqueeze(1) * top_k
    cols = torch.arange(top_k, device=device).unsqueeze(0)
    return first + (rows + cols) % span
