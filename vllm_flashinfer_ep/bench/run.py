"""Decode-step all2all cost: per-forward handles vs the persistent pool, eager and graphed.

For each token count T, one "step" runs L MoE layers of transport (dispatch + combine,
optionally a trivial expert op on the valid rows) through the package's own round code
(runtime/rounds.py, what the vLLM prepare/finalize calls), in modes interleaved in
one process:
  fresh  - a fresh FlashInfer handle per layer per step, eager (today's design)
  pooled - the persistent handle pool, eager (direct nccl.ep calls, runtime/native_handle.py)
  pooled_fi - as pooled, through FlashInfer's handle methods (VLLM_FLASHINFER_EP_NATIVE_EAGER=0)
  graph  - the persistent handle pool, the whole step captured in one CUDA graph
  raw    - FlashInfer alone: one persistent handle, each layer copies its routing into
           static buffers, update + dispatch + combine, captured (no package code)
  raw_bind - as raw, but `update` binds each layer's own topk_ids tensor (weights
           still copied, they are bound at handle creation)
  raw_eager - raw_bind run eagerly (not captured): the floor for pooled
  raw_fresh - FlashInfer alone, a fresh handle per layer per step, eager (FlashInfer's
           own per-forward path): the floor for fresh
All modes must produce the same outputs before anything is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from vllm_flashinfer_ep.bench.results import format_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=48, help="MoE layers per decode step")
    parser.add_argument(
        "--experts", dest="num_experts", type=int, default=128, help="global experts"
    )
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (an NCCL-EP LL size)")
    parser.add_argument(
        "--tokens",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[1, 8, 32, 128, 256],
        help="comma-separated tokens per rank per step",
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="timed steps per mode and size (>= 50)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--expert-compute",
        action="store_true",
        help="scale each expert's valid rows in place (a Triton kernel; default: transport only)",
    )
    parser.add_argument("--json", dest="json_path", help="write results as JSON here")
    parser.add_argument("--plot", dest="plot_path", help="write a PNG plot here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="print a cProfile of the pooled and raw_eager steps at the first token count (stderr)",
    )


def validate_arguments(args: argparse.Namespace) -> None:
    from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_LL, SUPPORTED_HIDDEN_SIZES

    if args.hidden not in SUPPORTED_HIDDEN_SIZES:
        raise SystemExit(
            f"bench: --hidden must be one of {list(SUPPORTED_HIDDEN_SIZES)} (NCCL-EP LL sizes)"
        )
    if not 1 <= args.top_k <= min(MAX_TOPK_LL, args.num_experts):
        raise SystemExit(f"bench: --top-k must be in [1, {min(MAX_TOPK_LL, args.num_experts)}]")
    if args.steps < 50:
        raise SystemExit("bench: --steps must be >= 50 (medians over fewer steps are noise)")
    if args.layers < 1 or any(t < 1 for t in args.tokens):
        raise SystemExit("bench: --layers and --tokens must be positive")


def gpu_refusal(command: str = "bench", module: str = "vllm_flashinfer_ep.bench.run") -> str | None:
    import torch

    if not torch.cuda.is_available():
        return (
            f"{command}: needs a CUDA GPU (sm_90+) with NCCL-EP; none is visible here. Run it on a "
            f"GPU host, e.g. `vllm-flashinfer-ep {command}` (world 1) or "
            f"`torchrun --nproc-per-node N -m {module}` (world N)."
        )
    return None


def refuse_without_gpu(command: str, module: str) -> bool:
    """Without a GPU, print the refusal before anything imports the GPU stack; True then."""
    refusal = gpu_refusal(command, module)
    if refusal:
        print(refusal, file=sys.stderr)
        return True
    return False


def run_harness(
    make_harness: Callable[[], Any],
    report: Callable[[Any, list], None],
    command: str = "bench",
    module: str = "vllm_flashinfer_ep.bench.run",
) -> int:
    """Refuse without a GPU (2), else build, run and close the harness; rank 0 reports."""
    if refuse_without_gpu(command, module):
        return 2
    harness = make_harness()
    try:
        rows = harness.run()
    finally:
        harness.close()
    if harness.rank == 0:
        report(harness, rows)
    return 0


def main(args: argparse.Namespace) -> int:
    validate_arguments(args)

    def make_harness():
        from vllm_flashinfer_ep.bench.harness import Harness

        return Harness(args)

    def report(harness, rows) -> None:
        print(format_table(rows, args, harness.world_size, harness.memory))
        if args.json_path:
            write_json(rows, args, harness.world_size, harness.memory, args.json_path)
        if args.plot_path:
            from vllm_flashinfer_ep.bench.plot import plot

            plot(rows, args, harness.world_size, args.plot_path)

    return run_harness(make_harness, report)


def standalone(
    module: str, doc: str | None, add: Callable, run: Callable, raw: bool = False
) -> int:
    """A benchmark as `python -m <module>` (`raw`: its help keeps the docstring's layout)."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else argparse.HelpFormatter
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc, formatter_class=formatter
    )
    add(parser)
    return run(parser.parse_args())


def cli() -> int:
    return standalone("vllm_flashinfer_ep.bench.run", __doc__, add_arguments, main)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
