"""All2all managers for the two flashinfer_ep backends.

vLLM builds one manager per EP group (in `CudaCommunicator.__init__`, through the
`communicator_manager` patch in patches/worker.py) and asks it for a "handle" once per MoE layer at
model load. Our handle is an EPRuntime (fleet + warmed handle pool) shared by all
layers of one MoE shape; the manager keeps strong references (vLLM's own handle cache
is weak) and destroys everything in `destroy()`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import env_checks, pool_sizes
from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime, build_runtime
from vllm_flashinfer_ep.runtime.exchange import cpu_exchange
from vllm_flashinfer_ep.runtime.fault_tolerance import FaultToleranceAdapter
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.vllm import rank_checks
from vllm_flashinfer_ep.vllm.config_rules import round_capacity, round_capture_reason

logger = get_logger(__name__)


def pool_sizes_from_config(vllm_config: Any) -> list[int]:
    """Token counts vLLM will capture, per EP rank (what the pool must pre-create)."""
    if vllm_config is None:
        return []
    from vllm.config import CUDAGraphMode

    comp = vllm_config.compilation_config
    if comp.cudagraph_mode == CUDAGraphMode.NONE or not comp.cudagraph_capture_sizes:
        return []
    sizes = set(int(s) for s in comp.cudagraph_capture_sizes)
    par = vllm_config.parallel_config
    if par.use_sequence_parallel_moe:
        tp = par.tensor_parallel_size
        sizes |= {math.ceil(s / tp) for s in sizes}
    return sorted(sizes)


class _FlashInferEPManager(All2AllManagerBase):
    algorithm: Algorithm

    def __init__(self, cpu_group: Any, tcp_store_group: Any = None) -> None:
        super().__init__(cpu_group, tcp_store_group)
        if not envs.skip_env_checks():
            env_checks.ensure_nvcc_for_jit(logger.info)
            env_checks.require_runtime_environment()
        from vllm.config import get_current_vllm_config_or_none

        self._vllm_config = get_current_vllm_config_or_none()
        par = self._vllm_config.parallel_config if self._vllm_config is not None else None
        self._fault_tolerance = bool(
            par is not None
            and par.enable_fault_tolerance
            and self.algorithm.supports_fault_tolerance
        )
        self.support_fault_tolerance = self._fault_tolerance
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._cpu_group = cpu_group
        self._fleets = FleetCache(self.rank, self.world_size, cpu_group)
        # Cross-rank checks before collectives (vllm/rank_checks.py), over one bounded
        # exchange; None: one rank.
        self._checks = rank_checks.RankChecks(
            cpu_exchange(cpu_group) if self.world_size > 1 and cpu_group is not None else None,
            self._vllm_config,
        )
        self._runtimes: dict[tuple, EPRuntime] = {}
        self._ft: FaultToleranceAdapter | None = None
        self._logged: set[str] = set()

    # vLLM: one call per MoE layer at model load.
    def get_handle(self, kwargs: dict[str, Any]) -> EPRuntime:
        spec = FleetSpec(
            algorithm=self.algorithm,
            num_experts=int(kwargs["num_experts"]),
            max_tokens_per_rank=int(kwargs["max_num_tokens_per_rank"]),
            hidden_size=int(kwargs["hidden_size"]),
            fault_tolerance=self._fault_tolerance,
        )
        top_k = int(kwargs["top_k"])
        key = (spec, top_k)
        runtime = self._runtimes.get(key)
        if runtime is None:
            sizes = self._pool_sizes(spec.effective_max_tokens_per_rank)
            self._require_ranks_agree(spec, top_k, sizes)
            runtime = build_runtime(self._fleets, spec, top_k, self._device, sizes)
            self._runtimes[key] = runtime
            if self._fault_tolerance and self._ft is None:  # reads the cache's fleets at each call
                self._ft = FaultToleranceAdapter(self._fleets.fleets, self._device)
        return runtime

    def _require_ranks_agree(self, spec: FleetSpec, top_k: int, sizes: list[int]) -> None:
        """Every EP rank builds this runtime alike, or every rank refuses, naming what
        differs (before the fleet and handle creations pair up)."""
        shape = (spec.algorithm.value, spec.num_experts, spec.hidden_size, top_k)
        self._checks.load(
            rank_checks.load_items(
                self._vllm_config,
                shape,
                spec.effective_max_tokens_per_rank,
                spec.fault_tolerance,
                sizes,
            )
        )

    def open_capture_phase(self) -> None:
        """vLLM opens its outermost graph capture (patches/worker.py): the EP ranks agree
        on the capture plan, then every rank pools the counts it adds."""
        self._checks.open_capture_phase(rt.pool for rt in self._runtimes.values())

    @property
    def backend_name(self) -> str:
        return self.algorithm.backend

    # vLLM (through the prepare/finalize selection patch): one call per MoE layer.
    def make_prepare_finalize(self, moe: Any, quant_config: Any, use_monolithic: bool = False):
        """Our prepare/finalize for a vLLM FusedMoEConfig, over the shared runtime."""
        flag = f"--all2all-backend {self.backend_name}"
        if use_monolithic:
            raise FlashInferEPConfigError(
                f"{flag} works with modular MoE kernels only; the selected MoE backend is "
                "monolithic. Pass --moe-backend triton."
            )
        from vllm_flashinfer_ep.vllm.receive_quant import refusal

        reason = refusal(quant_config, flag)
        if reason is not None:
            raise FlashInferEPConfigError(reason)
        from vllm_flashinfer_ep.vllm.forward_state import agreed_token_count
        from vllm_flashinfer_ep.vllm.prepare_finalize import PREPARE_FINALIZE
        from vllm_flashinfer_ep.vllm.round_chunks import RoundSplit

        # one round's tokens: the step's, or fewer where forwards split (round_chunks.py)
        capacity = round_capacity(int(moe.max_num_tokens), self.backend_name)
        split = capacity < moe.max_num_tokens
        if split:  # the capture sizes are final here (config time may not see them)
            why = round_capture_reason(flag, capacity, pool_sizes_from_config(self._vllm_config))
            if why is not None:
                raise FlashInferEPConfigError(why)
        runtime = self.get_handle(
            dict(
                num_experts=moe.num_experts,
                max_num_tokens_per_rank=capacity,
                hidden_size=moe.hidden_dim,
                top_k=moe.experts_per_token,
            )
        )
        cls = PREPARE_FINALIZE[self.algorithm]
        fp8 = self._fp8_dispatch(runtime, moe, quant_config)
        agreement = partial(agreed_token_count, capacity=runtime.capacity)
        if self.algorithm != Algorithm.LOW_LATENCY:
            # HT: ranks far apart in tokens run per-forward handles (forward_state.py).
            agreement = partial(
                agreed_token_count, max_spread=pool_sizes.HT_MAX_PAD, capacity=runtime.capacity
            )
        agreement = self._checks.capture_checked(agreement)
        rounds = None
        if split:
            rounds = RoundSplit(
                runtime.capacity, runtime.world_size, agreed_token_count, runtime.pool.counters
            )
        prepare_finalize = cls(
            runtime, agreement_fn=agreement, fp8_dispatch=fp8, round_split=rounds
        )
        # The runtime's first layer: its first round now if that layer dispatches BF16
        # (FlashInfer's receive buffer; FP8 layers never allocate it), then the memory log.
        runtime.finish_load(first_round=not fp8)
        return prepare_finalize

    def _fp8_dispatch(self, runtime: EPRuntime, moe: Any, quant_config: Any) -> bool:
        """Whether this layer sends FP8 on the wire (runtime/fp8_wire.py), decided at
        model load and agreed by every EP rank (a dispatch is collective: ranks mixing FP8
        and BF16 rows for one layer would corrupt or hang it). Every rank takes part in
        the exchange for every layer, BF16 ones too, and the layer's quantization must
        match (vllm/rank_checks.py). Logged once per reason."""
        from vllm_flashinfer_ep.vllm.receive_quant import fp8_dispatch_reason

        bf16 = quant_config is None or quant_config.quant_dtype is None
        why = None if bf16 else fp8_dispatch_reason(quant_config, int(moe.hidden_dim))
        if why is None and not bf16:
            why = runtime.fp8_wire_reason()
        everyone = self._checks.fp8_wire(quant_config, not bf16 and why is None)
        if bf16:
            return False  # nothing to log
        if why is None and not everyone:
            why = "another EP rank cannot (its log says why)"
        if why is not None and why not in self._logged:  # once per reason, not per layer
            self._logged.add(why)
            logger.info(
                "%s: FP8 layers dispatch BF16 and quantize after receive (%s)",
                self.backend_name,
                why,
            )
        return why is None

    def _pool_sizes(self, capacity: int) -> list[int]:
        """vLLM's capture sizes, plus buckets that cover every eager step up to the fleet
        capacity (runtime/pool_sizes.py), so no forward creates a handle. HT is never
        captured: buckets alone, padding at most HT_MAX_PAD rows."""
        reason = pool_sizes.unavailable_reason()
        if reason is not None:
            logger.info("%s: no persistent handle pool: %s", self.backend_name, reason)
            return []
        return pool_sizes.pool_sizes(
            self.algorithm, capacity, pool_sizes_from_config(self._vllm_config)
        )

    # ------------------------------------------------------ fault tolerance
    def _require_ft(self) -> FaultToleranceAdapter:
        if self._ft is None:
            raise RuntimeError(
                f"{self.backend_name}: fault tolerance is not active (start vLLM with "
                "--enable-fault-tolerance and --all2all-backend flashinfer_ep_low_latency)"
            )
        return self._ft

    def query_active_mask(self) -> torch.Tensor:
        return self._require_ft().query_active_mask()

    def query_fault(self) -> torch.Tensor:
        return self._require_ft().query_fault()

    def clean_buffers(self) -> None:
        self._require_ft().clean_buffers()

    # ------------------------------------------------------------- teardown
    def destroy(self) -> None:
        for runtime in self._runtimes.values():
            runtime.destroy()
        self._runtimes.clear()
        self._fleets.destroy()
        self._ft = None

    @property
    def runtimes(self) -> list[EPRuntime]:
        return list(self._runtimes.values())


class FlashInferEPLowLatencyManager(_FlashInferEPManager):
    algorithm = Algorithm.LOW_LATENCY


class FlashInferEPHighThroughputManager(_FlashInferEPManager):
    algorithm = Algorithm.HIGH_THROUGHPUT


MANAGERS: dict[str, type[_FlashInferEPManager]] = {
    cls.algorithm.backend: cls
    for cls in (FlashInferEPLowLatencyManager, FlashInferEPHighThroughputManager)
}
