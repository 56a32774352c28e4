"""How much GPU memory one NCCL-EP low-latency fleet needs, from measured sizes.

Why: the LL fleet is sized for `max_tokens_per_rank` (vLLM's --max-num-batched-tokens)
and its buffers grow with tokens x experts x hidden size; a large budget can need more
memory than the GPU has, which otherwise shows up only after a full start-up.

Shape of the estimate, from nccl-extensions 0.1.0 `nccl/ep/include/nccl_ep/common.hpp`
`LowLatencyLayout` (EXPERT_MAJOR): two payload slots, each dominated by the combine
send buffer (one slot per expert) plus the combine receive buffer (one per top_k slot),
i.e. bytes ~= 2 * (num_experts + top_k) * tokens * token_bytes * factor. The factor
covers headers, scale metadata and allocator rounding and is taken from measurements
(`first_handle_bytes` of docs/results/bench_world1_h*.json: growth of GPU memory when
the first handle of a fleet triggers NCCL-EP's lazy buffer allocation; one H200, EP
world 1, 128 experts, top_k 8, 256 tokens per rank, FleetAlgoKnobAllocator(torch_caching=True)).
Unmeasured: EP world > 1 (the layout has no per-rank term in the expert-major slots).

What one LL fleet costs in all (`ll_memory_bytes`), from `vllm-flashinfer-ep bench-memory`
(docs/results/bench_memory_world1.json; device-wide, H200, world 1, 128 experts, top_k 8,
capacities 512 and 4096, hidden 2048/4096/7168):
- a fixed part at fleet creation: the measured growth up to the first handle minus the
  estimate above is 680 MB for the first fleet of a process (NCCL-EP's group and kernels
  load then) and 344-438 MB for later ones;
- the buffers above, which grow with the capacity as estimated (within the fixed part);
- FlashInfer's LL receive buffer, [local experts, capacity x world, hidden] BF16,
  allocated at the first dispatch (measured within 0.1 % of its size);
- 10,752 bytes per pooled handle (torch allocator; no device-wide growth measurable);
- the pool's staging of padded rounds, 2 x [capacity, hidden] BF16 (exact; added after the
  bench-memory run).

What NCCL-EP itself requires of a fixed RDMA buffer (`ll_layout_bytes`): with
VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES set, NCCL-EP allocates exactly that many bytes at group
creation and `ncclEpInitHandle` fails ("requested layout needs N bytes but user-specified
rdma_buffer_size is M bytes") when the handle's `LowLatencyLayout` does not fit. That layout
is computed here as common.hpp computes it; the measured first-handle growths above exceed
it by 0.1-0.6 % (NCCL-EP's own small allocations).
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


# docs/results/bench_world1_h2048_final.json and bench_world1_h7168.json, rows[*].first_handle_bytes.
LL_MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(2048, 128, 8, 256, 291_504_128),
    Measurement(7168, 128, 8, 256, 1_015_021_568),
)
BF16_BYTES = 2


def _slots_bytes(hidden: int, num_experts: int, top_k: int, tokens: int) -> int:
    """The structural part of the estimate (see the module docstring)."""
    return 2 * (num_experts + top_k) * tokens * hidden * BF16_BYTES


# The largest measured/structural ratio, so the estimate never undershoots a measurement.
LL_OVERHEAD_FACTOR: float = max(
    m.fleet_bytes / _slots_bytes(m.hidden, m.num_experts, m.top_k, m.tokens_per_rank)
    for m in LL_MEASUREMENTS
)

# Share of the memory vLLM may use (--gpu-memory-utilization x GPU memory) that the LL
# fleet may take; the rest is left for weights, activations and the KV cache.
LL_BUFFER_BUDGET_FRACTION: float = 0.25


def ll_bytes_per_token(hidden: int, num_experts: int, top_k: int) -> float:
    """Estimated LL fleet bytes per token of per-rank capacity."""
    return _slots_bytes(hidden, num_experts, top_k, 1) * LL_OVERHEAD_FACTOR


def ll_fleet_bytes(tokens_per_rank: int, hidden: int, num_experts: int, top_k: int) -> int:
    """Estimated GPU memory of one LL fleet sized for `tokens_per_rank` tokens."""
    return math.ceil(tokens_per_rank * ll_bytes_per_token(hidden, num_experts, top_k))


# bench_memory_world1.json: the largest fixed part (the first fleet of a process, 680 MB),
# rounded up so that the total covers every measured row (its first round adds 2 MB
# beside the receive buffer).
LL_FLEET_FIXED_BYTES: int = 690_000_000
# HandlePool.handle_bytes of every non-first handle in docs/results/bench_world1_h*.json.
LL_HANDLE_BYTES: int = 10_752


def ll_receive_buffer_bytes(tokens_per_rank: int, hidden: int, num_experts: int) -> int:
    """FlashInfer's LL receive buffer: local experts x (capacity x world) rows x hidden BF16,
    i.e. num_experts x capacity x hidden x 2 bytes at any EP world size."""
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
    """Estimated GPU memory of one LL fleet in all: fixed part, NCCL-EP buffers,
    FlashInfer's receive buffer, `handles` pooled handles and their padding staging."""
    return sum(ll_memory_parts(tokens_per_rank, hidden, num_experts, top_k, handles).values())


def ll_pad_staging_bytes(tokens_per_rank: int, hidden: int) -> int:
    """HandlePool's staging of padded rounds: activations in and combined rows out,
    [capacity, hidden] BF16 each."""
    return 2 * tokens_per_rank * hidden * BF16_BYTES


def ll_max_tokens_within(budget_bytes: int, hidden: int, num_experts: int, top_k: int) -> int:
    """Largest per-rank token capacity whose estimated LL memory (`ll_memory_bytes`)
    fits in `budget_bytes`."""
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
    """Bytes of NCCL-EP's LL RDMA buffer for one handle: `LowLatencyLayout(tokens,
    max_token_bytes = hidden x 2 (FlashInfer's BF16 group config), world, experts, top_k,
    EXPERT_MAJOR).total_bytes` (nccl/ep/include/nccl_ep/common.hpp), rounded up as
    `get_low_latency_rdma_size_hint_for_layout` rounds it.

    Two payload slots, each max(dispatch send + receive, combine send + receive), and two
    signalling slots of one int per expert. The dispatch header of the expert-major layout
    is the token id plus one 2-byte expert id per top_k slot, 16-byte aligned; a combine
    message carries one bfloat162 of scale metadata per 128 elements.
    """
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
    """vLLM 0.33.0's default capture sizes on Hopper (config/vllm.py): 1, 2, 4, then steps
    of 8 below 256 and of 16 from 256, up to min(2 x max_num_seqs, 512)."""
    top = min(2 * max_num_seqs, max_size)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in sizes if s <= top]


def served_pool_sizes(capacity: int) -> list[int]:
    """The sizes a served LL engine with default capture sizes warms for `capacity`."""
    from vllm_flashinfer_ep.runtime.pool_sizes import pool_sizes

    return pool_sizes("low_latency", capacity, vllm_default_capture_sizes())
