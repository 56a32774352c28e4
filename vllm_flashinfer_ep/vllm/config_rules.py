"""The config-time rules of the flashinfer_ep backends, as plain functions.

Each returns a refusal or warning message, a verdict tuple, or None, and reads no vLLM
config, so the engine (vllm/config_validation.py) and `doctor` give the same verdicts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm_flashinfer_ep import backends, envs
from vllm_flashinfer_ep.runtime import buffer_sizes
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    SUPPORTED_HIDDEN_SIZES,
    max_top_k,
)

GIB = float(1 << 30)


def draft_model_reason(flag: str, draft: str) -> str:
    return (
        f"{flag}: the speculative draft model ({draft}) has MoE layers, and vLLM builds a "
        "draft_model draft with a parallel config of its own whose all2all backend is "
        "allgather_reducescatter; that all-gather would run through this backend's all2all "
        "manager, which has none. Serve a dense draft model, or a draft that shares the "
        "target's layers' parallel config (method mtp or eagle), in --speculative-config."
    )


def elastic_ep_reason(flag: str, enable_elastic_ep: bool) -> str | None:
    if not enable_elastic_ep:
        return None
    return (
        f"{flag} bootstraps NCCL-EP from the EP group's torch.distributed process group, "
        "which elastic EP does not create (its groups are stateless). Remove "
        "--enable-elastic-ep."
    )


def ubatching_reason(flag: str, use_ubatching: bool) -> str | None:
    """Why micro-batching (`ParallelConfig.use_ubatching`) is refused, or None."""
    if not use_ubatching:
        return None
    return (
        f"{flag} does not support micro-batching (dual-batch overlap): NCCL-EP's receive "
        "buffers are shared by all handles of a fleet, so two micro-batches would overwrite "
        "each other. Remove --enable-dbo (and --ubatch-size)."
    )


def fault_tolerance_reason(flag: str, backend: str, enable_fault_tolerance: bool) -> str | None:
    if not enable_fault_tolerance or backends.supports_fault_tolerance(backend):
        return None
    return (
        f"{flag} has no fault tolerance (NCCL-EP supports it for low latency only): use "
        "--all2all-backend flashinfer_ep_low_latency or remove --enable-fault-tolerance."
    )


def unused_backend_warning(
    backend: str, use_all2all: bool, enable_expert_parallel: bool
) -> str | None:
    """The warning logged when `backend` is selected but NCCL-EP will not run, or None."""
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


class StepBudgetVerdict(NamedTuple):
    """What config time does with --max-num-batched-tokens against a per-rank limit."""

    lowered_to: int | None  # --max-num-batched-tokens is lowered to this
    refusal: str | None
    why: str | None  # why the budget does not fit (None: it fits)


def ht_tokens_verdict(
    flag: str,
    tokens: int,
    *,
    chunked_prefill: bool,
    max_model_len: int | None,
    max_num_seqs: int | None = None,
) -> StepBudgetVerdict:
    """The HT step-budget rule: vLLM's profile run sends --max-num-batched-tokens through
    every MoE layer, so a budget above HT_MAX_TOKENS_PER_RANK is lowered (or refused)."""
    limit = HT_MAX_TOKENS_PER_RANK
    if tokens <= limit:
        return StepBudgetVerdict(None, None, None)
    what = f"takes at most {limit} tokens per rank and step"
    refusal = _unchunked_reason(flag, limit, what, tokens, chunked_prefill, max_model_len)
    if refusal is None and max_num_seqs is not None and max_num_seqs > limit:
        # vLLM refuses a step budget below --max-num-seqs; lowering it would make one.
        refusal = (
            f"{flag} takes at most {limit} tokens per rank and step, fewer than "
            f"--max-num-seqs {max_num_seqs}. Pass --max-num-seqs <= {limit} and "
            f"--max-num-batched-tokens <= {limit}."
        )
    why = f"NCCL-EP high throughput takes at most {limit} tokens per rank and step"
    return StepBudgetVerdict(None if refusal else limit, refusal, why)


class LLMemoryVerdict(NamedTuple):
    """What config time does with an LL fleet's estimated memory (`ll_memory_verdict`)."""

    need: int  # estimated bytes per GPU (buffer_sizes.ll_memory_bytes)
    parts: dict[str, int]  # ll_memory_parts
    handles: int  # pooled handles in the estimate
    budget: int | None  # None: no GPU visible, not checked
    summary: str
    why: str | None  # why the step budget does not fit
    lowered_to: int | None
    refusal: str | None


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
    """The LL memory rule (`total_memory` None: no GPU visible, nothing checked); a lowered
    budget is a multiple of `token_step` (`fp8_experts_choice.deep_gemm_step`)."""
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
    if fit <= 0:  # the buffers' fixed part alone is over the budget: no step size helps
        refusal = (
            f"{flag}: even a step of one token needs more NCCL-EP buffer memory per GPU than "
            f"{buffer_sizes.LL_BUFFER_BUDGET_FRACTION:.0%} of the {usable / GIB:.1f} GiB vLLM "
            f"may use (about {need / GIB:.1f} GiB at --max-num-batched-tokens {tokens}). "
            "Raise --gpu-memory-utilization."
        )
    elif fit < max_num_seqs:
        refusal = (
            f"{flag} {why}, fewer than --max-num-seqs {max_num_seqs}. Pass "
            f"--max-num-batched-tokens <= {fit} and --max-num-seqs <= {fit}, or raise "
            "--gpu-memory-utilization."
        )
    else:
        refusal = _unchunked_reason(flag, fit, why, tokens, chunked_prefill, max_model_len)
    lowered = None if refusal is not None else fit
    return LLMemoryVerdict(need, parts, handles, budget, summary, why, lowered, refusal)


# vLLM 0.33.0's largest default CUDA graph capture size on Hopper (config/vllm.py,
# `default_max_graph_size`). LL's step budget when none is passed: every step then runs
# in a graph, and a step prefills twice what vLLM's 256 for batched DP MoE does, which
# queued prompts when served (docs/benchmarks.md).
LL_DEFAULT_STEP_TOKENS = 512


def ll_default_step_tokens(vllm_default: int, capture_max: int, limit: int) -> int:
    """LL's --max-num-batched-tokens when none is passed: LL_DEFAULT_STEP_TOKENS, not above
    the largest CUDA graph capture size (steps above it would run without graphs) nor
    vLLM's own cap (`limit`: max_num_seqs x max_model_len), never below vLLM's choice."""
    return max(vllm_default, min(LL_DEFAULT_STEP_TOKENS, capture_max, limit))


def round_capacity(step_tokens: int, backend: str) -> int:
    """The tokens per rank one round carries: a whole step, or LL's
    VLLM_FLASHINFER_EP_LL_ROUND_TOKENS below it (forwards then split, vllm/round_chunks.py).
    Config time and the manager decide it here alike."""
    round_tokens = envs.ll_round_tokens() if backend == backends.LOW_LATENCY else 0
    return round_tokens if 0 < round_tokens < step_tokens else step_tokens


def round_capture_reason(flag: str, round_tokens: int, capture_sizes: Any) -> str | None:
    """Why rounds of `round_tokens` cannot serve these CUDA graph capture sizes (a captured
    forward is one round), or None."""
    largest = max((int(s) for s in capture_sizes or ()), default=0)
    if round_tokens >= largest:
        return None
    return (
        f"{flag}: {envs.LL_ROUND_TOKENS}={round_tokens} is below the largest CUDA graph "
        f"capture size, {largest}, and a captured forward runs as one round. Set it to at "
        f"least {largest}, or capture smaller batches (--compilation-config "
        f"'{{\"max_cudagraph_capture_size\": {round_tokens}}}')."
    )


def round_agreement_reason(
    flag: str, round_tokens: int, ep_world: int, data_parallel_size: int
) -> str | None:
    """Why the EP ranks could not agree on a forward's rounds (None: they can). Every rank
    cuts a forward into the rounds the largest rank needs, read from vLLM's data parallel
    token counts (its DP metadata), which exist only with data parallel ranks."""
    if ep_world <= 1 or data_parallel_size > 1:
        return None
    return (
        f"{flag}: {envs.LL_ROUND_TOKENS}={round_tokens} needs --data-parallel-size > 1 where "
        f"the EP group has {ep_world} ranks: the ranks agree on each forward's rounds from "
        "vLLM's data parallel token counts. Unset the variable or run data parallel."
    )


def ll_rounds_memory_reason(flag: str, round_tokens: int, verdict: LLMemoryVerdict) -> str | None:
    """Why the LL fleet for rounds of VLLM_FLASHINFER_EP_LL_ROUND_TOKENS cannot be built (a
    fleet that does not fit is refused: lowering the step budget would not shrink it)."""
    if verdict.lowered_to is None and verdict.refusal is None:
        return None
    fit = verdict.lowered_to or 0
    return (
        f"{flag}: {envs.LL_ROUND_TOKENS}={round_tokens}: the LL fleet for rounds of "
        f"{round_tokens} tokens needs about {verdict.need / GIB:.1f} GiB per GPU, more than "
        f"{buffer_sizes.LL_BUFFER_BUDGET_FRACTION:.0%} of the memory vLLM may use. "
        + (f"Set it to at most {fit}." if fit else "Raise --gpu-memory-utilization.")
    )


def ep_world_size(par: Any) -> int:
    """Ranks of one EP group: DP x PCP x TP (vllm/distributed/parallel_state.py, `_EP`)."""
    pcp = getattr(par, "prefill_context_parallel_size", 1)
    return par.data_parallel_size * pcp * par.tensor_parallel_size


def rdma_buffer_reason(
    flag: str,
    rdma_bytes: int,
    shape: tuple[int, int, int],
    tokens: int,
    world: int,
    budget: int | None,
) -> str | None:
    """Why VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES (never grown by NCCL-EP) cannot serve, or None."""
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


def device_memory_bytes() -> int | None:
    """Memory of GPU 0 as vLLM's platform reports it (NVML: no CUDA context), or None.
    Callers reach it through this module, so tests can stand in a GPU."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            return None
        return int(current_platform.get_device_total_memory(0))
    except Exception:  # noqa: BLE001 - unknown memory means "not checked", never an error
        return None


def _unchunked_reason(
    flag: str, limit: int, why: str, tokens: int, chunked_prefill: bool, max_model_len: int | None
) -> str | None:
    """Lowering the step budget below --max-model-len needs chunked prefill."""
    if chunked_prefill or max_model_len is None or max_model_len <= limit:
        return None
    return (
        f"{flag} {why}, but --max-num-batched-tokens is {tokens} with chunked prefill off "
        f"and --max-model-len {max_model_len}. Enable chunked prefill or pass "
        f"--max-model-len <= {limit}."
    )


# FP8 checkpoints (vLLM's `fp8`) and vLLM 0.33.0's online FP8 shorthands.
CHECKPOINT_FP8 = ("fp8",)
ONLINE_FP8 = ("fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
FP8_METHODS = CHECKPOINT_FP8 + ONLINE_FP8
# vLLM 0.33.0's MXFP4 MoE methods (gpt-oss checkpoints ship quant_method mxfp4, which
# vLLM serves as gpt_oss_mxfp4).
MXFP4_METHODS = ("mxfp4", "gpt_oss_mxfp4")


# --moe-backend values whose MXFP4 experts read LL's expert-major buffer: vLLM's oracle
# (fused_moe/oracle/mxfp4.py) picks BATCHED_MARLIN from `auto`, and turns `marlin` into it
# under the batched format; the other values build experts of the flat layout only.
MXFP4_LL_MOE_BACKENDS = ("auto", "marlin")


def mxfp4_experts_reason(
    flag: str, backend: str, method: str | None, moe_backend: str, lora: bool = False
) -> str | None:
    """Why MXFP4 expert weights (gpt-oss) cannot run under LL with this --moe-backend (or
    with LoRA: vLLM's batched MXFP4 experts have none). HT takes vLLM's pick (its
    monolithic kernels are excluded under all2all by vLLM itself)."""
    if method not in MXFP4_METHODS or backend != backends.LOW_LATENCY:
        return None
    if moe_backend not in MXFP4_LL_MOE_BACKENDS:
        return (
            f"{flag}: this model's expert weights are MXFP4, and LL's expert-major buffer "
            "needs vLLM's batched MXFP4 experts (BatchedMarlinExperts), which vLLM builds "
            f"from --moe-backend auto or marlin; --moe-backend {moe_backend} builds experts "
            "of the flat layout. Pass --moe-backend auto, or use --all2all-backend "
            "flashinfer_ep_high_throughput."
        )
    if lora:
        return (
            f"{flag}: this model's expert weights are MXFP4, and vLLM's batched MXFP4 experts "
            "(BatchedMarlinExperts, the ones LL's expert-major buffer needs) do not support "
            "LoRA. Drop --enable-lora, or use --all2all-backend flashinfer_ep_high_throughput."
        )
    return None


def quantization_reason(flag: str, method: str | None, block: Any) -> str | None:
    """Why the model's quantization (FP8_METHODS; `block`: weight_block_size) is refused."""
    if not method:
        return None
    if method in MXFP4_METHODS:
        return None  # vLLM's MXFP4 experts (mxfp4_experts_reason)
    if method not in FP8_METHODS:
        return (
            f"{flag} runs BF16 and FP8 ({', '.join(FP8_METHODS)}) MoE models; this model is "
            f"quantized with {method}. Serve a BF16 or FP8 checkpoint in vLLM's fp8 format "
            "(quant_method fp8; FP8 in compressed-tensors or modelopt format is not "
            "supported), or pick another --all2all-backend (e.g. deepep_low_latency)."
        )
    from vllm_flashinfer_ep.vllm.receive_quant import carries_block

    if not carries_block(block):
        return (
            f"{flag} carries FP8 activations in groups of 128 (128x128 block checkpoints); "
            f"this checkpoint's weight_block_size is {block}. Pick another --all2all-backend."
        )
    return None


def gpt_oss_fp8_reason(flag: str, model_type: str | None, method: str | None) -> str | None:
    """Why a gpt-oss model with FP8 MoE weights is refused on either backend: vLLM 0.33.0's
    gpt-oss loader (models/gpt_oss.py `_load_weights_other`) copies each expert tensor
    whole, which fails on padded FP8 weights (LL's hidden size; fp8_per_block rounds hidden
    and intermediate up to 128) and writes nothing into online FP8's deferred (meta)
    weights; the padded_expert_load patch covers unquantized weights only."""
    if model_type != "gpt_oss" or method not in FP8_METHODS:
        return None
    return (
        f"{flag}: gpt-oss with FP8 MoE weights ({method}) is not served: vLLM 0.33.0's "
        "gpt-oss loader copies each expert tensor whole "
        "(vllm/model_executor/models/gpt_oss.py _load_weights_other), which fails on padded "
        "FP8 weights (LL's hidden size, fp8_per_block's multiples of 128) and does not fill "
        "online FP8's deferred weights. Serve the BF16 checkpoint without --quantization."
    )


def dtype_reason(flag: str, dtype: str | None) -> str | None:
    """Why the model's dtype (vLLM's resolved --dtype, by name) is refused."""
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


def transport_reason() -> str | None:
    """Why VLLM_FLASHINFER_EP_TRANSPORT=nixl_ep cannot be served here, or None."""
    if envs.transport() != "nixl_ep":
        return None
    try:
        from flashinfer.moe_ep import have_nixl_ep

        built = bool(have_nixl_ep())
    except Exception:  # noqa: BLE001 - an unimportable FlashInfer has no NIXL-EP either
        built = False
    if built:
        return None
    return (
        f"{envs.TRANSPORT}=nixl_ep needs a FlashInfer built with NIXL-EP, and "
        "flashinfer.moe_ep.have_nixl_ep() is False here (the PyPI wheel ships none). "
        f"Unset {envs.TRANSPORT} to use nccl_ep."
    )


def placement_reason(flag: str, placement: str) -> str | None:
    """Why --expert-placement-strategy is refused, or None (NCCL-EP routes by ranges)."""
    if placement == "linear":
        return None
    return (
        f"{flag} needs each rank's experts to be one contiguous range of expert ids "
        f"(NCCL-EP routes by it); --expert-placement-strategy {placement} places them "
        "otherwise. Pass --expert-placement-strategy linear."
    )


def expert_split_reason(flag: str, experts: int | None, redundant: int, ranks: int) -> str | None:
    """Why the physical experts cannot split evenly over `ranks` EP ranks, or None."""
    if experts is None or ranks <= 1 or experts % ranks == 0:
        return None
    what = f"{experts} experts"
    if redundant:
        what += f" ({experts - redundant} + {redundant} EPLB redundant)"
    return (
        f"{flag}: the model's {what} do not split evenly over {ranks} EP ranks (data x "
        "tensor x prefill-context parallel size); NCCL-EP gives every rank the same number "
        "of experts. Pick a --data-parallel-size (and --tensor-parallel-size) whose product "
        f"divides them, or set num_redundant_experts in --eplb-config (with --enable-eplb) "
        f"so that they are a multiple of {ranks}."
    )


def hidden_reason(flag: str, backend: str, hidden: int | None) -> str | None:
    if hidden is None:
        return None
    if backend != backends.LOW_LATENCY:
        # nccl_ep.h: HT's max_token_bytes (hidden x 2 bytes of BF16) must be a multiple of 16.
        if (hidden * 2) % 16 == 0:
            return None
        return (
            f"{flag}: hidden size {hidden} makes {hidden * 2}-byte token rows, and NCCL-EP high "
            "throughput moves rows in multiples of 16 bytes (a hidden size divisible by 8). "
            "Use --all2all-backend flashinfer_ep_low_latency (it pads the hidden size)."
        )
    if hidden <= SUPPORTED_HIDDEN_SIZES[-1]:
        return None
    return (
        f"{flag}: hidden size {hidden} exceeds the largest NCCL-EP low-latency size "
        f"{SUPPORTED_HIDDEN_SIZES[-1]}. Use --all2all-backend flashinfer_ep_high_throughput."
    )
