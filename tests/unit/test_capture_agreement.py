"""The EP ranks decide the same capture plan, or all stop by name, on the fake world.

When vLLM's outermost graph capture opens, every rank's manager exchanges its capture
plan (the pooled counts, the resolved CUDA-graph mode and sizes, the decode query length
and the MoE token counts in capture order, computed with vLLM's own descriptor code) and
pools what the plan adds, before any handle is created in the phase. Inside the phase,
the first MoE layer of each eager warm-up forward compares its token count: a rank that
warms up a count its peers do not (one that would learn a count another has pooled)
stops with its peers instead of pairing a handle of another size.

The ranks are threads of one process: the phase (a process global) is entered once
around them, and each rank opens it on its manager as the graph_capture patch does.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.fakes.managers import manager_world
from tests.fakes.rank_configs import (
    LL,
    SIZES,
    assert_named_everywhere,
    clean_env,
    configs,
    load,
    make_base_config,
    speculate,
)
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.runtime import capture
from vllm_flashinfer_ep.runtime.exchange import ExchangeTimeoutError
from vllm_flashinfer_ep.vllm import capture_plan, rank_checks

pytestmark = pytest.mark.usefixtures("fake")

PLAN = "capture plan (capture phase opening)"


@pytest.fixture(scope="module")
def base_config():
    return make_base_config()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    clean_env(monkeypatch)


def warm_up(pf, tokens: int, seed: int = 0) -> None:
    """One eager MoE layer of a warm-up forward, as vLLM's prepare and finalize run it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 2048, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(tokens, 8, 2, torch.device("cpu"), gen)
    received = pf.prepare(x, weights, ids, 8, None, False, None)
    pf.runtime.round.combine(received[0], torch.empty_like(x))


def created(manager) -> int:
    return sum(rt.fleet.handles_created for rt in manager.runtimes)


@pytest.mark.parametrize("world", [2, 4])
def test_the_plan_is_agreed_and_what_it_adds_is_pooled_before_any_capture(base_config, world):
    """Two speculative tokens (V2 runner): decode graphs of 3, 6 and 9 tokens, which the
    configured sizes lack, are pooled on every rank when the phase opens."""
    with manager_world(LL, configs(base_config, world)) as w:
        for config in (m._vllm_config for m in w.managers):
            speculate(2)(config)
        pfs = w.run(load)

        def rank_fn(rank, manager):
            manager.open_capture_phase()
            (rt,) = manager.runtimes
            before = created(manager)
            pf = pfs[rank]
            for tokens in capture_plan.plan_of(manager._vllm_config).counts():
                warm_up(pf, tokens)
            return rt.pool.learned, created(manager) - before, rt.pool.counters.fresh_created

        with capture.capture_phase():
            results = w.run(rank_fn)
    assert results == [([9, 6, 3], 0, 0)] * world
    assert all(x.calls[2] == PLAN for x in w.exchanges)
    assert all(x.calls[3:] == ["capture warm-up forward"] * 8 for x in w.exchanges)


@pytest.mark.parametrize("world", [2, 4])
def test_a_resolved_mode_that_differs_stops_every_rank_before_any_handle(base_config, world):
    """The runner lowers the CUDA-graph mode after model load (the attention backend's
    support): ranks that agreed at load can still differ here."""
    from vllm.config import CUDAGraphMode

    with manager_world(LL, configs(base_config, world)) as w:
        w.run(load)
        w.managers[-1]._vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
        before = [created(m) for m in w.managers]
        with capture.capture_phase():
            outcomes = w.outcomes(lambda r, m: m.open_capture_phase())
        assert [created(m) for m in w.managers] == before
    assert_named_everywhere(outcomes, "resolved CUDA-graph mode", "cudagraph_mode")


@pytest.mark.parametrize("world", [2, 4])
def test_speculation_that_differs_at_capture_stops_every_rank_by_name(base_config, world):
    """The issue's case: V2 runner, equal capture sizes, no speculation on most ranks and
    one speculative token on the last; here the difference appears after the load check
    (e.g. a drafter's config resolved later), so the plan is what catches it."""
    with manager_world(LL, configs(base_config, world)) as w:
        w.run(load)
        speculate(1)(w.managers[-1]._vllm_config)
        with capture.capture_phase():
            outcomes = w.outcomes(lambda r, m: m.open_capture_phase())
    assert_named_everywhere(outcomes, "decode query length", "--speculative-config")


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_warming_up_a_count_its_peers_do_not_stops_every_rank(base_config, world):
    """One-sided learning: the last rank warms up 5 tokens (not pooled: it would learn
    the count) while the others warm up 8 (pooled): every rank stops by name at the
    layer's agreement, before any collective of the round."""
    with manager_world(LL, configs(base_config, world)) as w:
        pfs = w.run(load)

        def rank_fn(rank, manager):
            manager.open_capture_phase()
            before = created(manager)
            try:
                warm_up(pfs[rank], 5 if rank == world - 1 else 8)
            finally:
                assert created(manager) == before
                assert manager.runtimes[0].round.in_flight is None

        with capture.capture_phase():
            outcomes = w.outcomes(rank_fn)
    assert_named_everywhere(outcomes, rank_checks.WARMUP_COUNT, "--speculative-config")


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_stops_before_the_capture_leaves_the_others_a_named_error(
    base_config, monkeypatch, world
):
    monkeypatch.setenv(envs.EXCHANGE_TIMEOUT_S, "2")
    dead = world - 1
    with manager_world(LL, configs(base_config, world)) as w:
        w.run(load)
        start = time.monotonic()
        with capture.capture_phase():
            outcomes = w.outcomes(lambda r, m: "died" if r == dead else m.open_capture_phase())
        took = time.monotonic() - start
    assert outcomes[dead] == "died"
    for rank in range(dead):
        assert isinstance(outcomes[rank], ExchangeTimeoutError), outcomes[rank]
        assert "the capture plan" in str(outcomes[rank])
    assert took < 2 + 5


def test_the_outermost_graph_capture_opens_the_phase_once(monkeypatch):
    """vLLM enters graph_capture for TP, PP and DP, nested: the managers' phase opens at
    the outermost entry only, before vLLM's own context."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from vllm_flashinfer_ep.vllm.patches.worker import make_graph_capture

    events = []

    class Manager:
        def open_capture_phase(self):
            events.append(("open", capture.in_capture_phase()))

    group = SimpleNamespace(device_communicator=SimpleNamespace(all2all_manager=Manager()))
    monkeypatch.setattr(parallel_state, "get_ep_group", lambda: group)

    from contextlib import contextmanager

    @contextmanager
    def original(self, context=None):
        events.append("vllm")
        yield context

    patched = make_graph_capture(original)
    with patched(object(), "tp") as tp, patched(object(), tp) as pp, patched(object(), pp):
        pass
    assert events == [("open", True), "vllm", "vllm", "vllm"]


def test_equal_capture_sizes_and_other_speculation_give_other_plans(base_config):
    """What the plan compares for the issue's case (V2 runner, same capture sizes)."""
    import copy

    plain, spec = copy.deepcopy(base_config), copy.deepcopy(base_config)
    speculate(1)(spec)
    a, b = capture_plan.plan_of(plain), capture_plan.plan_of(spec)
    assert a.runner == b.runner == "v2" and a.capture_sizes == b.capture_sizes == tuple(SIZES)
    assert a.order != b.order and ("FULL", 1, 0) in a.order and ("FULL", 1, 0) not in b.order
    assert (a.decode_query_len, b.decode_query_len) == (1, 2)
