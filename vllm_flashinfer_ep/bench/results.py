"""Benchmark results: the modes, one row per token count, the table and the JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("fresh", "pooled", "graph", "raw", "raw_bind")


@dataclass
class Row:
    num_tokens: int
    median_ms: dict[str, float] = field(default_factory=dict)
    min_ms: dict[str, float] = field(default_factory=dict)
    max_ms: dict[str, float] = field(default_factory=dict)
    pool_bytes_per_size: float = 0.0
    first_handle_bytes: float = 0.0

    @property
    def fresh_over_graph(self) -> float:
        return self.median_ms["fresh"] / self.median_ms["graph"]

    @property
    def graph_over_raw(self) -> float:
        return self.median_ms["graph"] / self.median_ms["raw"]

    @property
    def graph_over_raw_bind(self) -> float:
        return self.median_ms["graph"] / self.median_ms["raw_bind"]


def format_table(rows: list[Row], args: Any, world_size: int) -> str:
    head = (
        f"decode step: {args.layers} layers, {args.num_experts} experts, top_k {args.top_k}, "
        f"hidden {args.hidden}, EP world {world_size}, {'expert scale' if args.expert_compute else 'transport only'}; "
        f"median (min-max) ms per step over {args.steps} steps"
    )
    cols = ["T"] + list(MODES) + ["fresh/graph", "graph/raw", "graph/raw_bind", "pool MB/size", "1st handle MB"]
    lines = [head, " | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        cells = [str(r.num_tokens)]
        for m in MODES:
            cells.append(f"{r.median_ms[m]:.3f} ({r.min_ms[m]:.3f}-{r.max_ms[m]:.3f})")
        cells += [
            f"{r.fresh_over_graph:.2f}x",
            f"{r.graph_over_raw:.3f}",
            f"{r.graph_over_raw_bind:.3f}",
            f"{r.pool_bytes_per_size / 1e6:.3f}",
            f"{r.first_handle_bytes / 1e6:.1f}",
        ]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def write_json(rows: list[Row], args: Any, world_size: int, path: str) -> None:
    payload = {
        "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
        "world_size": world_size,
        "rows": [
            {
                **asdict(r),
                "fresh_over_graph": r.fresh_over_graph,
                "graph_over_raw": r.graph_over_raw,
                "graph_over_raw_bind": r.graph_over_raw_bind,
            }
            for r in rows
        ],
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)


def summarize(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples), min(samples), max(samples)
