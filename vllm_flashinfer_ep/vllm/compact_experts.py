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
batch; the list is built with fixed-shape tensor ops, so a captured CUDA graph replays it
for any routing. The tile comes from vLLM's own lookup for that kernel at the forward's
token count (tuned tables, a user's `VLLM_TUNED_CONFIG_FOLDER` and `override_config`
included). Two kinds of experts take this path:

- unquantized BF16/FP16 weights: 16-bit GEMMs.
- 128x128 block-FP8 weights with dynamic activation groups of 128 (DeepSeek-style
  checkpoints): E4M3 GEMMs with FP32 scales per 128 activation elements and per 128x128
  weight block, `use_fp8_w8a8` and `block_shape=[128, 128]`, as vLLM's fused path runs
  them. The activations arrive E4M3 with their scales [experts, rows, hidden / 128]
  row-major (the FP8 wire, runtime/fp8_wire.py, or the prepare's quantization after
  receive), which the kernel reads as [experts * rows, hidden / 128] through the same row
  indices; BF16 activations are quantized here. The intermediate between the GEMMs is
  quantized per 128 elements as vLLM's batched experts quantize it (vLLM's
  `moe_kernel_quantize_input`, so its scale rounding, E8M0 included, is vLLM's), for the
  listed rows only: they are gathered, quantized and scattered back, so the pass also
  follows the batch, not the buffer (per-row groups: the same bytes as quantizing the
  whole buffer). Off (`FP8_ENABLED`) until its GPU test has run on the real kernels.

Anything else (per-tensor and per-channel FP8, static activation scales, other dtypes)
keeps vLLM's batched kernel with the per-batch tile of vllm/batched_tiles.py. Expert
biases are refused at load (`refuse_biases`): neither path applies them.

The wrapper is an instance patch (`PATCH`, vllm/patches/_helper.py), applied per experts
object by the LL prepare/finalize's setup hook (`install`) over the tile patch, checked
against vLLM 0.33.0's `apply` parameters first, recorded, and undoable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.vllm.batched_tiles import APPLY_PARAMS, TARGET, leave_to_vllm, named_args
from vllm_flashinfer_ep.vllm.patches._helper import (
    INSTANCE,
    Patch,
    PatchTargetError,
    apply_instance,
)

logger = get_logger(__name__)

ENABLED = True  # the test harness turns it off to measure vLLM's batched kernel
# The block-FP8 case stays off until its GPU test (tests/kernels/
# test_compact_experts_fp8_gpu.py) has run on the real kernels: no GPU was lent when it
# was written, and a kernel that refused these arguments would fail every FP8 LL forward.
# Its CPU tests turn it on.
FP8_ENABLED = False
_logged = False


def max_blocks(rows_bound: int, experts: int, rows_per_expert: int, block_m: int) -> int:
    """Most (expert, BLOCK_M rows) blocks a forward can need.

    `rows_bound` is the most rows the rank can receive in total. Each expert with rows
    needs ceil(rows / block_m) blocks: at most its rows, at most one partial block per
    expert beyond rows_bound / block_m, at most the buffer's own block count."""
    per_expert = -(-rows_per_expert // block_m)
    return max(1, min(rows_bound, -(-rows_bound // block_m) + experts, experts * per_expert))


def expert_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block list vLLM's fused-MoE kernel reads, from the received counts.

    Row r of expert e's buffer slot is flat row e * rows_per_expert + r. Returns
    (sorted_ids int32 [num_blocks * block_m]: flat rows block by block, the sentinel
    experts * rows_per_expert where a block has no row; expert_ids int32 [num_blocks]:
    the expert of each block, -1 past the last; blocks_rows int32 [1]: used blocks x
    block_m, past which the kernel's programs return). Fixed shapes, no host sync."""
    experts = counts.numel()
    dev = counts.device
    counts = counts.to(torch.int64)
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    index = torch.arange(num_blocks, device=dev, dtype=torch.int64)
    owner = torch.searchsorted(ends, index, right=True)
    live = owner < experts
    expert = owner.clamp(max=experts - 1)
    first_block = (ends - blocks)[expert]
    row = (index - first_block)[:, None] * block_m + torch.arange(block_m, device=dev)
    valid = live[:, None] & (row < counts[expert][:, None])
    sentinel = experts * rows_per_expert
    sorted_ids = torch.where(valid, expert[:, None] * rows_per_expert + row, sentinel)
    expert_ids = torch.where(live, expert, -1)
    blocks_rows = (ends[-1:] * block_m).clamp(max=num_blocks * block_m)
    return (
        sorted_ids.reshape(-1).to(torch.int32),
        expert_ids.to(torch.int32),
        blocks_rows.to(torch.int32),
    )


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


FP8 = torch.float8_e4m3fn
GROUP = 128  # activation elements per FP32 scale; weight blocks are GROUP x GROUP
BLOCK_SHAPE = [GROUP, GROUP]


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
    """Unquantized weights without biases, 16-bit activations, contiguous buffers."""
    qc = fused_experts.quant_config
    hidden = kw["hidden_states"]
    return (
        qc.quant_dtype is None
        and qc.w1_scale is None
        and qc.w2_scale is None
        and _no_zero_points_or_biases(qc)
        and hidden.dtype in (torch.bfloat16, torch.float16)
        and kw["w1"].dtype == hidden.dtype
        and kw["w2"].dtype == hidden.dtype
        and _buffers_fit(kw)
    )


def _weight_scales_fit(scales: Any, experts: int, n: int, k: int) -> bool:
    """FP32 scales [experts, ceil(n / 128), ceil(k / 128)]: one per 128x128 weight block."""
    return (
        isinstance(scales, torch.Tensor)
        and scales.dtype == torch.float32
        and tuple(scales.shape) == (experts, -(-n // GROUP), -(-k // GROUP))
    )


def row_scales(scales: Any, rows: int, k: int) -> torch.Tensor | None:
    """Activation scales as the fused kernel reads them: [rows, k / 128] FP32 (None: not
    viewable so, e.g. a column-major layout; that call stays on vLLM's batched kernel).
    The FP8 wire's [experts, rows per expert, k / 128] row-major is a view of it."""
    groups = k // GROUP
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype != torch.float32
        or scales.numel() != rows * groups
        or scales.dim() == 0
        or scales.shape[-1] != groups
    ):
        return None
    try:
        return scales.view(rows, groups)
    except RuntimeError:
        return None


def _block_fp8(fused_experts: Any, kw: dict) -> bool:
    """128x128 block-FP8 weights (FP32 block scales, no zero points or biases) with
    dynamic 128-element activation groups, BF16 outputs; activations E4M3 with FP32 scales
    per 128 elements, or BF16 (quantized here)."""
    qc = fused_experts.quant_config
    hidden, w1, w2, output = kw["hidden_states"], kw["w1"], kw["w2"], kw["output"]
    if not (
        qc.quant_dtype == FP8
        and qc.block_shape == BLOCK_SHAPE
        and not qc.per_act_token_quant
        and qc.a1_scale is None
        and qc.a2_scale is None
        and kw["a2_scale"] is None
        and _no_zero_points_or_biases(qc)
        and w1.dtype == FP8
        and w2.dtype == FP8
        and output.dtype == torch.bfloat16
        and w1.dim() == 3
        and w2.dim() == 3
        and _buffers_fit(kw)
    ):
        return False
    experts, rows, k = hidden.shape
    n = w1.shape[1]
    act_n = fused_experts.adjust_N_for_activation(n, kw["activation"])
    if (
        k % GROUP
        or act_n % GROUP
        or tuple(w1.shape) != (experts, n, k)
        or tuple(w2.shape) != (experts, k, act_n)
        or tuple(output.shape) != (experts, rows, k)
        or not _weight_scales_fit(qc.w1_scale, experts, n, k)
        or not _weight_scales_fit(qc.w2_scale, experts, k, act_n)
    ):
        return False
    if hidden.dtype == FP8:
        return row_scales(kw["a1q_scale"], experts * rows, k) is not None
    return hidden.dtype == torch.bfloat16 and kw["a1q_scale"] is None


def _eligible(fused_experts: Any, kw: dict) -> bool:
    return _unquantized(fused_experts, kw) or (FP8_ENABLED and _block_fp8(fused_experts, kw))


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    blocks: tuple,
    config: dict,
    compute_type: Any,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """c[row] = a[row] @ w[expert].T for the rows in the block list (vLLM's kernel).
    `scales`: (a's FP32 [rows, K / 128], w's FP32 [experts, N / 128, K / 128]) for E4M3
    a and w, 128x128 block FP8; None for 16-bit a and w."""
    from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel

    sorted_ids, expert_ids, blocks_rows = blocks
    a_scale, w_scale = scales if scales is not None else (None, None)
    invoke_fused_moe_triton_kernel(
        a,
        w,
        c,
        a_scale,
        w_scale,
        None,
        sorted_ids,
        expert_ids,
        blocks_rows,
        mul_routed_weight=False,
        top_k=1,
        config=config,
        compute_type=compute_type,
        use_fp8_w8a8=scales is not None,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
        block_shape=list(BLOCK_SHAPE) if scales is not None else None,
    )


def quantize_listed_rows(
    x: torch.Tensor, listed: torch.Tensor, quant_config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, width] 16-bit -> (E4M3 [rows, width], FP32 scales [rows, width / 128]).

    The rows in `listed` (the block list's flat rows; the sentinel `rows` where a block
    has none) get vLLM's quantization for the layer (`moe_kernel_quantize_input`, what
    vLLM's batched experts run on their buffer); other rows are left undefined, and the
    kernel never reads them. Each 128-element group is quantized on its own, so
    quantizing only these rows gives the bytes quantizing the whole buffer would. A list
    as long as the buffer quantizes the buffer as it is; a shorter one gathers its rows,
    quantizes them and scatters them back (fixed shapes, no host sync)."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    def quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return moe_kernel_quantize_input(
            t,
            None,
            quant_config.quant_dtype,
            quant_config.per_act_token_quant,
            quant_config.block_shape,
        )

    rows, width = x.shape
    if listed.numel() >= rows:
        return quantize(x)
    index = listed.to(torch.int64)
    q, s = quantize(x.index_select(0, index.clamp(max=rows - 1)))
    # One spare row takes what the sentinel entries scatter.
    q_all = torch.empty(rows + 1, width, dtype=q.dtype, device=x.device)
    s_all = torch.empty(rows + 1, s.shape[-1], dtype=s.dtype, device=x.device)
    q_all.view(torch.uint8).index_copy_(0, index, q.view(torch.uint8))
    s_all.index_copy_(0, index, s)
    # The kernel masks rows >= its A's row count: A must keep exactly `rows` rows.
    return q_all[:rows], s_all[:rows]


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
    fp8 = qc.quant_dtype is not None  # block FP8: the only quantized case `_eligible` takes
    # Each sender dispatches at most the LL capacity per rank (the experts' max_num_tokens).
    capacity = fused_experts.max_num_tokens or rows
    tokens = senders_tokens(
        topk_ids.shape[0], fused_experts.num_dispatchers, capacity, sent_per_rank
    )
    sent = min(tokens * fused_experts.num_dispatchers, total)
    # vLLM's lookup for this kernel: "fp8_w8a8" tables of block [128, 128] for FP8.
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
    if fp8:
        compute_type = tl.bfloat16  # what vLLM's Triton experts compute FP8 in (BF16 out)
    else:
        compute_type = tl.bfloat16 if hidden.dtype == torch.bfloat16 else tl.float16

    act_n = fused_experts.adjust_N_for_activation(n, kw["activation"])
    cache1 = _resize_cache(kw["workspace13"], (experts, rows, n))
    cache2 = _resize_cache(kw["workspace2"], (experts, rows, act_n))
    if not fp8:
        _gemm(hidden.view(total, k), w1, cache1.view(total, 1, n), blocks, config, compute_type)
        fused_experts.activation(kw["activation"], cache2, cache1, valid_token_counts=counts)
        _gemm(cache2.view(total, act_n), w2, output.view(total, 1, k), blocks, config, compute_type)
        return
    if hidden.dtype == FP8:  # E4M3 rows with their scales, as the prepare handed them
        a1, a1_scale = hidden.view(total, k), row_scales(kw["a1q_scale"], total, k)
    else:  # BF16 arrived: the listed rows quantized as vLLM's prepare would
        a1, a1_scale = quantize_listed_rows(hidden.view(total, k), blocks[0], qc)
    _gemm(
        a1,
        w1,
        cache1.view(total, 1, n),
        blocks,
        config,
        compute_type,
        (a1_scale, fused_experts.w1_scale),
    )
    fused_experts.activation(kw["activation"], cache2, cache1, valid_token_counts=counts)
    a2, a2_scale = quantize_listed_rows(cache2.view(total, act_n), blocks[0], qc)
    _gemm(
        a2,
        w2,
        output.view(total, 1, k),
        blocks,
        config,
        compute_type,
        (a2_scale, fused_experts.w2_scale),
    )


def _received_rows_apply(
    fused_experts: Any,
    inner: Callable[..., Any],
    sent_per_rank: Callable[[], int | None] | None = None,
) -> Callable[..., Any]:
    """`fused_experts.apply` computing received rows only, around `inner` (the instance
    patch's replacement); calls that are not eligible go to `inner`."""

    def apply(*args: Any, **kw: Any) -> Any:
        kw = named_args(args, kw)
        if not _eligible(fused_experts, kw):
            return inner(**kw)
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
    what="LL batched Triton experts compute the received rows only (unquantized; 128x128 "
    "block FP8 once FP8_ENABLED)",
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
            "flashinfer_ep_low_latency: unquantized and 128x128 block-FP8 experts run vLLM's "
            "fused-MoE kernel over the received rows only (not over the %d-row buffer of every "
            "expert)",
            fused_experts.max_num_tokens,
        )
    return True
