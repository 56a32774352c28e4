"""The received rows as blocks: (expert, BLOCK_M rows) pairs built on the device from the
counts, read by vLLM's fused-MoE kernel in place of its sorted token ids. Row r of expert
e is flat row e * rows_per_expert + r. The list's length is fixed (`max_blocks`), so CUDA
graphs replay it for any routing. One Triton launch on CUDA (launches are what a decode
step pays for); the torch build elsewhere writes the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:  # Triton comes with vLLM's CUDA builds; the torch build serves without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None

BLOCKS_PER_PROGRAM = 16  # blocks one program writes: [16, experts] compares fit registers


class RowBlocks(NamedTuple):
    """sorted_ids [num_blocks * block_m] (sentinel experts * rows_per_expert: no row),
    expert_ids [num_blocks] (-1 past the last), blocks_rows [1]: used blocks x block_m."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    blocks_rows: torch.Tensor

    @property
    def block_m(self) -> int:
        return self.sorted_ids.numel() // max(1, self.expert_ids.numel())


def max_blocks(rows_bound: int, experts: int, rows_per_expert: int, block_m: int) -> int:
    """Most blocks a forward of at most `rows_bound` received rows can need: at most the
    rows, one partial block per expert beyond rows_bound / block_m, the whole buffer."""
    per_expert = -(-rows_per_expert // block_m)
    return max(1, min(rows_bound, -(-rows_bound // block_m) + experts, experts * per_expert))


def row_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> RowBlocks:
    """The blocks of the received rows from the counts; fixed shapes, no host sync."""
    if counts.is_cuda and triton is not None:
        return triton_row_blocks(counts, rows_per_expert, block_m, num_blocks)
    return torch_row_blocks(counts, rows_per_expert, block_m, num_blocks)


def torch_row_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> RowBlocks:
    """`row_blocks` from torch ops (any device)."""
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
    return RowBlocks(
        sorted_ids.reshape(-1).to(torch.int32),
        expert_ids.to(torch.int32),
        blocks_rows.to(torch.int32),
    )


def triton_row_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> RowBlocks:
    """`row_blocks` in one Triton launch (CUDA tensors, or any under Triton's interpreter)."""
    if triton is None:
        raise RuntimeError("triton_row_blocks needs Triton")
    experts = counts.numel()
    if experts * rows_per_expert >= 2**31:
        raise ValueError("the row blocks' ids are int32")
    dev = counts.device
    out = RowBlocks(
        torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev),
        torch.empty(num_blocks, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev),
    )
    grid = (triton.cdiv(num_blocks, BLOCKS_PER_PROGRAM),)
    _row_blocks_kernel[grid](
        counts,
        *out,
        experts,
        rows_per_expert,
        num_blocks,
        BLOCK_M=block_m,
        EXPERTS=triton.next_power_of_2(experts),
        BLOCKS=BLOCKS_PER_PROGRAM,
    )
    return out


if triton is not None:

    @triton.jit
    def _row_blocks_kernel(
        counts_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        num_experts,
        rows_per_expert,
        num_blocks,
        BLOCK_M: tl.constexpr,
        EXPERTS: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        # Every program reads all counts (a few hundred at most) and writes BLOCKS blocks.
        e = tl.arange(0, EXPERTS)
        in_range = e < num_experts
        counts = tl.load(counts_ptr + e, mask=in_range, other=0).to(tl.int32)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, axis=0)
        total = tl.sum(blocks, axis=0)
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        # The owner of block b: the experts whose blocks all end at or before it.
        done = (ends[None, :] <= b[:, None]) & in_range[None, :]
        owner = tl.sum(done.to(tl.int32), axis=1)
        live = b < total
        first = tl.sum(tl.where(e[None, :] < owner[:, None], blocks[None, :], 0), axis=1)
        owned = tl.sum(tl.where(e[None, :] == owner[:, None], counts[None, :], 0), axis=1)
        r = tl.arange(0, BLOCK_M)
        row = (b - first)[:, None] * BLOCK_M + r[None, :]
        valid = live[:, None] & (row < owned[:, None])
        ids = tl.where(valid, owner[:, None] * rows_per_expert + row, num_experts * rows_per_expert)
        writes = b < num_blocks
        tl.store(sorted_ids_ptr + b[:, None] * BLOCK_M + r[None, :], ids, mask=writes[:, None])
        tl.store(expert_ids_ptr + b, tl.where(live, owner, -1), mask=writes)
        if tl.program_id(0) == 0:
            tl.store(blocks_rows_ptr, tl.minimum(total * BLOCK_M, num_blocks * BLOCK_M))

    @triton.jit
    def block_tile(sorted_ids_ptr, rows, d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(row ids of block program_id(0), columns of chunk program_id(1), their mask)."""
        ids = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        ids = ids.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return ids, cols, (ids < rows)[:, None] & (cols < d)[None, :]
