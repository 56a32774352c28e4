"""What the current vLLM forward says about token counts across EP ranks."""

from __future__ import annotations

from vllm_flashinfer_ep.runtime.round_plan import LOCAL


def agreed_token_count(
    num_tokens: int, max_spread: int | None = None, capacity: int | None = None
) -> int | str | None:
    """The largest EP rank's MoE token count in vLLM's DP metadata, read alike by every
    rank; LOCAL without it. `max_spread`: a wider spread gives None (fresh handles), so an
    idle HT rank does not pad up to a busy rank's prefill. A rank above the largest count
    raises: falling back alone would mis-pair the collectives."""
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
