"""bench-fp8's harness on the fake transport: the BF16-then-quantize and FP8-wire paths of
both backends agree before timing, a wrong FP8 path is refused before anything is timed,
HT times eager modes only. vLLM's quantization kernels need a GPU: the torch emulation of
tests/unit/test_receive_quant.py stands in (the device suite's `fp8bench` runs vLLM's)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.fakes.world import run_ranks
from tests.unit.test_receive_quant import emulated_quantize
from vllm_flashinfer_ep import cli
from vllm_flashinfer_ep.bench import fp8_run
from vllm_flashinfer_ep.bench.fp8_harness import Fp8Harness
from vllm_flashinfer_ep.runtime import fp8_wire
from vllm_flashinfer_ep.runtime.fleet import FleetCache
from vllm_flashinfer_ep.vllm import receive_quant

pytestmark = pytest.mark.usefixtures("fake")

CPU = torch.device("cpu")
TOKENS = {"ll": "1,6", "ht": "5,24"}


@pytest.fixture(autouse=True)
def torch_quantize(monkeypatch):
    monkeypatch.setattr(receive_quant, "_vllm_quantize", emulated_quantize)
    monkeypatch.setattr(receive_quant, "group_quantize", fp8_wire.group_quantize)


def _args(backend: str):
    args = cli.build_parser().parse_args(
        [
            "bench-fp8",
            "--backend",
            backend,
            "--layers",
            "3",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--hidden",
            "2048",
            "--tokens",
            TOKENS[backend],
            "--warmup",
            "1",
            "--steps",
            "2",
            "--no-progress",
        ]
    )
    fp8_run.validate_arguments(args)
    return args


def _harness(backend: str, rank: int = 0, world_size: int = 1, group=None) -> Fp8Harness:
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        return Fp8Harness(_args(backend), fleets=FleetCache(rank, world_size, group), device=CPU)


def _fake_time(timed: list):
    def fake_time(step) -> tuple[float, float]:
        step()
        timed.append(step)
        return float(len(timed)), 0.0

    return fake_time


def test_ht_run_checks_then_times_the_eager_modes(monkeypatch):
    h = _harness("ht")
    try:
        timed: list = []
        monkeypatch.setattr(h, "_time", _fake_time(timed))
        rows = h.run()
        assert [r.num_tokens for r in rows] == [5, 24]
        assert all(set(r.median_ms) == {"bf16_quant_eager", "fp8_wire_eager"} for r in rows)
        assert len(timed) == 2 * 2 * 2  # token counts x modes x steps
        # The FP8 mode really dispatched FP8 through the forward recipe.
        assert h.rt.fp8_wire.dispatches > 0
        table = fp8_run.format_table(rows, h.args, 1)
        assert "block-FP8 HT step" in table and "fp8_wire/bf16_quant" not in table
        # World 1: one row per token (14336 -> 7168 + 224 bytes at hidden 7168; here 2048).
        assert table.splitlines()[-1].endswith(
            f"{24 * 4096 / 1024:.1f} / {24 * (2048 + 64) / 1024:.1f}"
        )
    finally:
        h.close()


@pytest.mark.parametrize("backend", ["ll", "ht"])
def test_check_refuses_fp8_rows_that_differ_before_timing(monkeypatch, backend):
    """A wire that carries the wrong scales (here: doubled) must stop the benchmark."""
    h = _harness(backend)
    try:
        real = h.round.dispatch

        def wrong_scales(*args, **kwargs):
            d = real(*args, **kwargs)
            if kwargs.get("fp8"):
                (d.x_scale if backend == "ht" else d.expert_x_scale).mul_(2.0)
            return d

        monkeypatch.setattr(h.round, "dispatch", wrong_scales)
        timed: list = []
        monkeypatch.setattr(h, "_time", _fake_time(timed))
        with pytest.raises(
            SystemExit, match="FP8 wire rows disagree .* refusing to report timings"
        ):
            h.run()
        assert timed == []
    finally:
        h.close()


def test_ll_check_accepts_the_two_paths():
    h = _harness("ll")
    try:
        for t in (1, 6):
            h._check(t, h._layers(t, seed=t, loud=True))  # SystemExit on any disagreement
        assert h.rt.fp8_wire.dispatches == 2 * 2
    finally:
        h.close()


def test_ht_paths_agree_at_world_2():
    """Each rank receives the rows routed to it from both ranks; both paths the same rows."""

    def rank_fn(rank, group):
        h = _harness("ht", rank=rank, world_size=2, group=group)
        try:
            h._check(24, h._layers(24, seed=3, loud=True))
            return h.rt.fp8_wire.dispatches
        finally:
            h.close()

    assert run_ranks(2, rank_fn) == [2, 2]
