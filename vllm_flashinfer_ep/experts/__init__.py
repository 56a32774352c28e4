"""The experts wing: vLLM modular experts classes that compute only the received rows.

`for_low_latency` is what the patch table's `experts_selection` row calls when vLLM builds
an LL MoE kernel. No vLLM import at package import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vllm_flashinfer_ep.log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class ExpertsOptions:
    """What a user (package variables) or a benchmark sets for the LL experts."""

    # DeepGEMM layers: forwards of at most this many rows per expert run the received rows
    # (0: DeepGEMM for every forward; inf: the received rows for every forward).
    deep_gemm_received_rows: float = 4.0

    @classmethod
    def from_env(cls) -> ExpertsOptions:
        from vllm_flashinfer_ep import envs

        return cls(deep_gemm_received_rows=envs.deep_gemm_received_rows())


def replacements() -> dict[type, type]:
    """vLLM's batched experts classes, each with the class that runs in its place under LL."""
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts

    from vllm_flashinfer_ep.experts.deep_gemm import ReceivedRowsOrDeepGemmExperts
    from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts

    return {
        BatchedTritonExperts: ReceivedRowsExperts,
        BatchedDeepGemmExperts: ReceivedRowsOrDeepGemmExperts,
    }


def for_low_latency(
    experts: Any, *, fp8_wire: bool, sent_per_rank: Any, options: ExpertsOptions
) -> Any:
    """The experts an LL kernel runs in place of vLLM's pick `experts`, built with the same
    arguments. `fp8_wire`: FP8 activations arrive from the wire (else the received rows
    quantize BF16). FP8 layers need a replaced class; BF16 layers keep any other."""
    from vllm_flashinfer_ep.errors import FlashInferEPConfigError

    qc = experts.quant_config
    fp8 = qc is not None and qc.quant_dtype is not None
    table = replacements()
    if type(experts) in table.values():  # already this wing's (a kernel built again)
        return experts
    cls = table.get(type(experts))
    if cls is None:
        if fp8:
            raise FlashInferEPConfigError(
                "flashinfer_ep_low_latency runs FP8 MoE layers with vLLM's batched Triton or "
                f"DeepGEMM experts; the selected experts are {type(experts).__name__}. Pass "
                "--moe-backend triton."
            )
        _log_kept(type(experts).__name__)
        return experts
    built = cls.in_place_of(
        experts, fp8_wire=fp8_wire, sent_per_rank=sent_per_rank, options=options
    )
    detail = "the rows that arrived only, not every expert's whole buffer"
    if hasattr(built, "received_rows_up_to"):
        from vllm_flashinfer_ep.vllm.fp8_experts_choice import small_forwards_note

        detail = small_forwards_note(built.received_rows_up_to)
    _log_replacement(type(experts).__name__, cls.__name__, detail)
    return built


@functools.cache
def _log_kept(theirs: str) -> None:
    """Once per process: LL layers whose weights the wing has no class for (MXFP4's
    BatchedMarlinExperts) run vLLM's pick."""
    logger.info(
        "flashinfer_ep_low_latency: MoE layers run vLLM's %s (vLLM's choice for their "
        "weights; the received-rows experts cover BF16 and FP8)",
        theirs,
    )


@functools.cache
def _log_replacement(theirs: str, ours: str, detail: str) -> None:
    """Once per process and case: which experts LL layers run, and why."""
    logger.info(
        "flashinfer_ep_low_latency: MoE layers run %s in place of vLLM's %s (%s)",
        ours,
        theirs,
        detail.rstrip("."),
    )
