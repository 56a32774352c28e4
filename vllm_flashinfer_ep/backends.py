"""The two all2all backend names this package adds to vLLM, and what each supports."""

from __future__ import annotations

LOW_LATENCY = "flashinfer_ep_low_latency"
HIGH_THROUGHPUT = "flashinfer_ep_high_throughput"
BACKENDS: tuple[str, ...] = (LOW_LATENCY, HIGH_THROUGHPUT)

HELP = {
    LOW_LATENCY: (
        "FlashInfer NCCL-EP low-latency dispatch/combine (expert-major, batched experts, "
        "CUDA-graph capturable; decode). Needs hidden size in the LL set (rounded up), BF16."
    ),
    HIGH_THROUGHPUT: (
        "FlashInfer NCCL-EP high-throughput dispatch/combine (flat layout, standard experts; "
        "prefill). Not CUDA-graph capturable: CUDA graphs are turned off when dp > 1."
    ),
}


def is_ours(backend: str | None) -> bool:
    return backend in BACKENDS


def supports_fault_tolerance(backend: str | None) -> bool:
    """NCCL-EP fault tolerance exists for the low-latency algorithm only."""
    return backend == LOW_LATENCY
