"""The transport state one MoE shape needs: its fleet, its handle pool, its round; every
MoE layer of the shape shares one EPRuntime."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import fp8_wire
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.runtime.fp8_wire import Fp8Wire, HtFp8Wire, Quantizer
from vllm_flashinfer_ep.runtime.handle_pool import HandlePool
from vllm_flashinfer_ep.runtime.memory import memory_growth, memory_snapshot
from vllm_flashinfer_ep.runtime.rounds import Round, make_round

logger = get_logger(__name__)


@dataclass
class EPRuntime:
    spec: FleetSpec
    fleet: Any
    pool: HandlePool
    rank: int
    world_size: int
    round: Round = field(init=False)  # one per runtime: layers share its staging
    fp8_wire: Fp8Wire | HtFp8Wire | None = field(init=False, default=None)  # see enable_fp8_wire
    memory_bytes: int = field(init=False, default=0)  # GPU memory taken at load (finish_load)
    loaded: bool = field(init=False, default=False)  # finish_load ran
    before_build: tuple[int, int] = field(init=False, default=(0, 0))  # memory_snapshot

    def __post_init__(self) -> None:
        self.round = make_round(self)

    def fp8_wire_reason(self) -> str | None:
        """Why this runtime cannot send FP8 on the wire (None: it can), checked at load."""
        reason = fp8_wire.hidden_reason(self.spec.hidden_size)
        if reason is not None:
            return reason
        handle = self.pool.any_handle()
        if handle is None:
            return "no pooled handle to dispatch on (the handle pool is off)"
        ht = self.spec.algorithm == Algorithm.HIGH_THROUGHPUT
        return fp8_wire.native_reason(handle, "FWD" if ht else "DS_FP8E3M4")

    def enable_fp8_wire(self, quantize: Quantizer | None = None) -> Fp8Wire | HtFp8Wire:
        """FP8 on the wire, its buffers allocated at load (before vLLM sizes the KV cache)."""
        if self.fp8_wire is None:
            rows = self.capacity * self.world_size
            hidden = self.spec.hidden_size
            if self.spec.algorithm == Algorithm.HIGH_THROUGHPUT:
                wire = HtFp8Wire(
                    rows, hidden, self.pool.topk_weights, quantize or fp8_wire.group_quantize
                )
                self.pool.stage_padding("x", hidden, wire.tokens.dtype)
                self.pool.stage_padding("scales", wire.scales.shape[1], torch.float32)
                self.fp8_wire = wire
            else:
                if quantize is not None:
                    raise ValueError("the LL FP8 dispatch quantizes in NCCL-EP's kernel")
                self.fp8_wire = Fp8Wire(self.num_local_experts, rows, hidden, self.pool.device)
            logger.info(
                "flashinfer_ep: %s FP8 dispatch (E4M3 + FP32 scales per 128 elements on the wire, "
                "%d instead of %d bytes per row) for hidden %d; receive buffers %.1f MB",
                self.spec.algorithm,
                fp8_wire.bytes_per_row(self.spec.hidden_size, True),
                fp8_wire.bytes_per_row(self.spec.hidden_size, False),
                self.spec.hidden_size,
                self.fp8_wire.memory_bytes / 1e6,
            )
        return self.fp8_wire

    def finish_load(self, first_round: bool) -> None:
        """After the first layer's prepare/finalize, on every rank: first round, memory log."""
        if self.loaded:
            return
        self.loaded = True
        pool = self.pool
        if not pool.sizes:
            return
        if first_round:
            self.warm_round()
        self.memory_bytes = memory_growth(pool.device, self.before_build)
        logger.info(
            "flashinfer_ep: %s runtime (hidden %d, %d tokens per rank) loaded: %.2f GB of GPU "
            "memory device-wide (fleet, %d pooled handles for token counts %s%s); pool: %s",
            self.spec.algorithm,
            self.spec.hidden_size,
            self.capacity,
            self.memory_bytes / 1e9,
            len(pool.sizes),
            _compact(pool.sizes),
            ", FP8 wire buffers" if self.fp8_wire is not None else "",
            pool.memory_summary(),
        )

    def warm_round(self) -> None:
        """A BF16 round of zero rows, so FlashInfer's receive buffer is allocated at load."""
        pool = self.pool
        size = min(pool.sizes)
        x = torch.zeros(size, self.spec.hidden_size, dtype=torch.bfloat16, device=pool.device)
        weights = torch.zeros(size, pool.top_k, dtype=torch.float32, device=pool.device)
        received = self.round.dispatch(x, pool.pad_ids[:size].contiguous(), weights)
        if self.spec.algorithm == Algorithm.HIGH_THROUGHPUT:
            self.round.combine(None)
        else:
            self.round.combine(received.expert_x, None)

    @property
    def num_local_experts(self) -> int:
        return self.spec.num_experts // self.world_size

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def destroy(self) -> None:
        self.round.end()
        self.pool.destroy()


def build_runtime(
    fleets: FleetCache,
    spec: FleetSpec,
    top_k: int,
    device: torch.device | int | str,
    pool_sizes: list[int],
) -> EPRuntime:
    if spec.num_experts % fleets.world_size != 0:
        raise ValueError(
            f"{spec.num_experts} experts cannot be split evenly over {fleets.world_size} EP ranks"
        )
    before = memory_snapshot(torch.device(device))
    fleet = fleets.get(spec)
    pool = HandlePool(fleet, spec, top_k, device, rank=fleets.rank, world_size=fleets.world_size)
    runtime = EPRuntime(
        spec=spec, fleet=fleet, pool=pool, rank=fleets.rank, world_size=fleets.world_size
    )
    runtime.before_build = before
    if pool_sizes:
        pool.warm(pool_sizes)
    return runtime


def _compact(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
