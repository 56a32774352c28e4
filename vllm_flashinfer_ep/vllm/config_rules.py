"""The config-time rules of the flashinfer_ep backends, as plain functions.

Each takes the model's shape (model_shape.py, the one reader of Hugging Face configs)
and the parallel or scheduler settings, and returns the refusal or warning message, or a
verdict tuple, or None: no vLLM config is read or changed here. The engine applies them
in vllm/config_validation.py; `vllm-flashinfer-ep doctor` applies the same functions to
a config.json and the `vllm serve` arguments, so it gives the engine's verdicts. Every
message names the flag to change. One host reading sits here too, because both read it
the same way: `device_memory_bytes` (the GPU's memory, as vLLM's platform reports it).
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
    """Why a `draft_model` speculative draft with MoE layers is refused: vLLM builds it
    under a ParallelConfig of its own (all2all backend allgather_reducescatter), whose
    all-gather would run through the EP group's all2all manager, this backend's."""
    return (
        f"{flag}: the speculative draft model ({draft}) has MoE layers, and vLLM builds a "
        "draft_model draft with a parallel config of its own whose all2all backend is "
        "allgather_reducescatter; that all-gather would run through this backend's all2all "
        "manager, which has none. Serve a dense draft model, or a draft that shares the "
        "target's layers' parallel config (method mtp or eagle), in --speculative-config."
    )


def elastic_ep_reason(flag: str, enable_elastic_ep: bool) -> str | None:
    """Why --enable-elastic-ep is refused, or None: elastic EP makes its EP group without
    torch.distributed, and NCCL-EP's fleet is bootstrapped from a torch.distributed group
    (its communicator, the ranks' agreement at load, the FT rendezvous store)."""
    if not enable_elastic_ep:
        return None
    return (
        f"{flag} bootstraps NCCL-EP from the EP group's torch.distributed process group, "
        "which elastic EP does not create (its groups are stateless). Remove "
        "--enable-elastic-ep."
    )


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


class StepBudgetVerdict(NamedTuple):
    """What config time does with --max-num-batched-tokens against a per-rank limit."""

    lowered_to: int | None  # config time lowers --max-num-batched-tokens to this
    refusal: str | None  # config time refuses with this message
    why: str | None  # why the budget does not fit (None: it fits)


def ht_tokens_verdict(
    flag: str,
    tokens: int,
    *,
    chunked_prefill: bool,
    max_model_len: int | None,
    max_num_seqs: int | None = None,
) -> StepBudgetVerdict:
    """The HT step-budget rule, for the engine (`config_validation._clamp_ht_tokens`) and `doctor` alike.

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
    """The LL memory rule, for the engine (`config_validation._check_ll_capacity`) and `doctor` alike.

    `shape`: (LL hidden size, physical experts, top_k), `ModelShape.ll_fleet_shape`;
    `total_memory`: GPU memory in bytes (`device_memory_bytes`), None where no GPU is
    visible (then nothing is checked and the summary says so). The estimate includes
    the handle pool a served engine warms (runtime/pool_sizes.py buckets above vLLM's
    default capture sizes). `token_step`: a lowered budget is a multiple of it (DeepGEMM
    experts need whole row tiles, `fp8_experts_choice.deep_gemm_step`).
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
    elif not chunked_prefill and max_model_len is not None and max_model_len > fit:
        refusal = (
            f"{flag} {why}, but --max-num-batched-tokens is {tokens} with chunked prefill off "
            f"and --max-model-len {max_model_len}. Enable chunked prefill or pass "
            f"--max-model-len <= {fit}."
        )
    lowered = None if refusal is not None else fit
    return LLMemoryVerdict(need, parts, handles, budget, summary, why, lowered, refusal)


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


def device_memory_bytes() -> int | None:
    """Memory of GPU 0 as vLLM's platform reports it (NVML: no CUDA context), or None.
    Callers reach it as `config_rules.device_memory_bytes()`, so tests can stand in a GPU."""
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


def transport_reason() -> str | None:
    """Why VLLM_FLASHINFER_EP_TRANSPORT cannot be served here, or None: nixl_ep needs a
    FlashInfer built with NIXL-EP (FlashInfer is imported only to ask)."""
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
    """Why the physical experts (logical + EPLB redundant) cannot go to `ranks` EP ranks,
    or None: NCCL-EP gives every rank the same number of experts."""
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
