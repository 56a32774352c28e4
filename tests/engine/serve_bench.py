"""`vllm serve` under load, measured with vLLM's own `vllm bench serve` (EP world 1).

    python tests/engine/serve_bench.py --config ll|no_ep --out serve_ll.json [--shape ...]
    python tests/engine/serve_bench.py --table serve_no_ep.json serve_ll.json

One configuration per invocation (an engine start at the 30B shape and four load levels fit
one 600 s device call): the server runs vLLM's real multi-process layout through the
world-1 harness (tests/engine/world1_harness.py, loaded by entry point in every process),
with the same compilation settings as tests/engine/bench_engine.py (FULL_DECODE_ONLY
graphs, no torch.compile). `ll` serves with --all2all-backend flashinfer_ep_low_latency,
`no_ep` without expert parallelism. For each concurrency, `vllm bench serve` sends the
random dataset (fixed input and output lengths, --ignore-eos) and saves vLLM's result
JSON; this script keeps output tok/s, TTFT and TPOT medians and p99, and the request
counts. It fails when a request failed, or when the server log shows a handle created
after load (a per-forward handle or a refusal in capture).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_process  # noqa: E402
from bench_engine import COMPILATION, LL  # noqa: E402 - the engine benchmark's settings
from engine_models import QWEN3_30B_A3B, write_config_only, write_tiny_model  # noqa: E402
from engine_runner import engine_env, write_plugin_dist  # noqa: E402

from tests.helpers import free_port  # noqa: E402

# requests per concurrency: a few hundred where a step is short enough to afford them
PROMPTS = {1: 64, 8: 256, 32: 384, 128: 512}
KEYS = (
    "completed",
    "failed",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def serve_command(config: str, model: str, port: int, shape: str, tokens: int) -> list[str]:
    """Both configurations get the same step budget (`tokens`): under LL vLLM's default is
    the batched-DP 256 and without EP 8192 on this GPU, which would make LL over no-EP a
    comparison of prefill chunking, not of the transport."""
    args = [
        "--served-model-name",
        "moe",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        str(tokens),
        "--compilation-config",
        json.dumps(COMPILATION),
        "--gpu-memory-utilization",
        "0.85" if shape != "tiny" else "0.4",
    ]
    if shape != "tiny":
        args += ["--load-format", "dummy"]
    if config == "ll":
        args += ["--enable-expert-parallel", "--all2all-backend", LL]
    return serve_process.serve_command(model, port, *args)


def bench_command(model: str, port: int, concurrency: int, prompts: int, args, out: Path):
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        "moe",
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]


def keep(result: dict) -> dict:
    """The figures the table shows, from vLLM's result JSON."""
    return {k: result.get(k) for k in KEYS} | {"num_prompts": result.get("num_prompts")}


def problems(rows: dict[str, dict], log_text: str) -> list[str]:
    """Why this run does not count: failed requests, or rounds off the handles of load."""
    found = [
        f"concurrency {c}: {r['failed']} of {r['num_prompts']} requests failed"
        for c, r in rows.items()
        if r.get("failed") or r.get("completed") != r.get("num_prompts")
    ]
    found += [f"server log: {line}" for line in serve_process.off_the_pool(log_text)]
    return found


def run(args) -> int:
    """Serve one configuration and drive it at each concurrency; scratch removed after."""
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:  # a tiny model is 0.5 GB
        return _run(args, Path(tmp))


def _run(args, work: Path) -> int:
    if args.shape == "tiny":
        model = write_tiny_model(work / "tiny-h2048", 2048)
    else:
        model = write_config_only(work / "qwen3-30b-a3b-shape", QWEN3_30B_A3B)
    plugin = write_plugin_dist(work / "plugin")
    env = engine_env(plugin, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    port = args.port or free_port()
    log_path = Path(args.log or work / f"serve-{args.config}.log")
    rows: dict[str, dict] = {}
    started = time.monotonic()
    command = serve_command(args.config, model, port, args.shape, args.max_num_batched_tokens)
    deadline = started + args.deadline_s
    try:
        with serve_process.served(command, env, log_path, port, args.startup_s) as server:
            print(f"{args.config}: server up in {time.monotonic() - started:.0f} s", flush=True)
            for c in args.concurrency:
                out = work / f"bench-{args.config}-c{c}.json"
                left = deadline - time.monotonic()
                try:  # the client with the caller's environment (vLLM's path), not the harness
                    done = subprocess.run(
                        bench_command(model, port, c, PROMPTS.get(c, 4 * c), args, out),
                        env=dict(os.environ),
                        check=False,
                        timeout=max(left, 1),
                    )
                except subprocess.TimeoutExpired:
                    print(f"PROBLEM concurrency {c} not done by --deadline-s {args.deadline_s}")
                    return 1
                if server.poll() is not None:
                    print(f"PROBLEM the server exited during concurrency {c}")
                    return 1
                if done.returncode != 0 or not out.exists():
                    code = done.returncode
                    print(f"PROBLEM vllm bench serve failed at concurrency {c} (exit {code})")
                    return 1
                rows[str(c)] = keep(json.loads(out.read_text()))
                print(f"{args.config} c={c}: {rows[str(c)]}", flush=True)
                doc = {
                    "config": args.config,
                    "shape": args.shape,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "rows": rows,
                }
                Path(args.out).write_text(json.dumps(doc, indent=1))
    except serve_process.ServerError as exc:
        print(f"PROBLEM {exc}")
        return 1
    bad = problems(rows, log_path.read_text(errors="replace"))
    for line in bad:
        print("PROBLEM", line)
    return 1 if bad else 0


def table(no_ep: dict, ll: dict) -> str:
    """Markdown: each concurrency's figures for both configurations and LL over no-EP."""
    head = (
        "| concurrency | requests | no-EP out tok/s | LL out tok/s | LL / no-EP | "
        "TTFT med / p99 ms (no-EP) | TTFT med / p99 ms (LL) | "
        "TPOT med / p99 ms (no-EP) | TPOT med / p99 ms (LL) |"
    )
    budget = "max_num_batched_tokens"
    lines = [f"--max-num-batched-tokens: no EP {no_ep.get(budget)}, LL {ll.get(budget)}", ""]
    lines += [head, "|" + " --- |" * 9]
    for c in ll["rows"]:
        a, b = no_ep["rows"].get(c), ll["rows"][c]
        if a is None:
            continue
        lines.append(
            f"| {c} | {b['num_prompts']} | {a['output_throughput']:.0f} | "
            f"{b['output_throughput']:.0f} | {b['output_throughput'] / a['output_throughput']:.2f} | "
            f"{a['median_ttft_ms']:.1f} / {a['p99_ttft_ms']:.1f} | "
            f"{b['median_ttft_ms']:.1f} / {b['p99_ttft_ms']:.1f} | "
            f"{a['median_tpot_ms']:.2f} / {a['p99_tpot_ms']:.2f} | "
            f"{b['median_tpot_ms']:.2f} / {b['p99_tpot_ms']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["ll", "no_ep"])
    ap.add_argument("--shape", choices=["tiny", "qwen3-30b-a3b"], default="qwen3-30b-a3b")
    ap.add_argument(
        "--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8, 32, 128]
    )
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="both configurations' step budget (LL's default under DP+EP)",
    )
    ap.add_argument("--startup-s", type=int, default=300)
    ap.add_argument(
        "--deadline-s",
        type=int,
        default=540,
        help="stop (and stop the server) this long after start: one 600 s device call",
    )
    ap.add_argument("--log", help="where the server's log goes (default: a temporary folder)")
    ap.add_argument("--out", help="this configuration's rows as JSON")
    ap.add_argument("--table", nargs=2, metavar=("NO_EP_JSON", "LL_JSON"))
    args = ap.parse_args(argv)
    if args.table:
        no_ep, ll = (json.loads(Path(p).read_text()) for p in args.table)
        print(table(no_ep, ll))
        return 0
    if not args.config or not args.out:
        ap.error("--config and --out are needed (or --table NO_EP_JSON LL_JSON)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
