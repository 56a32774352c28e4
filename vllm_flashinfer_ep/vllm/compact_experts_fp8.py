"""FP8 LL experts over the received rows: the quantized half of vllm/compact_experts.py.

vLLM 0.33.0's `BatchedTritonExperts` takes three FP8 layouts (E4M3 weights and
activations, FP32 scales, BF16 out). Each runs here through vLLM's fused-MoE kernel
(`invoke_fused_moe_triton_kernel`, `use_fp8_w8a8`) over the block list compact_experts.py
builds from the received counts, with the scales vLLM's batched kernel would read:

- block: 128x128 weight blocks [E, N / 128, K / 128], dynamic activation groups of 128
  (DeepSeek-style checkpoints): `block_shape=[128, 128]`, A's scales [rows, K / 128].
- token: dynamic per-token activation scales with per-output-channel weight scales
  [E, N, 1] (or one per expert, [E] / [E, 1, 1]): `per_channel_quant=True`, A's scales
  [rows, 1].
- tensor: one activation scale per expert (dynamic, or the checkpoint's static one) with
  one weight scale per expert. vLLM's batched kernel reads the activation scale per
  expert ([E, 1, 1]); the fused kernel's tensor-wise branch reads a single one for all
  rows. So the per-expert scale goes in as a per-row one (`per_channel_quant=True`, each
  row its expert's scale, the weight scale read with a zero channel stride): the same
  FP32 products, accumulator x activation scale x weight scale.

Activations arrive in E4M3 with their scales (the FP8 wire), read in place through the
same row indices, or in BF16: the LL prepare leaves a layer without FP8 on the wire to
this path (compact_experts.quantizes_input), which quantizes the listed rows as the
prepare would have quantized the whole buffer (per row, gathered and scattered back, or in
one launch over the block list with `listed_quant.INPUT_ENABLED`; per tensor with the
prepare's one scale, static or max |x| / 448 over the received rows). The intermediate between the
GEMMs is quantized as vLLM's batched experts quantize it, for the listed rows only: block
and token intermediates activated and quantized in one kernel (vllm/listed_quant.py, on;
off: the listed activation, then vLLM's `moe_kernel_quantize_input` on the gathered rows,
scattered back), static per-tensor ones gathered, quantized with vLLM's op and scattered
back, dynamic ones by listed_quant's two launches (`TENSOR_ENABLED`, on; off: gathered too):

- block and token scales are per row, so those rows get the bytes quantizing the whole
  buffer would give them; a static per-tensor scale likewise.
- a dynamic per-tensor scale spans rows. vLLM's batched experts take it per expert over
  its received rows when eager (their loop over experts) and over the whole buffer (its
  rows past the counts zeroed: every received row) inside a CUDA graph or torch.compile.
  This path does the same, asking vLLM's own `_is_capturing_or_compiling`: max |x| over
  those rows / 448, as vLLM's dynamic kernel computes it, floored at the smallest normal
  FP32 (an expert of all-zero rows gets zeros, not a division by zero), then applied with
  vLLM's static quantization (its per-row form for per-expert scales).

Layouts that vLLM's batched kernel reads otherwise, or that this path does not
reproduce exactly (per-channel weights with per-tensor activations, static per-token or
per-expert activation scales, static scales on block layers, BF16 activations with a
per-expert static scale) return no scheme, and vLLM's batched kernel keeps those calls
(BF16 ones quantized first as the prepare would have).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep.vllm import block_list, listed_quant
from vllm_flashinfer_ep.vllm.block_list import listed_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # what vLLM's dynamic FP8 kernels divide max |x| by
GROUP = 128  # activation elements per FP32 scale; weight blocks are GROUP x GROUP
BLOCK_SHAPE = [GROUP, GROUP]
BLOCK, TOKEN, TENSOR = "block", "token", "tensor"


def row_scales(scales: Any, rows: int, groups: int) -> torch.Tensor | None:
    """Activation scales as the fused kernel reads them: [rows, groups] FP32 (groups:
    K / 128 for block FP8, 1 per token; None: not viewable so, e.g. a column-major layout,
    and that call stays on vLLM's batched kernel). The prepare's [experts, rows per
    expert, groups] row-major is a view of it."""
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


def expert_scales(scales: Any, experts: int) -> torch.Tensor | None:
    """A per-tensor activation scale as vLLM's batched experts take it (one for all, or
    [E, 1, 1] / [E, 1]: one per expert) -> FP32 [E] (None: another layout)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        return None
    if scales.numel() == 1:
        return scales.reshape(1).expand(experts)
    if tuple(scales.shape) in ((experts, 1, 1), (experts, 1)):
        return scales.reshape(experts)
    return None


def _weight_scales_fit(scales: Any, kind: str, experts: int, n: int, k: int) -> bool:
    """FP32 weight scales in a layout vLLM's batched kernel reads for `kind`: one per
    128x128 block, per output channel [E, N, 1], or one per expert [E] / [E, 1, 1]."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        return False
    shape = tuple(scales.shape)
    if kind == BLOCK:
        return shape == (experts, -(-n // GROUP), -(-k // GROUP))
    return shape in ((experts,), (experts, 1, 1)) or (kind == TOKEN and shape == (experts, n, 1))


def _static_scale_fits(scale: Any) -> bool:
    return scale is None or (
        isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.numel() == 1
    )


def scheme(fused_experts: Any, kw: dict) -> str | None:
    """The FP8 layout (BLOCK, TOKEN, TENSOR) of this call that the received-rows path
    computes as vLLM's batched kernel does; None: vLLM's batched kernel keeps it. Buffer
    layout, zero points and biases are compact_experts.py's checks."""
    qc = fused_experts.quant_config
    hidden, w1, w2, output = kw["hidden_states"], kw["w1"], kw["w2"], kw["output"]
    if not (
        qc.quant_dtype == FP8
        and w1.dtype == FP8
        and w2.dtype == FP8
        and w1.dim() == 3
        and w2.dim() == 3
        and output.dtype == torch.bfloat16
    ):
        return None
    experts, rows, k = hidden.shape
    n = w1.shape[1]
    act_n = fused_experts.adjust_N_for_activation(n, kw["activation"])
    if (
        tuple(w1.shape) != (experts, n, k)
        or tuple(w2.shape) != (experts, k, act_n)
        or tuple(output.shape) != (experts, rows, k)
    ):
        return None
    dynamic = qc.a1_scale is None and qc.a2_scale is None and kw["a2_scale"] is None
    if qc.block_shape is not None:
        kind, groups = BLOCK, k // GROUP
        fits = (
            qc.block_shape == BLOCK_SHAPE
            and not qc.per_act_token_quant
            and dynamic
            and not (k % GROUP or act_n % GROUP)
        )
    elif qc.per_act_token_quant:
        kind, groups, fits = TOKEN, 1, dynamic
    else:  # per-tensor activations: weights per expert, not per channel
        kind, groups = TENSOR, 1
        fits = not qc.per_out_ch_quant and _static_scale_fits(kw["a2_scale"])
    if not (
        fits
        and _weight_scales_fit(qc.w1_scale, kind, experts, n, k)
        and _weight_scales_fit(qc.w2_scale, kind, experts, k, act_n)
    ):
        return None
    scales = kw["a1q_scale"]
    if kind == TENSOR and hidden.dtype != FP8:  # BF16: quantized here with one scale
        arrived = (
            hidden.dtype == torch.bfloat16 and scales is None and _static_scale_fits(qc.a1_scale)
        )
    elif kind == TENSOR:
        arrived = hidden.dtype == FP8 and expert_scales(scales, experts) is not None
    elif hidden.dtype == FP8:
        arrived = row_scales(scales, experts * rows, groups) is not None
    else:  # BF16: quantized here, per row
        arrived = hidden.dtype == torch.bfloat16 and scales is None
    return kind if arrived else None


def _gather(x: torch.Tensor, listed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(the rows to quantize, the list as int64, whether they are x itself). A list as
    long as the buffer takes the buffer as it is; a shorter one gathers its rows (the
    sentinel entries read the last row; what they produce is scattered to a spare row)."""
    index = listed.to(torch.int64)
    if listed.numel() >= x.shape[0]:
        return x, index, True
    return x.index_select(0, index.clamp(max=x.shape[0] - 1)), index, False


def _scatter(t: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """Gathered rows back to their buffer rows: [rows, width], the rows not listed
    undefined (one spare row takes what the sentinel entries scatter)."""
    out = torch.empty(rows + 1, t.shape[-1], dtype=t.dtype, device=t.device)
    if t.dtype == FP8:
        out.view(torch.uint8).index_copy_(0, index, t.view(torch.uint8))
    else:
        out.index_copy_(0, index, t)
    # The kernel masks rows >= its A's row count: A must keep exactly `rows` rows.
    return out[:rows]


def quantize_listed_rows(
    x: torch.Tensor, listed: torch.Tensor, quant_config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, width] 16-bit -> (E4M3 [rows, width], FP32 scales [rows, groups]) with
    per-row scales (128-element groups, or per token).

    The rows in `listed` (the block list's flat rows; the sentinel `rows` where a block
    has none) get vLLM's quantization for the layer (`moe_kernel_quantize_input`, what
    vLLM's batched experts run on their buffer); other rows are left undefined, and the
    kernel never reads them. Each row is quantized on its own, so quantizing only these
    rows gives the bytes quantizing the whole buffer would (fixed shapes, no host sync)."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    t, index, whole = _gather(x, listed)
    q, s = moe_kernel_quantize_input(
        t,
        None,
        quant_config.quant_dtype,
        quant_config.per_act_token_quant,
        quant_config.block_shape,
    )
    if whole:
        return q, s
    return _scatter(q, index, x.shape[0]), _scatter(s, index, x.shape[0])


def over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as a true FP32 division, as vLLM's dynamic FP8 kernels divide. (torch
    multiplies by the reciprocal when the divisor is a host scalar: one ulp off at
    times, which moves E4M3 roundings.)"""
    return amax / torch.full_like(amax, FP8_MAX)


def _dynamic_tensor_scale(
    t: torch.Tensor, ids: torch.Tensor, rows: int, rows_per_expert: int, per_expert: bool
) -> torch.Tensor:
    """vLLM's dynamic per-tensor scale (max |x| / 448, floored) of the rows `t` whose
    flat ids are `ids` (the sentinel `rows`: not a listed row, left out): FP32 [1] over
    them all, or [len(t), 1], each row its expert's over that expert's rows."""
    listed_row = ids < rows
    low, high = torch.aminmax(t, dim=-1)
    row_max = torch.maximum(high, -low).float()  # max |x|
    row_max = torch.nan_to_num(row_max, nan=0.0, posinf=float("inf"))  # vLLM's fmaxf skips NaN
    row_max = torch.where(listed_row, row_max, torch.zeros_like(row_max))
    tiny = torch.finfo(torch.float32).tiny
    if not per_expert:
        return over_fp8_max(row_max.amax()).clamp_min(tiny).reshape(1)
    experts = rows // rows_per_expert
    owner = torch.where(listed_row, ids // rows_per_expert, experts)
    expert_max = torch.zeros(experts + 1, dtype=torch.float32, device=t.device)
    expert_max.scatter_reduce_(0, owner, row_max, "amax")
    return over_fp8_max(expert_max).clamp_min(tiny)[owner][:, None]


def _in_graph() -> bool:
    """vLLM's own test for its batched experts' in-graph branch (one dynamic per-tensor
    scale over the whole buffer), read at the call as vLLM reads it."""
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        _is_capturing_or_compiling,
    )

    return bool(_is_capturing_or_compiling())


def quantize_listed_rows_per_tensor(
    x: torch.Tensor,
    listed: torch.Tensor,
    rows_per_expert: int,
    quant_config: Any,
    static_scale: torch.Tensor | None,
    one_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, width] 16-bit, per-tensor layer -> (E4M3 [rows, width], FP32 scales
    [rows, 1], each row its expert's) for the listed rows, as vLLM's batched experts
    quantize their intermediate: with `static_scale` when the layer has one, else with
    the dynamic scale of the module docstring (per expert eagerly, one over every received
    row inside a CUDA graph or torch.compile), through vLLM's static quantization.
    `one_scale`: one dynamic scale over every listed row always, as the LL prepare
    quantizes a layer's BF16 input (vllm/receive_quant.py)."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    rows = x.shape[0]
    t, index, whole = _gather(x, listed)
    one_scale = one_scale or static_scale is not None or _in_graph()
    if static_scale is not None:
        scale = static_scale
    else:
        ids = index
        if whole:  # each buffer row: its own index if listed, else the sentinel
            ids = torch.full((rows + 1,), rows, dtype=torch.int64, device=x.device)
            ids = ids.index_copy_(0, index, index)[:rows]
        scale = _dynamic_tensor_scale(t, ids, rows, rows_per_expert, per_expert=not one_scale)
    q, s = moe_kernel_quantize_input(t, scale, quant_config.quant_dtype, False, None)
    q = q if whole else _scatter(q, index, rows)
    if one_scale:  # every row reads the one scale (stride 0)
        return q, s.reshape(1, 1).expand(rows, 1)
    return q, (s if whole else _scatter(s, index, rows))


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    blocks: tuple,
    config: dict,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    kind: str,
) -> None:
    """c[row] = dequantized a[row] @ w[expert].T for the listed rows (vLLM's kernel): E4M3
    a [rows, K] and w [E, N, K], BF16 c [rows, 1, N]; a_scale FP32 [rows, K / 128] (block)
    or [rows, 1] (token, tensor); w_scale as the quant config holds it."""
    import triton.language as tl

    block = list(BLOCK_SHAPE) if kind == BLOCK else None
    # BF16 out: what vLLM's Triton experts compute FP8 in.
    listed_gemm(a, w, c, blocks, config, tl.bfloat16, (a_scale, w_scale, kind != BLOCK, block))


def _e8m0_scales() -> bool:
    """Whether vLLM's group quantization rounds block scales to powers of two here (its
    `per_token_group_quant_fp8` asks this when not told)."""
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    return bool(is_deep_gemm_e8m0_used())


def apply(
    fused_experts: Any,
    kw: dict,
    kind: str,
    blocks: tuple,
    config: dict,
    cache1: torch.Tensor,
    cache2: torch.Tensor,
) -> None:
    """vLLM's batched FP8 experts computation (GEMM, activation, GEMM) on the listed rows.
    `kind`: `scheme`'s answer; cache1 [E, rows, N] and cache2 [E, rows, N'] the
    workspaces of GEMM1's output and the activation's."""
    hidden, w1, w2, output = kw["hidden_states"], kw["w1"], kw["w2"], kw["output"]
    experts, rows, k = hidden.shape
    total = experts * rows
    n, act_n = cache1.shape[-1], cache2.shape[-1]
    qc = fused_experts.quant_config
    listed = blocks[0]
    # groups of 128 with vLLM's E8M0 choice (block), else one scale per row
    group = GROUP if kind == BLOCK else None
    ue8m0 = kind == BLOCK and _e8m0_scales()
    if kind == TENSOR and hidden.dtype != FP8:  # BF16: one scale, as the prepare's
        x = hidden.view(total, k)
        if qc.a1_scale is None and listed_quant.takes_tensor(x, act=False):  # two launches
            a1, a1_scale = listed_quant.tensor_quant(x, blocks, rows, per_expert=False, act=False)
        else:
            a1, a1_scale = quantize_listed_rows_per_tensor(
                x, listed, rows, qc, qc.a1_scale, one_scale=True
            )
    elif kind == TENSOR:  # E4M3 with a scale per expert: one per row
        a1 = hidden.view(total, k)
        a1_scale = expert_scales(kw["a1q_scale"], experts)
        a1_scale = a1_scale.reshape(experts, 1).expand(experts, rows).reshape(total, 1)
    elif hidden.dtype == FP8:  # E4M3 rows with their scales, as the prepare handed them
        a1 = hidden.view(total, k)
        a1_scale = row_scales(kw["a1q_scale"], total, k // GROUP if kind == BLOCK else 1)
    else:  # BF16 arrived: the listed rows quantized as vLLM's prepare would
        x = hidden.view(total, k)
        if listed_quant.takes_input(x, group):  # one launch over the block list
            a1, a1_scale = listed_quant.quantize_rows(x, blocks, group, ue8m0)
        else:
            a1, a1_scale = quantize_listed_rows(x, listed, qc)
    gemm(a1, w1, cache1.view(total, 1, n), blocks, config, a1_scale, qc.w1_scale, kind)
    counts = kw["expert_tokens_meta"].expert_num_tokens
    x1 = cache1.view(total, n)
    if kind != TENSOR and listed_quant.takes(fused_experts, kw["activation"], x1, group):
        # activation and quantization in one launch, scales as vLLM's op would round them
        a2, a2_scale = listed_quant.silu_mul_quant(x1, blocks, group, ue8m0)
    elif (
        kind == TENSOR
        and kw["a2_scale"] is None
        and listed_quant.takes_tensor(x1, True, fused_experts, kw["activation"])
    ):  # the max, then activation and quantization: the scale per expert when eager
        per_expert = not _in_graph()
        a2, a2_scale = listed_quant.tensor_quant(x1, blocks, rows, per_expert, act=True)
    else:
        block_list.activation(fused_experts, kw["activation"], cache2, cache1, counts, blocks)
        x2 = cache2.view(total, act_n)
        if kind == TENSOR:
            a2, a2_scale = quantize_listed_rows_per_tensor(x2, listed, rows, qc, kw["a2_scale"])
        else:
            a2, a2_scale = quantize_listed_rows(x2, listed, qc)
    gemm(a2, w2, output.view(total, 1, k), blocks, config, a2_scale, qc.w2_scale, kind)
