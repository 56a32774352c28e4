"""How much GPU memory one NCCL-EP low-latency fleet needs, from measured sizes.

A budget the GPU cannot hold would otherwise show up only after a full start-up. The
structure follows nccl_ep's `LowLatencyLayout` (common.hpp, EXPERT_MAJOR); the overhead
factor and fixed parts come from docs/results/ (world 1; docs/architecture.md). Measured
fleets exceed `ll_layout_bytes` by under 1 %.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Measurement(NamedTuple):
    hidden: int
    num_experts: int
    top_k: int
    tokens_per_rank: int
    fleet_bytes: int


# first_handle_bytes of docs/results/bench_world1_h2048_final.json and bench_world1_h7168.json.
LL_MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(2048, 128, 8, 256, 291_504_128),
    Measurement(7168, 128, 8, 256, 1_015_021_568),
)
BF16_BYTES = 2


def _slots_bytes(hidden: int, num_experts: int, top_k: int, tokens: int) -> int:
    """Two payload slots, each dominated by the combine send (one slot per expert) and
    receive (one per top_k slot) buffers."""
    return 2 * (num_experts + top_k) * tokens * hidden * BF16_BYTES


# The largest measured/structural ratio, so the estimate never undershoots a measurement.
LL_OVERHEAD_FACTOR: float = max(
    m.fleet_bytes / _slots_bytes(m.hidden, m.num_experts, m.top_k, m.tokens_per_rank)
    for m in LL_MEASUREMENTS
)

# Share of the memory vLLM may use that the LL fleet may take (the rest: weights, KV cache).
LL_BUFFER_BUDGET_FRACTION: float = 0.25


def ll_bytes_per_token(hidden: int, num_experts: int, top_k: int) -> float:
    return _slots_bytes(hidden, num_experts, top_k, 1) * LL_OVERHEAD_FACTOR


def ll_fleet_bytes(tokens_per_rank: int, hidden: int, num_experts: int, top_k: int) -> int:
    return math.ceil(tokens_per_rank * ll_bytes_per_token(hidden, num_experts, top_k))


# A process's first fleet (NCCL-EP loads then), covering docs/results/bench_memory_world1.json.
LL_FLEET_FIXED_BYTES: int = 690_000_000
LL_HANDLE_BYTES: int = 10_752  # every non-first handle in docs/results/bench_world1_h*.json


def ll_receive_buffer_bytes(tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """FlashInfer's LL receive buffer: [local experts, capacity x world, hidden] BF16."""
    return num_experts * tokens_per_rank * hidden * BF16_BYTES


def ll_memory_parts(
    tokens_per_rank: int, hidden: int, num_experts: int, top_k: int, handles: int = 0
) -> dict[str, int]:
    """The parts of one LL fleet's estimated GPU memory (bytes), by what holds them."""
    return {
        "fixed": LL_FLEET_FIXED_BYTES,
        "buffers": ll_fleet_bytes(tokens_per_rank, hidden, num_experts, top_k),
        "receive": ll_receive_buffer_bytes(tokens_per_rank, hidden, num_experts),
        "pool": handles * LL_HANDLE_BYTES + ll_pad_staging_bytes(tokens_per_rank, hidden),
    }


def ll_memory_bytes(
    tokens_per_rank: int, hidden: int, num_experts: int, top_k: int, handles: int = 0
) -> int:
    return sum(ll_memory_parts(tokens_per_rank, hidden, num_experts, top_k, handles).values())


def ll_pad_staging_bytes(tokens_per_rank: int, hidden: int) -> int:
    """HandlePool's staging of padded rounds: in and out, [capacity, hidden] BF16 each."""
    return 2 * tokens_per_rank * hidden * BF16_BYTES


def ll_max_tokens_within(budget_bytes: int, hidden: int, num_experts: int, top_k: int) -> int:
    per_token = (
        ll_bytes_per_token(hidden, num_experts, top_k)
        + ll_receive_buffer_bytes(1, hidden, num_experts)
        + ll_pad_staging_bytes(1, hidden)
    )
    return max(0, math.floor((budget_bytes - LL_FLEET_FIXED_BYTES) / per_token))


# nccl-extensions 0.1.0 nccl/ep/include/nccl_ep/common.hpp: NUM_BUFFER_ALIGNMENT_BYTES.
NCCL_EP_BUFFER_ALIGNMENT = 128


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def ll_layout_bytes(
    tokens_per_rank: int, hidden: int, num_experts: int, top_k: int, world: int
) -> int:
    """Bytes of NCCL-EP's LL RDMA buffer for one handle: common.hpp's `LowLatencyLayout(...,
    EXPERT_MAJOR).total_bytes` for BF16 tokens, rounded up as
    `get_low_latency_rdma_size_hint_for_layout` does."""
    token_bytes = hidden * BF16_BYTES
    header = _align(4 + 2 * top_k, 16)
    dispatch_msg = header + token_bytes
    combine_msg = (token_bytes // BF16_BYTES // 128) * 4 + token_bytes
    dispatch = tokens_per_rank * dispatch_msg * (1 + world)
    combine = tokens_per_rank * combine_msg * (num_experts + top_k)
    signal = _align(num_experts * 4, NCCL_EP_BUFFER_ALIGNMENT)
    total = 2 * max(dispatch, combine) + 2 * signal
    return (total + NCCL_EP_BUFFER_ALIGNMENT) // NCCL_EP_BUFFER_ALIGNMENT * NCCL_EP_BUFFER_ALIGNMENT


def vllm_default_capture_sizes(max_num_seqs: int = 256, max_size: int = 512) -> list[int]:
    """vLLM 0.33.0's default capture sizes on Hopper (config/vllm.py)."""
    top = min(2 * max_num_seqs, max_size)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in sizes if s <= top]


def served_pool_sizes(capacity: int) -> list[int]:
    """The sizes a served LL engine with default capture sizes warms for `capacity`."""
    from vllm_flashinfer_ep.runtime.pool_sizes import pool_sizes

    return pool_sizes("low_latency", capacity, vllm_default_capture_sizes())
