"""Engine-config-time checks for the flashinfer_ep backends.

Runs inside `VllmConfig.__post_init__` (the `config_validation` row of patches/__init__.py), in the process
that builds the engine config, before any worker starts. Every failure is one
FlashInferEPConfigError that names the flag to change. Checks that need a GPU or the
native library (libnccl version, libnccl_ep load, nvcc, compute capability) run in
the worker, in the manager's constructor, before model load.

The rules are plain functions of the model's shape (model_shape.py, the one reader of
Hugging Face configs) and of the parallel settings that return the refusal or warning
message or None (`ubatching_reason`, `fault_tolerance_reason`, `unused_backend_warning`,
`quantization_reason`, `dtype_reason`, `top_k_reason`, `hidden_reason`,
`fp8_experts_reason`, `ht_tokens_verdict`, `ll_memory_verdict`, `rdma_buffer_reason`):
`vllm-flashinfer-ep doctor` applies the same functions to a config.json and the `vllm
serve` arguments, so it gives the engine's verdicts.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from vllm_flashinfer_ep import backends, envs, model_shape
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvVarError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.model_shape import ModelShape
from vllm_flashinfer_ep.runtime import buffer_sizes, env_checks
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    SUPPORTED_HIDDEN_SIZES,
    max_top_k,
)
from vllm_flashinfer_ep.vllm import deep_gemm_experts as dg

logger = get_logger(__name__)
GIB = float(1 << 30)


def validate(vllm_config: Any) -> None:
    par = vllm_config.parallel_config
    backend = par.all2all_backend
    if not backends.is_ours(backend):
        return
    flag = f"--all2all-backend {backend}"
    # The package's own variables: a bad value fails here, not after a GPU start-up.
    envs.validate_all()
    _check_transport_built()

    for reason in (
        ubatching_reason(flag, par.use_ubatching),
        fault_tolerance_reason(flag, backend, par.enable_fault_tolerance),
    ):
        if reason is not None:
            raise FlashInferEPConfigError(reason)
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
        _validate_model(model, model_shape.from_vllm_config(vllm_config), backend, flag)
    if backend == backends.HIGH_THROUGHPUT and par.use_all2all:
        _clamp_ht_tokens(vllm_config, flag)
    if backend == backends.LOW_LATENCY and par.use_all2all:
        _check_ll_capacity(vllm_config, flag)
    if model is not None and par.use_all2all:  # after the capacity: DeepGEMM reads it
        _pin_fp8_experts(vllm_config, backend, flag)
    if par.use_all2all:
        _check_rdma_buffer(vllm_config, backend, flag)
        _log_parallel_layout(par, flag)

    unused = unused_backend_warning(backend, par.use_all2all, par.enable_expert_parallel)
    if unused is not None:
        logger.warning("%s", unused)


def ubatching_reason(flag: str, use_ubatching: bool) -> str | None:
    """Why micro-batching (vLLM's `ParallelConfig.use_ubatching`: --enable-dbo or
    --ubatch-size > 1) is refused, or None."""
    if not use_ubatching:
        return None
    return (
        f"{flag} does not support micro-batching (dual-batch overlap): NCCL-EP's receive "
        "buffers are shared by all handles of a fleet, so two micro-batches would overwrite "
        "each other. Remove --enable-dbo (and --ubatch-size)."
    )


def fault_tolerance_reason(flag: str, backend: str, enable_fault_tolerance: bool) -> str | None:
    """Why --enable-fault-tolerance is refused with `backend`, or None."""
    if not enable_fault_tolerance or backends.supports_fault_tolerance(backend):
        return None
    return (
        f"{flag} has no fault tolerance (NCCL-EP supports it for low latency only): use "
        "--all2all-backend flashinfer_ep_low_latency or remove --enable-fault-tolerance."
    )


def unused_backend_warning(
    backend: str, use_all2all: bool, enable_expert_parallel: bool
) -> str | None:
    """The warning config time logs when `backend` is selected but NCCL-EP will not run,
    or None. `use_all2all`: vLLM's `ParallelConfig.use_all2all` (off at
    --data-parallel-size 1); without --enable-expert-parallel vLLM's MoE layers take its
    all-gather/reduce-scatter path (no all2all kernels: `use_all2all_kernels` needs EP)."""
    if not use_all2all:
        return (
            f"{backend} is selected but does nothing here: the MoE all2all only runs with "
            "--data-parallel-size > 1 and --enable-expert-parallel."
        )
    if not enable_expert_parallel:
        return (
            f"{backend} is selected without --enable-expert-parallel: vLLM will use its "
            "all-gather/reduce-scatter path, not NCCL-EP."
        )
    return None


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
    """Keep each step within NCCL-EP's high-throughput limit of tokens per rank
    (`ht_tokens_verdict`, which `doctor` prints): lowered with a warning, or refused."""
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    if sched is None:
        return
    verdict = ht_tokens_verdict(
        flag,
        sched.max_num_batched_tokens,
        chunked_prefill=sched.enable_chunked_prefill,
        max_model_len=None if model is None else model.max_model_len,
    )
    if verdict.refusal is not None:
        raise FlashInferEPConfigError(verdict.refusal)
    if verdict.lowered_to is not None:
        _lower_step_budget(vllm_config, flag, verdict.lowered_to, verdict.why)


class StepBudgetVerdict(NamedTuple):
    """What config time does with --max-num-batched-tokens against a per-rank limit."""

    lowered_to: int | None  # config time lowers --max-num-batched-tokens to this
    refusal: str | None  # config time refuses with this message
    why: str | None  # why the budget does not fit (None: it fits)


def ht_tokens_verdict(
    flag: str, tokens: int, *, chunked_prefill: bool, max_model_len: int | None
) -> StepBudgetVerdict:
    """The HT step-budget rule, for the engine (`_clamp_ht_tokens`) and `doctor` alike.

    The HT fleet cannot take more than HT_MAX_TOKENS_PER_RANK tokens per rank, and vLLM's
    profile run sends --max-num-batched-tokens tokens through every MoE layer at start-up,
    so a larger budget would fail there: it is lowered to the limit. Chunked prefill keeps
    any prompt length servable; without it a --max-model-len above the limit is refused.
    """
    limit = HT_MAX_TOKENS_PER_RANK
    if tokens <= limit:
        return StepBudgetVerdict(None, None, None)
    refusal = _unchunked_reason(
        flag,
        limit,
        f"takes at most {limit} tokens per rank and step",
        tokens,
        chunked_prefill,
        max_model_len,
    )
    why = f"NCCL-EP high throughput takes at most {limit} tokens per rank and step"
    return StepBudgetVerdict(None if refusal else limit, refusal, why)


def _check_ll_capacity(vllm_config: Any, flag: str) -> None:
    """Size the LL fleet from --max-num-batched-tokens only if its buffers fit the GPU.

    The LL per-rank capacity is vLLM's step budget; NCCL-EP's LL buffers grow with it
    times experts times hidden size (runtime/buffer_sizes.py, from measured sizes). Above
    LL_BUFFER_BUDGET_FRACTION of the memory vLLM may use, the budget is lowered with a
    warning; where that cannot work (chunked prefill off, or below --max-num-seqs) the
    config is refused. Both name --max-num-batched-tokens. The verdict is
    `ll_memory_verdict`'s, which `doctor` prints.
    """
    sched, model = vllm_config.scheduler_config, vllm_config.model_config
    if sched is None or model is None or getattr(model, "is_moe", True) is False:
        return
    shape = _ll_fleet_shape(vllm_config)
    if shape is None:
        return
    verdict = ll_memory_verdict(
        flag,
        shape,
        sched.max_num_batched_tokens,
        device_memory_bytes(),
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
    """Why some MoE layers the engine serves stay unquantized: the checkpoint's ignore
    list or a speculative draft (`unquantized_moe`, `draft_moe`)."""
    return unquantized_moe(shape.unquantized_modules) or draft_moe(vllm_config)


class LLMemoryVerdict(NamedTuple):
    """What config time does with an LL fleet's estimated memory (`ll_memory_verdict`)."""

    need: int  # estimated bytes per GPU (runtime/buffer_sizes.ll_memory_bytes)
    parts: dict[str, int]  # ll_memory_parts
    handles: int  # pooled handles in the estimate
    budget: int | None  # bytes the fleet may take; None: no GPU visible, not checked
    summary: str  # one sentence: the estimate, and the budget or why it is not checked
    why: str | None  # why the step budget does not fit (None: it fits or is not checked)
    lowered_to: int | None  # config time lowers --max-num-batched-tokens to this
    refusal: str | None  # config time refuses with this message


def ll_memory_verdict(
    flag: str,
    shape: tuple[int, int, int],
    tokens: int,
    total_memory: int | None,
    gpu_memory_utilization: float,
    *,
    max_num_seqs: int,
    chunked_prefill: bool,
    max_model_len: int | None,
    token_step: int = 1,
) -> LLMemoryVerdict:
    """The LL memory rule, for the engine (`_check_ll_capacity`) and `doctor` alike.

    `shape`: (LL hidden size, physical experts, top_k), `ModelShape.ll_fleet_shape`;
    `total_memory`: GPU memory in bytes (`device_memory_bytes`), None where no GPU is
    visible (then nothing is checked and the summary says so). The estimate includes
    the handle pool a served engine warms (runtime/pool_sizes.py buckets above vLLM's
    default capture sizes). `token_step`: a lowered budget is a multiple of it (DeepGEMM
    experts need whole row tiles, `deep_gemm_step`).
    """
    hidden, experts, top_k = shape
    handles = len(buffer_sizes.served_pool_sizes(tokens))
    parts = buffer_sizes.ll_memory_parts(tokens, hidden, experts, top_k, handles)
    need = sum(parts.values())
    what = (
        f"the NCCL-EP low-latency fleet (buffers, FlashInfer's receive buffer, {handles} "
        f"pooled handles) needs about {need / GIB:.2f} GiB per GPU for "
        f"--max-num-batched-tokens {tokens} ({experts} experts, hidden {hidden}, top_k {top_k})"
    )
    if total_memory is None:
        summary = (
            f"{what}; no GPU is visible here, so this estimate is not checked against GPU "
            "memory (a GPU that lacks it fails at model load)"
        )
        return LLMemoryVerdict(need, parts, handles, None, summary, None, None, None)
    usable = int(total_memory * gpu_memory_utilization)
    budget = int(usable * buffer_sizes.LL_BUFFER_BUDGET_FRACTION)
    summary = f"{what}; budget {budget / GIB:.2f} GiB"
    if need <= budget:
        return LLMemoryVerdict(need, parts, handles, budget, summary, None, None, None)
    fit = buffer_sizes.ll_max_tokens_within(budget, hidden, experts, top_k)
    fit -= fit % token_step
    why = (
        f"needs about {need / GIB:.1f} GiB of NCCL-EP buffers per GPU for "
        f"--max-num-batched-tokens {tokens}, more than {buffer_sizes.LL_BUFFER_BUDGET_FRACTION:.0%} "
        f"of the {usable / GIB:.1f} GiB vLLM may use; at most {fit} tokens fit"
    )
    refusal = None
    if fit < max_num_seqs:
        refusal = (
            f"{flag} {why}, fewer than --max-num-seqs {max_num_seqs}. Pass "
            f"--max-num-batched-tokens <= {fit} and --max-num-seqs <= {fit}, or raise "
            "--gpu-memory-utilization."
        )
    elif not chunked_prefill and max_model_len is not None and max_model_len > fit:
        refusal = (
            f"{flag} {why}, but --max-num-batched-tokens is {tokens} with chunked prefill off "
            f"and --max-model-len {max_model_len}. Enable chunked prefill or pass "
            f"--max-model-len <= {fit}."
        )
    lowered = None if refusal is not None else fit
    return LLMemoryVerdict(need, parts, handles, budget, summary, why, lowered, refusal)


def deep_gemm_step(moe_backend: str | None, ep_world: int) -> int:
    """The step an LL step budget is lowered in: whole DeepGEMM row tiles per expert when
    its experts are asked for (vllm/deep_gemm_experts.py), else any token count."""
    return dg.token_step(ep_world) if moe_backend == dg.MOE_BACKEND else 1


def _ll_fleet_shape(vllm_config: Any) -> tuple[int, int, int] | None:
    """(rounded LL hidden size, physical experts, top_k) of the model, or None if unknown
    (or wider than LL: refused by _validate_model with its own message)."""
    return model_shape.from_vllm_config(vllm_config).ll_fleet_shape()


def ep_world_size(par: Any) -> int:
    """Ranks of one EP group: vLLM 0.33.0 builds it over DP x PCP x TP, one per pipeline
    stage (vllm/distributed/parallel_state.py, `_EP`)."""
    return (
        par.data_parallel_size
        * getattr(par, "prefill_context_parallel_size", 1)
        * par.tensor_parallel_size
    )


def rdma_buffer_reason(
    flag: str,
    rdma_bytes: int,
    shape: tuple[int, int, int],
    tokens: int,
    world: int,
    budget: int | None,
) -> str | None:
    """Why VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES cannot serve this LL fleet, or None.

    NCCL-EP allocates a fixed RDMA buffer exactly and never grows it; a handle whose
    layout does not fit fails at model load (ncclEpInitHandle: ncclInvalidUsage). The
    floor is that layout (buffer_sizes.ll_layout_bytes); the ceiling the LL fleet's share
    of the GPU (`budget`), or envs.RDMA_MAX_BYTES where no GPU is visible.
    """
    if rdma_bytes == 0:
        return None
    hidden, experts, top_k = shape
    low = buffer_sizes.ll_layout_bytes(tokens, hidden, experts, top_k, world)
    high = envs.RDMA_MAX_BYTES if budget is None else budget
    if low <= rdma_bytes <= high:
        return None
    ceiling = (
        f"{high} (1 TiB; no GPU is visible here)"
        if budget is None
        else f"{high} ({buffer_sizes.LL_BUFFER_BUDGET_FRACTION:.0%} of the memory vLLM may use)"
    )
    return (
        f"{flag}: {envs.RDMA_BUFFER_BYTES}={rdma_bytes} is outside the range this fleet accepts: "
        f"from {low} (NCCL-EP's low-latency layout for {tokens} tokens per rank, hidden "
        f"{hidden}, {experts} experts, top_k {top_k}, EP world {world}) to {ceiling}. Set a "
        f"value in that range, or unset {envs.RDMA_BUFFER_BYTES} (0) to let NCCL-EP size it."
    )


def _check_rdma_buffer(vllm_config: Any, backend: str, flag: str) -> None:
    """A fixed RDMA buffer must hold the LL fleet's layout (envs.py checks the shape-free
    range already)."""
    rdma = envs.rdma_buffer_bytes()
    if rdma == 0 or backend != backends.LOW_LATENCY or vllm_config.model_config is None:
        return
    shape = _ll_fleet_shape(vllm_config)
    if shape is None:
        return
    total = device_memory_bytes()
    budget = (
        None
        if total is None
        else int(
            int(total * vllm_config.cache_config.gpu_memory_utilization)
            * buffer_sizes.LL_BUFFER_BUDGET_FRACTION
        )
    )
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    reason = rdma_buffer_reason(
        flag, rdma, shape, tokens, ep_world_size(vllm_config.parallel_config), budget
    )
    if reason is not None:
        raise FlashInferEPConfigError(reason)


def _log_parallel_layout(par: Any, flag: str) -> None:
    """Say how tensor and pipeline parallelism combine with the backend (docs/architecture.md,
    "Tensor and pipeline parallelism"): both are accepted."""
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


def device_memory_bytes() -> int | None:
    """Memory of GPU 0 as vLLM's platform reports it (NVML: no CUDA context), or None."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            return None
        return int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - unknown memory means "not checked", never an error
        return None


def _unchunked_reason(
    flag: str,
    limit: int,
    why: str,
    tokens: int,
    chunked_prefill: bool,
    max_model_len: int | None,
) -> str | None:
    """Lowering the step budget below --max-model-len needs chunked prefill."""
    if chunked_prefill or max_model_len is None or max_model_len <= limit:
        return None
    return (
        f"{flag} {why}, but --max-num-batched-tokens is {tokens} with chunked prefill off "
        f"and --max-model-len {max_model_len}. Enable chunked prefill or pass "
        f"--max-model-len <= {limit}."
    )


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


# Quantization methods whose MoE layers this package runs (128x128 block layers: FP8 on
# the wire; the others: BF16 on the wire, FP8 after receive):
# FP8 checkpoints (vLLM's `fp8` method) and vLLM 0.33.0's online FP8 shorthands.
CHECKPOINT_FP8 = ("fp8",)
ONLINE_FP8 = ("fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
FP8_METHODS = CHECKPOINT_FP8 + ONLINE_FP8


def quantization_reason(flag: str, method: str | None, block: Any) -> str | None:
    """BF16, FP8 checkpoints (per-tensor scales or 128x128 blocks) and online FP8
    (--quantization fp8_per_tensor / fp8_per_block / fp8_per_channel on a BF16
    checkpoint), on both backends; why anything else is refused. `method`: vLLM's
    quantization method (the checkpoint's quant_method or --quantization), `block` the
    checkpoint's weight_block_size."""
    if not method:
        return None
    if method not in FP8_METHODS:
        return (
            f"{flag} runs BF16 and FP8 ({', '.join(FP8_METHODS)}) MoE models; this model is "
            f"quantized with {method}. Serve a BF16 or FP8 checkpoint, or pick another "
            "--all2all-backend (e.g. deepep_low_latency)."
        )
    from vllm_flashinfer_ep.vllm.receive_quant import carries_block

    if not carries_block(block):
        return (
            f"{flag} carries FP8 activations in groups of 128 (128x128 block checkpoints); "
            f"this checkpoint's weight_block_size is {block}. Pick another --all2all-backend."
        )
    return None


def dtype_reason(flag: str, dtype: str | None) -> str | None:
    """Why the model's dtype (vLLM's resolved --dtype, a name: "float16") is refused."""
    if dtype is None or dtype == "bfloat16":
        return None
    return (
        f"{flag} dispatches BF16 activations, but the model dtype is {dtype}. Pass "
        "--dtype bfloat16."
    )


def top_k_reason(flag: str, backend: str, top_k: int | None) -> str | None:
    limit = max_top_k(backend == backends.LOW_LATENCY)
    if top_k is None or top_k <= limit:
        return None
    other = (
        " Try --all2all-backend flashinfer_ep_high_throughput."
        if backend == backends.LOW_LATENCY and top_k <= max_top_k(False)
        else " Pick another --all2all-backend."
    )
    return (
        f"{flag}: the model routes each token to {top_k} experts, more than this backend "
        f"supports ({limit}, see vllm_flashinfer_ep/runtime/limits.py).{other}"
    )


def hidden_reason(flag: str, backend: str, hidden: int | None) -> str | None:
    if backend != backends.LOW_LATENCY or hidden is None or hidden <= SUPPORTED_HIDDEN_SIZES[-1]:
        return None
    return (
        f"{flag}: hidden size {hidden} exceeds the largest NCCL-EP low-latency size "
        f"{SUPPORTED_HIDDEN_SIZES[-1]}. Use --all2all-backend flashinfer_ep_high_throughput."
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
    """Why the FP8 MoE layers cannot run with the --moe-backend asked for (None: they can).

    Their experts are vLLM's Triton experts (`auto` becomes triton: the scale layouts the
    package hands them are theirs, vllm/receive_quant.py), or, under LL for 128x128
    block-FP8 models, vLLM's batched DeepGEMM experts (vllm/deep_gemm_experts.py).
    `unquantized`: why some MoE layers of the served models stay unquantized
    (`unquantized_moe`, `draft_moe`)."""
    if moe_backend in ("auto", "triton"):
        return None
    deep_gemm = dg.MOE_BACKEND
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
    reason = dg.switches_reason(flag, environ)
    if reason is None and tokens_per_rank is not None:
        reason = dg.rows_reason(flag, tokens_per_rank, ep_world)
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
    """(the --moe-backend `auto` becomes for FP8 MoE layers, why). Under LL, 128x128
    block-FP8 layers take vLLM's DeepGEMM batched experts where they can run (the fastest
    of the measured paths at every batch, docs/benchmarks.md) and every MoE layer is
    block FP8 (`unquantized`: why not); everything else, vLLM's Triton experts."""
    deep_gemm = dg.MOE_BACKEND
    if backend != backends.LOW_LATENCY or not _is_block_128(method, block):
        return "triton", "the scale layouts the package hands vLLM's Triton experts"
    reason = (
        fp8_experts_reason(
            flag,
            backend,
            method,
            block,
            deep_gemm,
            tokens_per_rank,
            ep_world,
            environ,
            unquantized,
        )
        or dg.platform_reason()
    )
    if reason is not None:
        return "triton", f"DeepGEMM experts cannot run here: {reason}"
    return deep_gemm, "the fastest block-FP8 experts over the LL buffer"


def _is_block_128(method: str | None, block: Any) -> bool:
    if method == "fp8_per_block":
        return True
    return method == "fp8" and block is not None and list(block) == [128, 128]


def unquantized_moe(modules: Any) -> str | None:
    """Why some MoE layers of a quantized checkpoint stay unquantized (None: none do):
    the entries of its ignore list (ModelShape.unquantized_modules) that can name expert
    modules (vLLM 0.33.0 skips a MoE layer whose prefix an "experts" entry contains,
    quantization/utils/quant_utils.is_layer_skipped)."""
    named = [m for m in modules if "expert" in m.lower() or "moe" in m.lower()]
    if not named:
        return None
    more = f" and {len(named) - 2} more" if len(named) > 2 else ""
    return f"the checkpoint leaves MoE layers unquantized ({', '.join(named[:2])}{more})"


def draft_moe(vllm_config: Any) -> str | None:
    """Why a speculative draft model's MoE layers cannot take deep_gemm (None: there is
    none, it names its own backend, or it is 128x128 block FP8 like the target): the
    draft inherits --moe-backend unless its speculative config sets `moe_backend`."""
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
    asked, or what `auto` will become for an FP8 model, decided before the budget is (so a
    lowered budget keeps DeepGEMM's whole tiles)."""
    if asked != "auto" or method not in FP8_METHODS:
        return asked
    choice, _ = auto_fp8_experts(flag, backend, method, block, None, ep_world, environ, unquantized)
    return choice


def _pin_fp8_experts(vllm_config: Any, backend: str, flag: str) -> None:
    """FP8 MoE layers: the --moe-backend asked for, checked (`fp8_experts_reason`);
    auto becomes what `auto_fp8_experts` says, logged."""
    model, kernel = vllm_config.model_config, getattr(vllm_config, "kernel_config", None)
    if not getattr(model, "quantization", None) or kernel is None:
        return
    if getattr(model, "is_moe", True) is False:
        return
    shape = model_shape.from_vllm_config(vllm_config)
    sched = vllm_config.scheduler_config
    unquantized = _served_unquantized(vllm_config, shape)
    reason = fp8_experts_reason(
        flag,
        backend,
        model.quantization,
        shape.weight_block_size,
        kernel.moe_backend,
        sched.max_num_batched_tokens if sched is not None else None,
        ep_world_size(vllm_config.parallel_config),
        os.environ,
        unquantized,
    )
    if reason is not None:
        raise FlashInferEPConfigError(reason)
    if kernel.moe_backend == dg.MOE_BACKEND:
        logger.info(
            "%s: FP8 MoE layers use vLLM's DeepGEMM batched experts (--moe-backend %s) over "
            "the LL buffer, with MN-major activation scales.",
            flag,
            dg.MOE_BACKEND,
        )
        return
    if kernel.moe_backend == "triton":
        return
    choice, why = auto_fp8_experts(
        flag,
        backend,
        model.quantization,
        shape.weight_block_size,
        sched.max_num_batched_tokens if sched is not None else None,
        ep_world_size(vllm_config.parallel_config),
        os.environ,
        unquantized,
    )
    kernel.moe_backend = choice
    logger.info(
        "%s: FP8 MoE layers use --moe-backend auto -> %s (%s); 128x128 block-FP8 layers "
        "dispatch FP8 (%s=0: BF16), the others dispatch BF16 and quantize to FP8 after "
        "receive.",
        flag,
        choice,
        why,
        envs.FP8_DISPATCH,
    )


def _validate_model(model: Any, shape: ModelShape, backend: str, flag: str) -> None:
    """The model rules `doctor` applies too (the *_reason functions above)."""
    if getattr(model, "is_moe", True) is False:
        return
    dtype = getattr(model, "dtype", None)
    for reason in (
        quantization_reason(flag, getattr(model, "quantization", None), shape.weight_block_size),
        dtype_reason(flag, model_shape.dtype_name(dtype)),
        top_k_reason(flag, backend, shape.top_k),
        hidden_reason(flag, backend, shape.hidden_size),
    ):
        if reason is not None:
            raise FlashInferEPConfigError(reason)
