"""What the current vLLM forward says about token counts across EP ranks."""

from __future__ import annotations

from vllm_flashinfer_ep.runtime.handle_pool import LOCAL


def agreed_token_count(num_tokens: int) -> int | str | None:
    """The MoE token count every EP rank agrees on for this forward: the largest rank's.

    vLLM all-reduces each DP rank's token count every step (`num_tokens_across_dp` in the
    forward context's DP metadata; per-rank chunk sizes in `local_sizes` under sequence
    parallelism), so every rank computes the same maximum and picks the same pooled
    handle. Without DP metadata (a single DP rank, or outside a vLLM forward: kernel
    tests, benchmarks) every EP rank runs the same tokens: LOCAL. None when this rank's
    count exceeds what the metadata says, i.e. there is no agreement to rely on.
    """
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # pragma: no cover - vLLM layout changed
        return LOCAL
    if not is_forward_context_available():
        return LOCAL
    dp_metadata = getattr(get_forward_context(), "dp_metadata", None)
    if dp_metadata is None:
        return LOCAL
    sizes = dp_metadata.local_sizes
    if sizes is None:
        sizes = dp_metadata.num_tokens_across_dp_cpu.tolist()
    agreed = max((int(s) for s in sizes), default=0)
    return agreed if agreed >= num_tokens else None
