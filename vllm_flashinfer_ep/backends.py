"""The NCCL-EP algorithm and the vLLM all2all backend name each one is served under."""

from __future__ import annotations

from enum import Enum

PREFIX = "flashinfer_ep_"


class Algorithm(str, Enum):
    """NCCL-EP algorithm; `.backend` is its `--all2all-backend` name."""

    LOW_LATENCY = "low_latency"
    HIGH_THROUGHPUT = "high_throughput"

    def __str__(self) -> str:
        return self.value

    @property
    def backend(self) -> str:
        return PREFIX + self.value

    @property
    def supports_fault_tolerance(self) -> bool:
        return self is Algorithm.LOW_LATENCY

    @classmethod
    def of(cls, backend: str | None) -> Algorithm | None:
        for algorithm in cls:
            if backend == algorithm.backend:
                return algorithm
        return None


LOW_LATENCY = Algorithm.LOW_LATENCY.backend
HIGH_THROUGHPUT = Algorithm.HIGH_THROUGHPUT.backend
BACKENDS: tuple[str, ...] = tuple(a.backend for a in Algorithm)

HELP = {
    LOW_LATENCY: (
        "FlashInfer NCCL-EP low-latency dispatch/combine (expert-major, batched experts, "
        "CUDA-graph capturable; decode). Needs hidden size in the LL set (rounded up), BF16."
    ),
    HIGH_THROUGHPUT: (
        "FlashInfer NCCL-EP high-throughput dispatch/combine (flat layout, standard experts; "
        "prefill). Not CUDA-graph capturable: CUDA graphs are turned off wherever the all2all runs."
    ),
}


def is_ours(backend: str | None) -> bool:
    return backend in BACKENDS


def supports_fault_tolerance(backend: str | None) -> bool:
    algorithm = Algorithm.of(backend)
    return algorithm is not None and algorithm.supports_fault_tolerance


# vLLM 0.33.0's own `--all2all-backend` names (`ParallelConfig.all2all_backend`'s Literal),
# for callers that must not import vLLM to check a name (the eval CLI: importing vLLM
# makes a process slow to start and to exit). tests/unit/test_gsm8k_configs.py keeps it equal
# to vLLM's.
VLLM_BACKENDS: tuple[str, ...] = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "nixl_ep",
    "allgather_reducescatter",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
)
