"""What the current vLLM forward says about token counts across EP ranks."""

from __future__ import annotations

from vllm_flashinfer_ep.runtime.round_plan import LOCAL


def agreed_token_count(
    num_tokens: int, max_spread: int | None = None, capacity: int | None = None
) -> int | str | None:
    """The MoE token count every EP rank agrees on for this forward: the largest rank's.

    `max_spread`: when the largest and the smallest rank's counts differ by more, None
    (every rank then runs a per-forward handle of its own size): HT's experts compute
    padded rows, so an idle rank padding up to a busy rank's prefill would do that rank's
    expert work again. Every rank reads the same counts, so every rank decides alike.

    vLLM all-reduces each DP rank's token count every step (`num_tokens_across_dp` in the
    forward context's DP metadata; per-rank chunk sizes in `local_sizes` under sequence
    parallelism), so every rank computes the same maximum and picks the same pooled
    handle. Without DP metadata (a single DP rank, or outside a vLLM forward: kernel
    tests, benchmarks) every EP rank runs the same tokens: LOCAL.

    A rank whose own count exceeds the metadata's largest is an error, not a fallback to
    a per-forward handle: the other ranks would update their pooled handle while this one
    created a new one, and the collectives would pair up wrongly (a hang). Only that rank
    can see it; the others end through NCCL-EP's timeout (docs/fault_tolerance.md).

    `capacity`: a largest count above it is refused here, on every rank alike, before
    any collective (a rank left alone in a dispatch would wait for the others).
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
    counts = [int(s) for s in sizes]
    agreed = max(counts, default=0)
    if agreed < num_tokens:
        from vllm_flashinfer_ep.errors import HandlePoolError

        raise HandlePoolError(
            f"this rank runs {num_tokens} MoE tokens but vLLM's DP metadata for the forward "
            f"says the largest rank runs {agreed} ({list(sizes)}); the EP ranks cannot agree "
            "on a handle. Please report this with the vLLM command line."
        )
    if capacity is not None and agreed > capacity:
        from vllm_flashinfer_ep.runtime.round_plan import LARGEST_RANK, over_capacity

        raise over_capacity(agreed, capacity, LARGEST_RANK)
    if max_spread is not None and counts and agreed - min(counts) > max_spread:
        return None
    return agreed
