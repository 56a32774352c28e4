"""The pool holds every token count vLLM captures, whatever vLLM's sizing made of the
configured capture sizes: both model runners, num_speculative_tokens 0-5, and
sequence-parallel MoE. The captured counts come from vLLM 0.33.0's own sizing code
(V1: `CompilationConfig.adjust_cudagraph_sizes_for_spec_decode`; V2: the candidates of
`CudaGraphManager`), and the capture is driven the way both runners drive it: inside the
capture phase, one eager warm-up forward of a count, then its capture.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from tests.fakes.runtime import build_fake_runtime, install_capture_switch
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import HandlePoolError
from vllm_flashinfer_ep.runtime import capture
from vllm_flashinfer_ep.runtime.pool_sizes import bucket_sizes

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN = 2048
CONFIGURED = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # vLLM's default list, up to 64
MAX_NUM_SEQS = 16
CAPACITY = 128


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import CUDAGraphMode, SchedulerConfig, VllmConfig

    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=CAPACITY,
            max_model_len=CAPACITY,
            is_encoder_decoder=False,
        )
    )
    # The CPU platform turns graphs off; set what a GPU host would have.
    comp = config.compilation_config
    comp.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    comp.cudagraph_capture_sizes = list(CONFIGURED)
    comp.max_cudagraph_capture_size = max(CONFIGURED)
    return config


def v1_captured(vllm_config, num_spec: int) -> list[int]:
    """What the V1 runner captures: vLLM's own rounding of the capture sizes."""
    comp = copy.deepcopy(vllm_config.compilation_config)
    comp.adjust_cudagraph_sizes_for_spec_decode(1 + num_spec)
    return sorted(comp.cudagraph_capture_sizes)


def v2_captured(vllm_config, num_spec: int) -> list[int]:
    """What the V2 runner captures: the token counts of CudaGraphManager's candidates."""
    from vllm.v1.worker.gpu import cudagraph_utils

    stage = mock.Mock(is_first_rank=True, is_last_rank=True)
    with (
        mock.patch.object(cudagraph_utils, "get_pp_group", return_value=stage),
        mock.patch.object(cudagraph_utils.current_platform, "get_global_graph_pool"),
    ):
        manager = cudagraph_utils.CudaGraphManager(
            vllm_config,
            torch.device("cpu"),
            vllm_config.compilation_config.cudagraph_mode,
            decode_query_len=1 + num_spec,
        )
    return sorted({d.num_tokens for descs in manager._capture_descs.values() for d in descs})


RUNNERS = {"v1": v1_captured, "v2": v2_captured}


def load_time_sizes() -> list[int]:
    """What the manager pools at model load: the configured sizes, then eager buckets."""
    return sorted(set(CONFIGURED) | set(bucket_sizes(max(CONFIGURED), CAPACITY)))


def _round(rt, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, 8, 2, torch.device("cpu"), gen)
    scales = torch.rand(8, generator=gen) + 0.5
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, agreed_tokens=num_tokens)
    out = rnd.combine(scale_expert_rows(d.expert_x, scales), torch.empty_like(x))
    return out, reference_moe(x, ids, weights, scales)


@contextmanager
def vllm_capture_phase():
    """vLLM's graph_capture, through the package's patch of it (patches/worker.py)."""
    from vllm_flashinfer_ep.vllm.patches.worker import make_graph_capture

    @contextmanager
    def original(self, graph_capture_context=None):
        yield graph_capture_context

    with make_graph_capture(original)(object(), "context") as context:
        assert context == "context"
        yield


def capture_like_vllm(rt, switch, moe_counts: list[int]) -> None:
    """Per count, largest first (both runners' order): eager warm-up, then the capture."""
    with vllm_capture_phase():
        for seed, count in enumerate(sorted(moe_counts, reverse=True)):
            _round(rt, count, seed)
            with switch.capturing():
                _round(rt, count, seed)


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("num_spec", range(6))
@pytest.mark.parametrize("sp_tp", [1, 2], ids=["no_sp", "sp_tp2"])
def test_every_count_vllm_captures_is_pooled(vllm_config, monkeypatch, runner, num_spec, sp_tp):
    captured = RUNNERS[runner](vllm_config, num_spec)
    assert captured, "vLLM captures nothing: the fixture's config is wrong"
    # Under sequence-parallel MoE each rank's MoE sees its chunk of the padded batch.
    moe_counts = sorted({math.ceil(s / sp_tp) for s in captured})
    switch = install_capture_switch(monkeypatch)
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, sizes=load_time_sizes()
    )
    capture_like_vllm(rt, switch, moe_counts)
    assert set(moe_counts) <= set(rt.pool.sizes)
    assert rt.pool.learned == sorted(set(moe_counts) - set(load_time_sizes()), reverse=True)
    counters = rt.pool.counters
    assert counters.created_during_capture == 0 and counters.fresh_created == 0
    # Replays (captured rounds at every count) need no handle; outputs stay right.
    created = fleet.handles_created
    for seed, count in enumerate(moe_counts):
        with switch.capturing():
            out, want = _round(rt, count, 100 + seed)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert fleet.handles_created == created


def test_speculative_counts_are_not_in_the_configured_sizes(vllm_config):
    """The reason this file exists: with 2 speculative tokens both runners capture counts
    (9, 18, 33, ...) the configured sizes lack."""
    for runner in RUNNERS.values():
        assert {9, 18, 33} <= set(runner(vllm_config, 2)) - set(CONFIGURED)


def test_capture_outside_the_capture_phase_is_refused(monkeypatch):
    """Without the phase (no eager warm-up in vLLM's graph_capture) an unpooled count
    cannot be created inside the capture: a clear error, no handle."""
    switch = install_capture_switch(monkeypatch)
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=64, sizes=[8, 16])
    _round(rt, 9, 0)  # eager, outside the phase: padded onto 16, nothing learned
    assert rt.pool.sizes == [8, 16] and rt.pool.learned == []
    with (
        switch.capturing(),
        pytest.raises(HandlePoolError, match="no warmed flashinfer_ep handle for 9"),
    ):
        _round(rt, 9, 0)


def test_capture_phase_is_reentrant_and_closes():
    assert not capture.in_capture_phase()
    with capture.capture_phase() as outer:
        with capture.capture_phase() as inner:  # vLLM enters it for TP, PP and DP
            assert capture.in_capture_phase() and outer and not inner
        assert capture.in_capture_phase()
    assert not capture.in_capture_phase()
    with pytest.raises(KeyError), capture.capture_phase():
        raise KeyError("an error inside the capture")
    assert not capture.in_capture_phase()
