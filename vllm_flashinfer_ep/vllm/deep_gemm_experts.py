"""vLLM's DeepGEMM batched experts under the LL backend (`--moe-backend deep_gemm`).

Why: for 128x128 block-FP8 layers vLLM 0.33.0 offers `BatchedDeepGemmExperts`
(BATCHED_DEEPGEMM): DeepGEMM's masked grouped GEMM over the expert-major LL buffer. Its
scheduler reads each local expert's received count on the device and computes only the
tiles holding received rows, so it costs what the received rows cost and a captured graph
replays it for any routing: what DeepEP low-latency deployments run for block FP8. Which
of it and the received-rows Triton path (vllm/compact_experts_fp8.py) is faster at a
shape is measured side by side (tests/engine/fp8_experts_probe.py).

What it needs from the package, and gets here:
- Activation scales FP32, MN-major and TMA-aligned ([experts, rows, groups], strides
  (rows * groups, 1, rows)): what DeepEP's LL dispatch hands vLLM. The FP8 wire (NCCL-EP
  writes its scales row-major; its tensor descriptor has no strides) and the quantization
  after receive give row-major scales; `mn_major` re-lays them once per layer, with fixed
  shapes (captured in graphs), instead of DeepGEMM's transpose inside the GEMM call.
- Rows per expert (the LL capacity times the EP world) a multiple of 128: DeepGEMM stores
  a whole 64- or 128-row output tile through one 2-D map over [experts x rows, N]
  (sm90_fp8_gemm_1d2d.cuh), so the last partial tile of a full expert would write into
  the next expert's rows. `rows_reason` refuses other capacities, naming the flag.
Only the LL backend: HT hands Standard-format experts flat rows (vLLM's DeepGemmExperts
re-permutes and quantizes them itself), not covered here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MOE_BACKEND = "deep_gemm"  # vLLM's --moe-backend name; BATCHED_DEEPGEMM for BatchedExperts
ROW_MULTIPLE = 128  # DeepGEMM's largest BLOCK_M on sm90
# vLLM's switches that take DeepGEMM away (vllm/envs.py); either at 0 refuses deep_gemm.
DEEP_GEMM_SWITCHES = ("VLLM_USE_DEEP_GEMM", "VLLM_MOE_USE_DEEP_GEMM")


def is_deep_gemm(fused_experts: Any) -> bool:
    """Whether `fused_experts` is vLLM's BatchedDeepGemmExperts."""
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    return isinstance(fused_experts, BatchedDeepGemmExperts)


def rows_reason(flag: str, tokens_per_rank: int, ep_world: int) -> str | None:
    """Why DeepGEMM cannot run over this LL buffer (None: it can)."""
    rows = tokens_per_rank * ep_world
    if rows % ROW_MULTIPLE == 0:
        return None
    step = ROW_MULTIPLE // math.gcd(ROW_MULTIPLE, ep_world)
    return (
        f"{flag} with --moe-backend {MOE_BACKEND} needs the LL buffer's rows per expert "
        f"(--max-num-batched-tokens {tokens_per_rank} x EP world {ep_world} = {rows}) to be a "
        f"multiple of {ROW_MULTIPLE} (DeepGEMM writes whole row tiles). Pass "
        f"--max-num-batched-tokens a multiple of {step}, or --moe-backend triton."
    )


def switches_reason(flag: str, environ: Any) -> str | None:
    """Why vLLM would not run DeepGEMM here: one of its switches is at 0 (None: on)."""
    for name in DEEP_GEMM_SWITCHES:
        value = environ.get(name)
        if value is not None and value.strip().lstrip("+-").isdigit() and int(value) == 0:
            return (
                f"{flag}: --moe-backend {MOE_BACKEND} asks for DeepGEMM experts but {name}=0 "
                f"turns DeepGEMM off. Unset {name}, or pass --moe-backend triton."
            )
    return None


def mn_major(scales: torch.Tensor) -> torch.Tensor:
    """[experts, rows, groups] FP32 scales in any layout -> the same values MN-major
    (strides (rows * groups, 1, rows)); rows is a multiple of 128 (`rows_reason`), so the
    layout is TMA-aligned as it stands."""
    experts, rows, groups = scales.shape
    out = torch.empty_strided(
        (experts, rows, groups),
        (rows * groups, 1, rows),
        dtype=torch.float32,
        device=scales.device,
    )
    out.copy_(scales)
    return out
