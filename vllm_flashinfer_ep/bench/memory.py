"""GPU memory of the LL fleet and its handle pool, device-wide, as vLLM would build them.

For each hidden size: a fleet sized for `--capacity` tokens per rank, and a pool of the
sizes a served engine warms (vLLM's default CUDA-graph capture sizes up to the capacity,
plus the eager buckets above them, pool_sizes.bucket_sizes). Memory is read
device-wide (`torch.cuda.mem_get_info`: everything NCCL-EP allocates, natively or
through torch) and in torch's allocator at four points:
  before      no fleet yet
  first       after the first handle: includes NCCL-EP's lazy fleet buffers
  handles     after every handle is created and warmed (one eager update each)
  rounds      after one dispatch + combine on every handle (anything allocated lazily
              at a handle's first round)
Reported: fleet buffers (first - before), all handles (handles - first), average per
further handle ((handles - first) / (N - 1)), round growth (rounds - handles), total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from vllm_flashinfer_ep.bench.run import refuse_without_gpu

# The pool a served engine warms; also what the config-time and doctor estimates count.
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
    fleet_mb: float  # device-wide growth at the first handle (NCCL-EP's fleet buffers)
    handles_mb: float  # device-wide growth from the first handle to the last
    per_handle_mb: float  # handles_mb / (handles - 1)
    rounds_mb: float  # device-wide growth when every handle ran its first round
    total_mb: float  # device-wide, before the fleet to after the rounds
    torch_total_mb: float  # the same in torch's allocator (allocated bytes)
    pool_reported_mb: float  # what HandlePool.memory_bytes says (the engine log's figure)


def measure(
    hidden: int, capacity: int, num_experts: int, top_k: int, sizes: list[int], fleets, device
) -> MemoryRow:
    import torch

    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.bench.reference import random_routing
    from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
    from vllm_flashinfer_ep.runtime.fleet import FleetSpec
    from vllm_flashinfer_ep.runtime.memory import memory_snapshot

    spec = FleetSpec(Algorithm.LOW_LATENCY, num_experts, capacity, hidden)
    before = memory_snapshot(device)
    rt = build_runtime(fleets, spec, top_k, device, [])
    rt.pool.warm(sizes[:1])
    first = memory_snapshot(device)
    rt.pool.warm(sizes)
    handles = memory_snapshot(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x_all = torch.randn(capacity, hidden, device=device, generator=gen).to(torch.bfloat16)
    out_all = torch.empty_like(x_all)
    after_inputs = memory_snapshot(device)  # the round's own inputs are not the pool's
    for size in rt.pool.sizes:
        ids, weights = random_routing(size, num_experts, top_k, device, gen)
        d = rt.round.dispatch(x_all[:size], ids, weights)
        rt.round.combine(d.expert_x, out_all[:size])
    rounds = memory_snapshot(device)
    n = len(rt.pool.sizes)
    dev = 1  # index of the device-wide figure in a snapshot
    row = MemoryRow(
        hidden=hidden,
        capacity=capacity,
        handles=n,
        fleet_mb=(first[dev] - before[dev]) / MB,
        handles_mb=(handles[dev] - first[dev]) / MB,
        per_handle_mb=(handles[dev] - first[dev]) / MB / max(1, n - 1),
        rounds_mb=(rounds[dev] - after_inputs[dev]) / MB,
        total_mb=(rounds[dev] - after_inputs[dev] + handles[dev] - before[dev]) / MB,
        torch_total_mb=(rounds[0] - after_inputs[0] + handles[0] - before[0]) / MB,
        pool_reported_mb=rt.pool.memory_bytes / MB,
    )
    rt.destroy()
    fleets.destroy()
    return row


def format_table(rows: list[MemoryRow], args: argparse.Namespace) -> str:
    head = (
        f"LL fleet + handle pool memory, device-wide (MB): {args.num_experts} experts, top_k "
        f"{args.top_k}, EP world 1; pool = vLLM's default capture sizes <= capacity + eager buckets"
    )
    cols = [
        "hidden",
        "capacity",
        "handles",
        "fleet buffers",
        "all handles",
        "per handle",
        "first rounds",
        "total",
        "torch total",
        "pool log says",
    ]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        vals = [
            r.hidden,
            r.capacity,
            r.handles,
            r.fleet_mb,
            r.handles_mb,
            r.per_handle_mb,
            r.rounds_mb,
            r.total_mb,
            r.torch_total_mb,
            r.pool_reported_mb,
        ]
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


def validate_arguments(args: argparse.Namespace) -> None:
    from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_LL, SUPPORTED_HIDDEN_SIZES

    bad = [h for h in args.hidden if h not in SUPPORTED_HIDDEN_SIZES]
    if bad:
        raise SystemExit(
            f"bench-memory: --hidden {bad} not NCCL-EP LL sizes {list(SUPPORTED_HIDDEN_SIZES)}"
        )
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
    from vllm_flashinfer_ep.bench.harness import torchrun_fleets

    rows = []
    for capacity in args.capacity:
        for hidden in args.hidden:
            fleets, device = torchrun_fleets()
            rows.append(
                measure(
                    hidden,
                    capacity,
                    args.num_experts,
                    args.top_k,
                    served_pool_sizes(capacity),
                    fleets,
                    device,
                )
            )
    print(format_table(rows, args))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "args": {k: v for k, v in vars(args).items() if k not in ("json_path", "func")},
                    "rows": [asdict(r) for r in rows],
                },
                fh,
                indent=2,
            )
    return 0


def cli() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_flashinfer_ep.bench.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(cli())
