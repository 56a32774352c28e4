"""Benchmark results: the modes, one row per token count, the table and the JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("fresh", "pooled", "graph", "raw_fresh", "raw_eager", "raw", "raw_bind", "pooled_fi")

# (numerator, denominator, format) of each ratio column, in table order.
RATIOS: tuple[tuple[str, str, str], ...] = (
    ("pooled", "raw_eager", "{:.3f}"),
    ("pooled_fi", "raw_eager", "{:.3f}"),
    ("fresh", "raw_fresh", "{:.3f}"),
    ("raw_fresh", "graph", "{:.2f}x"),
    ("graph", "raw_bind", "{:.3f}"),
    ("graph", "raw", "{:.3f}"),
    ("fresh", "graph", "{:.2f}x"),
)


@dataclass
class PoolMemory:
    """GPU memory of the fleet buffers and pooled handles (bytes); per-handle figures leave
    out the first handle, which triggers NCCL-EP's lazy fleet buffers."""

    handles: int = 0
    total_device_bytes: int = 0
    total_torch_bytes: int = 0
    avg_handle_device_bytes: float = 0.0
    avg_handle_torch_bytes: float = 0.0
    median_handle_bytes: float = 0.0
    first_handle_bytes: float = 0.0

    @classmethod
    def from_snapshots(
        cls,
        before: tuple[int, int],
        after_first: tuple[int, int],
        after_all: tuple[int, int],
        *,
        handles: int,
        median_handle_bytes: float,
        first_handle_bytes: float,
    ) -> PoolMemory:
        """Snapshots are (torch-allocated, device-wide used) bytes."""

        def avg(i: int) -> float:
            return (after_all[i] - after_first[i]) / (handles - 1) if handles > 1 else 0.0

        return cls(
            handles=handles,
            total_device_bytes=after_all[1] - before[1],
            total_torch_bytes=after_all[0] - before[0],
            avg_handle_device_bytes=avg(1),
            avg_handle_torch_bytes=avg(0),
            median_handle_bytes=float(median_handle_bytes),
            first_handle_bytes=float(first_handle_bytes),
        )

    def describe(self) -> str:
        mb = 1e6
        return (
            f"pool memory (fleet buffers + {self.handles} handles): total {self.total_device_bytes / mb:.1f} MB "
            f"device-wide, {self.total_torch_bytes / mb:.1f} MB torch allocator; per handle: "
            f"avg {self.avg_handle_device_bytes / mb:.3f} MB device-wide / "
            f"{self.avg_handle_torch_bytes / mb:.3f} MB torch ((after all - after 1st) / (handles - 1)), "
            f"median {self.median_handle_bytes / mb:.3f} MB (growth per creation); "
            f"1st handle {self.first_handle_bytes / mb:.1f} MB"
        )


@dataclass
class Row:
    num_tokens: int
    median_ms: dict[str, float] = field(default_factory=dict)
    min_ms: dict[str, float] = field(default_factory=dict)
    max_ms: dict[str, float] = field(default_factory=dict)
    # Median host time to issue one step: where the host-bound eager modes' time goes.
    host_ms: dict[str, float] = field(default_factory=dict)

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.median_ms[numerator] / self.median_ms[denominator]

    @property
    def ratios(self) -> dict[str, float]:
        """Every ratio column, keyed `<numerator>_over_<denominator>`."""
        return {f"{a}_over_{b}": self.ratio(a, b) for a, b, _ in RATIOS}


def format_table(rows: list[Row], args: Any, world_size: int, memory: PoolMemory) -> str:
    head = (
        f"decode step: {args.layers} layers, {args.num_experts} experts, top_k {args.top_k}, "
        f"hidden {args.hidden}, EP world {world_size}, {'expert scale' if args.expert_compute else 'transport only'}; "
        f"median (min-max) ms per step over {args.steps} steps\n{memory.describe()}"
    )
    cols = ["T", *MODES, *(f"{a}/{b}" for a, b, _ in RATIOS)]
    lines = [head, " | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        cells = [str(r.num_tokens)]
        for m in MODES:
            cells.append(f"{r.median_ms[m]:.3f} ({r.min_ms[m]:.3f}-{r.max_ms[m]:.3f})")
        cells += [fmt.format(r.ratio(a, b)) for a, b, fmt in RATIOS]
        lines.append(" | ".join(cells))
    eager = [
        m
        for m in ("pooled", "pooled_fi", "raw_eager", "fresh", "raw_fresh")
        if rows and m in rows[0].host_ms
    ]
    if eager:
        lines += [
            "",
            "host time to issue one step, median ms (eager modes; per layer: / layers)",
            " | ".join(["T", *eager]),
            " | ".join("---" for _ in range(len(eager) + 1)),
        ]
        lines += [
            " | ".join([str(r.num_tokens), *(f"{r.host_ms[m]:.3f}" for m in eager)]) for r in rows
        ]
    return "\n".join(lines)


def write_json(rows: list[Row], args: Any, world_size: int, memory: PoolMemory, path: str) -> None:
    payload = {
        "config": {
            k: v for k, v in vars(args).items() if k not in ("func", "json_path", "plot_path")
        },
        "world_size": world_size,
        "memory": asdict(memory),
        "rows": [{**asdict(r), **r.ratios} for r in rows],
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)


def summarize(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples), min(samples), max(samples)
