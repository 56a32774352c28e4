"""HT benchmark results: the modes, one row per token count, the table and the JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from vllm_flashinfer_ep.bench.results import Row

HT_MODES = ("ht", "raw_ht_fresh")
LL_MODE = "ll_pooled"
HT_POOLED_MODE = "ht_pooled"  # opt-in (--ht-pooled): the pooled path a served HT engine runs
HT_TARGET = 1.05  # the target for ht / raw_ht_fresh

RATIOS = (("ht", "raw_ht_fresh"), (LL_MODE, "ht"), (HT_POOLED_MODE, "raw_ht_fresh"))


def modes(with_ll: bool, with_ht_pooled: bool = False) -> tuple[str, ...]:
    return (
        *HT_MODES,
        *((HT_POOLED_MODE,) if with_ht_pooled else ()),
        *((LL_MODE,) if with_ll else ()),
    )


@dataclass
class HtRow(Row):
    @property
    def ratios(self) -> dict[str, float]:
        """The ratio columns whose modes ran, keyed `<numerator>_over_<denominator>`."""
        return {
            f"{a}_over_{b}": self.median_ms[a] / self.median_ms[b]
            for a, b in RATIOS
            if a in self.median_ms and b in self.median_ms
        }


def within_target(rows: list[HtRow]) -> bool:
    return all(r.ratios["ht_over_raw_ht_fresh"] <= HT_TARGET for r in rows)


def format_table(rows: list[HtRow], args: Any, world_size: int, ll_skipped: str | None) -> str:
    ran = [m for m in modes(True, True) if rows and m in rows[0].median_ms]
    ratios = [(a, b) for a, b in RATIOS if a in ran and b in ran]
    head = [
        f"HT prefill step: {args.layers} layers, {args.num_experts} experts, top_k {args.top_k}, "
        f"hidden {args.hidden}, EP world {world_size}, eager, identity experts weighted per "
        f"received row; median (min-max) ms per step over {args.steps} steps",
    ]
    if ll_skipped:
        head.append(f"{LL_MODE} not run: {ll_skipped}")
    cols = ["T", *ran, *(f"{a}/{b}" for a, b in ratios)]
    lines = [*head, "", _md(cols), _md(["---"] * len(cols))]
    for r in rows:
        cells = [str(r.num_tokens)]
        cells += [f"{r.median_ms[m]:.3f} ({r.min_ms[m]:.3f}-{r.max_ms[m]:.3f})" for m in ran]
        cells += [f"{r.median_ms[a] / r.median_ms[b]:.3f}" for a, b in ratios]
        lines.append(_md(cells))
    if rows:
        verdict = "yes" if within_target(rows) else "NO"
        lines += ["", f"ht/raw_ht_fresh within {HT_TARGET}x at every T: {verdict}"]
    return "\n".join(lines)


def write_json(
    rows: list[HtRow], args: Any, world_size: int, ll_skipped: str | None, path: str
) -> None:
    payload = {
        "benchmark": "high_throughput",
        "config": {
            k: v for k, v in vars(args).items() if k not in ("func", "json_path", "plot_path")
        },
        "world_size": world_size,
        "modes": [m for m in modes(True, True) if rows and m in rows[0].median_ms],
        "ll_skipped": ll_skipped,
        "target_ht_over_raw_ht_fresh": HT_TARGET,
        "within_target": within_target(rows) if rows else None,
        "rows": [{**asdict(r), **r.ratios} for r in rows],
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
