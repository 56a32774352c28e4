"""GPU memory of the LL fleet and its handle pool, device-wide, as vLLM would build them.

For each hidden size and capacity, in a process of its own (NCCL-EP's first fleet of a
process also loads its group and kernels, which a served engine's worker pays once): the
runtime an engine's manager builds (`build_runtime` with the served pool and its first
round at load), then one round on every other pooled size. Memory is read device-wide
(`torch.cuda.mem_get_info`: everything NCCL-EP allocates, natively or through torch) and
in torch's allocator. Reported side by side:
  fleet + 1st handle  growth up to the first handle (NCCL-EP's fleet buffers)
  further handles     growth from the first handle to the last (average per handle too)
  rounds              growth in the first round at load and in the later rounds
  total               everything, device-wide (torch allocator: "torch total")
  log says            what the engine's load log reports (the build, measured device-wide)
  estimate            doctor's and the config check's estimate (runtime/buffer_sizes.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from vllm_flashinfer_ep.bench.run import refuse_without_gpu, standalone

# The pool a served engine warms, as the config-time and doctor estimates count it.
from vllm_flashinfer_ep.runtime.buffer_sizes import (  # noqa: F401
    served_pool_sizes,
    vllm_default_capture_sizes,
)

MB = 1e6


@dataclass
class MemoryRow:
    hidden: int
    capacity: int
    handles: int
    fleet_mb: float  # the columns are the module docstring's, in its order
    handles_mb: float
    per_handle_mb: float  # handles_mb / (handles - 1)
    rounds_mb: float
    total_mb: float
    torch_total_mb: float
    log_mb: float  # EPRuntime.memory_bytes
    estimate_mb: float  # buffer_sizes.ll_memory_bytes


def measure(
    hidden: int, capacity: int, num_experts: int, top_k: int, sizes: list[int], fleets, device
) -> MemoryRow:
    import torch

    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.bench.reference import random_routing
    from vllm_flashinfer_ep.runtime import buffer_sizes
    from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
    from vllm_flashinfer_ep.runtime.fleet import FleetSpec
    from vllm_flashinfer_ep.runtime.memory import memory_snapshot

    spec = FleetSpec(Algorithm.LOW_LATENCY, num_experts, capacity, hidden)
    before = memory_snapshot(device)
    rt = build_runtime(fleets, spec, top_k, device, sizes)
    rt.finish_load(first_round=True)  # as the managers, for a BF16 layer
    built = memory_snapshot(device)
    pool = rt.pool
    warm_before = pool.warm_before or before
    warm_after = pool.warm_after or built
    gen = torch.Generator(device=device).manual_seed(0)
    x_all = torch.randn(capacity, hidden, device=device, generator=gen).to(torch.bfloat16)
    out_all = torch.empty_like(x_all)
    after_inputs = memory_snapshot(device)  # the rounds' own inputs are not the runtime's
    for size in pool.sizes[1:]:  # the smallest ran its round at load
        ids, weights = random_routing(size, num_experts, top_k, device, gen)
        d = rt.round.dispatch(x_all[:size], ids, weights)
        rt.round.combine(d.expert_x, out_all[:size])
    rounds = memory_snapshot(device)
    n = len(pool.sizes)
    dev = 1  # index of the device-wide figure in a snapshot
    fleet = warm_before[dev] - before[dev] + pool.first_handle_bytes
    later = rounds[dev] - after_inputs[dev]
    row = MemoryRow(
        hidden=hidden,
        capacity=capacity,
        handles=n,
        fleet_mb=fleet / MB,
        handles_mb=(warm_after[dev] - before[dev] - fleet) / MB,
        per_handle_mb=(warm_after[dev] - before[dev] - fleet) / MB / max(1, n - 1),
        rounds_mb=(built[dev] - warm_after[dev] + later) / MB,
        total_mb=(built[dev] - before[dev] + later) / MB,
        torch_total_mb=(built[0] - before[0] + rounds[0] - after_inputs[0]) / MB,
        log_mb=rt.memory_bytes / MB,
        estimate_mb=buffer_sizes.ll_memory_bytes(capacity, hidden, num_experts, top_k, n) / MB,
    )
    rt.destroy()
    fleets.destroy()
    return row


def format_table(rows: list[MemoryRow], args: argparse.Namespace) -> str:
    head = (
        f"LL fleet + handle pool memory, device-wide (MB): {args.num_experts} experts, top_k "
        f"{args.top_k}, EP world 1; pool = vLLM's default capture sizes <= capacity + eager buckets"
    )
    cols = ["hidden", "capacity", "handles", "fleet + 1st handle", "further handles"]
    cols += ["per handle", "rounds", "total", "torch total", "log says", "log / total"]
    cols += ["estimate", "estimate / total"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        vals = [r.hidden, r.capacity, r.handles, r.fleet_mb, r.handles_mb, r.per_handle_mb]
        vals += [r.rounds_mb, r.total_mb, r.torch_total_mb, r.log_mb]
        vals += [f"{r.log_mb / r.total_mb:.3f}" if r.total_mb else "-", r.estimate_mb]
        vals += [f"{r.estimate_mb / r.total_mb:.3f}" if r.total_mb else "-"]
        lines.append(
            "| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in vals) + " |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hidden",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[2048, 4096, 7168],
        help="comma-separated hidden sizes (NCCL-EP LL sizes)",
    )
    parser.add_argument(
        "--capacity",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[512],
        help="comma-separated fleet capacities in tokens per rank (--max-num-batched-tokens)",
    )
    parser.add_argument("--experts", dest="num_experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--json", dest="json_path", help="write the rows as JSON here")
    # One row in this process, written to PATH (the parent runs each row in a child).
    parser.add_argument("--one-row", metavar="PATH", help=argparse.SUPPRESS)


def validate_arguments(args: argparse.Namespace) -> None:
    from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_LL, SUPPORTED_HIDDEN_SIZES

    bad = [h for h in args.hidden if h not in SUPPORTED_HIDDEN_SIZES]
    if bad:
        raise SystemExit(
            f"bench-memory: --hidden {bad} not NCCL-EP LL sizes {list(SUPPORTED_HIDDEN_SIZES)}"
        )
    if getattr(args, "one_row", None) and (len(args.hidden) != 1 or len(args.capacity) != 1):
        raise SystemExit("bench-memory: --one-row measures one --hidden and one --capacity")
    if any(c < 1 for c in args.capacity):
        raise SystemExit("bench-memory: --capacity must be positive")
    if not 1 <= args.top_k <= min(MAX_TOPK_LL, args.num_experts):
        raise SystemExit(
            f"bench-memory: --top-k must be in [1, {min(MAX_TOPK_LL, args.num_experts)}]"
        )


def main(args: argparse.Namespace) -> int:
    validate_arguments(args)
    if refuse_without_gpu("bench-memory", "vllm_flashinfer_ep.bench.memory"):
        return 2
    if args.one_row:
        return _measure_one(args)
    rows = []
    for capacity in args.capacity:
        for hidden in args.hidden:
            rows.append(_row_in_own_process(hidden, capacity, args))
    print(format_table(rows, args))
    if args.json_path:
        kept = {k: v for k, v in vars(args).items() if k not in ("json_path", "func", "one_row")}
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump({"args": kept, "rows": [asdict(r) for r in rows]}, fh, indent=2)
    return 0


def _row_in_own_process(hidden: int, capacity: int, args: argparse.Namespace) -> MemoryRow:
    """One row measured by a child process, as an engine worker builds its first fleet."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        command = [sys.executable, "-m", "vllm_flashinfer_ep.bench.memory", "--hidden", str(hidden)]
        command += ["--capacity", str(capacity), "--experts", str(args.num_experts)]
        command += ["--top-k", str(args.top_k), "--one-row", path]
        done = subprocess.run(command, check=False)
        if done.returncode != 0 or not os.path.exists(path):
            raise SystemExit(
                f"bench-memory: measuring hidden {hidden}, capacity {capacity} failed "
                f"(exit status {done.returncode}; its output is above)"
            )
        with open(path, encoding="utf-8") as fh:
            return MemoryRow(**json.load(fh))


def _measure_one(args: argparse.Namespace) -> int:
    from vllm_flashinfer_ep.bench.harness import torchrun_fleets

    (hidden,), (capacity,) = args.hidden, args.capacity
    fleets, device = torchrun_fleets()
    row = measure(
        hidden, capacity, args.num_experts, args.top_k, served_pool_sizes(capacity), fleets, device
    )
    with open(args.one_row, "w", encoding="utf-8") as fh:
        json.dump(asdict(row), fh)
    return 0


def cli() -> int:
    return standalone("vllm_flashinfer_ep.bench.memory", __doc__, add_arguments, main, raw=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
