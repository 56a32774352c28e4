"""Engine-config-time checks for the flashinfer_ep backends.

Runs inside `VllmConfig.__post_init__` (the `config_validation` row of patches/__init__.py), in the process
that builds the engine config, before any worker starts. Every failure is one
FlashInferEPConfigError that names the flag to change. Checks that need a GPU or the
native library (libnccl version, libnccl_ep load, nvcc, compute capability) run in
the worker, in the manager's constructor, before model load.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep import backends, envs
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvVarError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import buffer_sizes, env_checks
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    SUPPORTED_HIDDEN_SIZES,
    config_top_k,
    max_top_k,
    round_up_ll_hidden_size,
)

logger = get_logger(__name__)
GIB = float(1 << 30)
# Names under which Hugging Face configs carry the number of routed experts.
EXPERT_COUNT_CONFIG_KEYS: tuple[str, ...] = (
    "num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
)

def model_top_k(hf_config: Any) -> int | None:
    return config_top_k(lambda name: getattr(hf_config, name, None))


def validate(vllm_config: Any) -> None:
    par = vllm_config.parallel_config
    backend = par.all2all_backend
    if not backends.is_ours(backend):
        return
    flag = f"--all2all-backend {backend}"
    # The package's own variables: a bad value fails here, not after a GPU start-up.
    envs.validate_all()
    _check_transport_built()

    if par.use_ubatching:
        raise FlashInferEPConfigError(
            f"{flag} does not support micro-batching (dual-batch overlap): NCCL-EP's receive "
            "buffers are shared by all handles of a fleet, so two micro-batches would overwrite "
            "each other. Remove --enable-dbo (and --ubatch-size)."
        )
    if par.enable_fault_tolerance and not backends.supports_fault_tolerance(backend):
        raise FlashInferEPConfigError(
            f"{flag} has no fault tolerance (NCCL-EP supports it for low latency only): use "
            "--all2all-backend flashinfer_ep_low_latency or remove --enable-fault-tolerance."
        )
    # The host probes the worker and `doctor` use; these two need no GPU.
    for check in (env_checks.check_nccl_ep_installed(), env_checks.check_torch_cuda()):
        if not check.ok:
            raise FlashInferEPConfigError(f"{flag} cannot run: {check.detail}; {check.fix}.")

    placement = getattr(par, "expert_placement_strategy", "linear")
    if placement != "linear":
        raise FlashInferEPConfigError(
            f"{flag} needs each rank's experts to be one contiguous range of expert ids "
            f"(NCCL-EP routes by it); --expert-placement-strategy {placement} places them "
            "otherwise. Pass --expert-placement-strategy linear."
        )
    model = vllm_config.model_config
    if model is not None:
        _validate_model(model, backend, flag)
        if par.use_all2all:
            _pin_fp8_experts(vllm_config, flag)
    if backend == backends.HIGH_THROUGHPUT and par.use_all2all:
        _clamp_ht_tokens(vllm_config, flag)
    if backend == backends.LOW_LATENCY and par.use_all2all:
        _check_ll_capacity(vllm_config, flag)

    if not par.use_all2all:
        logger.warning(
            "%s is selected but does nothing here: the MoE all2all only runs with "
            "--data-parallel-size > 1 and --enable-expert-parallel.",
            backend,
        )
    elif not par.enable_expert_parallel:
        logger.warning(
            "%s is selected without --enable-expert-parallel: vLLM will use its "
            "all-gather/reduce-scatter path, not NCCL-EP.",
            backend,
        )


def _check_transport_built() -> None:
    """VLLM_FLASHINFER_EP_TRANSPORT=nixl_ep needs a FlashInfer built with NIXL-EP."""
    if envs.transport() != "nixl_ep":
        return
    try:
        from flashinfer.moe_ep import have_nixl_ep

        built = bool(have_nixl_ep())
    except Exception:  # noqa: BLE001 - an unimportable FlashInfer has no NIXL-EP either
        built = False
    if not built:
        raise FlashInferEPEnvVarError(
            f"{envs.TRANSPORT}=nixl_ep needs a FlashInfer built with NIXL-EP, and "
            "flashinfer.moe_ep.have_nixl_ep() is False here (the PyPI wheel ships none). "
            f"Unset {envs.TRANSPORT} to use nccl_ep."
        )


def _clamp_ht_tokens(vllm_config: Any, flag: str) -> None:
    """Keep each step within NCCL-EP's high-throughput limit of tokens per rank.

    The HT fleet cannot take more than HT_MAX_TOKENS_PER_RANK tokens per rank, and vLLM's
    profile run sends --max-num-batched-tokens tokens through every MoE layer at start-up,
    so a larger budget would fail there. Chunked prefill keeps any prompt length servable.
    """
    sched = vllm_config.scheduler_config
    if sched is None or sched.max_num_batched_tokens <= HT_MAX_TOKENS_PER_RANK:
        return
    _lower_step_budget(
        vllm_config,
        flag,
        HT_MAX_TOKENS_PER_RANK,
        f"takes at most {HT_MAX_TOKENS_PER_RANK} tokens per rank and step",
        f"NCCL-EP high throughput takes at most {HT_MAX_TOKENS_PER_RANK} tokens per rank and step",
    )


def _check_ll_capacity(vllm_config: Any, flag: str) -> None:
    """Size the LL fleet from --max-num-batched-tokens only if its buffers fit the GPU.

    The LL per-rank capacity is vLLM's step budget; NCCL-EP's LL buffers grow with it
    times experts times hidden size (runtime/buffer_sizes.py, from measured sizes). Above
    LL_BUFFER_BUDGET_FRACTION of the memory vLLM may use, the budget is lowered with a
    warning; where that cannot work (chunked prefill off, or below --max-num-seqs) the
    config is refused. Both name --max-num-batched-tokens.
    """
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    if sched is None or model is None or getattr(model, "is_moe", True) is False:
        return
    shape = _ll_fleet_shape(vllm_config)
    if shape is None:
        return
    hidden, experts, top_k = shape
    tokens = sched.max_num_batched_tokens
    need = buffer_sizes.ll_memory_bytes(tokens, hidden, experts, top_k)
    total = device_memory_bytes()
    if total is None:
        logger.info(
            "%s: the NCCL-EP low-latency fleet (buffers and FlashInfer's receive buffer) "
            "needs about %.2f GiB per GPU for --max-num-batched-tokens %d (%d experts, "
            "hidden %d, top_k %d); GPU memory is not visible here, so this is not checked "
            "against it.",
            flag, need / GIB, tokens, experts, hidden, top_k,
        )
        return
    usable = int(total * vllm_config.cache_config.gpu_memory_utilization)
    budget = int(usable * buffer_sizes.LL_BUFFER_BUDGET_FRACTION)
    logger.info(
        "%s: the NCCL-EP low-latency fleet (buffers and FlashInfer's receive buffer) needs "
        "about %.2f GiB per GPU for --max-num-batched-tokens %d (%d experts, hidden %d, "
        "top_k %d; budget %.2f GiB).",
        flag, need / GIB, tokens, experts, hidden, top_k, budget / GIB,
    )
    if need <= budget:
        return
    fit = buffer_sizes.ll_max_tokens_within(budget, hidden, experts, top_k)
    why = (
        f"needs about {need / GIB:.1f} GiB of NCCL-EP buffers per GPU for "
        f"--max-num-batched-tokens {tokens}, more than {buffer_sizes.LL_BUFFER_BUDGET_FRACTION:.0%} "
        f"of the {usable / GIB:.1f} GiB vLLM may use; at most {fit} tokens fit"
    )
    if fit < sched.max_num_seqs:
        raise FlashInferEPConfigError(
            f"{flag} {why}, fewer than --max-num-seqs {sched.max_num_seqs}. Pass "
            f"--max-num-batched-tokens <= {fit} and --max-num-seqs <= {fit}, or raise "
            "--gpu-memory-utilization."
        )
    _lower_step_budget(vllm_config, flag, fit, why, f"{flag} {why}")


def _ll_fleet_shape(vllm_config: Any) -> tuple[int, int, int] | None:
    """(rounded LL hidden size, physical experts, top_k) of the model, or None if unknown."""
    hf = vllm_config.model_config.hf_text_config
    hidden = getattr(hf, "hidden_size", None)
    top_k = model_top_k(hf)
    experts = next(
        (v for v in (getattr(hf, k, None) for k in EXPERT_COUNT_CONFIG_KEYS) if isinstance(v, int) and v > 0),
        None,
    )
    if not isinstance(hidden, int) or top_k is None or experts is None:
        return None
    par = vllm_config.parallel_config
    if getattr(par, "enable_eplb", False):
        experts += int(getattr(par.eplb_config, "num_redundant_experts", 0) or 0)
    try:
        hidden = round_up_ll_hidden_size(hidden)
    except ValueError:
        return None  # refused by _validate_model with its own message
    return hidden, experts, top_k


def device_memory_bytes() -> int | None:
    """Memory of GPU 0 as vLLM's platform reports it (NVML: no CUDA context), or None."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            return None
        return int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - unknown memory means "not checked", never an error
        return None


def _lower_step_budget(vllm_config: Any, flag: str, limit: int, why: str, log_why: str) -> None:
    """Lower --max-num-batched-tokens to `limit` with a warning, or refuse if that cannot work."""
    sched = vllm_config.scheduler_config
    asked = sched.max_num_batched_tokens
    model = vllm_config.model_config
    if not sched.enable_chunked_prefill and model is not None and model.max_model_len > limit:
        raise FlashInferEPConfigError(
            f"{flag} {why}, but --max-num-batched-tokens is {asked} with chunked prefill off and "
            f"--max-model-len {model.max_model_len}. Enable chunked prefill or pass "
            f"--max-model-len <= {limit}."
        )
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


# Quantization methods whose MoE layers this package runs (128x128 block layers: FP8 on
# the wire; the others: BF16 on the wire, FP8 after receive):
# FP8 checkpoints (vLLM's `fp8` method) and vLLM 0.33.0's online FP8 shorthands.
CHECKPOINT_FP8 = ("fp8",)
ONLINE_FP8 = ("fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
FP8_METHODS = CHECKPOINT_FP8 + ONLINE_FP8


def _check_quantization(model: Any, flag: str) -> None:
    """BF16, FP8 checkpoints (per-tensor scales or 128x128 blocks) and online FP8
    (--quantization fp8_per_tensor / fp8_per_block / fp8_per_channel on a BF16
    checkpoint), on both backends. Anything else is refused."""
    quant = getattr(model, "quantization", None)
    if not quant:
        return
    if quant not in FP8_METHODS:
        raise FlashInferEPConfigError(
            f"{flag} runs BF16 and FP8 ({', '.join(FP8_METHODS)}) MoE models; this model is "
            f"quantized with {quant}. Serve a BF16 or FP8 checkpoint, or pick another "
            "--all2all-backend (e.g. deepep_low_latency)."
        )
    from vllm_flashinfer_ep.vllm.receive_quant import carries_block

    block = checkpoint_block_shape(model)
    if not carries_block(block):
        raise FlashInferEPConfigError(
            f"{flag} carries FP8 activations in groups of 128 (128x128 block checkpoints); "
            f"this checkpoint's weight_block_size is {block}. Pick another --all2all-backend."
        )


def checkpoint_block_shape(model: Any) -> list[int] | None:
    """The checkpoint's FP8 `weight_block_size`, or None (per-tensor or online)."""
    hf = getattr(model, "hf_config", None)
    qc = getattr(hf, "quantization_config", None)
    if not isinstance(qc, dict):
        qc = getattr(getattr(model, "hf_text_config", None), "quantization_config", None)
    return qc.get("weight_block_size") if isinstance(qc, dict) else None


def _pin_fp8_experts(vllm_config: Any, flag: str) -> None:
    """FP8 MoE layers run with vLLM's Triton experts (the activation scale layouts the
    package quantizes into after receive): --moe-backend auto becomes triton, logged;
    another explicit choice is refused."""
    model, kernel = vllm_config.model_config, getattr(vllm_config, "kernel_config", None)
    if model is None or not getattr(model, "quantization", None) or kernel is None:
        return
    if getattr(model, "is_moe", True) is False:
        return
    asked = kernel.moe_backend
    if asked == "triton":
        return
    if asked != "auto":
        raise FlashInferEPConfigError(
            f"{flag} runs FP8 MoE layers with vLLM's Triton experts; --moe-backend {asked} "
            "quantizes or lays out activations otherwise. Pass --moe-backend triton (or leave "
            "it at auto)."
        )
    kernel.moe_backend = "triton"
    logger.info(
        "%s: FP8 MoE layers use vLLM's Triton experts (--moe-backend auto -> triton); "
        "128x128 block-FP8 layers dispatch FP8 (%s=0: BF16), the others dispatch BF16 and "
        "quantize to FP8 after receive.",
        flag,
        envs.FP8_DISPATCH,
    )


def _validate_model(model: Any, backend: str, flag: str) -> None:
    if getattr(model, "is_moe", True) is False:
        return
    _check_quantization(model, flag)
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype != torch.bfloat16:
        raise FlashInferEPConfigError(
            f"{flag} dispatches BF16 activations, but the model dtype is {dtype}. Pass "
            "--dtype bfloat16."
        )
    hf = model.hf_text_config
    top_k = model_top_k(hf)
    limit = max_top_k(backend == backends.LOW_LATENCY)
    if top_k is not None and top_k > limit:
        other = (
            " Try --all2all-backend flashinfer_ep_high_throughput."
            if backend == backends.LOW_LATENCY and top_k <= max_top_k(False)
            else " Pick another --all2all-backend."
        )
        raise FlashInferEPConfigError(
            f"{flag}: the model routes each token to {top_k} experts, more than this backend "
            f"supports ({limit}, see vllm_flashinfer_ep/runtime/limits.py).{other}"
        )
    hidden = getattr(hf, "hidden_size", None)
    if (
        backend == backends.LOW_LATENCY
        and isinstance(hidden, int)
        and hidden > SUPPORTED_HIDDEN_SIZES[-1]
    ):
        raise FlashInferEPConfigError(
            f"{flag}: hidden size {hidden} exceeds the largest NCCL-EP low-latency size "
            f"{SUPPORTED_HIDDEN_SIZES[-1]}. Use --all2all-backend flashinfer_ep_high_throughput."
        )
