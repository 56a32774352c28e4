"""PNG plot of benchmark medians per mode (log-scale time vs token count)."""

from __future__ import annotations

from typing import Any


def plot(rows: list[Any], args: Any, world_size: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_flashinfer_ep.bench.results import MODES

    tokens = [r.num_tokens for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in MODES:
        ax.plot(tokens, [r.median_ms[mode] for r in rows], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(f"ms per decode step ({args.layers} MoE layers)")
    ax.set_title(
        f"flashinfer_ep LL all2all, EP world {world_size}, hidden {args.hidden}, top_k {args.top_k}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
