"""Recovery after vLLM's retry (`clean_buffers` on every DP rank), on the two-rank fake.

After a retry every live peer takes part again, or the fault keeps being reported:
never a healthy report while a fleet masks a peer. Every fault-tolerant fleet is
cleaned and checked, including fleets created after the adapter.

The fake moves tokens but ignores its mask; `drop_masked_experts` makes it drop a
masked rank's expert outputs at combine (what NCCL-EP does, without re-normalizing),
so a masked peer really changes the outputs here.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.fakes import fake_moe_ep
from tests.fakes.runtime import install_capture_switch
from tests.fakes.world import run_ranks
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.runtime import fault_tolerance
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fault_tolerance import FaultToleranceAdapter
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.runtime.round_plan import LOCAL

pytestmark = pytest.mark.usefixtures("fake", "short_ft_timeout")

WORLD = 2
HIDDEN = 2048
NUM_EXPERTS = 8
TOKENS = 5
TOP_K = 2
CPU = torch.device("cpu")
SCALES = torch.rand(NUM_EXPERTS, generator=torch.Generator().manual_seed(7)) + 0.5


@pytest.fixture()
def short_ft_timeout(monkeypatch):
    """The FT timeout (the kernels' and the agreement's wait for a silent peer) short
    enough for a test to wait out a gone peer, long enough for threads that are there."""
    monkeypatch.setenv(envs.FT_TIMEOUT_MS, "2000")


@pytest.fixture()
def drop_masked_experts(monkeypatch):
    """LL combine reads nothing from a rank the combining rank's fleet masks."""
    exchange = fake_moe_ep.FakeFleet._exchange

    def dropping(self, op, payload):
        everyone = exchange(self, op, payload)
        if op != "combine" or not self.supports_fault_tolerance:
            return everyone
        mask = self.query_active_mask().tolist()
        return [
            (torch.zeros_like(rows), placed) if mask[src] == fake_moe_ep.MASKED else (rows, placed)
            for src, (rows, placed) in enumerate(everyone)
        ]

    monkeypatch.setattr(fake_moe_ep.FakeFleet, "_exchange", dropping)


def _spec(hidden: int = HIDDEN) -> FleetSpec:
    return FleetSpec(Algorithm.LOW_LATENCY, NUM_EXPERTS, 16, hidden, fault_tolerance=True)


def _runtime(cache: FleetCache, hidden: int = HIDDEN):
    return build_runtime(cache, _spec(hidden), TOP_K, CPU, [TOKENS])


def _rank_with_adapter(rank: int, group) -> tuple:
    """One rank's runtime on a fleet cache of its own, and the FT adapter over that cache."""
    cache = FleetCache(rank, WORLD, group)
    return _runtime(cache), FaultToleranceAdapter(cache.fleets, CPU)


def _inputs(rank: int, hidden: int = HIDDEN):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS, hidden, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(TOKENS, NUM_EXPERTS, TOP_K, CPU, gen)
    return x, ids, weights


def _step(rt, x, ids, weights) -> torch.Tensor:
    """One MoE round: dispatch, experts that scale their rows, combine."""
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, agreed_tokens=LOCAL)
    e_local = rt.num_local_experts
    scales = SCALES[rt.rank * e_local : (rt.rank + 1) * e_local]
    out = torch.empty_like(x)
    rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    return out


def _healthy(ft: FaultToleranceAdapter) -> bool:
    fault = ft.query_fault()
    assert fault.dtype == torch.bool and fault.dim() == 0
    return not bool(fault) and ft.query_active_mask().tolist() == [0] * WORLD


@pytest.mark.usefixtures("drop_masked_experts")
def test_retry_readmits_the_masked_peer_and_outputs_match_pre_fault():
    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        x, ids, weights = _inputs(rank)
        before = [_step(rt, x, ids, weights) for _ in range(2)]
        assert torch.equal(before[0], before[1]) and _healthy(ft)
        if rank == 0:  # rank 0's kernels timed out on rank 1 (alive, just late)
            rt.fleet.mask_rank(1)
            rt.fleet.raise_fault_flag()
            assert bool(ft.query_fault())
            assert ft.query_active_mask().tolist() == [0, 1]
        else:
            assert _healthy(ft)  # views are local: rank 1 saw nothing
        degraded = _step(rt, x, ids, weights)
        ft.clean_buffers()  # vLLM's retry, on every rank
        healthy_after = _healthy(ft)
        after = [_step(rt, x, ids, weights) for _ in range(2)]
        log = list(rt.fleet.ft_log)
        return before[0], degraded, healthy_after, after, log

    results = run_ranks(WORLD, rank_fn)
    for rank, (before, _degraded, healthy_after, after, log) in enumerate(results):
        assert healthy_after, f"rank {rank} not healthy after the retry"
        assert "clear_faults(readmit=True)" in log
        for out in after:
            assert torch.equal(out, before), f"rank {rank}: outputs differ from pre-fault"
    # The masked peer really was out: rank 0's outputs were degraded, rank 1's were not.
    assert not torch.equal(results[0][1], results[0][0])
    assert torch.equal(results[1][1], results[1][0])


def test_dead_peer_keeps_the_fault_reported():
    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        _step(rt, *_inputs(rank))
        if rank == 1:
            return None  # dies: takes part in nothing any more
        rt.fleet.kill_peer(1)
        assert bool(ft.query_fault())
        reports = []
        for _ in range(2):  # retries do not make it healthy
            ft.clean_buffers()
            reports.append((bool(ft.query_fault()), ft.query_active_mask().tolist()))
        return reports

    reports = run_ranks(WORLD, rank_fn)[0]
    assert reports == [(True, [0, 1])] * 2


@pytest.mark.usefixtures("drop_masked_experts")
def test_fault_in_a_later_second_fleet_is_reported_and_recovered():
    def rank_fn(rank, group):
        cache = FleetCache(rank, WORLD, group)
        first = _runtime(cache)
        # Built with the first fleet only (as a manager does at its first runtime):
        # the second fleet, created later, must still be seen.
        ft = FaultToleranceAdapter(cache.fleets, CPU)
        second = _runtime(cache, hidden=4096)
        assert first.fleet is not second.fleet
        x, ids, weights = _inputs(rank, 4096)
        before = _step(second, x, ids, weights)
        if rank == 0:
            second.fleet.mask_rank(1)  # only the second fleet faults
        seen = (bool(ft.query_fault()), ft.query_active_mask().tolist())
        ft.clean_buffers()
        logs = [f.ft_log.count("clear_faults(readmit=True)") for f in (first.fleet, second.fleet)]
        return seen, logs, _healthy(ft), torch.equal(_step(second, x, ids, weights), before)

    results = run_ranks(WORLD, rank_fn)
    assert results[0][0] == (True, [0, 1])
    assert results[1][0] == (False, [0, 0])
    for _seen, logs, healthy, same in results:
        assert logs == [1, 1] and healthy and same


def test_failed_readmission_keeps_the_fault_and_still_cleans_the_other_fleets():
    # World size 1: a fleet whose re-admission raises (its flag stays set) does not stop
    # the next fleet's (collective: every rank must make the same calls).
    cache = FleetCache(0, 1, None)
    a = _runtime_at_world_1(cache).fleet
    b = _runtime_at_world_1(cache, hidden=4096).fleet
    ft = FaultToleranceAdapter(cache.fleets, CPU)
    a.raise_fault_flag()

    def broken(*, readmit=False):
        raise RuntimeError("ncclEpMaskClean failed")

    a.clear_faults = broken
    ft.clean_buffers()
    assert "clear_faults(readmit=True)" in b.ft_log
    assert bool(ft.query_fault())
    del a.clear_faults  # the next retry works
    ft.clean_buffers()
    assert not bool(ft.query_fault())


def _runtime_at_world_1(cache: FleetCache, hidden: int = HIDDEN):
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        return _runtime(cache, hidden)


def test_a_rank_that_skips_the_retry_leaves_the_fault_reported():
    # Re-admission is collective: a retry that reaches only rank 0 re-admits nobody.
    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        _step(rt, *_inputs(rank))
        if rank == 1:
            return None  # never gets the retry
        rt.fleet.mask_rank(1)
        ft.clean_buffers()
        return bool(ft.query_fault()), ft.query_active_mask().tolist()

    assert run_ranks(WORLD, rank_fn, timeout_s=20)[0] == (True, [0, 1])


# ------------------------------------------------ the fake refuses what FlashInfer does
def test_fake_readmission_unmasks_every_peer_like_ncclEpMaskClean():
    # nccl_ep.h: the clean's barrier skips masked peers and then "sets all masks to
    # active" -- a dead peer's too. The adapter must not read that as recovery.
    def rank_fn(rank, group):
        rt = _runtime(FleetCache(rank, WORLD, group))
        _step(rt, *_inputs(rank))
        if rank == 1:
            return None  # dies
        rt.fleet.kill_peer(1)
        rt.fleet.clear_faults(readmit=True)
        return rt.fleet.query_active_mask().tolist(), rt.fleet.query_fault()

    assert run_ranks(WORLD, rank_fn)[0] == ([1, 1], False)


def test_fake_dispatch_against_a_readmission_fails():
    # A rank re-admitting while its peer dispatches is a package bug: the dispatch never
    # gets its peer's tokens (NCCL-EP would time out and mask); the fake fails it.
    def rank_fn(rank, group):
        rt = _runtime(FleetCache(rank, WORLD, group))
        if rank == 0:
            rt.fleet.clear_faults(readmit=True)
        else:
            _step(rt, *_inputs(rank))

    with pytest.raises(threading.BrokenBarrierError):
        run_ranks(WORLD, rank_fn, timeout_s=8)


def test_a_rank_its_peers_gave_up_on_reports_the_fault():
    # Rank 1 reaches the retry after the survivors' agreement timed out on it: their
    # agreed mask masks it, so its own agreement is refused (FlashInfer raises
    # MoEEpRankEvictedError) and it must keep reporting the fault, not a clean mask.
    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        _step(rt, *_inputs(rank))
        if rank == 0:
            rt.fleet.mask_rank(1)
            ft.clean_buffers()
        else:
            # later than the survivors' agreement waits (the FT timeout, at least 5 s)
            threading.Event().wait(fault_tolerance.AGREE_MIN_S + 1.5)
            ft.clean_buffers()
        return bool(ft.query_fault()), ft.query_active_mask().tolist()

    assert run_ranks(WORLD, rank_fn, timeout_s=40) == [(True, [0, 1]), (True, [0, 0])]


def test_a_late_peer_that_answers_within_the_ft_timeout_stays_admitted(monkeypatch):
    """A slow but live peer reaches the retry 7 s after its survivor: later than the
    agreement's floor (AGREE_MIN_S, 5 s), within the FT timeout (10 s). The survivor's
    agreement must wait the FT timeout for it: a shorter wait masks it for good."""
    monkeypatch.setenv(envs.FT_TIMEOUT_MS, "10000")
    late_s = fault_tolerance.AGREE_MIN_S + 2
    assert late_s < envs.ft_timeout_ms() / 1000 - 2  # room for a loaded machine

    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        _step(rt, *_inputs(rank))
        if rank == 0:
            rt.fleet.mask_rank(1)  # its kernels timed out on the slow peer
        else:
            threading.Event().wait(late_s)
        ft.clean_buffers()
        return _healthy(ft)

    assert run_ranks(WORLD, rank_fn, timeout_s=60) == [True, True]


def test_fake_readmission_needs_a_handle_and_refuses_capture(monkeypatch):
    bare = fake_moe_ep.create_fleet(
        fake_moe_ep.BootstrapConfig(world_size=1, rank=0),
        fake_moe_ep.FleetParams(NUM_EXPERTS, 16, HIDDEN),
        [fake_moe_ep.FleetAlgoKnobFaultTolerance()],
    )
    with pytest.raises(RuntimeError, match="requires at least one handle"):
        bare.clear_faults(readmit=True)
    bare.clear_faults(readmit=False)  # local, needs no handle
    fleet = _runtime_at_world_1(FleetCache(0, 1, None)).fleet
    switch = install_capture_switch(monkeypatch)
    with switch.capturing(), pytest.raises(RuntimeError, match="CUDA-graph capture"):
        fleet.clear_faults(readmit=True)
    fleet.clear_faults(readmit=True)


def test_two_ranks_recover_concurrently_without_deadlock():
    # Both ranks retry while both masked each other (symmetric timeouts).
    barrier = threading.Barrier(WORLD)

    def rank_fn(rank, group):
        rt, ft = _rank_with_adapter(rank, group)
        rt.fleet.mask_rank(1 - rank)
        barrier.wait(5)
        ft.clean_buffers()
        return _healthy(ft)

    assert run_ranks(WORLD, rank_fn) == [True, True]


# ------------------------------------------------------------------- the manager
def test_manager_checks_and_cleans_fleets_created_after_its_first_runtime(monkeypatch):
    import vllm.config as vllm_config_mod
    from vllm.config import CUDAGraphMode
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
    )

    from vllm_flashinfer_ep import backends, envs
    from vllm_flashinfer_ep.vllm import managers

    def base_init(self, cpu_group, tcp_store_group=None):
        self.cpu_group = cpu_group
        self.rank, self.world_size = cpu_group
        self.support_fault_tolerance = False

    cfg = SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.NONE, cudagraph_capture_sizes=[]
        ),
        parallel_config=SimpleNamespace(
            use_sequence_parallel_moe=False, tensor_parallel_size=1, enable_fault_tolerance=True
        ),
    )
    monkeypatch.setattr(All2AllManagerBase, "__init__", base_init)
    monkeypatch.setenv(envs.SKIP_ENV_CHECKS, "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: cfg)
    mgr = managers.MANAGERS[backends.LOW_LATENCY]((0, 1))
    mgr._device = CPU
    try:
        kw = dict(num_experts=NUM_EXPERTS, max_num_tokens_per_rank=16, top_k=TOP_K)
        first = mgr.get_handle(dict(kw, hidden_size=HIDDEN))
        adapter = mgr._require_ft()
        second = mgr.get_handle(dict(kw, hidden_size=4096))
        assert mgr._require_ft() is adapter  # one adapter, reading the cache's fleets
        assert not bool(mgr.query_fault())
        second.fleet.raise_fault_flag()  # only the later fleet faults
        assert bool(mgr.query_fault())
        mgr.clean_buffers()
        assert not bool(mgr.query_fault())
        for fleet in (first.fleet, second.fleet):
            assert fleet.ft_log.count("clear_faults(readmit=True)") == 1
    finally:
        mgr.destroy()
