"""Which CUDA-graph mode each flashinfer_ep backend allows, and why: one function, called
for every engine config (patched `set_splitting_ops_for_v1`) in every compilation mode.
vLLM passes that hook only the DP size, so `for_engine` says whether the all2all runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import pool_sizes

logger = get_logger(__name__)

KEEP_REASON = (
    "persistent NCCL-EP handles are created at warmup and updated inside each captured forward"
)
HT_REASON = (
    "high-throughput dispatch reads the received-token count on the host, a "
    "synchronization CUDA graphs cannot capture; every step, decodes included, runs "
    "without graphs (for traffic that decodes, --all2all-backend flashinfer_ep_low_latency)"
)


@dataclass(frozen=True)
class Decision:
    backend: str
    mode_before: str
    mode_after: str
    reason: str

    @property
    def changed(self) -> bool:
        return self.mode_before != self.mode_after


LAST_DECISION: Decision | None = None  # for tests and logs of the last engine config

# Whether the engine config being built runs the all2all (None: no engine config named).
_ALL2ALL_RUNS: ContextVar[bool | None] = ContextVar("flashinfer_ep_all2all_runs", default=None)


@contextlib.contextmanager
def for_engine(vllm_config) -> Iterator[None]:
    """While `vllm_config` is built: the all2all runs where vLLM says it does."""
    model, par = vllm_config.model_config, vllm_config.parallel_config
    runs = bool(par.use_all2all and par.enable_expert_parallel) and (model is None or model.is_moe)
    token = _ALL2ALL_RUNS.set(runs)
    try:
        yield
    finally:
        _ALL2ALL_RUNS.reset(token)


def apply(compilation_config, backend: str, data_parallel_size: int) -> Decision | None:
    """Turn CUDA graphs off (in place) where `backend` cannot capture; None if not ours."""
    global LAST_DECISION
    algorithm = Algorithm.of(backend)
    runs = _ALL2ALL_RUNS.get()
    if runs is None:  # outside an engine config: vLLM's effective data-parallel size
        runs = data_parallel_size > 1
    if algorithm is None or not runs:
        return None
    from vllm.config import CUDAGraphMode

    current = compilation_config.cudagraph_mode
    before = current.name if current is not None else CUDAGraphMode.NONE.name
    off = HT_REASON if algorithm is Algorithm.HIGH_THROUGHPUT else pool_sizes.unavailable_reason()
    if off is None:
        decision = Decision(backend, before, before, KEEP_REASON)
    else:
        if current is not None:
            compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        decision = Decision(backend, before, CUDAGraphMode.NONE.name, off)
    if decision.changed:
        logger.warning(
            "%s: CUDA graphs turned off (cudagraph_mode %s -> NONE): %s.", backend, before, off
        )
    else:
        logger.info("%s: cudagraph_mode %s kept: %s.", backend, before, decision.reason)
    LAST_DECISION = decision
    return decision
