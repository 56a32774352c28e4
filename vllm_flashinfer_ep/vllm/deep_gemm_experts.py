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
  after receive give row-major scales. DeepGEMM would transpose them itself, every row of
  the buffer (capacity x EP world rows per expert) in every layer; `mn_major` copies only
  the rows the round can have filled (tokens each rank sent x senders: one row per expert
  at a batch-1 decode step), with fixed shapes per pooled handle (captured in graphs).
  Rows past those hold whatever the allocator left: DeepGEMM's output rows past each
  expert's count come from them, and nobody reads those.
- Rows per expert (the LL capacity times the EP world) a multiple of 128: DeepGEMM stores
  a whole 64- or 128-row output tile through one 2-D map over [experts x rows, N]
  (sm90_fp8_gemm_1d2d.cuh), so the last partial tile of a full expert would write into
  the next expert's rows. `rows_reason` refuses other capacities, naming the flag; config
  time lowers a budget that does not fit memory to a step that keeps them whole.
- FP32 scales as they are: Hopper. Experts that want packed UE8M0 activation scales
  (Blackwell with vLLM's E8M0 setting: powers of two, packed) are refused at load
  (`device_reason`).
Only the LL backend: HT hands Standard-format experts flat rows (vLLM's DeepGemmExperts
re-permutes and quantizes them itself), not covered here. On Hopper vLLM's E8M0 setting
(`VLLM_USE_DEEP_GEMM_E8M0`, on by default) re-quantizes the block weights for DeepGEMM to
power-of-two scales, as it does without EP.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where scales are re-laid: config time and doctor need none
    import torch

MOE_BACKEND = "deep_gemm"  # vLLM's --moe-backend name; BATCHED_DEEPGEMM for BatchedExperts
ROW_MULTIPLE = 128  # DeepGEMM's largest BLOCK_M on sm90
# vLLM's switch that takes DeepGEMM away (vllm/envs.py, read by is_deep_gemm_supported).
# VLLM_MOE_USE_DEEP_GEMM is not one here: an explicit --moe-backend passes over it
# (oracle/fp8.py select_fp8_moe_backend).
DEEP_GEMM_SWITCH = "VLLM_USE_DEEP_GEMM"


def is_deep_gemm(fused_experts: Any) -> bool:
    """Whether `fused_experts` is vLLM's BatchedDeepGemmExperts."""
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    return isinstance(fused_experts, BatchedDeepGemmExperts)


def token_step(ep_world: int) -> int:
    """The --max-num-batched-tokens multiple that keeps rows per expert whole tiles."""
    return ROW_MULTIPLE // math.gcd(ROW_MULTIPLE, ep_world)


def rows_reason(flag: str, tokens_per_rank: int, ep_world: int) -> str | None:
    """Why DeepGEMM cannot run over this LL buffer (None: it can)."""
    rows = tokens_per_rank * ep_world
    if rows % ROW_MULTIPLE == 0:
        return None
    return (
        f"{flag} with --moe-backend {MOE_BACKEND} needs the LL buffer's rows per expert "
        f"(--max-num-batched-tokens {tokens_per_rank} x EP world {ep_world} = {rows}) to be a "
        f"multiple of {ROW_MULTIPLE} (DeepGEMM writes whole row tiles). Pass "
        f"--max-num-batched-tokens a multiple of {token_step(ep_world)}, or --moe-backend triton."
    )


def switches_reason(flag: str, environ: Any) -> str | None:
    """Why vLLM would not run DeepGEMM here: its switch is at 0 (None: on). Read as vLLM
    reads it (an integer); a value vLLM cannot read is vLLM's to refuse."""
    value = environ.get(DEEP_GEMM_SWITCH)
    try:
        off = value is not None and int(value) == 0
    except ValueError:
        return None
    if not off:
        return None
    return (
        f"{flag}: --moe-backend {MOE_BACKEND} asks for DeepGEMM experts but "
        f"{DEEP_GEMM_SWITCH}={value} turns DeepGEMM off. Unset {DEEP_GEMM_SWITCH}, or pass "
        "--moe-backend triton."
    )


def device_reason(flag: str, fused_experts: Any) -> str | None:
    """Why these DeepGEMM experts cannot take the FP32 scales the package hands them
    (None: they can): on Blackwell with vLLM's E8M0 setting they want packed
    power-of-two scales, which vLLM's own DeepEP path rounds and packs in its dispatch."""
    if not fused_experts.supports_packed_ue8m0_act_scales():
        return None
    return (
        f"{flag} with --moe-backend {MOE_BACKEND} hands DeepGEMM FP32 activation scales "
        "(Hopper); on this GPU DeepGEMM wants packed UE8M0 scales. Pass --moe-backend triton."
    )


def platform_reason() -> str | None:
    """Why `--moe-backend auto` does not take these experts on this host (None: a Hopper
    GPU with vLLM's DeepGEMM, where they were measured fastest for block FP8)."""
    try:
        from vllm.platforms import current_platform
        from vllm.utils.deep_gemm import is_deep_gemm_supported

        if not (current_platform.is_cuda() and current_platform.is_device_capability(90)):
            return "not a Hopper GPU"
        if not is_deep_gemm_supported():
            return "vLLM's DeepGEMM is not available here"
    except Exception as exc:  # noqa: BLE001 - no device to ask: the Triton experts
        return f"the GPU could not be queried ({type(exc).__name__})"
    return None


def mn_major(scales: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[experts, T, groups] FP32 scales in any layout -> a new MN-major tensor (strides
    (T * groups, 1, T)) holding their first `rows` rows per expert (all: None); T is a
    multiple of 128 (`rows_reason`), so the layout is TMA-aligned as it stands."""
    import torch

    experts, total, groups = scales.shape
    out = torch.empty_strided(
        (experts, total, groups),
        (total * groups, 1, total),
        dtype=torch.float32,
        device=scales.device,
    )
    rows = total if rows is None else max(0, min(rows, total))
    out[:, :rows].copy_(scales[:, :rows])
    return out
