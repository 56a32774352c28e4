"""The HT bench harness on the fake transport: every mode gives the input back, a wrong
mode is refused before timing, handle creations per mode, the table/JSON and the
argument checks."""

from __future__ import annotations

import json
import sys
from unittest import mock

import pytest
import torch

from tests.fakes.fake_moe_ep import HandleAlgoKnobNumReceivedTokens
from tests.fakes.world import run_ranks
from vllm_flashinfer_ep import cli
from vllm_flashinfer_ep.bench import ht_results, ht_run
from vllm_flashinfer_ep.bench.ht_harness import HtHarness
from vllm_flashinfer_ep.runtime.fleet import FleetCache

pytestmark = pytest.mark.usefixtures("fake")

LAYERS = 3
TOKENS = (1, 5, 16)
CPU = torch.device("cpu")


def _args(*extra: str):
    return cli.build_parser().parse_args(
        [
            "bench-ht",
            "--layers",
            str(LAYERS),
            "--experts",
            "8",
            "--top-k",
            "2",
            "--hidden",
            "2048",
            "--tokens",
            ",".join(map(str, TOKENS)),
            "--warmup",
            "1",
            "--no-progress",
            *extra,
        ]
    )


def _harness(args, rank: int = 0, world_size: int = 1, group=None) -> HtHarness:
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        return HtHarness(args, fleets=FleetCache(rank, world_size, group), device=CPU)


@pytest.fixture()
def bench():
    h = _harness(_args())
    yield h
    h.close()


def test_every_mode_gives_the_input_back(bench):
    assert bench.modes == ("ht", "raw_ht_fresh", "ll_pooled")
    for num_tokens in TOKENS:
        layers, outs, steps = bench._steps(num_tokens)
        bench._check_equal(num_tokens, layers, outs, steps)  # raises SystemExit on any mismatch
        for li, (x, _, _) in enumerate(layers):
            for mode in bench.modes:
                # Identity experts, normalized weights, world 1: each token comes back as itself.
                torch.testing.assert_close(
                    outs[mode][li].float(),
                    x.float(),
                    rtol=2e-2,
                    atol=2e-2,
                    msg=f"{mode} T={num_tokens} layer {li}",
                )
            # Same expert op on the same received rows: the package adds no error to raw FlashInfer.
            assert torch.equal(outs["ht"][li], outs["raw_ht_fresh"][li])


def test_modes_agree_at_world_2():
    """Other-rank slots: both HT modes must count each weight on its owning rank only."""

    def rank_fn(rank, group):
        h = _harness(_args(), rank=rank, world_size=2, group=group)
        try:
            layers, outs, steps = h._steps(5)
            h._check_equal(5, layers, outs, steps)
            return [
                outs["raw_ht_fresh"][li].float() - x.float() for li, (x, _, _) in enumerate(layers)
            ]
        finally:
            h.close()

    for diffs in run_ranks(2, rank_fn):
        assert all(d.abs().max() < 2e-2 for d in diffs)


@pytest.mark.parametrize("wrong", ["ht", "raw_ht_fresh"])
def test_check_refuses_a_mode_with_a_wrong_expert(bench, monkeypatch, wrong):
    real = HtHarness._expert

    def doubled(self, mode, x, weights, out):
        return real(self, mode, x, weights * 2 if mode == wrong else weights, out)

    monkeypatch.setattr(HtHarness, "_expert", doubled)
    layers, outs, steps = bench._steps(5)
    with pytest.raises(SystemExit, match=f"mode '{wrong}' disagrees at T=5, layer 0"):
        bench._check_equal(5, layers, outs, steps)
    # run() refuses before timing anything.
    timed = []
    monkeypatch.setattr(bench, "_time", lambda step: timed.append(step) or 1.0)
    with pytest.raises(SystemExit, match="refusing to report timings"):
        bench.run()
    assert timed == []


def test_check_refuses_a_wrong_ll_mode(bench):
    layers, outs, steps = bench._steps(16)
    step = steps["ll_pooled"]

    def wrong() -> None:
        step()
        outs["ll_pooled"][2].mul_(1.5)

    steps["ll_pooled"] = wrong
    with pytest.raises(SystemExit, match="mode 'll_pooled' disagrees at T=16, layer 2"):
        bench._check_equal(16, layers, outs, steps)


def test_handles_per_layer_per_mode(bench):
    fleet, pool = bench.fleet, bench.ht_rt.pool
    layers, _, steps = bench._steps(5)
    created, alive = fleet.handles_created, fleet.handles_alive
    per_layer = [("create_handle", 5), ("dispatch", 5), ("combine", 5), ("destroy", 5)]

    # raw_ht_fresh: one handle per layer per step, on the HT fleet, with the layer's own
    # weights and the received-count knob, destroyed after its combine.
    log_start = len(fleet.log)
    for _ in range(2):
        steps["raw_ht_fresh"]()
    assert fleet.handles_created == created + 2 * LAYERS and fleet.handles_alive == alive
    assert [(c.op, c.tokens) for c in fleet.log[log_start:]] == per_layer * (2 * LAYERS)
    for handle, (_, _, w) in zip(fleet.handles[-LAYERS:], layers, strict=True):
        assert handle.bound_weights is w and HandleAlgoKnobNumReceivedTokens in handle.knobs

    # ht: the package's path creates handles only in its fresh rounds (one per layer),
    # nothing pooled, nothing left alive.
    assert pool.sizes == [] and pool.counters.pooled_created == 0
    fresh_before, created = pool.counters.fresh_created, fleet.handles_created
    log_start = len(fleet.log)
    steps["ht"]()
    assert pool.counters.fresh_created - fresh_before == LAYERS
    assert fleet.handles_created == created + LAYERS and fleet.handles_alive == alive
    assert pool.counters.pooled_created == 0 and pool.counters.pooled_rounds == 0
    assert [(c.op, c.tokens) for c in fleet.log[log_start:]] == per_layer * LAYERS

    # ll_pooled: its warmed pool, no creation, on its own fleet.
    ll_fleet = bench.ll_rt.fleet
    assert ll_fleet is not fleet and bench.ll_rt.pool.sizes == list(TOKENS)
    ll_created, log_start = ll_fleet.handles_created, len(ll_fleet.log)
    steps["ll_pooled"]()
    assert ll_fleet.handles_created == ll_created
    assert [c.op for c in ll_fleet.log[log_start:]] == ["update", "dispatch", "combine"] * LAYERS


def test_run_times_every_mode_in_rotated_order(bench, monkeypatch):
    order: list[str] = []
    names: dict = {}
    real_steps = HtHarness._steps

    def steps_named(self, num_tokens):
        layers, outs, steps = real_steps(self, num_tokens)
        names.update({step: mode for mode, step in steps.items()})
        return layers, outs, steps

    def fake_time(step) -> tuple[float, float]:
        step()
        order.append(names[step])
        return float(len(order)), 0.0

    monkeypatch.setattr(HtHarness, "_steps", steps_named)
    monkeypatch.setattr(bench, "_time", fake_time)
    bench.args.steps = 2
    rows = bench.run()
    assert [r.num_tokens for r in rows] == list(TOKENS)
    assert all(set(r.median_ms) == set(bench.modes) for r in rows)
    modes = list(bench.modes)
    assert order[:6] == modes + modes[1:] + modes[:1]


def test_without_ll_hidden_or_flag(capsys):
    odd = _harness(_args("--hidden", "3000"))  # HT takes any multiple of 8, LL does not
    try:
        assert odd.modes == ("ht", "raw_ht_fresh") and odd.ll_rt is None
        assert len(odd.fleets.fleets()) == 1
        assert "ll_pooled skipped: unsupported hidden size 3000" in capsys.readouterr().err
        layers, outs, steps = odd._steps(5)
        odd._check_equal(5, layers, outs, steps)
    finally:
        odd.close()
    flagged = _harness(_args("--no-ll"))
    try:
        assert flagged.modes == ("ht", "raw_ht_fresh") and len(flagged.fleets.fleets()) == 1
        assert flagged.ll_skipped == "--no-ll" and capsys.readouterr().err == ""
    finally:
        flagged.close()


def test_table_and_json_ratios(tmp_path):
    medians = {"ht": 3.0, "raw_ht_fresh": 2.0, "ll_pooled": 7.0}
    row = ht_results.HtRow(512, median_ms=dict(medians), min_ms=dict(medians), max_ms=dict(medians))
    assert row.ratios == pytest.approx(
        {"ht_over_raw_ht_fresh": 1.5, "ll_pooled_over_ht": 7.0 / 3.0}
    )
    args = _args()
    lines = ht_results.format_table([row], args, 1, None).splitlines()
    header = next(line for line in lines if line.startswith("| T |"))
    cells = lines[lines.index(header) + 2]
    by_column = dict(
        zip(header.strip("| ").split(" | "), cells.strip("| ").split(" | "), strict=True)
    )
    assert by_column["ht/raw_ht_fresh"] == "1.500" and by_column["ll_pooled/ht"] == f"{7 / 3:.3f}"
    assert by_column["ht"].startswith("3.000") and by_column["raw_ht_fresh"].startswith("2.000")
    assert lines[-1] == "ht/raw_ht_fresh within 1.05x at every T: NO"
    path = tmp_path / "ht.json"
    ht_results.write_json([row], args, 1, None, str(path))
    data = json.loads(path.read_text())
    assert data["rows"][0]["ht_over_raw_ht_fresh"] == 1.5 and data["within_target"] is False
    assert data["modes"] == ["ht", "raw_ht_fresh", "ll_pooled"] and data["config"]["hidden"] == 2048

    ht_only = {"ht": 1.0, "raw_ht_fresh": 1.0}
    row = ht_results.HtRow(512, median_ms=dict(ht_only), min_ms=dict(ht_only), max_ms=dict(ht_only))
    table = ht_results.format_table([row], args, 1, "--no-ll")
    assert "ll_pooled not run: --no-ll" in table and "ll_pooled/ht" not in table
    assert table.endswith("within 1.05x at every T: yes")


def test_arguments():
    args = cli.build_parser().parse_args(["bench-ht"])
    assert (args.tokens, args.hidden, args.layers, args.num_experts, args.top_k) == (
        [512, 1024, 2048, 4096, 8192],
        4096,
        8,
        128,
        8,
    )
    ht_run.validate_arguments(args)
    ht_run.validate_arguments(
        cli.build_parser().parse_args(["bench-ht", "--hidden", "7168", "--top-k", "32"])
    )
    with pytest.raises(SystemExit, match=r"--tokens 9000 exceeds NCCL-EP HT's limit of 8192"):
        ht_run.validate_arguments(
            cli.build_parser().parse_args(["bench-ht", "--tokens", "512,9000"])
        )
    for bad, why in (
        (["--top-k", "33"], "--top-k"),
        (["--steps", "10"], "--steps"),
        (["--tokens", "0,4"], "--tokens"),
        (["--layers", "0"], "--layers"),
    ):
        with pytest.raises(SystemExit, match=why):
            ht_run.validate_arguments(cli.build_parser().parse_args(["bench-ht", *bad]))


def test_module_entry_validates_and_refuses_without_gpu(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["ht_run", "--tokens", "16384"])
    with pytest.raises(SystemExit, match="--tokens 16384"):
        ht_run.cli()
    assert cli.main(["bench-ht", "--tokens", "512"]) == 2
    assert "bench-ht: needs a CUDA GPU" in capsys.readouterr().err


def test_ht_pooled_mode_gives_the_input_back_on_pooled_handles():
    h = _harness(_args("--ht-pooled"))
    try:
        assert h.modes == ("ht", "raw_ht_fresh", "ht_pooled", "ll_pooled")
        pool = h.pooled_rt.pool
        assert pool.sizes == list(TOKENS) and h.pooled_rt.fleet is h.fleet  # same HT fleet
        for num_tokens in TOKENS:
            layers, outs, steps = h._steps(num_tokens)
            h._check_equal(num_tokens, layers, outs, steps)
            for li in range(LAYERS):
                assert torch.equal(outs["ht_pooled"][li], outs["ht"][li])
        created = h.fleet.handles_created
        steps["ht_pooled"]()
        assert h.fleet.handles_created == created and pool.counters.fresh_created == 0
    finally:
        h.close()
