"""Which CUDA-graph modes each flashinfer_ep backend allows, and why.

One table, read once per engine config. The decision is logged once with its reason
and applied in every compilation mode (vLLM's own DeepEP-HT gate only runs under
VLLM_COMPILE). It only matters when the all2all runs at all (dp > 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_flashinfer_ep import backends
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import handle_pool

logger = get_logger(__name__)

KEEP = "keep"  # keep whatever mode vLLM chose
NONE = "NONE"


@dataclass(frozen=True)
class Policy:
    allowed: str  # KEEP or NONE
    reason: str
    needs_handle_pool: bool = False


POLICY: dict[str, Policy] = {
    backends.LOW_LATENCY: Policy(
        allowed=KEEP,
        reason=(
            "persistent NCCL-EP handles are created at warmup and updated inside each "
            "captured forward"
        ),
        needs_handle_pool=True,
    ),
    backends.HIGH_THROUGHPUT: Policy(
        allowed=NONE,
        reason=(
            "high-throughput dispatch reads the received-token count on the host, a "
            "synchronization CUDA graphs cannot capture"
        ),
    ),
}


@dataclass(frozen=True)
class Decision:
    backend: str
    mode_before: str
    mode_after: str
    reason: str

    @property
    def changed(self) -> bool:
        return self.mode_before != self.mode_after


LAST_DECISION: Decision | None = None


def decide(backend: str, current_mode: str) -> Decision:
    policy = POLICY[backend]
    if policy.allowed == KEEP:
        missing = handle_pool.unavailable_reason() if policy.needs_handle_pool else None
        if missing is None:
            return Decision(backend, current_mode, current_mode, policy.reason)
        return Decision(backend, current_mode, NONE, missing)
    return Decision(backend, current_mode, NONE, policy.reason)


def apply(compilation_config, backend: str, data_parallel_size: int) -> Decision | None:
    """Apply the policy to a vLLM CompilationConfig (in place). Returns the decision."""
    global LAST_DECISION
    if not backends.is_ours(backend) or data_parallel_size <= 1:
        return None
    from vllm.config import CUDAGraphMode

    current = compilation_config.cudagraph_mode
    current_name = current.name if current is not None else NONE
    decision = decide(backend, current_name)
    if decision.mode_after == NONE and current is not None and current != CUDAGraphMode.NONE:
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    if decision.changed:
        logger.warning(
            "%s: CUDA graphs turned off (cudagraph_mode %s -> NONE): %s.",
            backend,
            decision.mode_before,
            decision.reason,
        )
    else:
        logger.info(
            "%s: cudagraph_mode %s kept: %s.", backend, decision.mode_after, decision.reason
        )
    LAST_DECISION = decision
    return decision
