"""Transport-level fault tolerance across 2 GPUs (low latency, real NCCL-EP).

(a) a rank stalls past the FT timeout; (b) a rank is killed. The survivor must see
`query_fault()` turn True and the dead rank masked within the deadline (no hang),
agree on the mask, keep dispatching with the dead rank masked, and keep reporting the
fault after vLLM's retry (clean_buffers), since the gone peer cannot be re-admitted: the
retry's re-admission unmasks it (NCCL-EP's clean sets every mask active), the agreement
after it masks it again.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from tests.environment_gate import missing
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fault_tolerance import FaultToleranceAdapter
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec

pytestmark = pytest.mark.multigpu

TIMEOUT_MS = 5000
DEADLINE_S = 30.0


def _setup(rank: int, world: int):
    os.environ[envs.FT_TIMEOUT_MS] = str(TIMEOUT_MS)
    cache = FleetCache(rank, world, dist.group.WORLD)
    dev = torch.device("cuda", rank)
    spec = FleetSpec(Algorithm.LOW_LATENCY, 32, 16, 2048, fault_tolerance=True)
    # One pooled handle of the step's 8 tokens, made while both ranks are up: the engine
    # creates no handle after load, so neither does this test once a peer is gone.
    rt = build_runtime(cache, spec, 4, dev, [8])
    ft = FaultToleranceAdapter(cache.fleets, dev)
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(8, 2048, device=dev, generator=gen).to(torch.bfloat16)
    ids, w = random_routing(8, 32, 4, dev, gen)
    return rt, ft, x, ids, w


def _step(rt, x, ids, w):
    rnd = rt.round
    d = rnd.dispatch(x, ids, w)
    return rnd.combine(d.expert_x, torch.empty_like(x))  # identity experts


def _expected(x, ids, w, alive_ranks: set[int], experts_per_rank: int):
    """Identity experts: out = x * sum of the weights of experts on live ranks.

    NCCL-EP drops a masked rank's experts without re-normalizing the rest.
    """
    owner = ids // experts_per_rank
    alive = torch.zeros_like(w, dtype=torch.bool)
    for r in alive_ranks:
        alive |= owner == r
    ones = torch.ones(ids.max().item() + 1, device=x.device)
    return reference_moe(x, ids, w * alive, ones)


def _close(out, expected):
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _survivor_sees_fault(rt, ft, x, ids, w) -> None:
    start = time.monotonic()
    _step(rt, x, ids, w)  # the peer never answers: must time out, not hang
    torch.cuda.synchronize()
    fault = ft.query_fault()
    assert fault.dtype == torch.bool and fault.dim() == 0
    assert bool(fault.cpu()), "fault not detected"
    mask = ft.query_active_mask().cpu().tolist()
    assert mask[1] == 1 and mask[0] == 0, mask  # vLLM polarity: 1 = masked
    assert time.monotonic() - start < DEADLINE_S
    rt.fleet.reconcile_active_mask(timeout_s=10)
    out = _step(rt, x, ids, w)  # keeps going with the dead rank masked
    torch.cuda.synchronize()
    # Rank 0's own experts still count; rank 1's are dropped (weight not re-normalized).
    _close(out, _expected(x, ids, w, {0}, rt.num_local_experts))
    # vLLM's retry re-admits every peer (ncclEpMaskClean sets every mask active, the
    # gone peer's too); the survivors' agreement right after it masks the gone peer
    # again within the FT timeout, so the fault is reported at once, before any step.
    ft.clean_buffers()
    assert bool(ft.query_fault().cpu()), "a gone peer read as healthy after the retry"
    assert ft.query_active_mask().cpu().tolist() == [0, 1]
    assert time.monotonic() - start < 2 * DEADLINE_S


def _stall(rank: int, world: int) -> None:
    rt, ft, x, ids, w = _setup(rank, world)
    out = _step(rt, x, ids, w)
    torch.cuda.synchronize()
    _close(out, _expected(x, ids, w, set(range(world)), rt.num_local_experts))
    assert not bool(ft.query_fault().cpu())
    if rank == 1:
        time.sleep(TIMEOUT_MS / 1000 * 3)  # stalls past the timeout, then leaves quietly
        return
    _survivor_sees_fault(rt, ft, x, ids, w)


def _killed(rank: int, world: int) -> None:
    rt, ft, x, ids, w = _setup(rank, world)
    out = _step(rt, x, ids, w)
    torch.cuda.synchronize()
    _close(out, _expected(x, ids, w, set(range(world)), rt.num_local_experts))
    assert not bool(ft.query_fault().cpu())
    if rank == 1:
        os._exit(0)  # abrupt death: no teardown
    _survivor_sees_fault(rt, ft, x, ids, w)


@pytest.mark.parametrize("scenario", [_stall, _killed], ids=["stalled", "killed"])
def test_survivor_detects_and_continues(scenario):
    if torch.cuda.device_count() < 2:
        missing("needs 2 GPUs")
    run_ranks(2, scenario, timeout_s=DEADLINE_S * 4)
