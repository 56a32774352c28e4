"""Engine results kept across device calls (tests/engine/engine_runner.py, CACHE_ENV): a
later call reads a spec's result instead of starting its engine again, and never reads
one the code or the spec has changed since. The engine process is a stand-in here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import engine_runner  # noqa: E402


def _fake_engine(calls):
    def run(cmd, **kwargs):
        spec_path, out_path = Path(cmd[2]), Path(cmd[3])
        calls.append(json.loads(spec_path.read_text()))
        out_path.write_text(json.dumps({"prompt_logprobs": [[-1.0]], "n": len(calls)}))
        return type("Done", (), {"returncode": 0})()

    return run


def test_a_later_call_reads_the_kept_result(tmp_path, monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(engine_runner.subprocess, "run", _fake_engine(calls))
    monkeypatch.setenv(engine_runner.CACHE_ENV, str(tmp_path / "kept"))
    monkeypatch.setenv(engine_runner.LOG_DIR_ENV, str(tmp_path / "logs"))
    spec = {"model": "/models/tiny", "backend": None}

    first = engine_runner.EngineRunner(tmp_path / "call1").run("ref", spec)
    again = engine_runner.EngineRunner(tmp_path / "call2").run("ref", spec)  # a new call
    assert len(calls) == 1 and again["n"] == first["n"] == 1

    engine_runner.EngineRunner(tmp_path / "call3").run("ref", {**spec, "enforce_eager": True})
    assert len(calls) == 2  # another spec: its own engine

    monkeypatch.setattr(engine_runner, "_code_digest", lambda: "changed")
    engine_runner.EngineRunner(tmp_path / "call4").run("ref", spec)
    assert len(calls) == 3  # changed code: never an old result


def test_without_the_folder_nothing_is_kept(tmp_path, monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(engine_runner.subprocess, "run", _fake_engine(calls))
    monkeypatch.delenv(engine_runner.CACHE_ENV, raising=False)
    monkeypatch.setenv(engine_runner.LOG_DIR_ENV, str(tmp_path / "logs"))
    for call in ("a", "b"):
        engine_runner.EngineRunner(tmp_path / call).run("ref", {"model": "/m"})
    assert len(calls) == 2


def test_an_unreadable_kept_result_is_run_again(tmp_path, monkeypatch):
    """A call killed while writing leaves no readable entry: the next one runs the engine."""
    calls: list[dict] = []
    monkeypatch.setattr(engine_runner.subprocess, "run", _fake_engine(calls))
    monkeypatch.setenv(engine_runner.CACHE_ENV, str(tmp_path / "kept"))
    monkeypatch.setenv(engine_runner.LOG_DIR_ENV, str(tmp_path / "logs"))
    engine_runner.EngineRunner(tmp_path / "a").run("ref", {"model": "/m"})
    [entry] = (tmp_path / "kept").glob("*.json")
    entry.write_text('{"prompt_logprobs": [[')  # cut short
    again = engine_runner.EngineRunner(tmp_path / "b").run("ref", {"model": "/m"})
    assert len(calls) == 2 and again["n"] == 2
    assert not list((tmp_path / "kept").glob("*.partial"))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLASHINFER_EP_TEST_DP_EXPECTED_M", "1"),  # a harness switch
        ("VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS", "0"),  # a package variable
    ],
)
def test_a_switch_or_package_variable_keys_the_kept_result(tmp_path, monkeypatch, name, value):
    """Harness switches and the package's variables change what an engine computes (the
    DP expected_m emulated, DeepGEMM's small forwards on DeepGEMM): a call with one set
    never reads the result of a call without it."""
    calls: list[dict] = []
    monkeypatch.setattr(engine_runner.subprocess, "run", _fake_engine(calls))
    monkeypatch.setenv(engine_runner.CACHE_ENV, str(tmp_path / "kept"))
    monkeypatch.setenv(engine_runner.LOG_DIR_ENV, str(tmp_path / "logs"))
    for unset in (*engine_runner.ENGINE_SWITCHES, name):
        monkeypatch.delenv(unset, raising=False)
    engine_runner.EngineRunner(tmp_path / "a").run("ll", {"model": "/m"})
    monkeypatch.setenv(name, value)
    engine_runner.EngineRunner(tmp_path / "b").run("ll", {"model": "/m"})
    assert len(calls) == 2
    engine_runner.EngineRunner(tmp_path / "c").run("ll", {"model": "/m"})
    assert len(calls) == 2  # the same value again: kept


def test_every_harness_switch_keys_kept_results_and_every_bench_switch_is_one():
    """A switch the harness reads changes what an engine computes, so a kept result is
    keyed by it (ENGINE_SWITCHES, the harness's SWITCHES: none left out of that tuple); a
    bench configuration may set only switches the harness
    reads, or the package's and vLLM's variables (a misspelt one would measure the
    default under another name)."""
    import bench_engine
    import world1_harness

    read = {
        value
        for name, value in vars(world1_harness).items()
        if name.endswith("_ENV") and name != "REMOVED_ENV"
    }
    assert read and read <= set(engine_runner.ENGINE_SWITCHES), read - set(
        engine_runner.ENGINE_SWITCHES
    )
    for name, (_, env) in bench_engine.CONFIGS.items():
        for var in env:
            assert var in read or not var.startswith("FLASHINFER_EP_TEST_"), (name, var)
