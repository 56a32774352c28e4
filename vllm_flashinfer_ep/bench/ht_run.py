"""Prefill-step all2all cost of the high-throughput (HT) backend vs raw FlashInfer.

For each token count T (tokens per rank), one "step" runs L MoE layers of NCCL-EP HT
dispatch + combine, eagerly (HT reads the received-row count on the host, so it cannot
be captured). The "experts" are the identity weighted by each received row's sum of
routing weights (what vLLM's weight-and-reduce writes for identity experts), so at any
EP world size every token comes back as itself. Modes, interleaved in one process:
  ht           - the package's HT round (runtime/rounds.py HighThroughputRound, what the
                 vLLM prepare/finalize drives): dispatch, host read of the received
                 count, global ids, reduced rows into `combine_buffer`, combine; a
                 fresh handle per layer: the served HT path only where no pooled size
                 fits (VLLM_FLASHINFER_EP_HANDLE_POOL=0, or DP ranks' counts more than
                 HT_MAX_PAD apart)
  raw_ht_fresh - FlashInfer alone, its own per-forward path: per layer a handle created
                 with the layer's routing (weights and received-count knobs), dispatch,
                 the same expert op on the received rows, combine, destroy
  ll_pooled    - (unless --no-ll) the package's LL eager round on its persistent
                 handle pool at the same T, for the LL-vs-HT comparison (needs an LL
                 hidden size and an LL fleet sized for the largest T: large buffers)
  ht_pooled    - (with --ht-pooled) as ht, on pooled HT handles re-targeted with `update`:
                 what a served HT engine runs (its manager pools buckets from 1 to the
                 capacity, at most HT_MAX_PAD = 256 rows apart, and pads a step to the
                 smallest that fits); here one handle per --tokens count, unpadded
All modes must reproduce the input before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_flashinfer_ep.bench.ht_results import format_table, write_json
from vllm_flashinfer_ep.bench.run import run_harness, standalone

COMMAND = "bench-ht"
MODULE = "vllm_flashinfer_ep.bench.ht_run"


def _token_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=8, help="MoE layers per prefill step")
    parser.add_argument(
        "--experts", dest="num_experts", type=int, default=128, help="global experts"
    )
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (any size for HT)")
    parser.add_argument(
        "--tokens",
        type=_token_list,
        default=[512, 1024, 2048, 4096, 8192],
        help="comma-separated tokens per rank per step (NCCL-EP HT: at most 8192)",
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="timed steps per mode and size (>= 50)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--no-ll",
        action="store_true",
        help="skip the ll_pooled mode (its LL fleet is sized for the largest --tokens value)",
    )
    parser.add_argument(
        "--ht-pooled",
        action="store_true",
        help="add the ht_pooled mode: the package's HT round on one pooled HT handle per token count",
    )
    parser.add_argument("--json", dest="json_path", help="write results as JSON here")
    parser.add_argument("--no-progress", action="store_true")


def validate_arguments(args: argparse.Namespace) -> None:
    from vllm_flashinfer_ep.runtime.limits import HT_MAX_TOKENS_PER_RANK, MAX_TOPK_HT

    if args.layers < 1 or args.num_experts < 1 or args.hidden < 1:
        raise SystemExit(f"{COMMAND}: --layers, --experts and --hidden must be positive")
    if not args.tokens or any(t < 1 for t in args.tokens):
        raise SystemExit(f"{COMMAND}: --tokens must be positive")
    too_many = [t for t in args.tokens if t > HT_MAX_TOKENS_PER_RANK]
    if too_many:
        raise SystemExit(
            f"{COMMAND}: --tokens {','.join(map(str, too_many))} exceeds NCCL-EP HT's limit of "
            f"{HT_MAX_TOKENS_PER_RANK} tokens per rank (MAX_SUPPORTED_TOKENS_PER_RANK); pass "
            f"--tokens values <= {HT_MAX_TOKENS_PER_RANK}"
        )
    limit = min(MAX_TOPK_HT, args.num_experts)
    if not 1 <= args.top_k <= limit:
        raise SystemExit(f"{COMMAND}: --top-k must be in [1, {limit}]")
    if args.steps < 50:
        raise SystemExit(f"{COMMAND}: --steps must be >= 50 (medians over fewer steps are noise)")
    if args.warmup < 0:
        raise SystemExit(f"{COMMAND}: --warmup must be >= 0")


def main(args: argparse.Namespace) -> int:
    validate_arguments(args)

    def make_harness():
        from vllm_flashinfer_ep.bench.ht_harness import HtHarness

        return HtHarness(args)

    def report(harness, rows) -> None:
        print(format_table(rows, args, harness.world_size, harness.ll_skipped))
        if args.json_path:
            write_json(rows, args, harness.world_size, harness.ll_skipped, args.json_path)

    return run_harness(make_harness, report, COMMAND, MODULE)


def cli() -> int:
    return standalone(MODULE, __doc__, add_arguments, main)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
