"""Persistent NCCL-EP handles, one per token count, and the buffers they bind: a store.

Why: a FlashInfer handle is fixed to one token count and top_k and binds its routing
weights at creation. CUDA graphs bake pointers, so a handle created inside a forward
cannot be replayed. The pool creates one handle per size the engine captures (and
bucket sizes for eager steps, runtime/pool_sizes.py), outside any capture, warms each
with one eager `update`, and lets every round re-target one with `update`. All layers
share the handles through two static buffers (`topk_ids` int64, `topk_weights` fp32)
that each layer copies its routing into, so memory grows with the number of sizes, not
layers x sizes.

The store holds handles, the static routing and padding buffers, and what they cost;
it decides nothing about a round: runtime/round_plan.py does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import HandlePoolError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import is_capturing
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.limits import max_top_k
from vllm_flashinfer_ep.runtime.memory import memory_growth, memory_snapshot
from vllm_flashinfer_ep.runtime.streams import HandleStreams
from vllm_flashinfer_ep.runtime.transport import moe_ep

logger = get_logger(__name__)


@dataclass
class PoolCounters:
    """What was done on the pool's handles; tests and the benchmark read these."""

    pooled_created: int = 0
    fresh_created: int = 0
    updates: int = 0
    pooled_rounds: int = 0
    padded_rounds: int = 0  # pooled rounds padded up to the next pooled size
    fresh_rounds: int = 0
    created_during_capture: int = 0  # attempts, each refused
    split_forwards: int = 0  # MoE layer forwards run as several rounds (round_chunks.py)


class HandlePool:
    """Handles of one fleet keyed by token count, with the buffers they bind."""

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
        # Whether a round may bind the caller's int64 ids directly (`update` takes any
        # contiguous int64 tensor on the device), saving a copy into `topk_ids`.
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
        self.fi = moe_ep()  # looked up once: eager rounds are host-bound
        self.streams = HandleStreams(self.device)
        self._weight_views: dict[int, torch.Tensor] = {}  # topk_weights[:n], made once per n
        self.staged: dict[str, torch.Tensor] = {}  # staging buffers by "name:dtype"
        # GPU memory each warm-up creation added (torch allocator or device-wide, whichever
        # grew more). The first handle of a fleet also triggers NCCL-EP's lazy buffer
        # allocation, so `per_handle_bytes` excludes it.
        self.handle_bytes: dict[int, int] = {}
        # Device-wide (and torch-allocator) use before the first and after the last warm-up.
        self.warm_before: tuple[int, int] | None = None
        self.warm_after: tuple[int, int] | None = None
        self.handles: dict[int, Any] = {}
        # Sizes learned in the engine's capture phase: those its capture plan adds (pooled
        # when the phase opens) and those a warm-up forward ran beyond the plan.
        self.learned: list[int] = []

    # --------------------------------------------------------------- contents
    @property
    def sizes(self) -> list[int]:
        return sorted(self.handles)

    def any_handle(self) -> Any:
        """A warmed handle (to check what the installed FlashInfer offers), or None."""
        return next(iter(self.handles.values()), None)

    def pooled_size(self, agreed_tokens: int) -> int | None:
        """The pooled handle size a round of `agreed_tokens` runs on (the smallest pooled
        size that fits), or None if none fits."""
        if agreed_tokens in self.handles:
            return agreed_tokens
        fits = [s for s in self.handles if s >= agreed_tokens]
        return min(fits) if fits else None

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
            if size in self.handles:
                continue
            self._fill_dummy_routing(size)
            before = memory_snapshot(self.device)
            join = self.streams.state()[1]
            handle = self.create(size, join)
            self.streams.ordered(
                join, handle.update, self.fi.HandleParams(topk_ids=self.topk_ids[:size])
            )
            self.handle_bytes[size] = memory_growth(self.device, before)
            self.counters.updates += 1
            self.handles[size] = handle
            self.counters.pooled_created += 1
        # Some count will pad: its staging exists before vLLM sizes the KV cache.
        for name in ("x", "out"):
            self.stage_padding(name, self.spec.hidden_size, torch.bfloat16)
        self.warm_after = memory_snapshot(self.device)
        return self.sizes

    def learn_planned(self, sizes: list[int]) -> None:
        """Pool the counts the engine's capture plan adds, in the plan's order, when the
        capture phase opens (the EP ranks agreed on the plan, vllm/rank_checks.py)."""
        for size in sizes:
            self.warm([size])
            self.learned.append(size)
        logger.info(
            "flashinfer_ep: pooled handles for %s tokens, counts the engine captures beyond "
            "its configured capture sizes (speculative decoding, sequence-parallel MoE)",
            sizes,
        )

    def learn(self, size: int) -> None:
        """Pool `size`, the agreed count of an eager warm-up forward in the engine's capture
        phase that its plan lacked: the engine captures that count next, and a handle
        cannot be created inside the capture. The EP ranks compared the warm-up's count
        first (vllm/rank_checks.py), so every rank learns alike."""
        self.warm([size])
        self.learned.append(size)
        logger.info(
            "flashinfer_ep: pooled a handle for %d tokens, a size the engine captures beyond "
            "its configured capture sizes (speculative decoding, sequence-parallel MoE or "
            "a drafter's graphs)",
            size,
        )

    def create(self, num_tokens: int, join: bool = False) -> Any:
        """A handle routing `topk_ids[:num_tokens]` with `topk_weights[:num_tokens]` bound
        (collective; outside capture)."""
        fi = self.fi
        knobs: list[Any] = [fi.HandleAlgoKnobTopKWeights(weights=self.topk_weights[:num_tokens])]
        if self.num_received is not None:
            knobs.append(fi.HandleAlgoKnobNumReceivedTokens(target=self.num_received))
        params = fi.HandleParams(topk_ids=self.topk_ids[:num_tokens])
        return self.streams.ordered(join, self.fleet.create_handle, params, algo_knobs=knobs)

    # -------------------------------------------------------- static buffers
    def weights_view(self, num_tokens: int) -> torch.Tensor:
        """`topk_weights[:num_tokens]`, the rows a handle of that size has bound (made once
        per size: a slice costs more host time than a dict lookup)."""
        view = self._weight_views.get(num_tokens)
        if view is None:
            view = self._weight_views[num_tokens] = self.topk_weights[:num_tokens]
        return view

    def write_pad_routing(self, num_tokens: int, size: int) -> None:
        """Rows num_tokens..size of the static routing: the pad pattern, weight 0."""
        self.topk_ids[num_tokens:size].copy_(self.pad_ids[num_tokens:size], non_blocking=True)
        self.topk_weights[num_tokens:size].zero_()

    def staging(self, name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        """[capacity, width] staging of padded rounds (activations in, combined rows out),
        one per name and dtype (BF16 and FP8 layers may share a pool).

        Persistent: the same address every round (FlashInfer memoizes small tensors' FFI
        wrappers by address; a new buffer per round would miss and stay pinned in that
        memo)."""
        key = f"{name}:{dtype}"
        buf = self.staged.get(key)
        if buf is None or buf.shape[1] != width:
            buf = self.staged[key] = torch.empty(
                self.capacity, width, dtype=dtype, device=self.device
            )
        return buf

    def stage_padding(self, name: str, width: int, dtype: torch.dtype) -> None:
        """Allocate the staging of `name` now (at model load, before vLLM sizes the KV
        cache) if some token count of this pool will pad."""
        if len(self.handles) > 1 or (self.handles and min(self.handles) > 1):
            self.staging(name, width, dtype)

    def _fill_dummy_routing(self, num_tokens: int) -> None:
        rows = torch.arange(num_tokens, device=self.device).unsqueeze(1) * self.top_k
        cols = torch.arange(self.top_k, device=self.device).unsqueeze(0)
        self.topk_ids[:num_tokens].copy_((rows + cols) % self.spec.num_experts)
        self.topk_weights[:num_tokens].fill_(1.0 / self.top_k)

    # ------------------------------------------------------------------ memory
    @property
    def memory_bytes(self) -> int:
        """Memory the pool's warm-up added, device-wide: NCCL-EP's lazy fleet buffers
        (allocated at the first handle) plus every handle. The larger of the device-wide
        and the torch-allocator growth (NCCL-EP allocates through both)."""
        if self.warm_before is None or self.warm_after is None:
            return 0
        return max(0, *(a - b for a, b in zip(self.warm_after, self.warm_before)))

    @property
    def first_handle_bytes(self) -> int:
        """Memory added by the pool's first creation (includes NCCL-EP's lazy fleet buffers)."""
        return next(iter(self.handle_bytes.values()), 0)

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

    def memory_summary(self) -> str:
        """One line for the logs: what the pool holds and what it costs, device-wide."""
        return (
            f"{len(self.handles)} handles, {self.memory_bytes / 1e6:.1f} MB device memory in "
            f"all (first handle with NCCL-EP's fleet buffers {self.first_handle_bytes / 1e6:.1f} "
            f"MB, {self.average_handle_bytes / 1e6:.2f} MB per further handle on average)"
        )

    def destroy(self) -> None:
        for handle in self.handles.values():
            try:
                handle.destroy()
            except Exception:  # noqa: BLE001
                logger.exception("flashinfer_ep: handle.destroy() failed")
        self.handles.clear()


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
