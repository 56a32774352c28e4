"""Where a decode step's GPU time goes, per MoE layer, from a torch.profiler run.

Kernels are put in categories by name (`CATEGORIES`, first match wins): the transport
(NCCL-EP's dispatch and combine), the experts' GEMMs, the row blocks the received-rows
experts build, the activation between the GEMMs, quantization, and the rest of the model
(attention, dense GEMMs, norms, small torch kernels). Names that match no pattern are
"other" and are listed, so a misfiled kernel shows. Per-layer figures divide by MoE layers
x decode steps profiled; the steps are a profiled run of prefill + N decode steps less one
of the prefill alone (`difference`), so no prefill is counted. A diagnosis aid for
docs/benchmarks.md (issue 28's breakdown), printed by engine_run's profile.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# (category, pattern on the lower-cased kernel name); first match wins.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("transport", r"nccl|ncclep|\bep_|dispatch_kernel|combine_kernel|low_latency|_ll_"),
    ("row blocks", r"_row_blocks_kernel|searchsorted|cumsum|devicescan|scan_kernel"),
    # DeepGEMM's grouped GEMMs carry their GemmType in the name: 1 contiguous, 2 masked (LL's
    # experts), 5 contiguous with psum layout; 0 (Normal) is a dense layer's GEMM.
    (
        "experts GEMMs",
        r"fused_moe_kernel|batched_triton_kernel|moe_align|grouped_gemm|m_grouped"
        r"|gemmtype\)[125][,>]",
    ),
    ("activation", r"act_and_mul|silu|gelu|swiglu"),
    ("quantization", r"quant|amax|per_token_group|scaled_fp8|dynamic_scaled"),
    ("attention", r"attn|attention|fmha|flash_fwd|paged|reshape_and_cache"),
    ("router", r"topk|softmax|gating|router"),
    ("dense GEMMs", r"gemm|cutlass|nvjet|cublas|sm90_xmma|xmma|hopper"),
    ("norms and rotary", r"rms_norm|layer_norm|rotary|rope|norm_kernel"),
    ("small torch kernels", r"elementwise|reduce_kernel|index|copy|fill|cat_|where|gather|scatter"),
)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CATEGORIES)


def category(kernel: str) -> str:
    low = kernel.lower()
    for name, pattern in _COMPILED:
        if pattern.search(low):
            return name
    return "other"


def breakdown(
    kernels: Iterable[tuple[str, float, int]], layers: int, steps: int
) -> dict[str, dict]:
    """kernels: (name, total GPU microseconds, calls). Per category: microseconds per
    layer per step, the share of all, and its kernels (by time)."""
    scale = max(1, layers * steps)
    out: dict[str, dict] = {}
    total = 0.0
    for name, us, calls in kernels:
        entry = out.setdefault(category(name), {"us": 0.0, "kernels": []})
        entry["us"] += us
        entry["kernels"].append((name, us, calls))
        total += us
    for entry in out.values():
        entry["us_per_layer_step"] = entry["us"] / scale
        entry["share"] = entry["us"] / total if total else 0.0
        entry["kernels"].sort(key=lambda k: -k[1])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def difference(
    longer: Iterable[tuple[str, float, int]], shorter: Iterable[tuple[str, float, int]]
) -> list[tuple[str, float, int]]:
    """Per kernel, a run of prefill + N decode steps less a run of the prefill alone: the
    N decode steps: the kernels whose calls grew (rows of one name summed, time never below
    zero)."""

    def by_name(rows: Iterable[tuple[str, float, int]]) -> dict[str, tuple[float, int]]:
        out: dict[str, tuple[float, int]] = {}
        for name, us, calls in rows:
            a_us, a_calls = out.get(name, (0.0, 0))
            out[name] = (a_us + us, a_calls + calls)
        return out

    base = by_name(shorter)
    rows = []
    for name, (us, calls) in by_name(longer).items():
        b_us, b_calls = base.get(name, (0.0, 0))
        if calls > b_calls:  # a decode-step kernel; timing noise never goes below zero
            rows.append((name, max(us - b_us, 0.0), calls - b_calls))
    return rows


def added(
    longer: Iterable[tuple[str, float, int]], shorter: Iterable[tuple[str, float, int]]
) -> list[tuple[str, float, int]]:
    """Per kernel, the GPU time a run adds over another of as many steps (a long prompt's
    prefill chunks riding in decode steps): signed, so noise cancels across kernels, and
    counted whether or not its calls grew."""
    base: dict[str, tuple[float, int]] = {}
    for name, us, calls in shorter:
        b_us, b_calls = base.get(name, (0.0, 0))
        base[name] = (b_us + us, b_calls + calls)
    mine: dict[str, tuple[float, int]] = {}
    for name, us, calls in longer:
        a_us, a_calls = mine.get(name, (0.0, 0))
        mine[name] = (a_us + us, a_calls + calls)
    rows = []
    for name in mine.keys() | base.keys():
        a_us, a_calls = mine.get(name, (0.0, 0))
        b_us, b_calls = base.get(name, (0.0, 0))
        rows.append((name, a_us - b_us, a_calls - b_calls))
    return sorted(rows, key=lambda row: -row[1])


def table(
    parts: dict[str, dict], layers: int, steps: int, top: int = 3, what: str = "decode step"
) -> str:
    lines = [
        f"GPU time per MoE layer per {what} ({layers} layers x {steps} steps profiled)",
        "",
        "| category | us per layer-step | share | largest kernels |",
        "| --- | --- | --- | --- |",
    ]
    for name, entry in parts.items():
        largest = "; ".join(
            f"{k[:60]} ({us / max(1, layers * steps):.1f})" for k, us, _ in entry["kernels"][:top]
        )
        lines.append(
            f"| {name} | {entry['us_per_layer_step']:.1f} | {100 * entry['share']:.1f} % | {largest} |"
        )
    return "\n".join(lines)


def from_profiler(prof) -> list[tuple[str, float, int]]:
    """(name, GPU microseconds, calls) of the CUDA kernels in a torch.profiler run."""
    rows = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", None)
        if device_us is None:  # older torch
            device_us = getattr(evt, "self_cuda_time_total", 0.0)
        if device_us and str(getattr(evt, "device_type", "")).endswith("CUDA"):
            rows.append((evt.key, float(device_us), int(evt.count)))
    return rows
