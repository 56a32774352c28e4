"""A step of a 128x128 block-FP8 model: BF16 on the wire (then vLLM's group quantization
of what arrived) vs FP8 on the wire, side by side in one process, with the bytes each
dispatch moves. `--backend ll` (default): the LL decode step, FP8 by NCCL-EP's DS_FP8E3M4
dispatch; `--backend ht`: the HT prefill step, FP8 by vLLM's group quantization before
NCCL-EP's forward recipe (runtime/fp8_wire.py).

Both modes run the package's round on the same pooled handles and inputs, with a BF16
stand-in for the experts' output (the combine is BF16 in both); what differs is exactly
what an FP8 layer's prepare does. Modes, median ms per step of `--layers` layers:
  bf16_quant, fp8_wire              LL only: captured in CUDA graphs (decode as served)
  bf16_quant_eager, fp8_wire_eager  eager (LL: steps above the capture sizes; HT: always)
Before timing, the FP8 wire's received rows are checked against the BF16 path's
quantized rows (order-free: NCCL-EP promises no row order).

  torchrun --nproc-per-node N -m vllm_flashinfer_ep.bench.fp8_run --hidden 7168
  torchrun --nproc-per-node N -m vllm_flashinfer_ep.bench.fp8_run --backend ht --tokens 256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from vllm_flashinfer_ep.bench.fp8_modes import modes
from vllm_flashinfer_ep.bench.results import Row
from vllm_flashinfer_ep.bench.run import run_harness, standalone
from vllm_flashinfer_ep.runtime.fp8_wire import bytes_per_row, hidden_reason
from vllm_flashinfer_ep.runtime.limits import SUPPORTED_HIDDEN_SIZES

COMMAND = "bench-fp8"
MODULE = "vllm_flashinfer_ep.bench.fp8_run"
DEFAULT_TOKENS = {"ll": [1, 8, 32, 128, 256], "ht": [256, 1024, 4096]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=("ll", "ht"),
        default="ll",
        help="ll: the LL decode step (DS_FP8E3M4 dispatch); ht: the HT step (forward recipe)",
    )
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--experts", dest="num_experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument(
        "--hidden", type=int, default=7168, help="a multiple of 512 (the recipe's rule)"
    )
    parser.add_argument(
        "--tokens",
        type=lambda s: [int(v) for v in s.split(",")],
        default=None,
        help="comma-separated tokens per rank per step (default: LL 1,8,32,128,256; HT 256,1024,4096)",
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--no-progress", action="store_true")


def validate_arguments(args: argparse.Namespace) -> None:
    """Fills --tokens' per-backend default; refuses what the backend's FP8 dispatch cannot do."""
    if args.tokens is None:
        args.tokens = list(DEFAULT_TOKENS[args.backend])
    reason = hidden_reason(args.hidden)
    if reason is None and args.backend == "ll" and args.hidden not in SUPPORTED_HIDDEN_SIZES:
        reason = f"hidden size {args.hidden} is not an NCCL-EP LL size {SUPPORTED_HIDDEN_SIZES}"
    if reason is not None:
        raise SystemExit(f"bench-fp8: {reason}; pass --hidden 2048, 4096 or 7168")
    if args.layers < 1 or any(t < 1 for t in args.tokens) or args.steps < 1:
        raise SystemExit("bench-fp8: --layers, --tokens and --steps must be positive")


def dispatch_bytes(
    num_tokens: int, top_k: int, hidden: int, ht_world: int | None = None
) -> dict[str, int]:
    """Bytes of activations and scales one rank's dispatch moves. LL: each token goes once
    to each of its top_k experts. HT (`ht_world`: the EP world size): once to each rank
    that holds one of its experts, so at most min(top_k, world) rows per token."""
    rows = num_tokens * (top_k if ht_world is None else min(top_k, ht_world))
    return {"bf16": rows * bytes_per_row(hidden, False), "fp8": rows * bytes_per_row(hidden, True)}


def _bytes(num_tokens: int, args: Any, world_size: int) -> dict[str, int]:
    return dispatch_bytes(
        num_tokens, args.top_k, args.hidden, world_size if args.backend == "ht" else None
    )


def format_table(rows: list[Row], args: Any, world_size: int) -> str:
    step = "HT step" if args.backend == "ht" else "LL decode step"
    head = (
        f"block-FP8 {step}: {args.layers} layers, {args.num_experts} experts, top_k "
        f"{args.top_k}, hidden {args.hidden}, EP world {world_size}; median (min-max) ms per step "
        f"over {args.steps} steps; bytes one rank's dispatch moves"
        + (" (at most: one row per destination rank)" if args.backend == "ht" else "")
    )
    names = modes(args.backend)
    graphs = "fp8_wire" in names
    cols = [
        "T",
        *names,
        *(["fp8_wire/bf16_quant"] if graphs else []),
        "eager fp8/bf16",
        "dispatch KB bf16 / fp8",
    ]
    lines = [head, " | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        b = _bytes(r.num_tokens, args, world_size)
        cells = [str(r.num_tokens)]
        cells += [f"{r.median_ms[m]:.3f} ({r.min_ms[m]:.3f}-{r.max_ms[m]:.3f})" for m in names]
        if graphs:
            cells.append(f"{r.ratio('fp8_wire', 'bf16_quant'):.3f}")
        cells.append(f"{r.ratio('fp8_wire_eager', 'bf16_quant_eager'):.3f}")
        cells.append(f"{b['bf16'] / 1024:.1f} / {b['fp8'] / 1024:.1f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    validate_arguments(args)

    def make_harness():
        from vllm_flashinfer_ep.bench.fp8_harness import Fp8Harness

        return Fp8Harness(args)

    def report(harness, rows) -> None:
        print(format_table(rows, args, harness.world_size))
        if args.json_path:
            payload = {
                "config": {k: v for k, v in vars(args).items() if k not in ("func", "json_path")},
                "world_size": harness.world_size,
                "rows": [
                    {**asdict(r), "dispatch_bytes": _bytes(r.num_tokens, args, harness.world_size)}
                    for r in rows
                ],
            }
            with open(args.json_path, "w", encoding="utf-8") as fh:
                json.dump(payload, fh, indent=2)

    return run_harness(make_harness, report, COMMAND, MODULE)


def cli() -> int:
    return standalone(MODULE, __doc__, add_arguments, main, raw=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
