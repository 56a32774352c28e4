"""`vllm serve` under load, measured with vLLM's own `vllm bench serve` (EP world 1).

    python tests/engine/serve_bench.py --config no_ep|ll|ht --compilation default|decode-only
        --datasets 256x64,2048x256 --out run.json [--model-dir DIR] [--warm-only]
    python tests/engine/serve_bench.py --merge a.json b.json ... [--out all.json]

One configuration per invocation (a 30B-shape server and its load levels fit one 600 s
device call): the server runs vLLM's real multi-process layout through the world-1 harness
(tests/engine/world1_harness.py). `ll` / `ht` serve with --enable-expert-parallel and the
package's backend, `no_ep` without expert parallelism. `--compilation default` passes no
compilation argument at all (vLLM's torch.compile and cudagraph mode); `decode-only` is
bench_engine.py's FULL_DECODE_ONLY graphs without torch.compile. No step budget is passed
unless --max-num-batched-tokens says so: each engine runs with what vLLM and the package
resolve, read back from the worker. For each dataset, one unmeasured wave at its top
concurrency first (JIT builds out of the figures), then for each concurrency `vllm bench
serve` sends the random dataset (fixed lengths, --ignore-eos, a seed of its own per wave);
the row keeps output tok/s, TTFT and TPOT median and p99. After load and after every row
the worker's handle counters are read through vLLM's /collective_rpc
(VLLM_SERVER_DEV_MODE=1, the harness's probe method): a row during which any handle was
created fails, as do a failed request and a wave whose prompts the server's prefix cache
found (/metrics: its prefill would not have run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_process  # noqa: E402
from bench_engine import COMPILATION, LL  # noqa: E402 - the engine benchmark's settings
from engine_models import QWEN3_30B_A3B, write_config_only, write_tiny_model  # noqa: E402
from engine_runner import engine_env, write_plugin_dist  # noqa: E402
from world1_harness import PROBE_METHOD  # noqa: E402

from tests.helpers import free_port  # noqa: E402

HT = "flashinfer_ep_high_throughput"
BACKENDS = {"no_ep": None, "ll": LL, "ll_rounds": LL, "ht": HT}
# A configuration's package variables on top of SERVER_ENV: `ll_rounds` splits MoE forwards
# above 512 tokens into rounds (vllm/round_chunks.py) and takes vLLM's budget without EP.
ROUND_VAR = "VLLM_FLASHINFER_EP_LL_ROUND_TOKENS"
CONFIG_ENV = {"ll_rounds": {ROUND_VAR: "512"}}  # --round-tokens N serves other rounds
CONFIGS = tuple(BACKENDS)  # the table's column order; no_ep is every ratio's reference
COMPILATIONS = ("default", "decode-only")
# input tokens, output tokens, {concurrency: requests}: a few hundred requests where a
# step is short enough to afford them, fewer for the long prompts
DATASETS = {
    "256x64": (256, 64, {1: 64, 8: 256, 32: 384, 128: 512}),
    "2048x256": (2048, 256, {8: 64, 32: 128}),
}
# One length for every dataset and configuration: vLLM's compile-cache key includes it,
# so a warm-up serves every later run of the same configuration.
MAX_MODEL_LEN = 4096
# Every server gets these on top of the harness's environment: the multi-process layout,
# and the /collective_rpc endpoint the counters are read through (127.0.0.1 only).
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1"}
BUDGET_SOURCE = (
    "read from the worker after start (scheduler_config.max_num_batched_tokens, after vLLM's "
    "and the package's config-time changes), through /collective_rpc"
)
KEYS = (
    "completed",
    "failed",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)
# The pool's counters that count a handle's creation (runtime/handle_pool.PoolCounters).
CREATED = ("pooled_created", "fresh_created", "created_during_capture")


def serve_args(
    config: str,
    compilation: str,
    shape: str,
    tokens: int | None = None,
    capture: int | None = None,
) -> list[str]:
    """vLLM's arguments after the model and port. `default` adds no compilation, eager or
    -O argument: what vLLM resolves is read back from the worker, not assumed. `tokens`
    and `capture`: the step budget and largest CUDA graph capture size to pass (None:
    none passed)."""
    if config not in BACKENDS or compilation not in COMPILATIONS:
        raise ValueError(f"unknown configuration {config!r} / compilation {compilation!r}")
    args = ["--served-model-name", "moe", "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--gpu-memory-utilization", "0.85" if shape != "tiny" else "0.4"]
    if shape != "tiny":
        args += ["--load-format", "dummy"]
    if tokens is not None:
        args += ["--max-num-batched-tokens", str(tokens)]
    if capture is not None:
        if compilation != "default":  # decode-only names its own capture sizes
            raise ValueError(f"a capture size with compilation {compilation!r}")
        args += ["--max-cudagraph-capture-size", str(capture)]
    if compilation == "decode-only":
        args += ["--compilation-config", json.dumps(COMPILATION)]
    if BACKENDS[config]:
        args += ["--enable-expert-parallel", "--all2all-backend", BACKENDS[config]]
    return args


def bench_args(
    input_len: int, output_len: int, concurrency: int, prompts: int, seed: int
) -> list[str]:
    """`vllm bench serve`'s load arguments (recorded per dataset). `seed`: the random
    dataset's; with one seed every wave would send the same prompts again, and vLLM's
    prefix cache (on by default) would skip their prefill."""
    return [
        "--seed",
        str(seed),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot",
        "--metric-percentiles",
        "50,99",
    ]


def bench_command(model: str, port: int, load: list[str], out: Path) -> list[str]:
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
        *load,
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


def probe(port: int) -> dict:
    """The worker's probe (engine_run.worker_probe) through vLLM's /collective_rpc."""
    return serve_process.post(port, "/collective_rpc", {"method": PROBE_METHOD}, timeout=60)[
        "results"
    ][0]


def handles(probe_doc: dict) -> dict[str, int]:
    """Handles created so far, summed over the worker's runtimes (none without EP)."""
    runtimes = probe_doc.get("runtimes") or []
    return {k: sum(int(rt["counters"][k]) for rt in runtimes) for k in CREATED}


def created_after_load(at_load: dict, now: dict) -> dict[str, int]:
    """The counters that grew between two probes: a handle made while serving."""
    a, b = handles(at_load), handles(now)
    return {k: b[k] - a[k] for k in CREATED if b[k] != a[k]}


def split_forwards(probe_doc: dict) -> int:
    """MoE layer forwards run as several rounds so far (VLLM_FLASHINFER_EP_LL_ROUND_TOKENS),
    summed over the worker's runtimes."""
    runtimes = probe_doc.get("runtimes") or []
    return sum(int(rt["counters"].get("split_forwards", 0)) for rt in runtimes)


def check_row(row: dict, before: dict, after: dict) -> dict:
    """Mark `row` with the handles created during it (any makes it a failed row) and the
    MoE layer forwards that ran as several rounds during it."""
    grown = created_after_load(before, after)
    row["handles_created"] = grown
    row["split_forwards"] = split_forwards(after) - split_forwards(before)
    if grown:
        row["problem"] = f"handles created after load: {grown}"
    return row


def resolved(probe_doc: dict) -> dict:
    """What the engine runs with, as its worker has it (not as the arguments asked)."""
    keys = ("compilation_mode", "cudagraph_mode", "capture_sizes", "max_num_batched_tokens")
    out = {k: probe_doc.get(k) for k in (*keys, "manager", "kernels", "device")}
    out["pool_sizes"] = [rt["pool_sizes"] for rt in probe_doc.get("runtimes") or []]
    out["handles_at_load"] = handles(probe_doc)
    return out


# vLLM's log lines saying how many tokens its KV cache holds (sized once at start, after
# the weights, activations, CUDA graphs and, with EP, NCCL-EP's buffers), and how full
# its queue runs (the API server's stats, every 10 s): a server whose KV cache or step
# budget cannot admit the load queues requests, and the row shows it only as TTFT.
_KV_GIB = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")  # after "GPU", or another pool
_USAGE = re.compile(
    r"Actual usage is ([\d.]+) GiB for consumed memory \(weights \+ non-torch\), ([\d.]+) "
    r"GiB for peak activation, and ([\d.]+) GiB for CUDAGraph memory"
)
# the package's load line (runtime/ep_runtime.py): the runtime's device-wide growth
_EP_RUNTIME = re.compile(r"runtime \(hidden \d+, \d+ tokens per rank\) loaded: ([\d.]+) GB")
# a stats line: Running, Waiting, then optional parts (Deferred, KV fetch, Preemptions)
_QUEUE = re.compile(r"Running: (\d+) reqs, Waiting: (\d+) reqs, (.*?)KV cache usage: ([\d.]+)%")
_PREEMPTIONS = re.compile(r"Preemptions: (\d+)")


def kv_cache(log_text: str) -> dict:
    """The KV cache each worker sized at start and what took the rest of the memory it may
    use (one entry per worker that logged it; "consumed": weights and memory outside
    torch's allocator, NCCL-EP's buffers among it; "ep_runtime_gb": what each EP runtime
    took, in GB), from its log."""
    usage = _USAGE.findall(log_text)
    return {
        "gib": [float(m) for m in _KV_GIB.findall(log_text)],
        "tokens": [int(m.replace(",", "")) for m in _KV_TOKENS.findall(log_text)],
        "consumed_gib": [float(u[0]) for u in usage],
        "peak_activation_gib": [float(u[1]) for u in usage],
        "cuda_graph_gib": [float(u[2]) for u in usage],
        "ep_runtime_gb": [float(m) for m in _EP_RUNTIME.findall(log_text)],
    }


def queue(log_text: str) -> dict | None:
    """The server's queue in `log_text`, from its stats lines (one per 10 s: samples, each
    maximum taken on its own) and the requests preempted in those intervals (None: no
    such line, as in a wave shorter than one interval)."""
    seen = [
        (int(r), int(w), float(u), sum(map(int, _PREEMPTIONS.findall(rest))))
        for r, w, rest, u in _QUEUE.findall(log_text)
    ]
    if not seen:
        return None
    return {
        "samples": len(seen),
        "max_running": max(s[0] for s in seen),
        "max_waiting": max(s[1] for s in seen),
        "max_kv_usage_pct": max(s[2] for s in seen),
        "preemptions": sum(s[3] for s in seen),
    }


def _log_from(path: Path, offset: int) -> str:
    """What the server logged from byte `offset` on."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def problems(doc: dict, log_text: str = "") -> list[str]:
    """Why a run does not count: failed requests, handles made after load (its rows'
    marks), a server log line saying a round ran off the pool."""
    found = []
    for run in doc["runs"]:
        name = f"{label(run)}/{run['compilation']}"
        for dataset, data in run["datasets"].items():
            for c, r in data["rows"].items():
                where = f"{name} {dataset} concurrency {c}"
                unfinished = r.get("completed") is None and r.get("problem")
                if not unfinished and (
                    r.get("failed") or r.get("completed") != r.get("num_prompts")
                ):
                    found.append(f"{where}: {r.get('failed')} of {r['num_prompts']} failed")
                if r.get("problem"):
                    found.append(f"{where}: {r['problem']}")
            if (data.get("warm_wave") or {}).get("problem"):
                found.append(f"{name} {dataset} warm wave: {data['warm_wave']['problem']}")
    return found + [f"server log: {line}" for line in serve_process.off_the_pool(log_text)]


def run(args) -> int:
    """Serve one configuration and drive it; scratch removed after (a tiny model is 0.5 GB)."""
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp:
        return _run(args, Path(tmp))


def _model(shape: str, root: Path) -> str:
    if shape == "tiny":
        return write_tiny_model(root / "tiny-h2048", 2048)
    return write_config_only(root / "qwen3-30b-a3b-shape", QWEN3_30B_A3B)


def _run(args, work: Path) -> int:
    started = time.monotonic()
    deadline = started + args.deadline_s
    model = _model(args.shape, Path(args.model_dir) if args.model_dir else work)
    server_env = SERVER_ENV | config_env(args.config, args.round_tokens)
    env = engine_env(write_plugin_dist(work / "plugin"), server_env)
    port = args.port or free_port()
    log_path = Path(args.log or work / f"serve-{args.config}.log")
    vllm_args = serve_args(
        args.config, args.compilation, args.shape, args.max_num_batched_tokens, args.capture_size
    )
    record = {
        "config": args.config,
        "compilation": args.compilation,
        "shape": args.shape,
        "vllm_args": vllm_args,
        "server_env": server_env,
        "warm_up": args.warm_only,
        "datasets": {},
    }
    doc = {"runs": [record]}
    out = Path(args.out)
    command = serve_process.serve_command(model, port, *vllm_args)
    try:
        startup = max(deadline - time.monotonic(), 1)
        with serve_process.served(command, env, log_path, port, startup) as server:
            record["startup_seconds"] = round(time.monotonic() - started, 1)
            last = at_load = probe(port)
            cache = prefix_cache(port)  # read once between waves, as the probe
            record["resolved"] = resolved(at_load)
            record["kv_cache"] = kv_cache(log_path.read_text(errors="replace"))
            record["budget"] = {
                "max_num_batched_tokens": at_load["max_num_batched_tokens"],
                "asked": args.max_num_batched_tokens,  # None: vLLM's / the package's default
                "capture_asked": args.capture_size,  # None: vLLM's capture sizes
                "source": BUDGET_SOURCE,
            }
            print(
                f"{args.config}: up in {record['startup_seconds']} s, KV cache "
                f"{_kv_tokens(record)} tokens: {record['resolved']}"
            )
            out.write_text(json.dumps(doc, indent=1))
            for wave in plan(args.datasets, args.warm_only, args.warm_wave):
                dataset, c, warm = wave.dataset, wave.concurrency, wave.warm
                input_len, output_len, _ = DATASETS[dataset]
                data = record["datasets"].setdefault(
                    dataset, {"input_len": input_len, "output_len": output_len, "rows": {}}
                )
                load = bench_args(input_len, output_len, c, wave.prompts, wave.seed)
                data.setdefault("bench_args", {})["warm_wave" if warm else str(c)] = load
                result = work / f"bench-{dataset}-c{c}{'-warm' if warm else ''}.json"
                logged = log_path.stat().st_size
                why = _drive(model, port, load, result, deadline, server)
                if why:  # the row says so, and the table with it (a FAILED cell)
                    row = {"problem": why, "num_prompts": wave.prompts, "completed": None}
                else:
                    before, last = last, probe(port)  # this wave's handles: any fails it
                    row = check_row(keep(json.loads(result.read_text())), before, last)
                    cache_before, cache = cache, prefix_cache(port)
                    check_prefill(row, cache_before, cache)
                    row["server_queue"] = queue(_log_from(log_path, logged))
                if warm:
                    data["warm_wave"] = row
                else:
                    data["rows"][str(c)] = row
                out.write_text(json.dumps(doc, indent=1))
                if why:
                    print(f"PROBLEM {dataset} concurrency {c}: {why}")
                    return 1
                print(f"{args.config} {dataset} c={c}{' warm' if warm else ''}: {row}", flush=True)
    except serve_process.ServerError as exc:
        print(f"PROBLEM {exc}")
        return 1
    bad = problems(doc, log_path.read_text(errors="replace"))
    for line in bad:
        print("PROBLEM", line)
    return 1 if bad else 0


class Wave(NamedTuple):
    dataset: str
    concurrency: int
    prompts: int
    warm: bool  # unmeasured
    seed: int  # the random dataset's: one per wave of a run, so no prompt comes twice


def plan(datasets: list[str], warm_only: bool, warm_wave: bool) -> list[Wave]:
    """The waves in order: first one unmeasured wave per dataset at its top concurrency
    (Triton's JIT and vLLM's first steps of each shape out of the figures), then the
    measured levels unless only warming up."""
    waves = []
    if warm_wave or warm_only:
        waves += [(d, max(DATASETS[d][2]), max(DATASETS[d][2]), True) for d in datasets]
    if not warm_only:
        waves += [(d, c, n, False) for d in datasets for c, n in DATASETS[d][2].items()]
    return [Wave(*w, seed=i) for i, w in enumerate(waves, start=1)]


# A wave whose prompt tokens the server found in its prefix cache beyond this share did
# not prefill what it sent (random prompts collide on a block now and then, no more).
PREFIX_HIT_LIMIT = 0.02


def prefix_cache(port: int) -> tuple[float, float] | str:
    """(hit, queried) prompt tokens of the server's prefix cache so far (/metrics), or
    why they could not be read (the row keeps its figures and says so)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            return prefix_cache_counts(r.read().decode())
    except OSError as exc:
        return f"/metrics unread: {exc}"


def prefix_cache_counts(metrics: str) -> tuple[float, float]:
    """vLLM's `vllm:prefix_cache_hits` and `_queries` counters, summed over engines."""
    totals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_hits_total"], totals["vllm:prefix_cache_queries_total"]


def check_prefill(row: dict, before: tuple | str, after: tuple | str) -> dict:
    """Mark `row` with its prefix-cache hit share (None: the server looked nothing up, as
    with prefix caching off, or the counters were unread); above PREFIX_HIT_LIMIT it fails."""
    unread = [x for x in (before, after) if isinstance(x, str)]
    if unread:
        row["prefix_cache_hit_share"], row["prefix_cache_unread"] = None, unread[0]
        return row
    hits, queries = after[0] - before[0], after[1] - before[1]
    row["prefix_cache_hit_share"] = share = hits / queries if queries else None
    if share is not None and share > PREFIX_HIT_LIMIT:
        why = f"prefix cache hits: {share:.1%} of the prompt tokens (prompts sent again)"
        row["problem"] = "; ".join(p for p in (row.get("problem"), why) if p)
    return row


def _drive(model, port, load, result: Path, deadline: float, server) -> str | None:
    """One `vllm bench serve` with the caller's environment (vLLM's path, not the
    harness's); why it does not count, or None."""
    try:
        done = subprocess.run(
            bench_command(model, port, load, result),
            env=dict(os.environ),
            check=False,
            timeout=max(deadline - time.monotonic(), 1),
        )
    except subprocess.TimeoutExpired:
        return "not done by --deadline-s"
    if server.poll() is not None:
        return "the server exited"
    if done.returncode != 0 or not result.exists():
        return f"vllm bench serve failed (exit {done.returncode})"
    return None


def _as_doc(doc: dict) -> dict:
    """A results file as {"runs": [...]}: files written before --compilation (one
    configuration, 256/64, FULL_DECODE_ONLY, a fixed step budget) are read as such runs."""
    if "runs" in doc:
        return doc
    run = {
        "config": doc["config"],
        "compilation": "decode-only",
        "shape": doc["shape"],
        "budget": {"max_num_batched_tokens": doc["max_num_batched_tokens"]},
        "datasets": {"256x64": {"input_len": 256, "output_len": 64, "rows": doc["rows"]}},
    }
    return {"runs": [run], "note": doc.get("note")}


def config_env(config: str, round_tokens: int | None = None) -> dict[str, str]:
    """A configuration's package variables: `ll_rounds` at `round_tokens` (None: 512)."""
    env = dict(CONFIG_ENV.get(config, {}))
    if round_tokens is not None and ROUND_VAR in env:
        env[ROUND_VAR] = str(round_tokens)
    return env


def label(run: dict) -> str:
    """A run's name in tables: its configuration, with its round where rounds split
    (`ll_rounds/1024`), the step budget where one was passed (`ll@2048`) and the largest
    capture size where one was passed (`ll@1024+cg1024`), so one configuration at several
    rounds, budgets or capture sizes can sit side by side."""
    budget = run.get("budget", {})
    name = run["config"]
    rounds = (run.get("server_env") or {}).get(ROUND_VAR)
    name += f"/{rounds}" if rounds is not None else ""
    name += f"@{budget['asked']}" if budget.get("asked") is not None else ""
    return name + (f"+cg{budget['capture_asked']}" if budget.get("capture_asked") else "")


def _labels(runs: dict[tuple[str, str], dict], comp: str) -> list[str]:
    """The labels of one compilation's runs, in CONFIGS order, then by round, then by
    budget asked, then by capture size asked."""

    def order(name: str) -> tuple:
        run = runs[(name, comp)]
        asked = run.get("budget", {}).get("asked")
        capture = run.get("budget", {}).get("capture_asked") or 0
        rounds = int((run.get("server_env") or {}).get(ROUND_VAR, 0))
        return CONFIGS.index(run["config"]), rounds, asked is not None, asked or 0, capture

    return sorted((n for n, c in runs if c == comp), key=order)


# A run's own keys; the rest are its server's facts (arguments, budget, KV cache, start).
RUN_KEYS = ("config", "compilation", "shape", "datasets")


def served_by(run: dict, dataset: str) -> dict:
    """`run`'s entry for `dataset` with the facts of the server that served it under
    "server" (a merged run keeps another server's datasets: they keep their own facts)."""
    data = run["datasets"][dataset]
    facts = {k: v for k, v in run.items() if k not in RUN_KEYS}
    return data if "server" in data else {**data, "server": facts}


def facts(run: dict, dataset: str) -> dict:
    """The facts of the server that served `run`'s `dataset`."""
    return run["datasets"][dataset].get("server") or run


def merge(docs: list[dict]) -> dict:
    """One results file from several runs' files (one shape, one card): a later file's
    run of the same label (configuration, round, budget and capture size asked) and
    compilation replaces its datasets. Warm-ups are left out."""
    runs: dict[tuple[str, str], dict] = {}
    notes = []
    for doc in map(_as_doc, docs):
        notes += ([doc["note"]] if doc.get("note") else []) + doc.get("notes", [])
        for run in doc["runs"]:
            if run.get("warm_up"):
                continue
            key = (label(run), run["compilation"])
            if key in runs:  # the later run's settings, the earlier one's other datasets
                kept = {d: served_by(runs[key], d) for d in runs[key]["datasets"]}
                run = {**run, "datasets": {**kept, **run["datasets"]}}
            runs[key] = run
    shapes = {r["shape"] for r in runs.values()}
    cards = {r.get("resolved", {}).get("device") for r in runs.values()} - {None}
    if len(shapes) > 1 or len(cards) > 1:
        raise ValueError(f"cannot merge runs of shapes {sorted(shapes)} on cards {sorted(cards)}")
    joined = {"runs": list(runs.values())}
    return joined | ({"notes": notes} if notes else {})


def _ratio(a, b) -> str:
    return f" ({a / b:.2f})" if a is not None and b else ""


def table(doc: dict) -> str:
    """Markdown per compilation and dataset: each configuration's output tok/s, TPOT
    median and TTFT p99, EP configurations with their ratio to no EP in brackets, and
    the step budget and KV cache of each configuration that served the dataset (one
    that did not has no columns there); a failed row says FAILED instead of figures.
    The reference is no EP's run with no budget asked where there is one."""
    runs = {(label(r), r["compilation"]): r for r in _as_doc(doc)["runs"]}
    out = []
    for comp in COMPILATIONS:
        every = _labels(runs, comp)
        datasets = [d for d in DATASETS if any(d in runs[(c, comp)]["datasets"] for c in every)]
        for dataset in datasets:  # the configurations that served this dataset
            names = [c for c in every if dataset in runs[(c, comp)]["datasets"]]
            ref_name = next((n for n in names if runs[(n, comp)]["config"] == "no_ep"), None)
            served = {c: facts(runs[(c, comp)], dataset) for c in names}
            budgets = ", ".join(
                f"{c} {served[c].get('budget', {}).get('max_num_batched_tokens')}" for c in names
            )
            kv = ", ".join(f"{c} {_kv_tokens(served[c])}" for c in names)
            head = ["concurrency", "requests"]
            for c in names:
                head += [f"{c} out tok/s", f"{c} TPOT med ms", f"{c} TTFT p99 ms"]
            out += [
                f"{dataset} (input x output tokens), compilation {comp}; "
                f"--max-num-batched-tokens: {budgets}; KV cache tokens: {kv}",
                "",
                "| " + " | ".join(head) + " |",
                "|" + " --- |" * len(head),
            ]
            rows = {c: runs[(c, comp)]["datasets"].get(dataset, {}).get("rows", {}) for c in names}
            levels = sorted({int(k) for r in rows.values() for k in r})
            for level in levels:
                got = {c: rows[c].get(str(level)) for c in names}
                ref = got.get(ref_name) if not (got.get(ref_name) or {}).get("problem") else None
                prompts = next(r["num_prompts"] for r in got.values() if r)
                cells = [str(level), str(prompts)]
                for c in names:
                    cells += _cells(got[c], ref if c != ref_name else None)
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out).rstrip()


def _kv_tokens(run: dict) -> str:
    """The tokens a run's KV cache held, per engine ("unrecorded" before it was kept)."""
    return "/".join(str(t) for t in run.get("kv_cache", {}).get("tokens", [])) or "unrecorded"


def _cells(row: dict | None, ref: dict | None) -> list[str]:
    if row is None:
        return ["-"] * 3
    if row.get("problem") or row.get("failed"):
        return ["FAILED: " + (row.get("problem") or f"{row['failed']} requests failed")] * 3
    ref = ref or {}
    tps, tpot, ttft = row["output_throughput"], row["median_tpot_ms"], row["p99_ttft_ms"]
    return [
        f"{tps:.0f}{_ratio(tps, ref.get('output_throughput'))}",
        f"{tpot:.2f}{_ratio(tpot, ref.get('median_tpot_ms'))}",
        f"{ttft:.1f}{_ratio(ttft, ref.get('p99_ttft_ms'))}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=CONFIGS)
    ap.add_argument("--compilation", choices=COMPILATIONS, default="default")
    ap.add_argument("--datasets", type=lambda s: s.split(","), default=["256x64"])
    ap.add_argument("--shape", choices=["tiny", "qwen3-30b-a3b"], default="qwen3-30b-a3b")
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step budget to pass (default: none passed; vLLM's and the package's own)",
    )
    ap.add_argument(
        "--max-cudagraph-capture-size",
        dest="capture_size",
        type=int,
        default=None,
        help="the largest CUDA graph capture size to pass, with --compilation default "
        "(default: none passed; vLLM's capture sizes)",
    )
    ap.add_argument(
        "--round-tokens",
        type=int,
        default=None,
        help="ll_rounds only: VLLM_FLASHINFER_EP_LL_ROUND_TOKENS for the server (default 512)",
    )
    ap.add_argument(
        "--model-dir",
        help="where the config-only model is written (a fixed folder keeps vLLM's compile "
        "cache valid across device calls; default: a temporary folder)",
    )
    ap.add_argument(
        "--warm-only",
        action="store_true",
        help="start, read the worker, one wave per dataset at its top concurrency, stop: "
        "fills the compile and JIT caches (its JSON is never merged)",
    )
    ap.add_argument(
        "--no-warm-wave",
        dest="warm_wave",
        action="store_false",
        help="measure without the unmeasured wave per dataset first",
    )
    ap.add_argument(
        "--deadline-s",
        type=int,
        default=540,
        help="stop (and stop the server) this long after start: one 600 s device call",
    )
    ap.add_argument("--log", help="where the server's log goes (default: a temporary folder)")
    ap.add_argument("--out", help="this run's JSON (with --merge: the joined file)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join runs' files, print tables")
    args = ap.parse_args(argv)
    if args.merge:
        try:
            joined = merge([json.loads(Path(p).read_text()) for p in args.merge])
        except ValueError as exc:
            print(exc)
            return 2
        if args.out:
            Path(args.out).write_text(json.dumps(joined, indent=1))
        print(table(joined))
        bad = problems(joined)
        for line in bad:
            print("PROBLEM", line)
        return 1 if bad else 0
    unknown = [d for d in args.datasets if d not in DATASETS]
    if not args.config or not args.out or unknown:
        ap.error(f"--config and --out are needed, datasets from {list(DATASETS)} (or --merge)")
    if args.round_tokens is not None and (args.config != "ll_rounds" or args.round_tokens < 1):
        ap.error("--round-tokens takes a positive count, with --config ll_rounds only")
    if args.capture_size is not None and (args.compilation != "default" or args.capture_size < 1):
        ap.error("--max-cudagraph-capture-size takes a positive size, with --compilation default")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
