"""The bench harness on the fake transport: every mode agrees, handle counts per mode,
the ratio columns and the memory summary.

CUDA graphs are modelled by `_FakeGraph`: the step runs once eagerly (the warm-up
`capture_graph` does), then once under the capture switch (the capture); a replay runs
it again under the switch, so a mode that created a handle while "captured" fails.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.fakes.runtime import install_capture_switch
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep import cli
from vllm_flashinfer_ep.bench import harness as harness_module
from vllm_flashinfer_ep.bench import results
from vllm_flashinfer_ep.bench.harness import Harness
from vllm_flashinfer_ep.bench.reference import reference_moe
from vllm_flashinfer_ep.runtime.fleet import FleetCache

pytestmark = pytest.mark.usefixtures("fake")

LAYERS = 3
TOKENS = (1, 4, 8)


class _FakeGraph:
    def __init__(self, step, switch) -> None:
        self.step, self.switch = step, switch
        step()
        self.replay()

    def replay(self) -> None:
        with self.switch.capturing():
            self.step()


@pytest.fixture()
def bench(monkeypatch):
    switch = install_capture_switch(monkeypatch)
    monkeypatch.setattr(harness_module, "capture_graph", lambda step: _FakeGraph(step, switch))
    # The Triton expert op needs a GPU: the same per-expert scale in torch.
    monkeypatch.setattr(
        Harness, "_expert", lambda self, x, counts, layer: scale_expert_rows(x, self.scales[layer])
    )
    args = cli.build_parser().parse_args(
        [
            "bench",
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
            "--expert-compute",
            "--warmup",
            "1",
        ]
    )
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        h = Harness(args, fleets=FleetCache(0, 1, None), device=torch.device("cpu"))
    yield h
    h.close()


def test_new_modes_match_the_others_and_the_reference(bench):
    for num_tokens in TOKENS:
        sets, steps = bench._steps(num_tokens)
        bench._check_equal(num_tokens, sets, steps)  # raises SystemExit on any mismatch
        for li in range(LAYERS):
            x, ids, w, _ = sets["fresh"][li]
            want = reference_moe(x, ids, w, bench.scales[li]).float()
            for mode in results.MODES:
                got = sets[mode][li][3].float()
                torch.testing.assert_close(
                    got, want, rtol=2e-2, atol=2e-2, msg=f"{mode} T={num_tokens}"
                )
            for mode in ("raw_fresh", "raw_eager"):
                torch.testing.assert_close(sets[mode][li][3], sets["pooled"][li][3], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["raw_fresh", "raw_eager"])
def test_check_refuses_a_wrong_new_mode(bench, mode):
    sets, steps = bench._steps(8)
    step = steps[mode]

    def wrong() -> None:
        step()
        sets[mode][1][3].mul_(1.5)

    steps[mode] = wrong
    with pytest.raises(SystemExit, match=f"mode '{mode}' disagrees at T=8, layer 1"):
        bench._check_equal(8, sets, steps)


def test_raw_fresh_creates_a_handle_per_layer_per_step_raw_eager_none(bench):
    fleet = bench.fleet
    _, steps = bench._steps(4)
    steps["raw_eager"]()  # warm-up: the persistent raw handle for T=4 exists after this
    created, alive = fleet.handles_created, fleet.handles_alive
    for _ in range(3):
        steps["raw_eager"]()
    assert fleet.handles_created == created and fleet.handles_alive == alive
    log_start = len(fleet.log)
    for _ in range(2):
        steps["raw_fresh"]()
    assert fleet.handles_created == created + 2 * LAYERS
    assert fleet.handles_alive == alive  # each destroyed after its combine
    ops = [(c.op, c.tokens) for c in fleet.log[log_start:]]
    assert ops == [("create_handle", 4), ("dispatch", 4), ("combine", 4), ("destroy", 4)] * (
        2 * LAYERS
    )
    # raw_eager updates its persistent handle once per layer, never creates one.
    log_start = len(fleet.log)
    steps["raw_eager"]()
    assert [c.op for c in fleet.log[log_start:]] == ["update", "dispatch", "combine"] * LAYERS


def test_run_times_every_mode_and_reports_memory(bench, monkeypatch):
    order: list[str] = []
    names = {}

    def fake_time(step) -> tuple[float, float]:
        step()
        order.append(names.get(step, "?"))
        return 1.0, 0.5

    real_steps = Harness._steps

    def steps_named(self, num_tokens):
        sets, steps = real_steps(self, num_tokens)
        names.update({step: mode for mode, step in steps.items()})
        return sets, steps

    monkeypatch.setattr(bench, "_time", fake_time)
    monkeypatch.setattr(Harness, "_steps", steps_named)
    bench.args.no_progress = True
    bench.args.steps = 2
    rows = bench.run()
    assert [r.num_tokens for r in rows] == list(TOKENS)
    assert all(set(r.median_ms) == set(results.MODES) == set(r.host_ms) for r in rows)
    assert all(v == 0.5 for r in rows for v in r.host_ms.values())
    n = len(results.MODES)
    assert order[:n] == list(results.MODES) and order[n : 2 * n] == list(
        results.MODES[1:] + results.MODES[:1]
    )
    assert bench.memory.handles == len(
        TOKENS
    )  # CPU: no memory to read, but the handle count is real


def test_ratio_columns_use_the_named_modes(tmp_path):
    import json

    # Distinct primes per mode: any swapped mode changes every ratio it is part of.
    medians = dict(zip(results.MODES, (2.0, 3.0, 5.0, 7.0, 11.0, 13.0, 17.0, 19.0), strict=True))
    row = results.Row(8, median_ms=dict(medians), min_ms=dict(medians), max_ms=dict(medians))
    want = {
        "pooled_over_raw_eager": 3.0 / 11.0,
        "pooled_fi_over_raw_eager": 19.0 / 11.0,
        "fresh_over_raw_fresh": 2.0 / 7.0,
        "raw_fresh_over_graph": 7.0 / 5.0,
        "graph_over_raw_bind": 5.0 / 17.0,
        "graph_over_raw": 5.0 / 13.0,
        "fresh_over_graph": 2.0 / 5.0,
    }
    assert row.ratios == pytest.approx(want)
    args = cli.build_parser().parse_args(["bench", "--json", "/somewhere/b.json"])
    table = results.format_table([row], args, 1, results.PoolMemory()).splitlines()
    header, cells = table[-3].split(" | "), table[-1].split(" | ")
    by_column = dict(zip(header, cells, strict=True))
    assert by_column["pooled/raw_eager"] == f"{3 / 11:.3f}"
    assert by_column["pooled_fi/raw_eager"] == f"{19 / 11:.3f}"
    assert by_column["fresh/raw_fresh"] == f"{2 / 7:.3f}"
    assert by_column["raw_fresh/graph"] == f"{7 / 5:.2f}x"
    assert by_column["graph/raw_bind"] == f"{5 / 17:.3f}"
    assert by_column["raw_eager"].startswith("11.000") and by_column["raw_fresh"].startswith(
        "7.000"
    )
    path = tmp_path / "b.json"
    results.write_json([row], args, 1, results.PoolMemory(), str(path))
    payload = json.loads(path.read_text())
    assert "json_path" not in payload["config"]  # results carry no machine paths
    data = payload["rows"][0]
    assert {k: data[k] for k in want} == pytest.approx(want)
    assert data["median_ms"] == medians


def test_pool_memory_totals_and_average():
    mem = results.PoolMemory.from_snapshots(
        (1_000, 10_000),
        (301_000, 410_000),
        (331_000, 450_000),
        handles=5,
        median_handle_bytes=9_000,
        first_handle_bytes=400_000,
    )
    assert mem.total_torch_bytes == 330_000 and mem.total_device_bytes == 440_000
    assert mem.avg_handle_torch_bytes == 7_500 and mem.avg_handle_device_bytes == 10_000
    single = results.PoolMemory.from_snapshots(
        (0, 0), (5, 5), (5, 5), handles=1, median_handle_bytes=0, first_handle_bytes=5
    )
    assert single.avg_handle_device_bytes == 0.0


def test_host_profile_names_the_package_round_and_flashinfer_calls(bench):
    _, steps = bench._steps(4)
    report = bench.host_profile(steps, ("pooled", "raw_eager"), repeats=2, top=40)
    pooled, raw = report.split("=== host profile: raw_eager")
    assert "=== host profile: pooled, 2 steps ===" in pooled
    assert "round_plan.py" in pooled and "rounds.py" in pooled  # the package's round
    assert "round_plan.py" not in raw and "rounds.py" not in raw  # FlashInfer alone
