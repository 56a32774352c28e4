"""The engine benchmark keeps the rows an engine measured before it died (tests/engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_run import bench_row, bench_rows_from_log  # noqa: E402

LOG = """\
(MainProcess pid=1) INFO 12-03 10:08:23 [core.py:412] init engine took 7.36 s
engine_run: ready in 32.0s
engine_run: bench warm-up 1.249s
engine_run: bench batch=1 first=0.072s full=4.571s
engine_run: bench batch=8 first=0.103s full=7.981s
INFO noise engine_run: bench batch=99 first=1.0s full=2.0s
engine_run: bench batch=32 first=0.164s full=15.529s
Timeout (0:01:00)!
"""


def test_rows_from_progress_lines():
    rows = bench_rows_from_log(LOG, 128)
    assert [r["batch"] for r in rows] == [1, 8, 32]  # only whole progress lines count
    assert rows[1] == bench_row(8, 128, 0.103, 7.981)


def test_row_arithmetic():
    row = bench_row(8, 128, 0.103, 7.981)
    assert abs(row["decode_seconds"] - 7.878) < 1e-9
    assert abs(row["output_tokens_per_s"] - 8 * 128 / 7.878) < 1e-9
    assert abs(row["ms_per_step"] - 7878 / 128) < 1e-9


def _doc(quantization, name, tps, **extra):
    import json

    rows = [bench_row(b, 128, 0.1, 0.1 + 128 * b / t) for b, t in zip((1, 8), tps)]
    doc = {"shape": "qwen3-30b-a3b", "meta": {name: {}}, "results": {name: rows}, **extra}
    if quantization:
        doc["quantization"] = quantization
    return json.dumps(doc)


def test_one_engine_per_call_results_merge_into_one_file(tmp_path, capsys):
    """FP8 engines run one per device call; their files join into one results file."""
    import json

    from bench_engine import main

    a, b, c = (tmp_path / n for n in ("a.json", "b.json", "c.json"))
    a.write_text(_doc("fp8_per_block", "no_ep", (100, 400), startup_switches={"s": 1}))
    b.write_text(_doc("fp8_per_block", "ll_graph", (80, 360)))
    c.write_text(_doc(None, "ll_graph", (80, 360)))
    out = tmp_path / "fp8.json"
    assert main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    joined = json.loads(out.read_text())
    assert set(joined["results"]) == {"no_ep", "ll_graph"}
    assert joined["quantization"] == "fp8_per_block" and joined["startup_switches"] == {"s": 1}
    assert "| 8 | 400 | 360 | 0.90 |" in capsys.readouterr().out
    assert main(["--merge", str(a), str(c)]) == 2  # a BF16 run never joins an FP8 one


def test_runs_on_different_gpus_never_merge(tmp_path, capsys):
    """An H100 engine and an H200 engine are not one side-by-side table."""
    import json

    from bench_engine import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, name, card in ((a, "no_ep", "NVIDIA H100 80GB HBM3"), (b, "ll_graph", "NVIDIA H200")):
        doc = json.loads(_doc("fp8_per_block", name, (100, 400)))
        doc["meta"][name]["device"] = card
        path.write_text(json.dumps(doc))
    assert main(["--merge", str(a), str(b)]) == 2
    assert "different GPUs" in capsys.readouterr().out
    same = json.loads(b.read_text())
    same["meta"]["ll_graph"]["device"] = "NVIDIA H100 80GB HBM3"
    b.write_text(json.dumps(same))
    assert main(["--merge", str(a), str(b)]) == 0


def test_a_partial_run_gives_no_table(tmp_path, capsys):
    """A file whose engine died early lacks batches: the merge says which, not a short table."""
    import json

    from bench_engine import main

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(_doc(None, "no_ep", (100, 400)))
    partial = json.loads(_doc(None, "ll_graph", (80, 360)))
    partial["results"]["ll_graph"] = partial["results"]["ll_graph"][:1]
    b.write_text(json.dumps(partial))
    assert main(["--merge", str(a), str(b)]) == 1
    assert "ll_graph lack batches of [1, 8]" in capsys.readouterr().out


def test_every_engine_gets_the_same_budget_and_the_json_names_its_kernels(tmp_path, monkeypatch):
    """bench_engine's run on a stand-in engine: one step budget for every configuration,
    each engine's kernels and budget in the JSON, the engine timeout passed on."""
    import json

    import bench_engine

    specs, timeouts = [], []

    def run(self, name, spec, env=None, timeout=540):
        specs.append(spec)
        timeouts.append(timeout)
        probe = {
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "runtimes": [],
            "kernels": [f"{spec.get('backend')}+Experts"],
            "max_num_batched_tokens": spec["max_num_batched_tokens"],
            "device": "stand-in GPU",
        }
        rows = [bench_row(b, 128, 0.1, 1.0) for b in (1, 8)]
        return {"startup_seconds": 1.0, "after_load": probe, "bench": rows}

    monkeypatch.setattr(bench_engine.EngineRunner, "run", run)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(bench_engine.tempfile, "tempdir", str(scratch))
    out = tmp_path / "r.json"
    argv = ["--configs", "no_ep,ll_graph", "--batch-sizes", "1,8", "--out", str(out)]
    assert bench_engine.main([*argv, "--engine-timeout", "300"]) == 0
    assert list(scratch.iterdir()) == []  # generated weights and logs are removed
    assert [s["max_num_batched_tokens"] for s in specs] == [256, 256]
    assert timeouts == [300, 300]
    meta = json.loads(out.read_text())["meta"]
    assert meta["no_ep"]["kernels"] == ["None+Experts"]
    assert meta["no_ep"]["device"] == "stand-in GPU"
    assert meta["ll_graph"]["max_num_batched_tokens"] == 256


def _specs_of(monkeypatch, argv: list[str]) -> list[dict]:
    """The engine specs bench_engine hands a stand-in engine for `argv`."""
    import bench_engine

    specs = []

    def run(self, name, spec, env=None, timeout=540):
        specs.append(spec)
        probe = {"cudagraph_mode": "FULL_DECODE_ONLY", "runtimes": [], "kernels": []}
        return {"startup_seconds": 1.0, "after_load": probe | {"max_num_batched_tokens": 256}}

    monkeypatch.setattr(bench_engine.EngineRunner, "run", run)
    assert bench_engine.main(argv) == 0
    return specs


def test_the_profiled_prompts_prefill_in_one_step(monkeypatch):
    """Batch x prompt within the step budget: the profiled steps after it are decode steps,
    not prefill chunks mixed with decodes (128 prompts of 8 tokens need 4 steps of 256)."""
    for batch, prompt in ((1, 8), (128, 2)):
        argv = ["--configs", "no_ep", "--profile-batch", str(batch), "--no-bench"]
        [spec] = _specs_of(monkeypatch, argv)
        profile = spec["profile"]
        assert profile["prompt_len"] == prompt
        assert profile["batch"] * profile["prompt_len"] <= spec["max_num_batched_tokens"]


def test_the_mixed_profile_chunks_a_long_prompt_into_the_decodes_steps(monkeypatch):
    """Concurrency 128 at budget 256: 127 decodes and chunks of 129 prefill tokens; the
    decodes outlast the short prompts' prefill steps and all the chunks; the model fits
    the long prompt; vLLM's default compilation when asked (nothing overridden)."""
    argv = ["--configs", "no_ep,ll_graph", "--profile-mixed", "128", "--no-bench"]
    for spec in _specs_of(monkeypatch, [*argv, "--shape", "qwen3-30b-a3b"]):
        mixed = spec["profile_mixed"]
        assert (mixed["decodes"], mixed["chunk"], mixed["long_prompt_len"]) == (127, 129, 2048)
        assert mixed["decodes"] + mixed["chunk"] == spec["max_num_batched_tokens"]
        prefill_steps = -(-mixed["decodes"] * mixed["prompt_len"] // 256)
        assert mixed["max_tokens"] > prefill_steps + -(-2048 // mixed["chunk"])
        assert spec["max_model_len"] >= 2048 + 1
        assert mixed["moe_layers"] == 48
        assert spec["compilation_config"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    specs = _specs_of(monkeypatch, [*argv, "--compilation", "default"])
    assert all("compilation_config" not in spec for spec in specs)


def test_a_mixed_profile_without_room_for_a_chunk_is_refused(monkeypatch):
    with pytest.raises(SystemExit, match="leave no room"):
        _specs_of(monkeypatch, ["--configs", "no_ep", "--profile-mixed", "257", "--no-bench"])


def test_the_table_sets_eager_ll_against_eager_no_ep():
    """ll_eager's reference is the eager engine without EP (every step eager, as mixed
    steps run under FULL_DECODE_ONLY), not no EP's graphs."""
    from bench_engine import CONFIGS, table

    assert CONFIGS["no_ep_eager"][0] == {"backend": None, "enforce_eager": True}
    rows = {
        name: [bench_row(b, 128, 0.1, 0.1 + 128 * b / t) for b, t in zip((1, 8), tps)]
        for name, tps in {"no_ep_eager": (50, 200), "ll_eager": (40, 100)}.items()
    }
    text = table("qwen3-30b-a3b", [1, 8], rows)
    assert "ll_eager / no_ep_eager" in text
    assert "| 8 | 200 | 100 | 0.50 |" in text


def test_no_prompt_of_the_mixed_profile_is_seen_twice(monkeypatch):
    """vLLM's prefix cache is on by default: a long prompt issued again would skip its
    prefill, and the profile would measure decodes against decodes."""
    import contextlib

    import profile_breakdown
    import torch
    from engine_run import _profile_mixed

    class Engine:
        def __init__(self):
            self.calls: list[list[list[int]]] = []

        def generate(self, prompts, params, use_tqdm):
            assert len(prompts) == len(params)
            self.calls.append([list(p["prompt_token_ids"]) for p in prompts])

    monkeypatch.setattr(torch.profiler, "profile", lambda **_: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for name in ("from_profiler", "added"):
        monkeypatch.setattr(profile_breakdown, name, lambda *a: [])
    monkeypatch.setattr(profile_breakdown, "breakdown", lambda *a: {})
    monkeypatch.setattr(profile_breakdown, "table", lambda *a, **k: "")
    engine = Engine()
    p = {"decodes": 3, "prompt_len": 20, "max_tokens": 8, "long_prompt_len": 300}
    _profile_mixed(engine, {**p, "chunk": 100, "moe_layers": 2}, vocab=151936)

    assert [len(c) for c in engine.calls] == [4, 3] * 5  # warm-up, profiled, 3 wall pairs
    assert all(len(c[-1]) == 300 for c in engine.calls[::2])
    first_blocks = [tuple(prompt[:16]) for call in engine.calls for prompt in call]
    assert len(set(first_blocks)) == len(first_blocks)  # no prefix-cache hit, even a block
