"""Engine-config-time checks for the flashinfer_ep backends, in `VllmConfig.__post_init__`
(the `config_validation` patch row), before any worker starts: config_rules.py and
fp8_experts_choice.py applied to vLLM's config. A refusal names the flag; what the rules
lower or choose is written back and logged. GPU checks run in the worker before load.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_flashinfer_ep import backends, envs, model_shape
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvVarError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.model_shape import ModelShape
from vllm_flashinfer_ep.runtime import buffer_sizes, env_checks
from vllm_flashinfer_ep.vllm import config_rules
from vllm_flashinfer_ep.vllm.config_rules import (
    MXFP4_METHODS,
    dtype_reason,
    ep_world_size,
    fault_tolerance_reason,
    gpt_oss_fp8_reason,
    hidden_reason,
    ht_tokens_verdict,
    ll_memory_verdict,
    mxfp4_experts_reason,
    quantization_reason,
    rdma_buffer_reason,
    top_k_reason,
    ubatching_reason,
    unused_backend_warning,
)
from vllm_flashinfer_ep.vllm.fp8_experts_choice import (
    MOE_BACKEND,
    auto_fp8_experts,
    budget_backend,
    deep_gemm_step,
    draft_moe,
    fp8_experts_reason,
    small_forwards_note,
    unquantized_experts_reason,
    unquantized_moe,
)

logger = get_logger(__name__)


def validate(vllm_config: Any) -> None:
    par = vllm_config.parallel_config
    backend = par.all2all_backend
    if not backends.is_ours(backend):
        return
    flag = f"--all2all-backend {backend}"
    # The package's own variables: a bad value fails here, not after a GPU start-up.
    envs.validate_all()
    transport = config_rules.transport_reason()
    if transport is not None:
        raise FlashInferEPEnvVarError(transport)

    for reason in (
        ubatching_reason(flag, par.use_ubatching),
        fault_tolerance_reason(flag, backend, par.enable_fault_tolerance),
        config_rules.elastic_ep_reason(flag, bool(getattr(par, "enable_elastic_ep", False))),
    ):
        if reason is not None:
            raise FlashInferEPConfigError(reason)
    override = os.environ.get("NCCL_EP_TIMEOUT_MS")
    if par.enable_fault_tolerance and override is not None:
        logger.warning(
            "NCCL_EP_TIMEOUT_MS=%s is set: NCCL-EP's kernels wait that long for a silent "
            "peer, not %s=%d (which still bounds the survivors' agreement after a retry). "
            "Unset NCCL_EP_TIMEOUT_MS to use %s.",
            override,
            envs.FT_TIMEOUT_MS,
            envs.ft_timeout_ms(),
            envs.FT_TIMEOUT_MS,
        )
    # The host probes the worker and `doctor` use; these two need no GPU.
    for check in (env_checks.check_nccl_ep_installed(), env_checks.check_torch_cuda()):
        if not check.ok:
            raise FlashInferEPConfigError(f"{flag} cannot run: {check.detail}; {check.fix}.")

    placement = config_rules.placement_reason(
        flag, getattr(par, "expert_placement_strategy", "linear")
    )
    if placement is not None:
        raise FlashInferEPConfigError(placement)
    model = vllm_config.model_config
    shape = None
    if model is not None:
        shape = model_shape.from_vllm_config(vllm_config)
        _validate_model(model, shape, backend, flag)
    if par.use_all2all and par.enable_expert_parallel:
        if shape is not None and getattr(model, "is_moe", True):
            split = config_rules.expert_split_reason(
                flag, shape.physical_experts, shape.redundant_experts, ep_world_size(par)
            )
            if split is not None:
                raise FlashInferEPConfigError(split)
        _validate_draft(vllm_config, backend, flag)
    if backend == backends.HIGH_THROUGHPUT and par.use_all2all:
        _clamp_ht_tokens(vllm_config, flag)
    if backend == backends.LOW_LATENCY and par.use_all2all:
        _check_ll_capacity(vllm_config, flag)
    if model is not None and par.use_all2all:  # after the capacity: DeepGEMM reads it
        _check_unquantized_experts(vllm_config, backend, flag)
        _pin_fp8_experts(vllm_config, backend, flag)
    if par.use_all2all:
        _check_rdma_buffer(vllm_config, backend, flag)
        _log_parallel_layout(par, flag)

    unused = unused_backend_warning(backend, par.use_all2all, par.enable_expert_parallel)
    if unused is not None:
        logger.warning("%s", unused)


def _clamp_ht_tokens(vllm_config: Any, flag: str) -> None:
    """Each step within NCCL-EP's HT tokens per rank (`ht_tokens_verdict`): lowered or refused."""
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    if sched is None:
        return
    verdict = ht_tokens_verdict(
        flag,
        sched.max_num_batched_tokens,
        chunked_prefill=sched.enable_chunked_prefill,
        max_model_len=None if model is None else model.max_model_len,
        max_num_seqs=sched.max_num_seqs,
    )
    if verdict.refusal is not None:
        raise FlashInferEPConfigError(verdict.refusal)
    if verdict.lowered_to is not None:
        _lower_step_budget(vllm_config, flag, verdict.lowered_to, verdict.why)


def _check_ll_capacity(vllm_config: Any, flag: str) -> None:
    """The LL capacity is the step budget, and NCCL-EP's buffers grow with it times experts
    times hidden: `ll_memory_verdict` lowers the budget to fit, or refuses."""
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    if sched is None or model is None or getattr(model, "is_moe", True) is False:
        return
    shape = _ll_fleet_shape(vllm_config)
    if shape is None:
        return
    round_tokens = config_rules.round_capacity(sched.max_num_batched_tokens, backends.LOW_LATENCY)
    if round_tokens < sched.max_num_batched_tokens:
        _check_ll_rounds(vllm_config, flag, shape, round_tokens)
        return
    asked = envs.ll_round_tokens()
    if asked > 0:  # set, but a round already holds a whole step
        logger.warning(
            "%s: %s=%d is at or above --max-num-batched-tokens %d: no forward splits into "
            "rounds and the fleet holds a whole step (with the variable set, the budget is "
            "vLLM's for engines without EP unless passed). Set it below the budget, or unset it.",
            flag,
            envs.LL_ROUND_TOKENS,
            asked,
            sched.max_num_batched_tokens,
        )
    verdict = ll_memory_verdict(
        flag,
        shape,
        sched.max_num_batched_tokens,
        config_rules.device_memory_bytes(),  # by module: tests stand in a GPU there
        vllm_config.cache_config.gpu_memory_utilization,
        max_num_seqs=sched.max_num_seqs,
        chunked_prefill=sched.enable_chunked_prefill,
        max_model_len=model.max_model_len,
        token_step=deep_gemm_step(
            _budget_backend(vllm_config, flag), ep_world_size(vllm_config.parallel_config)
        ),
    )
    if verdict.budget is None:
        logger.warning("%s: %s", flag, verdict.summary)
    else:
        logger.info("%s: %s", flag, verdict.summary)
    if verdict.refusal is not None:
        raise FlashInferEPConfigError(verdict.refusal)
    if verdict.lowered_to is not None:
        _lower_step_budget(vllm_config, flag, verdict.lowered_to, f"{flag} {verdict.why}")


def _check_ll_rounds(
    vllm_config: Any, flag: str, shape: tuple[int, int, int], round_tokens: int
) -> None:
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS below the step budget: the fleet is sized for one
    round of that many tokens and longer forwards split (vllm/round_chunks.py). A captured
    forward is one round, so the round covers every capture size; the fleet must fit."""
    var = f"{envs.LL_ROUND_TOKENS}={round_tokens}"
    sched, comp = vllm_config.scheduler_config, vllm_config.compilation_config
    par = vllm_config.parallel_config
    ep_world = ep_world_size(par)
    reason = config_rules.round_agreement_reason(
        flag, round_tokens, ep_world, par.data_parallel_size
    )
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    # The sizes are final only after vLLM's own checks (a set cudagraph mode has them
    # here); the manager checks again at load (managers.py).
    captured = [] if comp is None or not comp.cudagraph_mode else comp.cudagraph_capture_sizes
    reason = config_rules.round_capture_reason(flag, round_tokens, captured)
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    # Only DeepGEMM asked by name refuses a round of part tiles: `auto` decides for the
    # round itself (_pin_fp8_experts) and keeps Triton where DeepGEMM cannot take it.
    asked = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    step = deep_gemm_step(asked, ep_world)
    if round_tokens % step:
        raise FlashInferEPConfigError(
            f"{flag}: {var} is not a multiple of {step}, the tokens per rank DeepGEMM's "
            f"experts take in whole row tiles here. Set a multiple of {step}."
        )
    model = vllm_config.model_config
    verdict = ll_memory_verdict(
        flag,
        shape,
        round_tokens,
        config_rules.device_memory_bytes(),
        vllm_config.cache_config.gpu_memory_utilization,
        max_num_seqs=1,  # a step of more sequences than a round takes splits too
        chunked_prefill=True,
        max_model_len=model.max_model_len,
        token_step=step,
    )
    reason = config_rules.ll_rounds_memory_reason(flag, round_tokens, verdict)
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    budget = sched.max_num_batched_tokens
    logger.info(
        "%s: LL rounds carry at most %d tokens per rank (%s); a step of up to "
        "--max-num-batched-tokens %d runs each MoE layer as up to %d rounds. %s",
        flag,
        round_tokens,
        envs.LL_ROUND_TOKENS,
        budget,
        -(-budget // round_tokens),
        verdict.summary,
    )


def _budget_backend(vllm_config: Any, flag: str) -> str | None:
    """`budget_backend` for an LL engine config."""
    asked = getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", None)
    model = vllm_config.model_config
    shape = model_shape.from_vllm_config(vllm_config)
    return budget_backend(
        flag,
        backends.LOW_LATENCY,
        getattr(model, "quantization", None),
        shape.weight_block_size,
        asked,
        ep_world_size(vllm_config.parallel_config),
        os.environ,
        _served_unquantized(vllm_config, shape),
    )


def _served_unquantized(vllm_config: Any, shape: ModelShape) -> str | None:
    """Why some served MoE layers stay unquantized (`unquantized_moe`, `draft_moe`)."""
    return unquantized_moe(shape.unquantized_modules) or draft_moe(vllm_config)


def _ll_fleet_shape(vllm_config: Any) -> tuple[int, int, int] | None:
    """(rounded LL hidden size, physical experts, top_k) of the model (None: unknown)."""
    return model_shape.from_vllm_config(vllm_config).ll_fleet_shape()


def _check_rdma_buffer(vllm_config: Any, backend: str, flag: str) -> None:
    """A fixed RDMA buffer must hold the LL fleet's layout (envs.py checks its range)."""
    rdma = envs.rdma_buffer_bytes()
    if rdma == 0 or backend != backends.LOW_LATENCY or vllm_config.model_config is None:
        return
    shape = _ll_fleet_shape(vllm_config)
    if shape is None:
        return
    total = config_rules.device_memory_bytes()  # by module: tests stand in a GPU there
    budget = None
    if total is not None:
        gmu = vllm_config.cache_config.gpu_memory_utilization
        budget = int(int(total * gmu) * buffer_sizes.LL_BUFFER_BUDGET_FRACTION)
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    reason = rdma_buffer_reason(
        flag, rdma, shape, tokens, ep_world_size(vllm_config.parallel_config), budget
    )
    if reason is not None:
        raise FlashInferEPConfigError(reason)


def _log_parallel_layout(par: Any, flag: str) -> None:
    """How TP and PP combine with the backend (docs/architecture.md): both are accepted."""
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    if (tp == 1 and pp == 1) or not par.enable_expert_parallel:
        return
    parts = [f"one NCCL-EP fleet per EP group of {ep_world_size(par)} ranks (DP x TP)"]
    if tp > 1:
        parts.append(
            f"--tensor-parallel-size {tp}: sequence-parallel MoE, each TP rank dispatches "
            f"its 1/{tp} of the tokens"
        )
    if pp > 1:
        parts.append(f"--pipeline-parallel-size {pp}: one EP group (and fleet) per pipeline stage")
    logger.info("%s: %s.", flag, "; ".join(parts))


def _lower_step_budget(vllm_config: Any, flag: str, limit: int, log_why: str) -> None:
    """Lower --max-num-batched-tokens to `limit` with a warning."""
    sched = vllm_config.scheduler_config
    asked = sched.max_num_batched_tokens
    sched.max_num_batched_tokens = limit
    if sched.max_num_scheduled_tokens is not None:
        sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, limit)
    logger.warning(
        "%s: %s; --max-num-batched-tokens lowered from %d to %d (pass a value <= %d to "
        "silence this).",
        flag,
        log_why,
        asked,
        limit,
        limit,
    )


def _check_unquantized_experts(vllm_config: Any, backend: str, flag: str) -> None:
    """BF16 MoE models: the --moe-backend asked for serves them through this backend."""
    model, kernel = vllm_config.model_config, getattr(vllm_config, "kernel_config", None)
    if getattr(model, "quantization", None) or kernel is None:
        return
    if getattr(model, "is_moe", True) is False:
        return
    reason = unquantized_experts_reason(flag, backend, kernel.moe_backend)
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    if backend == backends.HIGH_THROUGHPUT and kernel.moe_backend == "auto":
        # vLLM's auto may pick FlashInfer's TRT-LLM BF16 experts (Blackwell); HT needs Triton.
        kernel.moe_backend = "triton"
        logger.info(
            "%s: unquantized MoE layers use --moe-backend auto -> triton (vLLM's Triton "
            "experts, what this backend hands its received rows to).",
            flag,
        )


def _pin_fp8_experts(vllm_config: Any, backend: str, flag: str) -> None:
    """FP8 MoE layers: --moe-backend checked (`fp8_experts_reason`), auto pinned, logged.
    MXFP4 layers: --moe-backend checked (`mxfp4_experts_reason`), vLLM's pick kept."""
    model, kernel = vllm_config.model_config, getattr(vllm_config, "kernel_config", None)
    if not getattr(model, "quantization", None) or kernel is None:
        return
    if getattr(model, "is_moe", True) is False:
        return
    if model.quantization in MXFP4_METHODS:
        lora = getattr(vllm_config, "lora_config", None) is not None
        reason = mxfp4_experts_reason(
            flag, backend, model.quantization, kernel.moe_backend, lora=lora
        )
        if reason is not None:
            raise FlashInferEPConfigError(reason)
        return
    shape = model_shape.from_vllm_config(vllm_config)
    sched = vllm_config.scheduler_config
    unquantized = _served_unquantized(vllm_config, shape)
    # the LL buffer's tokens per rank: one round's where rounds split, else the budget's
    tokens = (
        config_rules.round_capacity(sched.max_num_batched_tokens, backend)
        if sched is not None
        else None
    )
    reason = fp8_experts_reason(
        flag,
        backend,
        model.quantization,
        shape.weight_block_size,
        kernel.moe_backend,
        tokens,
        ep_world_size(vllm_config.parallel_config),
        os.environ,
        unquantized,
    )
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    if kernel.moe_backend == MOE_BACKEND:
        logger.info(
            "%s: FP8 MoE layers use vLLM's DeepGEMM batched experts (--moe-backend %s) over "
            "the LL buffer, with MN-major activation scales; %s",
            flag,
            MOE_BACKEND,
            small_forwards_note(),
        )
        return
    if kernel.moe_backend == "triton":
        return
    choice, why = auto_fp8_experts(
        flag,
        backend,
        model.quantization,
        shape.weight_block_size,
        tokens,
        ep_world_size(vllm_config.parallel_config),
        os.environ,
        unquantized,
    )
    kernel.moe_backend = choice
    logger.info(
        "%s: FP8 MoE layers use --moe-backend auto -> %s (%s); 128x128 block-FP8 layers "
        "dispatch FP8 (%s=0: BF16), the others dispatch BF16 and quantize to FP8 after "
        "receive.%s",
        flag,
        choice,
        why,
        envs.FP8_DISPATCH,
        f" DeepGEMM: {small_forwards_note()}" if choice == MOE_BACKEND else "",
    )


def _validate_draft(vllm_config: Any, backend: str, flag: str) -> None:
    """A speculative draft with MoE layers. MTP and EAGLE drafts run their MoE layers
    through this backend (the target's parallel config): the model rules apply. A
    `draft_model` draft's own parallel config would all-gather through this backend's
    manager, which has no such operation: refused."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    if draft is None or getattr(draft, "is_moe", False) is not True:
        return
    if getattr(spec, "method", None) == "draft_model":
        raise FlashInferEPConfigError(config_rules.draft_model_reason(flag, draft.model))
    target = model_shape.from_vllm_config(vllm_config)
    shape = model_shape.read_shape(
        draft.hf_config,
        getattr(draft, "hf_text_config", None),
        redundant_experts=target.redundant_experts,
    )
    ranks = ep_world_size(vllm_config.parallel_config)
    try:
        _validate_model(draft, shape, backend, flag)
        split = config_rules.expert_split_reason(
            flag, shape.physical_experts, shape.redundant_experts, ranks
        )
        if split is not None:
            raise FlashInferEPConfigError(split)
    except FlashInferEPConfigError as exc:
        raise FlashInferEPConfigError(
            f"the speculative draft model ({draft.model}) has MoE layers, which run through "
            f"this backend too: {exc} (or serve a draft the backend takes, via "
            "--speculative-config)"
        ) from None


def _validate_model(model: Any, shape: ModelShape, backend: str, flag: str) -> None:
    """The model rules (config_rules' *_reason functions, as `doctor` applies them)."""
    if getattr(model, "is_moe", True) is False:
        return
    dtype = getattr(model, "dtype", None)
    for reason in (
        quantization_reason(flag, getattr(model, "quantization", None), shape.weight_block_size),
        dtype_reason(flag, model_shape.dtype_name(dtype)),
        top_k_reason(flag, backend, shape.top_k),
        hidden_reason(flag, backend, shape.hidden_size),
        gpt_oss_fp8_reason(flag, shape.model_type, getattr(model, "quantization", None)),
    ):
        if reason is not None:
            raise FlashInferEPConfigError(reason)
