"""LL experts that launch work only for the rows that arrived, not for the whole buffer.

The LL dispatch hands vLLM's batched experts an expert-major buffer: [local experts,
rows per expert, hidden], rows per expert = the LL capacity times the EP world (256 at
world 1). vLLM 0.33.0's `BatchedTritonExperts` launches one Triton program per (expert,
BLOCK_M rows of that buffer, BLOCK_N columns) and lets the programs beyond an expert's
received count return at once. At a real model's shape that is one program for every
BLOCK_M rows of the whole buffer, for a decode step that carries a few rows per expert,
and the empty programs, not the weights, set the time (docs/benchmarks.md, "Why the
experts were the bottleneck"; tests/engine/batched_tile_probe.py).

Here the two GEMMs run through vLLM's fused-MoE kernel (`invoke_fused_moe_triton_kernel`,
the kernel vLLM runs without EP) over a list of (expert, BLOCK_M rows) blocks built on the
device from the received counts. Its length is bounded by the rows this rank can receive
in the forward (tokens per sender x senders x top_k), so the launch shrinks with the
batch; the list is built on the device with fixed shapes (vllm/block_list.py), so a
captured CUDA graph replays it for any routing. The tile comes from vLLM's own lookup for that kernel at the forward's
token count (tuned tables, a user's `VLLM_TUNED_CONFIG_FOLDER` and `override_config`
included). Two kinds of experts take this path:

- unquantized BF16/FP16 weights: 16-bit GEMMs.
- FP8 weights in the layouts vLLM's batched experts take (vllm/compact_experts_fp8.py):
  128x128 blocks with dynamic 128-element activation groups (DeepSeek-style), per
  output channel with dynamic per-token activations, and per tensor with a dynamic or
  static activation scale. E4M3 GEMMs with vLLM's scales and vLLM's quantization of
  the intermediate, for the listed rows only (`FP8_ENABLED`; dynamic per-tensor
  intermediates under `FP8_DYNAMIC_TENSOR`).

Anything else (FP8 layouts that module does not take, other dtypes, zero points) keeps
vLLM's batched kernel with the per-batch tile of vllm/batched_tiles.py. Expert biases are
refused at load (`refuse_biases`): neither path applies them.

The wrapper is an instance patch (`PATCH`, vllm/patches/_helper.py), applied per experts
object by the LL prepare/finalize's setup hook (`install`) over the tile patch, checked
against vLLM 0.33.0's `apply` parameters first, recorded, and undoable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.vllm import block_list, compact_experts_fp8
from vllm_flashinfer_ep.vllm.batched_tiles import APPLY_PARAMS, TARGET, leave_to_vllm, named_args
from vllm_flashinfer_ep.vllm.block_list import (  # noqa: F401 - expert_blocks also for callers
    expert_blocks,
    listed_gemm,
)

# The FP8 half's public names, still importable from here where they were before it moved.
from vllm_flashinfer_ep.vllm.compact_experts_fp8 import (  # noqa: F401
    BLOCK_SHAPE,
    FP8,
    GROUP,
    quantize_listed_rows,
    row_scales,
)
from vllm_flashinfer_ep.vllm.patches._helper import (
    INSTANCE,
    Patch,
    PatchTargetError,
    apply_instance,
)

logger = get_logger(__name__)

ENABLED = True  # the test harness turns it off to measure vLLM's batched kernel
# The FP8 cases (vllm/compact_experts_fp8.py); their GPU test (tests/kernels/
# test_compact_experts_fp8_gpu.py) passed on the H200 on 2026-12-05 for block and per-token
# layers and static per-tensor ones. Dynamic per-tensor intermediates (online
# fp8_per_tensor) followed once per-tensor scales became true FP32 divisions (their captured
# replay had differed from vLLM's before), after the engine's accuracy test and benchmark
# (docs/benchmarks.md, docs/contributing/gpu_runs.md).
FP8_ENABLED = True
FP8_DYNAMIC_TENSOR = True
_logged = False


def max_blocks(rows_bound: int, experts: int, rows_per_expert: int, block_m: int) -> int:
    """Most (expert, BLOCK_M rows) blocks a forward can need.

    `rows_bound` is the most rows the rank can receive in total. Each expert with rows
    needs ceil(rows / block_m) blocks: at most its rows, at most one partial block per
    expert beyond rows_bound / block_m, at most the buffer's own block count."""
    per_expert = -(-rows_per_expert // block_m)
    return max(1, min(rows_bound, -(-rows_bound // block_m) + experts, experts * per_expert))


def senders_tokens(
    local_tokens: int, dispatchers: int, capacity: int, sent_per_rank: int | None = None
) -> int:
    """The most tokens any sender dispatches in this forward.

    `sent_per_rank`: what every rank dispatched this round when the transport knows it
    (a pooled round: its handle's size, padding included; rounds.Round.sent_per_rank).
    Otherwise, one sender (world 1): this rank's own count; several: the largest count in
    vLLM's DP metadata for the forward (every rank's tokens; CUDA graphs pad them to one
    size), at most `capacity`, the LL capacity per rank (the bound the buffer was sized
    for, which the transport enforces); without the metadata, that capacity."""
    if sent_per_rank is not None:
        return sent_per_rank
    if dispatchers == 1:
        return local_tokens
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            dp = get_forward_context().dp_metadata
            if dp is not None:
                return min(int(dp.num_tokens_across_dp_cpu.max()), capacity)
    except (ImportError, AttributeError):
        pass
    return capacity


def refuse_biases(fused_experts: Any) -> None:
    """Expert biases (e.g. gpt-oss): vLLM 0.33.0's batched kernel has no bias term and
    this package's received-rows path does not pass them yet, so the model would be
    computed without them. Refuse at load, naming the alternatives."""
    from vllm_flashinfer_ep.errors import FlashInferEPConfigError

    qc = fused_experts.quant_config
    if getattr(qc, "w1_bias", None) is not None or getattr(qc, "w2_bias", None) is not None:
        raise FlashInferEPConfigError(
            "flashinfer_ep_low_latency does not support MoE expert biases yet (vLLM's batched "
            "experts have no bias term, the model would run without them); serve this model "
            "with another --all2all-backend or without --enable-expert-parallel"
        )


def _buffers_fit(kw: dict) -> bool:
    hidden, output = kw["hidden_states"], kw["output"]
    return (
        hidden.dim() == 3
        and hidden.is_contiguous()
        and output.is_contiguous()
        and kw["expert_tokens_meta"] is not None
    )


def _no_zero_points_or_biases(qc: Any) -> bool:
    return all(getattr(qc, name) is None for name in ("w1_zp", "w2_zp", "w1_bias", "w2_bias"))


def _unquantized(fused_experts: Any, kw: dict) -> bool:
    """Unquantized weights, 16-bit activations."""
    qc = fused_experts.quant_config
    hidden = kw["hidden_states"]
    return (
        qc.quant_dtype is None
        and qc.w1_scale is None
        and qc.w2_scale is None
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and kw["w1"].dtype == hidden.dtype
        and kw["w2"].dtype == hidden.dtype
    )


def eligible(fused_experts: Any, kw: dict) -> bool:
    """Contiguous buffers, no zero points or biases, and unquantized weights or an FP8
    layout `compact_experts_fp8.scheme` takes (once FP8_ENABLED)."""
    if not (_buffers_fit(kw) and _no_zero_points_or_biases(fused_experts.quant_config)):
        return False
    if _unquantized(fused_experts, kw):
        return True
    if not FP8_ENABLED:
        return False
    kind = compact_experts_fp8.scheme(fused_experts, kw)
    if kind == compact_experts_fp8.TENSOR and not FP8_DYNAMIC_TENSOR:
        return fused_experts.quant_config.a2_scale is not None or kw["a2_scale"] is not None
    return kind is not None


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    blocks: tuple,
    config: dict,
    compute_type: Any,
) -> None:
    """c[row] = a[row] @ w[expert].T for the rows in the block list, 16-bit a and w (FP8:
    compact_experts_fp8.gemm); one kernel call for both, block_list.listed_gemm."""
    listed_gemm(a, w, c, blocks, config, compute_type)


def compact_apply(fused_experts: Any, kw: dict, sent_per_rank: int | None = None) -> None:
    """vLLM's batched experts computation (GEMM, activation, GEMM) on received rows only.
    `sent_per_rank`: see `senders_tokens`."""
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
    from vllm.model_executor.layers.fused_moe.utils import _resize_cache

    hidden, w1, w2, output = kw["hidden_states"], kw["w1"], kw["w2"], kw["output"]
    counts = kw["expert_tokens_meta"].expert_num_tokens
    topk_ids = kw["topk_ids"]
    experts, rows, k = hidden.shape
    total = experts * rows
    n = w1.shape[1]
    top_k = topk_ids.shape[1]
    qc = fused_experts.quant_config
    # Each sender dispatches at most the LL capacity per rank (the experts' max_num_tokens).
    capacity = fused_experts.max_num_tokens or rows
    tokens = senders_tokens(
        topk_ids.shape[0], fused_experts.num_dispatchers, capacity, sent_per_rank
    )
    sent = min(tokens * fused_experts.num_dispatchers, total)
    # vLLM's lookup for this kernel: "fp8_w8a8" tables for FP8 (of block [128, 128] for
    # block FP8), as vLLM's batched experts look it up.
    config = try_get_optimal_moe_config(
        w1.size(),
        w2.size(),
        top_k,
        qc.config_name(hidden.dtype),
        max(1, sent),
        block_shape=fused_experts.block_shape,
    )
    bound = max_blocks(sent * top_k, experts, rows, config["BLOCK_SIZE_M"])
    blocks = expert_blocks(counts, rows, config["BLOCK_SIZE_M"], bound)
    act_n = fused_experts.adjust_N_for_activation(n, kw["activation"])
    cache1 = _resize_cache(kw["workspace13"], (experts, rows, n))
    cache2 = _resize_cache(kw["workspace2"], (experts, rows, act_n))
    if qc.quant_dtype is not None:  # an FP8 layout `eligible` took
        kind = compact_experts_fp8.scheme(fused_experts, kw)
        compact_experts_fp8.apply(fused_experts, kw, kind, blocks, config, cache1, cache2)
        return
    compute_type = tl.bfloat16 if hidden.dtype == torch.bfloat16 else tl.float16
    _gemm(hidden.view(total, k), w1, cache1.view(total, 1, n), blocks, config, compute_type)
    block_list.activation(fused_experts, kw["activation"], cache2, cache1, counts, blocks)
    _gemm(cache2.view(total, act_n), w2, output.view(total, 1, k), blocks, config, compute_type)


def quantizes_input(fused_experts: Any) -> bool:
    """Whether this experts object, once `install`ed (the caller knows: `install`'s
    answer), takes its FP8 layer's activations in BF16 and quantizes them itself: the LL
    prepare then hands BF16 over (a layer without FP8 on the wire). Quantizing the buffer
    in the prepare runs over every row of every expert whatever the batch (its cost:
    docs/benchmarks.md, "Per-channel FP8"); the received-rows path quantizes the listed
    rows, and a call it does not take gets the whole buffer quantized as the prepare would
    have (`_quantized_for_vllm`)."""
    qc = getattr(fused_experts, "quant_config", None)
    return (
        ENABLED
        and FP8_ENABLED
        and qc is not None
        and qc.quant_dtype == compact_experts_fp8.FP8
        and not fused_experts.expects_unquantized_inputs
    )


def _quantized_for_vllm(fused_experts: Any, kw: dict) -> dict:
    """The call as vLLM's batched kernel takes it: BF16 activations of an FP8 layer (the
    prepare left them to this path, `quantizes_input`) quantized over the whole buffer
    with the scales the prepare would have given (vllm/receive_quant.py)."""
    qc = fused_experts.quant_config
    hidden = kw["hidden_states"]
    if not (
        qc.quant_dtype == compact_experts_fp8.FP8
        and hidden.dtype != compact_experts_fp8.FP8
        and kw["a1q_scale"] is None
        and kw["expert_tokens_meta"] is not None
        and not fused_experts.expects_unquantized_inputs
    ):
        return kw
    from vllm_flashinfer_ep.vllm import receive_quant

    counts = kw["expert_tokens_meta"].expert_num_tokens
    xq, xs = receive_quant.quantize_expert_buffer(hidden, counts, qc, False)
    return {**kw, "hidden_states": xq, "a1q_scale": xs}


def _received_rows_apply(
    fused_experts: Any,
    inner: Callable[..., Any],
    sent_per_rank: Callable[[], int | None] | None = None,
) -> Callable[..., Any]:
    """`fused_experts.apply` computing received rows only, around `inner` (the instance
    patch's replacement); calls that are not eligible go to `inner`."""

    def apply(*args: Any, **kw: Any) -> Any:
        kw = named_args(args, kw)
        if not eligible(fused_experts, kw):
            return inner(**_quantized_for_vllm(fused_experts, kw))
        return compact_apply(fused_experts, kw, sent_per_rank() if sent_per_rank else None)

    apply._flashinfer_ep_compact = True  # type: ignore[attr-defined]
    return apply


PATCH = Patch(
    "compact_experts",
    "worker",
    TARGET,
    INSTANCE,
    _received_rows_apply,
    APPLY_PARAMS,
    what="LL batched Triton experts compute the received rows only (unquantized; FP8 "
    "block, per-channel and per-tensor once FP8_ENABLED)",
    why="vLLM's batched kernel launches programs over every expert's whole buffer; the "
    "empty ones set a decode step's time (docs/benchmarks.md)",
    how="per experts object, from the LL prepare/finalize's post_init_setup, over "
    "batched_tiles: wrap its apply; vLLM's fused-MoE kernel over a block list built on the "
    "device from the received counts, other calls to the wrapped apply",
    upstream="a received-rows (block list) path in vLLM's BatchedTritonExperts",
    removal="then",
)


def install(fused_experts: Any, sent_per_rank: Callable[[], int | None] | None = None) -> bool:
    """Make `fused_experts` (vLLM's BatchedTritonExperts) compute received rows only.

    Applies `PATCH` to the instance (vLLM 0.33.0's `apply` parameters, checked; applying
    it again is a no-op). `sent_per_rank()` says, during a round, how many tokens every
    rank dispatched (padded rounds send more than the batch holds). Returns whether the
    instance now does so."""
    if not ENABLED:
        return False
    try:
        if not apply_instance(PATCH, fused_experts, sent_per_rank):
            return False  # not a BatchedTritonExperts
    except PatchTargetError as error:
        return leave_to_vllm(error, "the experts computation")
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "flashinfer_ep_low_latency: %s experts run vLLM's fused-MoE kernel over the "
            "received rows only (not over the %d-row buffer of every expert)",
            "unquantized and FP8" if FP8_ENABLED else "unquantized",
            fused_experts.max_num_tokens,
        )
    return True
