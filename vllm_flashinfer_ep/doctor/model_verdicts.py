"""doctor's verdicts on a model: the engine's config-time rules (vllm/config_rules.py,
vllm/fp8_experts_choice.py) applied to its config.json (through model_shape, as config
validation reads it) and the serve arguments."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from vllm_flashinfer_ep import envs, model_shape
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.doctor.model_config import ModelConfigError, load_model_config
from vllm_flashinfer_ep.doctor.settings import (
    ServeSettings,
    checked_backend,
    vllm_batched_dp_tokens,
    vllm_default_tokens,
    vllm_defaults,
)
from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError
from vllm_flashinfer_ep.runtime.buffer_sizes import LL_BUFFER_BUDGET_FRACTION
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    MAX_TOPK_HT,
    MAX_TOPK_LL,
    SUPPORTED_HIDDEN_SIZES,
    round_up_ll_hidden_size,
)
from vllm_flashinfer_ep.vllm import config_rules as rules
from vllm_flashinfer_ep.vllm import fp8_experts_choice as fp8_choice


def model_checks(
    model: str, tokens_per_rank: int | None = None, settings: ServeSettings | None = None
) -> list[Check]:
    """The engine's config-time verdicts on `model`, as doctor lines."""
    settings = settings or ServeSettings()
    if tokens_per_rank is not None:
        settings = replace(settings, max_num_batched_tokens=tokens_per_rank)
    try:
        cfg = load_model_config(model)
    except ModelConfigError as exc:
        return [Check("model config", False, str(exc), exc.fix)]
    except Exception as exc:  # noqa: BLE001 - report why the config is unreadable
        return [
            Check("model config", False, str(exc), "pass a local model dir or a reachable HF id")
        ]
    cfg = model_shape.with_overrides(cfg, settings.hf_overrides)
    shape = model_shape.read_shape(
        cfg,
        redundant_experts=model_shape.redundant_experts(settings.enable_eplb, settings.eplb_config),
    )
    checks = []
    # Another backend's name is reported by serve_checks; the checks are those of LL.
    backend = checked_backend(settings.backend)
    flag = f"--all2all-backend {backend}"
    low_latency = backend == LOW_LATENCY
    hidden = shape.hidden_size
    if hidden is not None:
        reason = rules.hidden_reason(flag, backend, hidden)
        if not low_latency:
            detail = f"{hidden} (high throughput takes any multiple of 8)"
        elif reason is not None:
            detail = f"{hidden} (LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
        elif round_up_ll_hidden_size(hidden) == hidden:
            detail = f"{hidden} (a native NCCL-EP LL size)"
        else:
            detail = (
                f"{hidden} -> rounded up to {round_up_ll_hidden_size(hidden)} for {LOW_LATENCY} "
                f"(LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
            )
        name = "LL hidden size" if low_latency else "hidden size"
        checks.append(Check(name, reason is None, detail, reason or ""))
    if shape.top_k is None:
        why = "no experts-per-token field: not an MoE config?"
        checks.append(Check("top_k", False, why, "pass an MoE model"))
    else:
        reason = rules.top_k_reason(flag, backend, shape.top_k)
        limits = f"(limits: low latency {MAX_TOPK_LL}, high throughput {MAX_TOPK_HT})"
        checks.append(Check("top_k", reason is None, f"{shape.top_k} {limits}", reason or ""))
    checks.append(_dtype_check(shape, settings, flag))
    if settings.use_all2all and settings.enable_expert_parallel and shape.physical_experts:
        ranks = settings.ep_world
        split = rules.expert_split_reason(
            flag, shape.physical_experts, shape.redundant_experts, ranks
        )
        detail = f"{shape.physical_experts} experts over {ranks} EP ranks"
        checks.append(Check("experts per EP rank", split is None, detail, split or ""))
    method = settings.quantization or shape.quant_method
    block = shape.weight_block_size
    reason = rules.quantization_reason(flag, method, block) or rules.gpt_oss_fp8_reason(
        flag, shape.model_type, method
    )
    shown = f"quantization {method or 'none'}"
    shown += f", weight_block_size {block}" if block is not None else ""
    checks.append(Check("checkpoint precision", reason is None, shown, reason or ""))
    fleet = shape.ll_fleet_shape() if low_latency else None
    total = rules.device_memory_bytes() if fleet is not None else None
    unquantized = fp8_choice.unquantized_moe(shape.unquantized_modules)
    asked_rounds = _round_tokens() if fleet is not None else 0
    rounds = _split_rounds(settings, asked_rounds)
    if asked_rounds and rounds is None and settings.max_num_batched_tokens is None:
        # the variable set: LL takes vLLM's budget for engines without EP, not LL's default
        default = vllm_default_tokens(settings)
        settings = replace(settings, max_num_batched_tokens=default) if default else settings
    # the fleet holds one round: a whole step, or VLLM_FLASHINFER_EP_LL_ROUND_TOKENS
    fleet_settings = (
        settings if rounds is None else replace(settings, max_num_batched_tokens=rounds[0])
    )
    memory = None
    if fleet is not None:
        memory = _ll_memory_verdict(flag, shape, fleet, fleet_settings, total, method, unquantized)
    if method is None and settings.moe_backend != "auto":
        asked = settings.moe_backend
        why = fp8_choice.unquantized_experts_reason(flag, backend, asked)
        checks.append(Check("experts", why is None, f"--moe-backend {asked}", why or ""))
    if method in rules.MXFP4_METHODS:
        asked = settings.moe_backend
        why = rules.mxfp4_experts_reason(flag, backend, method, asked, settings.enable_lora)
        checks.append(Check("experts", why is None, f"MXFP4, --moe-backend {asked}", why or ""))
    if method in rules.FP8_METHODS and reason is None:
        # The engine checks the experts against the step budget after lowering it.
        tokens = (memory.lowered_to if memory else None) or fleet_settings.tokens
        checks.append(
            _fp8_experts_check(flag, backend, method, block, settings, tokens, unquantized)
        )
    if not low_latency:
        checks.append(_ht_tokens_check(flag, shape, settings))
    if fleet is not None:
        checks.append(_ll_memory_check(shape, fleet, fleet_settings, memory, rounds is not None))
        if rounds is not None:
            checks.append(_ll_rounds_check(flag, settings, *rounds))
        elif asked_rounds:
            checks.append(
                Check(
                    "LL rounds",
                    True,
                    f"{envs.LL_ROUND_TOKENS}={asked_rounds} is at or above the step budget "
                    f"({settings.max_num_batched_tokens or 'vLLM default, set by the GPU'}): "
                    "no forward splits, and the fleet holds a whole step",
                    "set it below --max-num-batched-tokens, or unset it",
                    warn=True,
                )
            )
        elif settings.max_num_batched_tokens is None:
            larger = replace(settings, max_num_batched_tokens=LARGER_LL_BUDGET)
            checks.append(
                _ll_budget_check(
                    settings,
                    memory,
                    _ll_memory_verdict(flag, shape, fleet, larger, total, method, unquantized),
                )
            )
        rdma = _rdma_check(flag, fleet, settings, total)
        if rdma is not None:
            checks.append(rdma)
    return checks


def draft_check(spec: dict[str, Any] | None, settings: ServeSettings) -> Check | None:
    """--speculative-config: the engine's verdict on a `draft_model` draft (the one method
    whose draft has a parallel config of its own), from its config.json."""
    if not spec or spec.get("method") != "draft_model" or not spec.get("model"):
        return None
    if not (settings.use_all2all and settings.enable_expert_parallel):
        return None
    flag = f"--all2all-backend {checked_backend(settings.backend)}"
    draft = str(spec["model"])
    try:
        cfg = load_model_config(draft)
    except Exception as exc:  # noqa: BLE001 - report why the config is unreadable
        return Check("draft model", True, f"{draft}: not checked ({exc})", "", warn=True)
    if model_shape.read_shape(cfg).routed_experts is None:
        return Check("draft model", True, f"{draft} (dense)")
    reason = rules.draft_model_reason(flag, draft)
    return Check("draft model", False, f"{draft} (MoE, method draft_model)", reason)


def _fp8_experts_check(
    flag: str,
    backend: str,
    method: str,
    block: Any,
    settings: ServeSettings,
    tokens: int,
    unquantized: str | None,
) -> Check:
    """--moe-backend for an FP8 model: the engine's verdict (`fp8_experts_reason`) at the
    LL step budget after any lowering (`tokens`)."""
    asked, ll_tokens = settings.moe_backend, tokens if backend == LOW_LATENCY else None
    reason = fp8_choice.fp8_experts_reason(
        flag, backend, method, block, asked, ll_tokens, settings.ep_world, os.environ, unquantized
    )
    if reason is not None:
        return Check("FP8 experts", False, f"--moe-backend {asked}", reason)
    runs, shown = asked, f"--moe-backend {asked}"
    if asked == "auto":
        runs, why = fp8_choice.auto_fp8_experts(
            flag, backend, method, block, ll_tokens, settings.ep_world, os.environ, unquantized
        )
        shown += f" -> {runs} ({why})"
    kind = "DeepGEMM batched" if runs == "deep_gemm" else "Triton"
    detail = f"{shown}: vLLM's {kind} experts"
    if runs == "deep_gemm" and backend == LOW_LATENCY:
        try:  # a bad value is the environment check's to report
            detail += f"; {fp8_choice.small_forwards_note()}"
        except FlashInferEPEnvVarError:
            pass
    return Check("FP8 experts", True, detail)


def _dtype_check(shape: model_shape.ModelShape, settings: ServeSettings, flag: str) -> Check:
    served = model_shape.served_dtype(settings.dtype, shape.dtype)
    detail = f"{served or 'unknown'} (checkpoint {shape.dtype or 'names none'}, --dtype {settings.dtype})"
    if served is None:
        return Check(
            "dtype",
            True,
            detail,
            "config.json names no dtype: vLLM reads it from the "
            "weights; pass --dtype bfloat16 to be sure",
            warn=True,
        )
    reason = rules.dtype_reason(flag, served)
    return Check("dtype", reason is None, detail, reason or "")


def _ht_tokens_check(flag: str, shape: model_shape.ModelShape, settings: ServeSettings) -> Check:
    """--max-num-batched-tokens against NCCL-EP's HT limit per rank (`ht_tokens_verdict`)."""
    name = f"HT tokens per rank (at most {HT_MAX_TOKENS_PER_RANK})"
    chunked = True if settings.enable_chunked_prefill is None else settings.enable_chunked_prefill
    max_model_len = settings.max_model_len or shape.max_position_embeddings
    tokens, source = settings.max_num_batched_tokens, ""
    if tokens is None:
        tokens = vllm_default_tokens(settings)
        source = " (vLLM's default for `vllm serve` on this GPU)"
        if not chunked and max_model_len is not None:
            # vLLM: without chunked prefill the default step budget is at least a prompt
            tokens = max(max_model_len, tokens or 0)
            source = " (vLLM's default with chunked prefill off: --max-model-len)"
    if tokens is None:
        return Check(
            name,
            True,
            "--max-num-batched-tokens unset: vLLM's default depends on the GPU "
            "(16384 on GPUs of 160 GiB or more); not checked: no GPU visible here",
            "run doctor on the GPU host, or pass --max-num-batched-tokens "
            f"<= {HT_MAX_TOKENS_PER_RANK}",
            warn=True,
        )
    verdict = rules.ht_tokens_verdict(
        flag,
        tokens,
        chunked_prefill=chunked,
        max_model_len=max_model_len,
        max_num_seqs=settings.max_num_seqs,
    )
    detail = f"--max-num-batched-tokens {tokens}{source}"
    if verdict.refusal is not None:
        return Check(name, False, detail, verdict.refusal)
    if verdict.lowered_to is not None:
        return Check(
            name,
            True,
            detail,
            f"the engine lowers --max-num-batched-tokens from {tokens} to "
            f"{verdict.lowered_to}: {verdict.why} (pass a value <= {verdict.lowered_to} "
            "to silence this)",
            warn=True,
        )
    return Check(name, True, detail)


def _ll_memory_verdict(
    flag: str,
    shape: model_shape.ModelShape,
    fleet: tuple[int, int, int],
    settings: ServeSettings,
    total: int | None,
    method: str | None,
    unquantized: str | None,
):
    """config_rules.ll_memory_verdict on the serve arguments (vLLM's defaults where unset)."""
    gmu, seqs, chunked = vllm_defaults(settings) if total is not None else (1.0, 1, True)
    return rules.ll_memory_verdict(
        flag,
        fleet,
        settings.tokens,
        total,
        gmu,
        max_num_seqs=seqs,
        chunked_prefill=chunked,
        max_model_len=settings.max_model_len or shape.max_position_embeddings,
        token_step=fp8_choice.deep_gemm_step(
            fp8_choice.budget_backend(
                flag,
                LOW_LATENCY,
                method,
                shape.weight_block_size,
                settings.moe_backend,
                settings.ep_world,
                os.environ,
                unquantized,
            ),
            settings.ep_world,
        ),
    )


def _ll_memory_check(
    shape: model_shape.ModelShape,
    fleet: tuple[int, int, int],
    settings: ServeSettings,
    verdict,
    rounds: bool = False,
) -> Check:
    """The LL fleet's estimated memory per GPU and the engine's verdict on it (`rounds`:
    the fleet holds one round of VLLM_FLASHINFER_EP_LL_ROUND_TOKENS, not a step)."""
    hidden, experts, top_k = fleet
    tokens = settings.tokens
    sized_for = (
        f"for rounds of {tokens} tokens ({envs.LL_ROUND_TOKENS})"
        if rounds
        else f"at --max-num-batched-tokens {tokens}"
    )
    parts, gib = verdict.parts, rules.GIB
    redundant = (
        f" ({shape.routed_experts} + {shape.redundant_experts} EPLB redundant)"
        if shape.redundant_experts
        else ""
    )
    detail = (
        f"about {verdict.need / gib:.2f} GiB per GPU {sized_for}: "
        f"NCCL-EP fixed {parts['fixed'] / gib:.2f} + buffers {parts['buffers'] / gib:.2f} + "
        f"FlashInfer receive buffer {parts['receive'] / gib:.2f} + {verdict.handles} pooled handles and "
        f"their padding staging {parts['pool'] / 1e6:.1f} MB "
        f"({experts} experts{redundant}, hidden {hidden}, top_k {top_k})"
    )
    name = "LL memory estimate"
    if rounds:
        reason = rules.ll_rounds_memory_reason(f"--all2all-backend {LOW_LATENCY}", tokens, verdict)
        if reason is not None:
            return Check(name, False, detail, reason)
    if verdict.refusal is not None:
        return Check(name, False, detail, verdict.refusal)
    if verdict.budget is None:
        return Check(
            name,
            True,
            detail + "; not checked: no GPU visible here",
            "run doctor on the GPU host to check it against GPU memory",
            warn=True,
        )
    if verdict.lowered_to is not None:
        return Check(
            name,
            True,
            detail,
            f"the engine lowers --max-num-batched-tokens from {tokens} "
            f"to {verdict.lowered_to}: the fleet {verdict.why}",
            warn=True,
        )
    return Check(name, True, f"{detail}; fits the budget of {verdict.budget / gib:.2f} GiB")


def _round_tokens() -> int:
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS (0 where unset or bad: the environment check's)."""
    try:
        return envs.ll_round_tokens()
    except FlashInferEPEnvVarError:
        return 0


def _split_rounds(settings: ServeSettings, round_tokens: int) -> tuple[int, int | None] | None:
    """(round tokens, step budget or None where vLLM's default is unknown here) where
    VLLM_FLASHINFER_EP_LL_ROUND_TOKENS splits LL forwards, as the engine decides it
    (config_rules.round_capacity); None where a round is a whole step. A bad value is
    the environment check's to report."""
    if round_tokens == 0:
        return None
    # LL is then not batched DP MoE: vLLM's budget for engines without EP
    budget = settings.max_num_batched_tokens or vllm_default_tokens(settings)
    if budget is None:
        return round_tokens, None
    capacity = rules.round_capacity(budget, LOW_LATENCY)
    return (capacity, budget) if capacity < budget else None


def _ll_rounds_check(
    flag: str, settings: ServeSettings, round_tokens: int, budget: int | None
) -> Check:
    refused = rules.round_agreement_reason(
        flag, round_tokens, settings.ep_world, settings.data_parallel_size
    )
    if refused is not None:
        return Check("LL rounds", False, f"{envs.LL_ROUND_TOKENS}={round_tokens}", refused)
    steps = (
        f"a step of up to --max-num-batched-tokens {budget} runs each MoE layer as up to "
        f"{-(-budget // round_tokens)} rounds"
        if budget is not None
        else "longer steps (vLLM's budget for engines without EP, set by the GPU) run as "
        "several rounds per MoE layer"
    )
    return Check(
        "LL rounds",
        True,
        f"at most {round_tokens} tokens per rank per round ({envs.LL_ROUND_TOKENS}); {steps}; "
        "the engine refuses a value below its largest CUDA graph capture size",
    )


# The larger budget the serving benchmark measured beside LL's default (docs/benchmarks.md).
LARGER_LL_BUDGET = 1024


def _ll_budget_check(settings: ServeSettings, now, larger) -> Check:
    """LL's step budget when none is passed, and what a larger one costs: its steps above
    the largest CUDA graph capture size run without graphs, its buffers take KV cache."""
    gib = rules.GIB
    without = vllm_default_tokens(settings)
    others = f"; without EP vLLM gives {without} on this GPU" if without else ""
    cost = f"about {larger.need / gib:.2f} GiB per GPU against {now.need / gib:.2f}"
    if larger.refusal is not None or larger.lowered_to is not None:
        cost += ", more than the engine allows here"
    return Check(
        "LL step budget",
        True,
        f"--max-num-batched-tokens unset: LL steps take at most {settings.tokens} tokens "
        f"(the package's default for LL: {rules.LL_DEFAULT_STEP_TOKENS}, at most the largest "
        f"CUDA graph capture size; vLLM gives {vllm_batched_dp_tokens()} for batched DP "
        f"MoE{others}); --max-num-batched-tokens "
        f"{LARGER_LL_BUDGET} runs steps above the capture size without graphs for {cost}, "
        "taken from the KV cache, and served slower than the default",
    )


def _rdma_check(
    flag: str, fleet: tuple[int, int, int], settings: ServeSettings, total: int | None
) -> Check | None:
    """VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES against the fleet, as config time checks it."""
    try:
        rdma = envs.rdma_buffer_bytes()
    except Exception:  # noqa: BLE001 - a bad value is reported by the variables check
        return None
    if rdma == 0:
        return None
    budget = None
    if total is not None:
        gmu, _, _ = vllm_defaults(settings)
        budget = int(int(total * gmu) * LL_BUFFER_BUDGET_FRACTION)
    reason = rules.rdma_buffer_reason(flag, rdma, fleet, settings.tokens, settings.ep_world, budget)
    return Check("RDMA buffer", reason is None, f"{envs.RDMA_BUFFER_BYTES}={rdma}", reason or "")
