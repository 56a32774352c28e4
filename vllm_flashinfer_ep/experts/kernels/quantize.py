"""FP8 quantization of the received rows, optionally fused with SiLU-and-mul (between the
GEMMs; without it, BF16 arrivals before GEMM1). Rounding is vLLM 0.33.0's, with true
divisions as its CUDA kernels divide (constants: fp8_numerics.py):
- per group (`per_token_group_fp8_quant`): max(amax, floor) / 448, a power of two in E8M0;
- per token (`dynamic_per_token_scaled_fp8_quant`): max(amax / 448, floor);
- per tensor: a dynamic scale's max over the received rows first, then x times 1 / scale.
Rows that did not arrive are left undefined: the GEMM after reads received rows only.
"""

from __future__ import annotations

import torch

from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.experts.kernels.row_blocks import RowBlocks, triton

if triton is not None:
    import triton.language as tl

    from vllm_flashinfer_ep.experts.kernels.activation import silu_mul_rows
    from vllm_flashinfer_ep.experts.kernels.row_blocks import block_tile

TILE = 4096  # elements one program holds at a time: BLOCK_M x BLOCK_N


def rows_reason(x: torch.Tensor, group: int | None, act: bool) -> str | None:
    """Why these kernels do not take `x`, [rows, 2d] when `act` (None: they do)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit x, got {x.dtype}"
    if not x.is_contiguous() or x.dim() != 2 or (act and x.shape[1] % 2):
        return f"contiguous [rows, {'2d' if act else 'd'}], got {tuple(x.shape)}"
    d = x.shape[1] // 2 if act else x.shape[1]
    if group is not None and d % group:
        return f"d = {d} not a multiple of the group {group}"
    return None


def _outputs(x: torch.Tensor, act: bool, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, d = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    q = torch.empty(rows, d, dtype=num.FP8, device=x.device)
    return q, torch.empty(rows, groups, dtype=torch.float32, device=x.device)


def _checked(name: str, x: torch.Tensor, group: int | None, act: bool) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")
    reason = rows_reason(x, group, act)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")


def quantize_rows(
    x: torch.Tensor, blocks: RowBlocks, group: int | None, ue8m0: bool, act: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (E4M3 [rows, d], FP32 scales [rows, d / group], [rows, 1] when `group` is None)
    for the received rows; `act`: x is GEMM1's output, activated first."""
    _checked("quantize_rows", x, group, act)
    d = x.shape[1] // 2 if act else x.shape[1]
    q, scales = _outputs(x, act, 1 if group is None else d // group)
    num_blocks = blocks.expert_ids.numel()
    if num_blocks == 0 or d == 0:
        return q, scales
    block_m = blocks.block_m
    if group is None:
        block_n, sub_m = token_tiling(d, block_m)  # both powers of two: sub_m divides
        grid = (num_blocks, block_m // sub_m)
    else:
        block_n, sub_m, grid = group, block_m, (num_blocks, d // group)
    _quantize_rows_kernel[grid](
        x,
        q,
        scales,
        blocks.sorted_ids,
        blocks.blocks_rows,
        x.shape[0],
        d,
        FP8_MAX=num.FP8_MAX,
        GROUP_FLOOR=num.GROUP_AMAX_FLOOR,
        TOKEN_FLOOR=num.TOKEN_SCALE_FLOOR,
        BLOCK_M=block_m,
        SUB_M=sub_m,
        BLOCK_N=block_n,
        WHOLE_ROW=block_n >= d,
        PER_TOKEN=group is None,
        UE8M0=bool(ue8m0),
        ACT=act,
    )
    return q, scales


def token_tiling(d: int, block_m: int) -> tuple[int, int]:
    """Per token: (columns a program holds, rows it takes). A row within TILE is read once;
    a wider one takes a program of its own and is read twice (amax, then quantize)."""
    width = triton.next_power_of_2(d)
    if width <= TILE:
        return width, max(1, min(block_m, TILE // width))
    return TILE, 1


def tensor_quant(
    x: torch.Tensor,
    blocks: RowBlocks,
    rows_per_expert: int,
    per_expert: bool,
    act: bool,
    static_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (E4M3 [rows, d], FP32 [rows, 1]) for a per-tensor layer's received rows; the
    scale is `static_scale`, else max(max |y| / 448, floor) over the received rows (NaN as
    zero, infinity kept), per expert when `per_expert`."""
    _checked("tensor_quant", x, None, act)
    q, scales = _outputs(x, act, 1)
    rows, d = q.shape
    num_blocks = blocks.expert_ids.numel()
    if num_blocks == 0 or d == 0:
        return q, scales
    block_m = blocks.block_m
    block_n = min(triton.next_power_of_2(d), max(16, TILE // block_m))
    grid = (num_blocks, triton.cdiv(d, block_n))
    per_expert = per_expert and static_scale is None
    args = (blocks.sorted_ids, blocks.expert_ids, blocks.blocks_rows, rows, d, int(per_expert))
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "ACT": act}
    if static_scale is None:  # the max first; the quantization reads it as its scale's source
        source = torch.zeros(rows // rows_per_expert if per_expert else 1, device=x.device)
        _amax_kernel[grid](x, source, *args, **meta)
    else:
        source = static_scale.reshape(1)
    _tensor_quant_kernel[grid](
        x,
        q,
        scales,
        source,
        *args,
        FP8_MAX=num.FP8_MAX,
        FLOOR=num.TENSOR_SCALE_FLOOR,
        STATIC=static_scale is not None,
        **meta,
    )
    return q, scales


if triton is not None:

    @triton.jit
    def _rows(x_ptr, ids, cols, mask, d, ACT: tl.constexpr):
        """The values to quantize, FP32: SiLU(gate) x up (`ACT`), or x's rows."""
        if ACT:
            y = silu_mul_rows(x_ptr, ids, cols, mask, d)
        else:
            y = tl.load(x_ptr + ids[:, None] * d + cols[None, :], mask=mask, other=0.0)
            y = y.to(tl.float32)
        return y

    @triton.jit
    def _store_q(q_ptr, y, scale, ids, cols, mask, d, FP8_MAX: tl.constexpr):
        q = tl.clamp(tl.math.div_rn(y, scale[:, None]), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + ids[:, None] * d + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        sorted_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        FP8_MAX: tl.constexpr,
        GROUP_FLOOR: tl.constexpr,
        TOKEN_FLOOR: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        WHOLE_ROW: tl.constexpr,
        PER_TOKEN: tl.constexpr,
        UE8M0: tl.constexpr,
        ACT: tl.constexpr,
    ):
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        span = tl.arange(0, BLOCK_N)
        if PER_TOKEN:  # SUB_M of the block's rows, each row's one scale
            first = b * BLOCK_M + tl.program_id(1) * SUB_M
            ids = tl.load(sorted_ids_ptr + first + tl.arange(0, SUB_M)).to(tl.int64)
            received = ids < rows
            if WHOLE_ROW:  # BLOCK_N >= d: read once
                mask = received[:, None] & (span < d)[None, :]
                y = _rows(x_ptr, ids, span, mask, d, ACT)
                amax = tl.max(tl.abs(y), axis=1)
                scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), TOKEN_FLOOR)
                tl.store(s_ptr + ids, scale, mask=received)
                _store_q(q_ptr, y, scale, ids, span, mask, d, FP8_MAX)
            else:  # wider rows: the amax over the chunks, then each chunk quantized
                amax = tl.zeros([SUB_M], dtype=tl.float32)
                for c0 in range(0, d, BLOCK_N):
                    cols = c0 + span
                    mask = received[:, None] & (cols < d)[None, :]
                    y = _rows(x_ptr, ids, cols, mask, d, ACT)
                    amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
                scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), TOKEN_FLOOR)
                tl.store(s_ptr + ids, scale, mask=received)
                for c0 in range(0, d, BLOCK_N):
                    cols = c0 + span
                    mask = received[:, None] & (cols < d)[None, :]
                    y = _rows(x_ptr, ids, cols, mask, d, ACT)
                    _store_q(q_ptr, y, scale, ids, cols, mask, d, FP8_MAX)
        else:
            ids = tl.load(sorted_ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            received = ids < rows
            g = tl.program_id(1)
            cols = g * BLOCK_N + span
            mask = received[:, None] & (cols < d)[None, :]
            y = _rows(x_ptr, ids, cols, mask, d, ACT)
            amax = tl.maximum(tl.max(tl.abs(y), axis=1), GROUP_FLOOR)
            scale = tl.math.div_rn(amax, FP8_MAX)
            if UE8M0:
                scale = tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(scale, GROUP_FLOOR))))
            tl.store(s_ptr + ids * (d // BLOCK_N) + g, scale, mask=received)
            _store_q(q_ptr, y, scale, ids, cols, mask, d, FP8_MAX)

    # per_expert not specialized: eager and captured calls share one compiled kernel.
    @triton.jit(do_not_specialize=["per_expert"])
    def _amax_kernel(
        x_ptr,
        amax_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        per_expert,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
    ):
        """max |y| of a block's received rows into its slot (NaN as zero: vLLM's fmaxf)."""
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        a = tl.abs(_rows(x_ptr, ids, cols, mask, d, ACT))
        a = tl.where(a == a, a, 0.0)
        slot = tl.load(expert_ids_ptr + b) * per_expert  # a live block's expert, or slot 0
        tl.atomic_max(amax_ptr + slot, tl.max(tl.max(a, axis=1), axis=0))

    @triton.jit(do_not_specialize=["per_expert"])
    def _tensor_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        source_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        per_expert,
        FP8_MAX: tl.constexpr,
        FLOOR: tl.constexpr,
        STATIC: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
    ):
        """A block's received rows quantized with their slot's scale as vLLM's static
        per-tensor kernel does (times the inverted scale); chunk 0 writes the scales."""
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        slot = tl.load(expert_ids_ptr + b) * per_expert  # a live block's expert, or slot 0
        if STATIC:
            scale = tl.load(source_ptr + slot) + tl.zeros([BLOCK_M], tl.float32)
        else:
            amax = tl.load(source_ptr + slot) + tl.zeros([BLOCK_M], tl.float32)
            scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FLOOR)
        inverted = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
        y = _rows(x_ptr, ids, cols, mask, d, ACT)
        q = tl.clamp(y * inverted[:, None], -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + ids[:, None] * d + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + ids, scale, mask=ids < rows)
