"""What the current vLLM forward says about token counts across EP ranks."""

from __future__ import annotations


def tokens_uniform_across_ranks() -> bool:
    """True when every DP rank runs the same MoE token count in this forward.

    vLLM pads DP ranks to one count whenever it runs a CUDA graph (and in eager
    steps it agreed to pad); in other eager steps counts differ per rank. Outside a
    vLLM forward (kernel tests, benchmarks) the caller drives all ranks identically.
    """
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # pragma: no cover - vLLM layout changed
        return True
    if not is_forward_context_available():
        return True
    dp_metadata = getattr(get_forward_context(), "dp_metadata", None)
    if dp_metadata is None:
        return True
    sizes = dp_metadata.local_sizes
    if sizes is None:
        sizes = dp_metadata.num_tokens_across_dp_cpu.tolist()
    return len(set(int(s) for s in sizes)) <= 1
