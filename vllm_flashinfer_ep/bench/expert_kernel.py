"""A trivial expert op over the valid rows only (`--expert-compute`), graph-capturable:
expert e scales its first counts[e] rows in place, so the cost follows the real token
count rather than the padded capacity."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_valid_rows(
    x_ptr,
    counts_ptr,
    scales_ptr,
    rows_per_expert,
    hidden,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    expert = tl.program_id(0)
    row_block = tl.program_id(1)
    count = tl.load(counts_ptr + expert)
    first_row = row_block * BLOCK_R
    if first_row >= count:
        return
    scale = tl.load(scales_ptr + expert)
    rows = first_row + tl.arange(0, BLOCK_R)
    row_ok = rows < count
    base = x_ptr + (expert * rows_per_expert + rows)[:, None] * hidden
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols[None, :] < hidden)
        vals = tl.load(base + cols[None, :], mask=mask)
        tl.store(base + cols[None, :], (vals.to(tl.float32) * scale).to(vals.dtype), mask=mask)


def scale_valid_rows_(
    expert_x: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """In place: expert_x[e, :counts[e]] *= scales[e]. expert_x is [E, R, H] contiguous."""
    experts, rows, hidden = expert_x.shape
    block_r = 16
    grid = (experts, triton.cdiv(rows, block_r))
    _scale_valid_rows[grid](
        expert_x, counts, scales.float().contiguous(), rows, hidden, BLOCK_R=block_r, BLOCK_H=256
    )
    return expert_x
