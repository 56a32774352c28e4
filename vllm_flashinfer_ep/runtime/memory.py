"""GPU memory readings shared by the fleet cache, the handle pool and the benchmarks."""

from __future__ import annotations

import torch


def memory_snapshot(device: torch.device) -> tuple[int, int]:
    """(torch-allocated, device-wide used) bytes: NCCL-EP allocates both ways."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return int(torch.cuda.memory_allocated(device)), int(total - free)


def memory_growth(device: torch.device, before: tuple[int, int]) -> int:
    """Bytes added since `before`: the larger of the torch-allocator and device-wide growth."""
    after = memory_snapshot(device)
    return max(0, after[0] - before[0], after[1] - before[1])
