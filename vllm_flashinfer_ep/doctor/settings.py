"""The `vllm serve` arguments doctor's verdicts depend on, and vLLM 0.33.0's defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from vllm_flashinfer_ep import backends
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.vllm import config_rules as rules


@dataclass(frozen=True)
class ServeSettings:
    """The `vllm serve` arguments doctor's checks depend on, under vLLM's names (its
    ParallelConfig properties read them); None: vLLM's default."""

    backend: str = LOW_LATENCY
    dtype: str = "auto"
    quantization: str | None = None
    moe_backend: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_placement_strategy: str = "linear"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    enable_eplb: bool = False
    eplb_config: dict[str, Any] = field(default_factory=dict)
    enable_dbo: bool = False
    ubatch_size: int = 0
    enable_fault_tolerance: bool = False
    enable_elastic_ep: bool = False
    enable_lora: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        eplb = dict(args.eplb_config or {})
        eplb.update(getattr(args, "eplb_overrides", {}) or {})
        return cls(
            backend=args.all2all_backend,
            dtype=args.dtype,
            quantization=args.quantization,
            moe_backend=args.moe_backend,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_model_len=args.max_model_len,
            data_parallel_size=args.data_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            prefill_context_parallel_size=args.prefill_context_parallel_size,
            enable_expert_parallel=bool(args.enable_expert_parallel),
            expert_placement_strategy=getattr(args, "expert_placement_strategy", "linear"),
            hf_overrides=dict(getattr(args, "hf_overrides", None) or {}),
            enable_eplb=bool(args.enable_eplb),
            eplb_config=eplb,
            enable_dbo=bool(args.enable_dbo),
            ubatch_size=args.ubatch_size,
            # vLLM: --fault-tolerance-config turns fault tolerance on (EngineArgs.__post_init__)
            enable_fault_tolerance=bool(args.enable_fault_tolerance)
            or args.fault_tolerance_config is not None,
            enable_elastic_ep=bool(getattr(args, "enable_elastic_ep", False)),
            enable_lora=bool(args.enable_lora),
        )

    @property
    def tokens(self) -> int:
        # LL's default step budget (the default_step_budget patch), bound by vLLM's default
        # capture sizes, 2 x --max-num-seqs (doctor reads no capture size flags)
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        capture = 2 * vllm_defaults(self)[1]
        return rules.ll_default_step_tokens(vllm_batched_dp_tokens(), capture, capture)

    @property
    def ep_world(self) -> int:
        # vLLM's EP group: DP x PCP x TP ranks (config_rules.ep_world_size).
        return rules.ep_world_size(self)

    # vLLM 0.33.0's own ParallelConfig properties, evaluated on these arguments.
    @property
    def all2all_backend(self) -> str:
        return self.backend

    @property
    def use_sequence_parallel_moe(self) -> bool:
        return _parallel_property("use_sequence_parallel_moe", self)

    @property
    def use_all2all(self) -> bool:
        return _parallel_property("use_all2all", self)

    @property
    def use_ubatching(self) -> bool:
        return _parallel_property("use_ubatching", self)


def _parallel_property(name: str, settings: ServeSettings) -> bool:
    """vLLM's (patched) `ParallelConfig.<name>` on the serve arguments, building none."""
    from vllm.config.parallel import ParallelConfig

    return bool(getattr(ParallelConfig, name).fget(settings))


def vllm_defaults(settings: ServeSettings) -> tuple[float, int, bool]:
    """vLLM 0.33.0's defaults where unset: --gpu-memory-utilization, --max-num-seqs (by GPU
    memory, at most the step budget) and chunked prefill (on)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    gmu = settings.gpu_memory_utilization or EngineArgs.gpu_memory_utilization
    seqs = settings.max_num_seqs
    if seqs is None:
        world = settings.tensor_parallel_size * settings.pipeline_parallel_size
        # vLLM caps an unset --max-num-seqs by the budget it picks itself (256 for LL's
        # batched DP MoE), before the package raises LL's (the default_step_budget patch)
        seqs = min(
            EngineArgs.get_batch_defaults(world)[1].get(UsageContext.OPENAI_API_SERVER, 128),
            settings.max_num_batched_tokens or vllm_batched_dp_tokens(),
        )
    chunked = True if settings.enable_chunked_prefill is None else settings.enable_chunked_prefill
    return gmu, seqs, chunked


def vllm_batched_dp_tokens() -> int:
    """vLLM's step budget for batched DP MoE: what it picks for LL before the package
    raises it (the default_step_budget patch), and what caps an unset --max-num-seqs."""
    from vllm.config import SchedulerConfig

    return SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP


def vllm_default_tokens(settings: ServeSettings) -> int | None:
    """vLLM 0.33.0's default --max-num-batched-tokens for HT (by GPU; None: no GPU here)."""
    if rules.device_memory_bytes() is None:
        return None
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    world = settings.tensor_parallel_size * settings.pipeline_parallel_size
    return EngineArgs.get_batch_defaults(world)[0].get(
        UsageContext.OPENAI_API_SERVER, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    )


def checked_backend(name: str) -> str:
    return name if backends.is_ours(name) else LOW_LATENCY
