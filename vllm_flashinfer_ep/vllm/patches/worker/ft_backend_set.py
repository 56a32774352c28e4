"""Let vLLM's fault-tolerance sentinel accept the low-latency backend.

Patches: `FT_BACKEND_SET` in vllm/v1/worker/sentinel/gpu_worker_sentinel.py (l.26),
read as a module global by `WorkerSentinel.__init__` (l.40-45), which raises for
backends outside it. Plugins load in the worker before `Worker.__init__`, so
rebinding the global is enough. High throughput stays out: NCCL-EP has no FT for it.
"""

from __future__ import annotations

from vllm_flashinfer_ep.backends import LOW_LATENCY

TARGET = "vllm.v1.worker.sentinel.gpu_worker_sentinel.FT_BACKEND_SET"


def is_applied() -> bool:
    import vllm.v1.worker.sentinel.gpu_worker_sentinel as sentinel

    return LOW_LATENCY in sentinel.FT_BACKEND_SET


def apply() -> None:
    import vllm.v1.worker.sentinel.gpu_worker_sentinel as sentinel

    if is_applied():
        return
    sentinel.FT_BACKEND_SET = frozenset(sentinel.FT_BACKEND_SET | {LOW_LATENCY})
