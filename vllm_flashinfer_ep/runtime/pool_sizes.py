"""Which token counts a handle pool holds: the one sizing policy, so that the managers,
the memory estimates and the benchmarks all describe the pool that is built.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.runtime.transport import handle_supports_update

# HT pads by at most this many rows per round: its experts compute padded rows too, so the
# geometric buckets alone could add up to half a prefill's expert work.
HT_MAX_PAD = 256


def bucket_sizes(above: int, capacity: int, max_pad: int | None = None) -> list[int]:
    """Pooled sizes for eager steps in (above, capacity]: 2^k and 3*2^(k-1), and the
    capacity, so any count pads by less than half its size. `max_pad` also bounds the
    padding in rows (sizes `max_pad` apart fill wider gaps)."""
    sizes: set[int] = set()
    power = 1
    while power <= capacity:
        sizes |= {s for s in (power, 3 * power // 2) if s >= 1 and above < s <= capacity}
        power *= 2
    if capacity > above:
        sizes.add(capacity)
    if max_pad is not None and max_pad >= 1:
        previous = above
        for size in sorted(sizes):
            sizes |= set(range(previous + max_pad, size, max_pad))
            previous = size
    return sorted(sizes)


def pool_sizes(
    algorithm: Algorithm | str, capacity: int, captured: Iterable[int] = ()
) -> list[int]:
    """The token counts a pool is warmed with at load. LL: the capture sizes that fit, then
    eager buckets above them (other captured counts: runtime/capture.py). HT (never
    captured): buckets from 1, at most HT_MAX_PAD rows apart."""
    if Algorithm(algorithm) != Algorithm.LOW_LATENCY:
        return bucket_sizes(0, capacity, max_pad=HT_MAX_PAD)
    fits = {int(s) for s in captured if 1 <= int(s) <= capacity}
    return sorted(fits | set(bucket_sizes(max(fits, default=0), capacity)))


def unavailable_reason() -> str | None:
    """Why a persistent pool cannot back CUDA graphs here (None: it can); the managers and
    the CUDA-graph policy both follow this answer."""
    if not envs.handle_pool_enabled():
        return f"the persistent handle pool is disabled ({envs.HANDLE_POOL}=0)"
    if not handle_supports_update():
        return (
            "the installed FlashInfer has no Handle.update(), so handles cannot be "
            "re-targeted inside a captured forward (install flashinfer-python==0.7.2.post1)"
        )
    return None
