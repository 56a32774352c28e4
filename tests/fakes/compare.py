"""Order-free comparisons: NCCL-EP promises which rows arrive, not in which order."""

from __future__ import annotations

import torch


def sorted_rows(*columns: torch.Tensor) -> torch.Tensor:
    """Rows of the column-wise concatenation (as float64), sorted lexicographically."""
    rows = torch.cat([c.reshape(c.shape[0], -1).to(torch.float64) for c in columns], dim=1)
    order = sorted(range(rows.shape[0]), key=lambda i: rows[i].tolist())
    return rows[order]


def assert_same_rows(
    actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], **tol
) -> None:
    """Same multiset of rows, whatever their order (rows of several aligned tensors)."""
    a, e = sorted_rows(*actual), sorted_rows(*expected)
    assert a.shape == e.shape, f"{a.shape[0]} rows received, {e.shape[0]} expected"
    torch.testing.assert_close(a, e, **(tol or {"rtol": 0, "atol": 0}))
