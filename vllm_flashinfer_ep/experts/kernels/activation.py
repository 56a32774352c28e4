"""Gated activations over the received rows only (vLLM's masked activation covers every
expert's whole slot), rounded as vLLM's kernels round:
- SiLU-and-mul: the SiLU to the 16-bit type, then the product;
- gpt-oss's clamped SwiGLU (vLLM's `swigluoai`, gate and up interleaved): FP32 throughout,
  one rounding at the end.
"""

from __future__ import annotations

import torch

from vllm_flashinfer_ep.experts.kernels.row_blocks import RowBlocks, triton

if triton is not None:
    import triton.language as tl

    from vllm_flashinfer_ep.experts.kernels.row_blocks import block_tile

TILE = 4096  # elements one program handles: BLOCK_M x BLOCK_N


def buffers_reason(out: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why `silu_and_mul` does not take these buffers (None: it does)."""
    if x.dtype != out.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit x and out of one dtype, got {x.dtype}, {out.dtype}"
    if not (x.is_contiguous() and out.is_contiguous()):
        return "x and out must be contiguous"
    rows, width = x.shape
    if width % 2 or tuple(out.shape) != (rows, width // 2):
        return f"x [rows, 2d] and out [rows, d], got {tuple(x.shape)} and {tuple(out.shape)}"
    return None


def silu_and_mul(out: torch.Tensor, x: torch.Tensor, blocks: RowBlocks) -> None:
    """out[row] = silu(x[row, :d]) * x[row, d:] for the received rows; others untouched."""
    _launch("silu_and_mul", out, x, blocks)


def swiglu_oai(
    out: torch.Tensor, x: torch.Tensor, blocks: RowBlocks, alpha: float, limit: float
) -> None:
    """out[row, j] = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit), gate = x[row, 2j], up = x[row, 2j + 1], for the received rows;
    others untouched."""
    _launch("swiglu_oai", out, x, blocks, float(alpha), float(limit))


def _launch(name: str, out: torch.Tensor, x: torch.Tensor, blocks: RowBlocks, *scalars) -> None:
    """One program per (block of received rows, column tile) of activation `name`."""
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")
    reason = buffers_reason(out, x)
    if reason is not None:
        raise ValueError(f"{name}: {reason}")
    rows, d = out.shape
    num_blocks = blocks.expert_ids.numel()
    if num_blocks == 0 or d == 0:
        return
    block_m = blocks.block_m
    block_n = max(16, min(triton.next_power_of_2(d), TILE // block_m))
    kernel = {"silu_and_mul": _silu_and_mul_kernel, "swiglu_oai": _swiglu_oai_kernel}[name]
    kernel[(num_blocks, triton.cdiv(d, block_n))](
        x,
        out,
        blocks.sorted_ids,
        blocks.blocks_rows,
        rows,
        d,
        *scalars,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )


if triton is not None:

    @triton.jit
    def swiglu_oai_rows(x_ptr, ids, cols, mask, d, alpha, limit):
        """gpt-oss's clamped SwiGLU of x [rows, 2d] (gate, up interleaved), FP32."""
        gate_at = x_ptr + ids[:, None] * (2 * d) + 2 * cols[None, :]
        gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_at + 1, mask=mask, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return (up + 1.0) * (gate / (1.0 + tl.exp(-gate * alpha)))

    @triton.jit
    def _swiglu_oai_kernel(
        x_ptr,
        out_ptr,
        sorted_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        alpha,
        limit,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        if tl.program_id(0) * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        y = swiglu_oai_rows(x_ptr, ids, cols, mask, d, alpha, limit)
        tl.store(
            out_ptr + ids[:, None] * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )

    @triton.jit
    def silu_mul_rows(x_ptr, ids, cols, mask, d):
        """SiLU(gate) x up of x [rows, 2d], rounded as vLLM's, as FP32 of 16-bit values."""
        gate_at = x_ptr + ids[:, None] * (2 * d) + cols[None, :]
        gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_at + d, mask=mask, other=0.0).to(tl.float32)
        ty = x_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(ty)
        return (act.to(tl.float32) * up).to(ty).to(tl.float32)

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,
        out_ptr,
        sorted_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        if tl.program_id(0) * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        y = silu_mul_rows(x_ptr, ids, cols, mask, d)
        tl.store(
            out_ptr + ids[:, None] * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )
