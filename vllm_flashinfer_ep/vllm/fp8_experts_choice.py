"""Which vLLM experts run FP8 MoE layers under the flashinfer_ep backends (config time):
what a named --moe-backend is refused for, what `auto` becomes, which backend a lowered
step budget is rounded for. --moe-backend is one value for every MoE layer served (target
and draft). No vLLM or torch import: doctor and config validation read this.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_flashinfer_ep import backends, envs, model_shape
from vllm_flashinfer_ep.vllm.config_rules import FP8_METHODS

MOE_BACKEND = "deep_gemm"  # vLLM's --moe-backend name; BATCHED_DEEPGEMM for BatchedExperts
# DeepGEMM stores whole 64/128-row tiles through one 2-D map over [experts x rows, N]
# (sm90_fp8_gemm_1d2d.cuh): other row counts spill a tile into the next expert's rows.
ROW_MULTIPLE = 128
# vLLM's switch that takes DeepGEMM away (read by is_deep_gemm_supported). An explicit
# --moe-backend passes over VLLM_MOE_USE_DEEP_GEMM (oracle/fp8.py), so that one is not.
DEEP_GEMM_SWITCH = "VLLM_USE_DEEP_GEMM"


def token_step(ep_world: int) -> int:
    """The --max-num-batched-tokens multiple that keeps DeepGEMM's rows per expert whole tiles."""
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


def platform_reason() -> str | None:
    """Why `--moe-backend auto` does not take DeepGEMM on this host (None: a Hopper GPU
    with vLLM's DeepGEMM)."""
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


def deep_gemm_step(moe_backend: str | None, ep_world: int) -> int:
    """The step an LL step budget is lowered in: whole DeepGEMM row tiles per expert when
    its experts are asked for, else any token count."""
    return token_step(ep_world) if moe_backend == MOE_BACKEND else 1


# --moe-backend values vLLM 0.33.0 serves unquantized MoE layers with here (oracle/
# unquantized.py: marlin, humming fall through to auto; batched_triton is LL's format).
UNQUANTIZED_MOE_BACKENDS = {
    backends.LOW_LATENCY: ("auto", "triton", "batched_triton", "marlin", "humming"),
    backends.HIGH_THROUGHPUT: ("auto", "triton", "marlin", "humming"),
}


def unquantized_experts_reason(flag: str, backend: str, moe_backend: str) -> str | None:
    """Why a BF16 model's MoE layers cannot run with the --moe-backend asked for (None:
    they can): these backends hand tokens to vLLM's Triton experts (batched under LL)."""
    if moe_backend in UNQUANTIZED_MOE_BACKENDS.get(backend, ("auto",)):
        return None
    return (
        f"{flag} runs unquantized MoE layers with vLLM's Triton experts; --moe-backend "
        f"{moe_backend} takes another activation layout or does not serve unquantized "
        "layers. Pass --moe-backend auto (or triton)."
    )


def fp8_experts_reason(
    flag: str,
    backend: str,
    method: str | None,
    block: Any,
    moe_backend: str,
    tokens_per_rank: int | None,
    ep_world: int,
    environ: Any,
    unquantized: str | None = None,
) -> str | None:
    """Why the FP8 MoE layers cannot run with the --moe-backend asked for (None: they can):
    vLLM's Triton experts, or under LL for 128x128 block FP8 its batched DeepGEMM experts.
    `unquantized`: why some served MoE layers stay unquantized (`unquantized_moe`)."""
    if moe_backend in ("auto", "triton"):
        return None
    deep_gemm = MOE_BACKEND
    if moe_backend != deep_gemm:
        return (
            f"{flag} runs FP8 MoE layers with vLLM's Triton experts (or, under "
            f"{backends.LOW_LATENCY} with 128x128 block-FP8, --moe-backend {deep_gemm}); "
            f"--moe-backend {moe_backend} quantizes or lays out activations otherwise. Pass "
            "--moe-backend triton (or leave it at auto)."
        )
    if backend != backends.LOW_LATENCY:
        return (
            f"{flag}: --moe-backend {deep_gemm} runs under {backends.LOW_LATENCY} only (this "
            "backend hands the experts flat rows). Pass --moe-backend triton, or "
            f"--all2all-backend {backends.LOW_LATENCY}."
        )
    if not _is_block_128(method, block):
        return (
            f"{flag}: --moe-backend {deep_gemm} takes 128x128 block-FP8 layers only (vLLM's "
            f"DeepGEMM experts); this model is quantized with {method}"
            + (f", weight_block_size {block}" if block is not None else "")
            + ". Pass --moe-backend triton."
        )
    if unquantized is not None:
        return (
            f"{flag}: --moe-backend {deep_gemm} is one setting for every MoE layer, and "
            f"{unquantized}: vLLM runs unquantized MoE layers with triton, never "
            f"{deep_gemm}. Pass --moe-backend auto or triton."
        )
    reason = switches_reason(flag, environ)
    if reason is None and tokens_per_rank is not None:
        reason = rows_reason(flag, tokens_per_rank, ep_world)
    return reason


def auto_fp8_experts(
    flag: str,
    backend: str,
    method: str | None,
    block: Any,
    tokens_per_rank: int | None,
    ep_world: int,
    environ: Any,
    unquantized: str | None = None,
) -> tuple[str, str]:
    """(the --moe-backend `auto` becomes for FP8 MoE layers, why): vLLM's DeepGEMM batched
    experts under LL where every MoE layer is 128x128 block FP8 and they can run, else
    vLLM's Triton experts."""
    deep_gemm = MOE_BACKEND
    if backend != backends.LOW_LATENCY or not _is_block_128(method, block):
        return "triton", "the scale layouts the package hands vLLM's Triton experts"
    reason = (
        fp8_experts_reason(
            flag, backend, method, block, deep_gemm, tokens_per_rank, ep_world, environ, unquantized
        )
        or platform_reason()
    )
    if reason is not None:
        return "triton", f"DeepGEMM experts cannot run here: {reason}"
    return deep_gemm, "the fastest block-FP8 experts over the LL buffer"


def small_forwards_note(up_to: float | None = None) -> str:
    """What the LL DeepGEMM layers run small forwards on at `up_to` (None: the variable's)."""
    if up_to is None:
        up_to = envs.deep_gemm_received_rows()
    if up_to <= 0:
        return f"every forward on DeepGEMM ({envs.DEEP_GEMM_RECEIVED_ROWS}=0)."
    if up_to == math.inf:
        return (
            "every forward on the package's received-rows Triton experts "
            f"({envs.DEEP_GEMM_RECEIVED_ROWS}=inf)."
        )
    return (
        f"forwards of at most {up_to:g} rows per expert run the package's received-rows "
        f"Triton experts, faster there ({envs.DEEP_GEMM_RECEIVED_ROWS}=0: DeepGEMM for "
        "every forward)."
    )


def _is_block_128(method: str | None, block: Any) -> bool:
    if method == "fp8_per_block":
        return True
    return method == "fp8" and block is not None and list(block) == [128, 128]


def unquantized_moe(modules: Any) -> str | None:
    """Why some MoE layers of a quantized checkpoint stay unquantized (None: none do): its
    ignore list's entries that can name experts (vLLM's quant_utils.is_layer_skipped)."""
    named = [m for m in modules if "expert" in m.lower() or "moe" in m.lower()]
    if not named:
        return None
    more = f" and {len(named) - 2} more" if len(named) > 2 else ""
    return f"the checkpoint leaves MoE layers unquantized ({', '.join(named[:2])}{more})"


def draft_moe(vllm_config: Any) -> str | None:
    """Why a speculative draft's MoE layers cannot take deep_gemm (None: no such draft, its
    own `moe_backend`, or block FP8 like the target): the draft inherits --moe-backend."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or getattr(spec, "moe_backend", None) is not None:
        return None
    if getattr(draft, "is_moe", False) is not True:
        return None
    shape = model_shape.read_shape(draft.hf_config, getattr(draft, "hf_text_config", None))
    method = getattr(draft, "quantization", None)
    if _is_block_128(method, shape.weight_block_size) and not unquantized_moe(
        shape.unquantized_modules
    ):
        return None
    return (
        f"the speculative draft's MoE layers (quantization {method or 'none'}) inherit "
        '--moe-backend (give the draft its own: "moe_backend": "triton" in '
        "--speculative-config)"
    )


def budget_backend(
    flag: str,
    backend: str,
    method: str | None,
    block: Any,
    asked: str | None,
    ep_world: int,
    environ: Any,
    unquantized: str | None = None,
) -> str | None:
    """The --moe-backend an LL step budget is lowered for (`deep_gemm_step`): the one
    asked, or what `auto` will become for an FP8 model."""
    if asked != "auto" or method not in FP8_METHODS:
        return asked
    choice, _ = auto_fp8_experts(flag, backend, method, block, None, ep_world, environ, unquantized)
    return choice
