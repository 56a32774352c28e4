"""Run one vLLM engine configuration in this process and write what it observed as JSON.

Each engine runs in its own interpreter (`python tests/engine/engine_run.py SPEC OUT`), so a
crash in one configuration cannot take the others down and every engine starts clean.
The engine core and the worker run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
`collective_rpc` reads the package's objects directly; `vllm serve` (test_serve_world1.py)
covers the multi-process layout.

SPEC (JSON): model, backend (null = the same engine without EP), enforce_eager,
max_num_batched_tokens, load_format, compilation_config, gpu_memory_utilization,
sequences (teacher-forced prompt logprobs), decode {num_prompts, prompt_len, max_tokens},
bench {batch_sizes, output_len, prompt_len}.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import re
import sys
import time
from typing import Any

STACK_DUMP_ENV = "FLASHINFER_EP_TEST_STACK_DUMP_S"


def _device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def worker_probe(worker: Any) -> dict[str, Any]:
    """What the worker built: cudagraph mode, capture sizes, manager, runtimes, P/F, kernels."""
    from vllm.distributed.parallel_state import get_ep_group

    cfg = worker.vllm_config
    comp = cfg.compilation_config
    out: dict[str, Any] = {
        "cudagraph_mode": comp.cudagraph_mode.name if comp.cudagraph_mode is not None else None,
        "compilation_mode": getattr(comp.mode, "name", comp.mode),  # NONE: no torch.compile
        "capture_sizes": sorted(int(s) for s in (comp.cudagraph_capture_sizes or [])),
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "data_parallel_size": cfg.parallel_config.data_parallel_size,
        "model_runner": "v2" if cfg.use_v2_model_runner else "v1",
        "device": _device_name(),  # timings compare only on the same card
    }
    try:
        comm = get_ep_group().device_communicator
    except AssertionError:
        comm = None
    manager = getattr(comm, "all2all_manager", None)
    out["manager"] = type(manager).__name__ if manager is not None else None
    runtimes = list(getattr(manager, "runtimes", []) or [])
    out["runtimes"] = [
        {
            "algorithm": rt.spec.algorithm,
            "hidden_size": rt.spec.hidden_size,
            "num_experts": rt.spec.num_experts,
            "capacity": rt.capacity,
            "world_size": rt.world_size,
            "top_k": rt.pool.top_k,
            "pool_sizes": rt.pool.sizes,
            # sizes learned from vLLM's capture (runtime/capture.py's capture phase)
            "pool_learned": list(getattr(rt.pool, "learned", [])),
            "pool_memory_bytes": rt.pool.memory_bytes,
            "pool_first_handle_bytes": rt.pool.first_handle_bytes,
            "pool_average_handle_bytes": rt.pool.average_handle_bytes,
            "counters": dataclasses.asdict(rt.pool.counters),
            # FP8 on the wire (runtime/fp8_wire.py): eager FP8 dispatches so far; None when off
            "fp8_dispatches": rt.fp8_wire.dispatches if getattr(rt, "fp8_wire", None) else None,
            # eager LL rounds issued as direct nccl.ep calls (runtime/native_handle.py)
            "direct_rounds": rt.round.planner.native.rounds
            if rt.round.planner.native is not None
            else None,
        }
        for rt in runtimes
    ]
    model = worker.model_runner.model
    if not hasattr(model, "modules") and hasattr(model, "unwrap"):
        model = model.unwrap()
    impls = {}
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        impl = getattr(kernel, "impl", None)
        if impl is not None:
            impls[id(impl)] = impl
    out["kernels"] = sorted(
        {
            f"{type(k.prepare_finalize).__name__}+{type(k.fused_experts).__name__}"
            for k in impls.values()
        }
    )
    out["num_kernels"] = len(impls)
    # the bound DeepGEMM layers were built with (experts/deep_gemm.py), as the worker has it
    bounds = {getattr(k.fused_experts, "received_rows_up_to", None) for k in impls.values()}
    bounds.discard(None)
    out["deep_gemm_received_rows"] = bounds.pop() if len(bounds) == 1 else sorted(bounds) or None
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    # the harness's DP expected_m in place (world1_harness.patch_deep_gemm_expected_m; the
    # kernels above say whether any layer runs DeepGEMM's experts)
    out["dp_expected_m"] = bool(
        getattr(BatchedDeepGemmExperts.apply, "_flashinfer_ep_test_dp_expected_m", False)
    )
    out["quant_dtypes"] = sorted(
        {str(getattr(k.fused_experts.quant_config, "quant_dtype", None)) for k in impls.values()}
    )
    out["kernel_runtimes"] = len(
        {
            id(k.prepare_finalize.runtime)
            for k in impls.values()
            if hasattr(k.prepare_finalize, "runtime")
        }
    )
    return out


def _counters(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc(worker_probe)[0]


def _build(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(**engine_kwargs(spec))


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM`'s keyword arguments for a spec (the CPU tests build configs from them)."""
    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        dtype="bfloat16",
        seed=0,
        max_model_len=spec.get("max_model_len", 1024),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.5),
        enforce_eager=bool(spec.get("enforce_eager", False)),
        load_format=spec.get("load_format", "auto"),
        max_num_seqs=spec.get("max_num_seqs", 256),
    )
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("compilation_config"):
        kwargs["compilation_config"] = spec["compilation_config"]
    if spec.get("speculative_config"):
        kwargs["speculative_config"] = spec["speculative_config"]
    for key in ("quantization", "moe_backend"):
        if spec.get(key):
            kwargs[key] = spec[key]
    if spec.get("enable_flashinfer_autotune") is not None:
        kwargs["enable_flashinfer_autotune"] = bool(spec["enable_flashinfer_autotune"])
    if spec.get("backend"):
        kwargs.update(enable_expert_parallel=True, all2all_backend=spec["backend"])
    return kwargs


def _prompt_logprobs(llm: Any, sequences: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False
    )
    result = []
    for seq, out in zip(sequences, outs):
        row = []
        for pos in range(1, len(seq)):
            entry = out.prompt_logprobs[pos]
            row.append(float(entry[seq[pos]].logprob))
        result.append(row)
    return result


def _decode(llm: Any, num_prompts: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [
        TokensPrompt(
            prompt_token_ids=[2 + (7 * i + 13 * j) % (vocab - 2) for j in range(prompt_len)]
        )
        for i in range(num_prompts)
    ]
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "seconds": elapsed,
    }


def _bench(
    llm: Any, batch_sizes: list[int], output_len: int, prompt_len: int, vocab: int
) -> list[dict]:
    """Decode throughput per batch size: (B * output_len) / (t(1 + output_len) - t(1))."""
    rows = []
    warm = _decode(llm, max(batch_sizes), prompt_len, 4, vocab)  # warm every path once
    print(f"engine_run: bench warm-up {warm['seconds']:.3f}s", flush=True)
    for b in batch_sizes:
        first = min(_decode(llm, b, prompt_len, 1, vocab)["seconds"] for _ in range(2))
        full = min(_decode(llm, b, prompt_len, 1 + output_len, vocab)["seconds"] for _ in range(2))
        print(f"engine_run: bench batch={b} first={first:.3f}s full={full:.3f}s", flush=True)
        rows.append(bench_row(b, output_len, first, full))
    return rows


def bench_row(batch: int, output_len: int, first: float, full: float) -> dict[str, float]:
    """One batch size's decode throughput from t(prefill + 1 token) and t(+ output_len)."""
    decode_s = max(full - first, 1e-9)
    return {
        "batch": batch,
        "output_len": output_len,
        "decode_seconds": decode_s,
        "output_tokens_per_s": batch * output_len / decode_s,
        "ms_per_step": 1000.0 * decode_s / output_len,
    }


BENCH_LINE = re.compile(r"^engine_run: bench batch=(\d+) first=([\d.]+)s full=([\d.]+)s$")


def bench_rows_from_log(text: str, output_len: int) -> list[dict[str, float]]:
    """The rows an engine printed before it died (its progress lines are the same measure)."""
    rows = []
    for line in text.splitlines():
        m = BENCH_LINE.match(line.strip())
        if m:
            rows.append(bench_row(int(m[1]), output_len, float(m[2]), float(m[3])))
    return rows


def _profile(llm: Any, p: dict[str, Any], vocab: int) -> str:
    """The CUDA kernels of a few decode steps, by total GPU time (a diagnosis aid)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch, prompt_len, steps = p["batch"], p.get("prompt_len", 8), p.get("output_len", 8)
    _decode(llm, batch, prompt_len, 4, vocab)  # warm this batch size

    def profiled(max_tokens: int):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = _decode(llm, batch, prompt_len, max_tokens, vocab)
            torch.cuda.synchronize()
        return prof, out

    prof, out = profiled(1 + steps)  # prefill (which gives the first token) + steps
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=p.get("rows", 30))
    print(
        f"engine_run: profile batch={batch} prefill + {steps} decode steps "
        f"{out['seconds']:.3f}s\n{table}",
        flush=True,
    )
    if p.get("moe_layers"):  # per MoE layer and decode step, by kind of kernel
        from profile_breakdown import breakdown, difference, from_profiler
        from profile_breakdown import table as breakdown_table

        prefill, _ = profiled(1)
        decode = difference(from_profiler(prof), from_profiler(prefill))
        parts = breakdown(decode, p["moe_layers"], steps)
        print(
            f"engine_run: breakdown\n{breakdown_table(parts, p['moe_layers'], steps)}", flush=True
        )
    return table


def _mix(llm: Any, p: dict[str, Any], vocab: int, long_len: int, salt: int) -> float:
    """One generate of `decodes` short prompts decoding `max_tokens` each and, when
    long_len > 0, one prompt of long_len tokens (one output token) listed last: the
    scheduler prefills the short prompts first, then chunks the long one into the
    decodes' steps (budget minus decodes per step). Returns its wall seconds.

    Every call's prompts are new (`salt`): vLLM's prefix cache is on by default, and a
    prompt seen before would skip its prefill, leaving no chunk to measure."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def tokens(i: int, n: int) -> list[int]:
        rng = random.Random(f"{salt}/{i}")
        return [rng.randrange(2, vocab) for _ in range(n)]

    decodes = p["decodes"]
    prompts = [TokensPrompt(prompt_token_ids=tokens(i, p["prompt_len"])) for i in range(decodes)]
    short = SamplingParams(
        max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
    )
    params = [short] * decodes
    if long_len:
        prompts.append(TokensPrompt(prompt_token_ids=tokens(decodes, long_len)))
        params.append(SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _profile_mixed(llm: Any, p: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Issue 50's mixed step: what one long prompt's prefill chunks add to the decode steps
    they ride in, per MoE layer and chunk step (GPU time by kind of kernel, and the wall
    time the host adds), from a profiled run with the prompt less one without it."""
    import itertools

    import torch
    from profile_breakdown import added, breakdown, from_profiler, table
    from torch.profiler import ProfilerActivity, profile

    long_len, chunk = p["long_prompt_len"], p["chunk"]
    steps = -(-long_len // chunk)  # chunk steps the long prompt's prefill takes
    salts = itertools.count()  # new prompts in every generate (`_mix`)

    def mix(length: int) -> float:
        return _mix(llm, p, vocab, length, next(salts))

    for length in (long_len, 0):
        mix(length)  # warm both shapes of step

    def profiled(length: int):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds = mix(length)
            torch.cuda.synchronize()
        return from_profiler(prof), seconds

    (mixed, t_mixed), (plain, t_plain) = profiled(long_len), profiled(0)
    walls = [(mix(long_len), mix(0)) for _ in range(3)]
    wall_added = min(a for a, _ in walls) - min(b for _, b in walls)
    parts = breakdown(added(mixed, plain), p["moe_layers"], steps)
    gpu_added = sum(entry["us"] for entry in parts.values())
    what = f"chunk step ({p['decodes']} decodes + {chunk} prefill tokens)"
    print(
        f"engine_run: mixed {p['decodes']} decodes + a {long_len}-token prompt in {steps} "
        f"chunks of {chunk}: wall added {1e3 * wall_added / steps:.3f} ms per chunk step, "
        f"GPU added {gpu_added / 1e3 / steps:.3f} ms\n"
        f"{table(parts, p['moe_layers'], steps, what=what)}",
        flush=True,
    )
    return {
        "chunk_steps": steps,
        "wall_added_ms_per_chunk_step": 1e3 * wall_added / steps,
        "gpu_added_ms_per_chunk_step": gpu_added / 1e3 / steps,
        "profiled_seconds": {"mixed": t_mixed, "decodes_only": t_plain},
        "us_per_layer_step": {k: v["us_per_layer_step"] for k, v in parts.items()},
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm = _build(spec)
    result: dict[str, Any] = {"spec": {k: v for k, v in spec.items() if k != "sequences"}}
    result["startup_seconds"] = time.perf_counter() - t0
    result["after_load"] = _counters(llm)
    print(f"engine_run: ready in {result['startup_seconds']:.1f}s", flush=True)
    dump_s = float(os.environ.get(STACK_DUMP_ENV, "0") or 0)
    if dump_s > 0:  # a stalled engine leaves every thread's stack in its log
        faulthandler.dump_traceback_later(dump_s, repeat=True, file=sys.stderr)
    vocab = int(spec.get("vocab", 4096))
    if spec.get("sequences"):
        result["prompt_logprobs"] = _prompt_logprobs(llm, spec["sequences"])
        result["after_prefill"] = _counters(llm)
    if spec.get("decode"):
        d = spec["decode"]
        result["decode"] = _decode(llm, d["num_prompts"], d["prompt_len"], d["max_tokens"], vocab)
        result["after_decode"] = _counters(llm)
    if spec.get("profile"):
        result["profile"] = _profile(llm, spec["profile"], vocab)
    if spec.get("profile_mixed"):
        result["profile_mixed"] = _profile_mixed(llm, spec["profile_mixed"], vocab)
    if spec.get("bench"):
        b = spec["bench"]
        result["bench"] = _bench(llm, b["batch_sizes"], b["output_len"], b["prompt_len"], vocab)
        result["after_bench"] = _counters(llm)
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[1]).read())
    result = run(spec)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    print(f"engine_run: wrote {argv[2]}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of NCCL/NCCL-EP objects; results are written


if __name__ == "__main__":
    sys.exit(main(sys.argv))
