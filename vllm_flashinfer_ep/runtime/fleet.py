"""Fleet bootstrap and the per-shape fleet cache: a FlashInfer `Fleet` owns the NCCL-EP
group and buffers for one MoE shape, shared by every layer of that shape (draft/MTP
layers may add another)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    SUPPORTED_HIDDEN_SIZES,
    unsupported_hidden_size_reason,
)
from vllm_flashinfer_ep.runtime.memory import memory_growth, memory_snapshot
from vllm_flashinfer_ep.runtime.transport import moe_ep

logger = get_logger(__name__)


@dataclass(frozen=True)
class FleetSpec:
    """The shape a fleet is sized for. Equal specs share one fleet."""

    algorithm: Algorithm
    num_experts: int
    max_tokens_per_rank: int
    hidden_size: int
    dtype_bytes: int = 2
    fault_tolerance: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", Algorithm(self.algorithm))  # ValueError if unknown
        if (
            self.algorithm == Algorithm.LOW_LATENCY
            and self.hidden_size not in SUPPORTED_HIDDEN_SIZES
        ):
            raise FlashInferEPConfigError(
                unsupported_hidden_size_reason(self.hidden_size)
                + f" (supported: {list(SUPPORTED_HIDDEN_SIZES)}); vLLM layers are rounded "
                "up by the plugin, so this only happens when the runtime is used directly."
            )
        if self.fault_tolerance and self.algorithm != Algorithm.LOW_LATENCY:
            raise FlashInferEPConfigError(
                "NCCL-EP fault tolerance exists only for the low-latency algorithm: use "
                "--all2all-backend flashinfer_ep_low_latency or drop --enable-fault-tolerance."
            )
        if self.dtype_bytes != 2:
            raise FlashInferEPConfigError(
                "the flashinfer_ep backends dispatch BF16 activations only "
                f"(got {self.dtype_bytes}-byte elements); use --dtype bfloat16."
            )

    @property
    def effective_max_tokens_per_rank(self) -> int:
        if self.algorithm == Algorithm.HIGH_THROUGHPUT:
            return min(self.max_tokens_per_rank, HT_MAX_TOKENS_PER_RANK)
        return self.max_tokens_per_rank


def bootstrap_config(rank: int, world_size: int, process_group: Any) -> Any:
    """BootstrapConfig for one EP rank, on the device vLLM bound (never LOCAL_RANK, which
    vLLM may have remapped); stream 0 is the handles' stream outside capture."""
    fi = moe_ep()
    return fi.BootstrapConfig(
        world_size=world_size,
        rank=rank,
        stream=0,
        auto_bootstrap=False,
        process_group=process_group,
        device=torch.cuda.current_device(),
    )


def _fleet_knobs(spec: FleetSpec) -> list[Any]:
    fi = moe_ep()
    # Through torch's caching allocator, so vLLM's memory profiling sees the buffers.
    knobs: list[Any] = [fi.FleetAlgoKnobAllocator(torch_caching=True)]
    rdma_bytes = envs.rdma_buffer_bytes()
    if rdma_bytes > 0:
        # Allocated once at group creation, never re-allocated for later handles.
        knobs.append(fi.FleetAlgoKnobRdmaBufferSize(bytes_=rdma_bytes))
    if spec.fault_tolerance:
        knobs.append(fi.FleetAlgoKnobFaultTolerance(enabled=True, timeout_ms=envs.ft_timeout_ms()))
    return knobs


def create_fleet(spec: FleetSpec, bootstrap: Any) -> Any:
    """Create one fleet (collective over the EP group)."""
    fi = moe_ep()
    algorithm = fi.EpAlgorithm[spec.algorithm.name]  # same member names
    # LL's layout for vLLM's batched experts; HT ignores it (flat layout).
    layout = fi.EpLayout.EXPERT_MAJOR
    params = fi.FleetParams(
        num_experts=spec.num_experts,
        max_tokens_per_rank=spec.effective_max_tokens_per_rank,
        token_hidden_size=spec.hidden_size,
        dtype_bytes=spec.dtype_bytes,
        algorithm=algorithm,
        layout=layout,
    )
    if spec.max_tokens_per_rank != spec.effective_max_tokens_per_rank:
        logger.warning(
            "flashinfer_ep_high_throughput: NCCL-EP caps tokens per rank at %d; the fleet is "
            "sized for %d instead of the requested %d (lower --max-num-batched-tokens to "
            "silence this).",
            HT_MAX_TOKENS_PER_RANK,
            spec.effective_max_tokens_per_rank,
            spec.max_tokens_per_rank,
        )
    return fi.create_fleet(
        bootstrap, params, algo_knobs=_fleet_knobs(spec), backend=envs.transport()
    )


class FleetCache:
    """One fleet per FleetSpec, created on first use and destroyed together."""

    def __init__(self, rank: int, world_size: int, process_group: Any) -> None:
        self.rank, self.world_size, self._process_group = rank, world_size, process_group
        self._fleets: dict[FleetSpec, Any] = {}

    def get(self, spec: FleetSpec) -> Any:
        fleet = self._fleets.get(spec)
        if fleet is None:
            boot = bootstrap_config(self.rank, self.world_size, self._process_group)
            gpu = torch.device("cuda")  # the current device, the fleet's (bootstrap_config)
            before = memory_snapshot(gpu)
            fleet = create_fleet(spec, boot)
            self._fleets[spec] = fleet
            logger.info(
                "flashinfer_ep: created %s fleet (experts=%d, max_tokens_per_rank=%d, "
                "hidden=%d, ep_world=%d, ft=%s): %.1f MB device memory at creation",
                spec.algorithm,
                spec.num_experts,
                spec.effective_max_tokens_per_rank,
                spec.hidden_size,
                self.world_size,
                spec.fault_tolerance,
                memory_growth(gpu, before) / 1e6,
            )
        return fleet

    def fleets(self) -> list[Any]:
        return list(self._fleets.values())

    def destroy(self) -> None:
        for fleet in self._fleets.values():
            try:
                fleet.destroy()
            except Exception:  # noqa: BLE001 - teardown must not mask the real error
                logger.exception("flashinfer_ep: fleet.destroy() failed")
        self._fleets.clear()
