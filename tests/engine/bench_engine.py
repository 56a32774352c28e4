"""End-to-end decode throughput of the engine at EP world size 1, three configurations side by side.

    python tests/engine/bench_engine.py --shape tiny|qwen3-30b-a3b|deepseek-v3|qwen3-235b-a22b
        --out results.json [--quantization fp8_per_block --configs no_ep,ll_graph,ll_graph_triton]

Configurations (one engine process each, run one after the other in this command):
  no_ep     : the same engine without expert parallelism (vLLM's default MoE path)
  ll_graph  : --all2all-backend flashinfer_ep_low_latency, persistent handle pool
  ll_pooloff: the same with VLLM_FLASHINFER_EP_HANDLE_POOL=0 (per-forward handles; the
              policy turns CUDA graphs off)
All three run with cudagraph_mode FULL_DECODE_ONLY and no torch.compile (decode steps replay
full CUDA graphs where the configuration allows graphs at all). Decode throughput per batch size B: B * output_len / (t(prefill + output_len tokens) -
t(prefill + 1 token)), the best of two runs each. `tiny` is the 4-layer test model with
random weights; `qwen3-30b-a3b` is Qwen3-30B-A3B's architecture (48 layers, hidden 2048,
128 experts, top_k 8) with vLLM's dummy weights, so no checkpoint is needed. Two published
shapes of the model matrix (model_matrix.py: published config, layers reduced to fit one
80 GB GPU at --gpu-memory-utilization 0.85, dummy weights):
  deepseek-v3     : hidden 7168, 256 experts, top_k 8, moe intermediate 2048, MLA (128 heads,
                    q_lora 1536, kv_lora 512), block FP8 as published (the FP8 start-up
                    switches below); 5 layers, 1 dense + 4 MoE (published: 3 dense + 58 MoE,
                    so MoE layers dominate the step as there) ~ 50 GB
  qwen3-235b-a22b : hidden 4096, 128 experts, top_k 8, moe intermediate 1536, 64 query /
                    4 KV heads of 128; BF16; 10 of 94 layers ~ 52 GB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_models import QWEN3_30B_A3B, qwen3_moe_config, write_config_only, write_tiny_model  # noqa: E402
from engine_run import bench_rows_from_log  # noqa: E402
from engine_runner import EngineRunner  # noqa: E402
from model_matrix import deepseek_v3, moe_layer_count, qwen3_235b_a22b  # noqa: E402

LL = "flashinfer_ep_low_latency"
CAPTURE = [1, 2, 4, 8, 16, 32, 64, 128, 256]
# Decode steps replayed as full CUDA graphs, no torch.compile (fast start-up at 48 layers);
# the same for all three engines. The pool-off engine gets NONE from the package's policy.
COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": CAPTURE}
CONFIGS = {
    "no_ep": ({"backend": None}, {}),
    "ll_graph": ({"backend": LL}, {}),
    "ll_pooloff": ({"backend": LL}, {"VLLM_FLASHINFER_EP_HANDLE_POOL": "0"}),
    # LL with its fleet sized for rounds of 512 (a longer forward runs as several rounds):
    # for steps above 512 tokens (--max-num-batched-tokens), e.g. --profile-mixed's prompt
    "ll_rounds": ({"backend": LL}, {"VLLM_FLASHINFER_EP_LL_ROUND_TOKENS": "512"}),
    # FP8 (--quantization fp8_per_block): ll_graph is what `--moe-backend auto` picks, vLLM's
    # batched DeepGEMM experts on Hopper with small forwards on the received rows (the
    # JSON's "kernels" name the classes); ll_graph_deepgemm names them explicitly,
    # ll_graph_triton takes the received-rows experts for every forward, and
    # ll_graph_deepgemm_only DeepGEMM for every forward.
    "ll_graph_deepgemm": ({"backend": LL, "moe_backend": "deep_gemm"}, {}),
    "ll_graph_triton": ({"backend": LL, "moe_backend": "triton"}, {}),
    "ll_graph_deepgemm_only": (
        {"backend": LL},
        {"VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS": "0"},
    ),
    # Diagnosis only (not in the default set): the pooled LL path without CUDA graphs.
    "ll_eager": ({"backend": LL, "enforce_eager": True}, {}),
    "no_ep_eager": ({"backend": None, "enforce_eager": True}, {}),  # ll_eager's reference
}
DEFAULT_CONFIGS = "no_ep,ll_graph,ll_pooloff"
# FP8 engines (--quantization): vLLM's own start-up switches, so each engine starts within
# one device call: no DeepGEMM warm-up of every linear shape up front (kernels JIT at
# first use, during the capture warm-up), no FlashInfer autotuning. Recorded in the JSON.
FP8_STARTUP_ENV = {"VLLM_DEEP_GEMM_WARMUP": "skip"}
FP8_STARTUP_SPEC = {"enable_flashinfer_autotune": False}
# vLLM switches left at their defaults that decide which FP8 kernels are measured (DeepGEMM's
# power-of-two scales; FlashInfer's block-FP8 GEMM for small linear batches): recorded as set.
FP8_KERNEL_SWITCHES = ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")


def startup_switches() -> dict:
    """What the FP8 engines ran with: the start-up switches and the kernel switches' values
    in this environment ("unset": vLLM's default)."""
    import os

    kernel = {name: os.environ.get(name, "unset") for name in FP8_KERNEL_SWITCHES}
    return {**FP8_STARTUP_ENV, **FP8_STARTUP_SPEC, **kernel}


# The config.json of each dummy-weight shape (tiny: generated weights, tiny_config()).
SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3": deepseek_v3(layers=5) | {"first_k_dense_replace": 1},
    "qwen3-235b-a22b": qwen3_235b_a22b(layers=10),
}


def shape_config(shape: str) -> dict:
    return qwen3_moe_config(2048) if shape == "tiny" else SHAPES[shape]


def checkpoint_fp8(shape: str) -> bool:
    """The shape's config is an FP8 checkpoint's (DeepSeek-V3's block FP8)."""
    quant = shape_config(shape).get("quantization_config") or {}
    return quant.get("quant_method") == "fp8"


def _model(shape: str, work: Path) -> tuple[str, dict]:
    if shape == "tiny":
        return write_tiny_model(work / "tiny-h2048", 2048), {"vocab": 4096}
    config = SHAPES[shape]
    path = write_config_only(work / f"{shape}-shape", config)
    return path, {
        "vocab": config["vocab_size"],
        "load_format": "dummy",
        "gpu_memory_utilization": 0.85,
    }


def engine_spec(args, name: str, model: str, extra: dict) -> tuple[dict, dict]:
    """The engine spec and environment of configuration `name` for this command."""
    base, env = CONFIGS[name]
    spec = {
        "model": model,
        "max_model_len": 512,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **extra,
        **base,
    }
    if args.compilation == "decode-only":
        spec["compilation_config"] = COMPILATION
    if args.quantization:
        spec["quantization"] = args.quantization
    if args.quantization or checkpoint_fp8(args.shape):
        spec.update(FP8_STARTUP_SPEC)
        env = {**FP8_STARTUP_ENV, **env}
    if not args.no_bench:
        spec["bench"] = {
            "batch_sizes": [int(b) for b in args.batch_sizes.split(",")],
            "output_len": args.output_len,
            "prompt_len": args.prompt_len,
        }
    if args.profile_batch:
        # The prompts' prefill in one step (batch x prompt_len within the budget), so the
        # profiled steps past it are decode steps only, not prefill chunks mixed with them.
        fit = max(1, min(args.prompt_len, args.max_num_batched_tokens // args.profile_batch))
        spec["profile"] = {
            "batch": args.profile_batch,
            "prompt_len": fit,
            "output_len": 8,
            "moe_layers": moe_layer_count(shape_config(args.shape)),
        }
    if args.profile_mixed:
        decodes = args.profile_mixed - 1
        if decodes >= args.max_num_batched_tokens:
            raise SystemExit(
                f"--profile-mixed {args.profile_mixed}: its {decodes} decodes leave no room "
                f"for a prefill chunk in --max-num-batched-tokens {args.max_num_batched_tokens}"
            )
        spec["profile_mixed"] = {
            "decodes": decodes,
            "prompt_len": args.prompt_len,
            "long_prompt_len": args.long_prompt_len,
            "chunk": args.max_num_batched_tokens - decodes,
            # the decodes outlast the prompts' prefill steps and the long prompt's chunks
            "max_tokens": decodes * args.prompt_len // args.max_num_batched_tokens
            + args.long_prompt_len // (args.max_num_batched_tokens - decodes)
            + 8,
            "moe_layers": moe_layer_count(shape_config(args.shape)),
        }
        spec["max_model_len"] = max(spec["max_model_len"], args.long_prompt_len + 8)
    return spec, env


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    ap.add_argument(
        "--quantization",
        default=None,
        help="vLLM's online quantization of the weights for every configuration "
        "(e.g. fp8_per_block), with FP8_STARTUP_ENV / FP8_STARTUP_SPEC",
    )
    ap.add_argument(
        "--profile-batch",
        type=int,
        default=0,
        help="also profile a few decode steps at this batch size (top CUDA kernels in the log)",
    )
    ap.add_argument(
        "--profile-mixed",
        type=int,
        default=0,
        metavar="CONCURRENCY",
        help="also profile mixed steps: CONCURRENCY - 1 decodes with one --long-prompt-len "
        "prompt's prefill chunked into their steps (what the chunks add, per MoE layer)",
    )
    ap.add_argument("--long-prompt-len", type=int, default=2048)
    ap.add_argument(
        "--compilation",
        choices=["decode-only", "default"],
        default="decode-only",
        help="decode-only: FULL_DECODE_ONLY graphs without torch.compile (the decode "
        "benchmark's); default: vLLM's own (torch.compile, FULL_AND_PIECEWISE)",
    )
    ap.add_argument("--no-bench", action="store_true", help="profile only")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=256,
        help="every configuration's step budget (LL's default under DP+EP; no EP would get "
        "8192 and prefill in fewer, larger steps)",
    )
    ap.add_argument(
        "--engine-timeout",
        type=float,
        default=540,
        help="seconds one engine may take (within one 600 s device call; a timed-out "
        "engine keeps the rows it printed)",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="run nothing: join these results files (one engine per device call, same shape "
        "and quantization) into --out and print the table",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quantization and checkpoint_fp8(args.shape):
        ap.error(f"--shape {args.shape} is an FP8 checkpoint already: no --quantization")
    if args.merge:
        return merge(args.merge, args.out)
    # Generated weights and engine logs are scratch: a tiny model is 0.5 GB, so every run
    # removes its own (a failed engine's log tail is printed before that).
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        return _run(args, Path(tmp))


def _run(args, work: Path) -> int:
    """Each configuration's engine in turn; results written after each, so a cut run keeps them."""
    model, extra = _model(args.shape, work)
    runner = EngineRunner(work)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, list[dict]] = {}
    meta: dict[str, dict] = {}
    failed: list[str] = []
    for name in args.configs.split(","):
        spec, env = engine_spec(args, name, model, extra)
        try:
            res = runner.run(
                f"bench-{args.shape}-{name}", spec, env=env, timeout=args.engine_timeout
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            # Keep what the engine measured before it died (its progress lines).
            log = runner.log_path(f"bench-{args.shape}-{name}")
            text = log.read_text(errors="replace") if log.exists() else ""
            tail = "".join(text.splitlines(True)[-40:])
            print(f"{name}: engine failed: {str(exc).splitlines()[0]}\n{tail}", flush=True)
            results[name] = bench_rows_from_log(text, args.output_len)
            meta[name] = {"error": str(exc).splitlines()[0], "partial": True}
            failed.append(name)
        else:
            results[name] = res.get("bench", [])
            probe = res["after_load"]
            meta[name] = {
                "cudagraph_mode": probe["cudagraph_mode"],
                "startup_seconds": round(res["startup_seconds"], 1),
                "pool_sizes": [rt["pool_sizes"] for rt in probe["runtimes"]],
                "kernels": probe["kernels"],  # prepare/finalize + experts, as the engine built them
                # the bound of DeepGEMM layers' small forwards (experts/deep_gemm.py)
                "deep_gemm_received_rows": probe.get("deep_gemm_received_rows"),
                # DeepGEMM's expected_m as DP ranks estimate it (world1_harness, a switch;
                # it acts where "kernels" name ReceivedRowsOrDeepGemmExperts)
                "dp_expected_m": probe.get("dp_expected_m"),
                "max_num_batched_tokens": probe["max_num_batched_tokens"],
                "device": probe.get("device"),  # the GPU: timings compare only on one card
                "compilation": args.compilation,
            }
            if "profile_mixed" in res:  # what a long prompt's chunks add (engine_run)
                meta[name]["profile_mixed"] = res["profile_mixed"]
        print(f"{name}: {meta[name]} {results[name]}", flush=True)
        if args.out:  # after each engine, so a cut-short run keeps what it measured
            doc = {"shape": args.shape, "meta": meta, "results": results}
            if args.quantization or checkpoint_fp8(args.shape):
                doc["quantization"] = args.quantization or "fp8 (checkpoint)"
                doc["startup_switches"] = startup_switches()
            args.out.write_text(json.dumps(doc, indent=1))
    if not args.no_bench and all(len(r) == len(batches) for r in results.values()):
        print(table(args.shape, batches, results))
    if failed:
        print(f"engines that failed (partial rows kept): {', '.join(failed)}", flush=True)
        return 1
    return 0


def merge(paths: list[Path], out: Path | None) -> int:
    """Join results files of one shape and quantization (later files win per configuration)."""
    docs = [json.loads(p.read_text()) for p in paths]
    kinds = {(d["shape"], d.get("quantization")) for d in docs}
    if len(kinds) != 1:
        print(f"cannot merge different shapes or quantizations: {sorted(kinds, key=str)}")
        return 2
    cards = {m["device"] for d in docs for m in d["meta"].values() if m.get("device")}
    if len(cards) > 1:
        print(f"cannot merge runs on different GPUs: {sorted(cards)}")
        return 2
    joined = {k: v for d in docs for k, v in d.items() if k not in ("meta", "results")}
    joined["meta"] = {n: m for d in docs for n, m in d["meta"].items()}
    joined["results"] = {n: r for d in docs for n, r in d["results"].items()}
    if out is not None:
        out.write_text(json.dumps(joined, indent=1))
    sizes = {n: [r["batch"] for r in rs] for n, rs in joined["results"].items()}
    batches = max(sizes.values(), key=len, default=[])
    short = [n for n, b in sizes.items() if b != batches]
    if short:
        print(f"no table: {', '.join(short)} lack batches of {batches} (a partial run?)")
        return 1
    if batches:
        print(table(joined["shape"], batches, joined["results"]))
    return 0


def table(shape: str, batches: list[int], results: dict[str, list[dict]]) -> str:
    """Markdown: tokens/s per configuration, each EP configuration over no_ep, graphs over
    pool-off, eager LL over eager no EP."""
    names = list(results)
    ratios = [(n, "no_ep") for n in names if n != "no_ep" and "no_ep" in results]
    if "ll_graph" in results and "ll_pooloff" in results:
        ratios.append(("ll_graph", "ll_pooloff"))
    if "ll_eager" in results and "no_ep_eager" in results:
        ratios.append(("ll_eager", "no_ep_eager"))
    head = ["batch"] + [f"{n} tok/s" for n in names] + [f"{a} / {b}" for a, b in ratios]
    lines = [
        f"decode throughput, {shape} (output tokens/s)",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for i, b in enumerate(batches):
        tps = {n: results[n][i]["output_tokens_per_s"] for n in names}
        row = (
            [str(b)]
            + [f"{tps[n]:.0f}" for n in names]
            + [f"{tps[a] / tps[b]:.2f}" for a, b in ratios]
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
