"""The serving benchmark (tests/engine/serve_bench.py): commands vLLM 0.33.0's own parsers
accept, the figures kept from vLLM's result JSON, and what makes a run not count."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import serve_bench  # noqa: E402


def _vllm_parser(which: str):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    if which == "bench":
        from vllm.benchmarks.serve import add_cli_args
    else:
        from vllm.entrypoints.common.cli_args import make_arg_parser as add_cli_args
    add_cli_args(parser)
    return parser


def test_vllm_bench_serve_accepts_the_command():
    args = argparse.Namespace(input_len=256, output_len=64)
    cmd = serve_bench.bench_command("/m", 8765, 32, 384, args, Path("/tmp/r/x.json"))
    assert cmd[2:5] == ["vllm.entrypoints.cli.main", "bench", "serve"]
    parsed = _vllm_parser("bench").parse_args(cmd[5:])
    assert (parsed.max_concurrency, parsed.num_prompts, parsed.dataset_name) == (32, 384, "random")
    assert (parsed.random_input_len, parsed.random_output_len, parsed.ignore_eos) == (256, 64, True)
    assert parsed.save_result and parsed.result_filename == "x.json"


@pytest.mark.parametrize("config", ["ll", "no_ep"])
def test_vllm_serve_accepts_the_command(config):
    cmd = serve_bench.serve_command(config, "/m", 8765, "qwen3-30b-a3b", 256)
    assert cmd[2:4] == ["vllm.entrypoints.cli.main", "serve"]
    parsed = _vllm_parser("serve").parse_args(cmd[5:])
    assert parsed.load_format == "dummy"
    assert parsed.max_num_batched_tokens == 256  # the same budget for LL and no EP
    assert (parsed.all2all_backend == serve_bench.LL) == (config == "ll")
    assert parsed.enable_expert_parallel == (config == "ll")


def _row(failed=0, completed=64, prompts=64, tput=100.0):
    return {
        "completed": completed,
        "failed": failed,
        "num_prompts": prompts,
        "output_throughput": tput,
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "median_tpot_ms": 5.0,
        "p99_tpot_ms": 6.0,
    }


def test_a_run_counts_only_with_every_request_served_on_handles_made_at_load():
    assert serve_bench.problems({"1": _row()}, "INFO all fine\n") == []
    assert "1 of 64 requests failed" in serve_bench.problems({"1": _row(failed=1)}, "")[0]
    assert serve_bench.problems({"8": _row(completed=63)}, "")  # one missing
    log = "INFO flashinfer_ep: a round of 300 tokens runs on a per-forward handle: ...\n"
    assert serve_bench.problems({"1": _row()}, log) == [f"server log: {log.strip()}"]


def test_kept_figures_and_the_table():
    result = _row() | {"itl": [1, 2], "errors": [""]}
    assert serve_bench.keep(result) == _row()
    text = serve_bench.table({"rows": {"1": _row(tput=200.0)}}, {"rows": {"1": _row(tput=150.0)}})
    assert "| 1 | 64 | 200 | 150 | 0.75 | 10.0 / 20.0 |" in text


def test_either_a_config_or_a_table():
    with pytest.raises(SystemExit):
        serve_bench.main(["--config", "ll"])


def _stand_ins(monkeypatch, results: dict, seen_env: list, server_exits_at: int | None = None):
    """A server that is always up (unless it exits after `server_exits_at` benches) and a
    `vllm bench serve` that writes vLLM's result JSON with `results`."""
    import contextlib
    import json as json_

    class Proc:
        benches = 0

        def poll(self):
            if server_exits_at is not None and Proc.benches >= server_exits_at:
                return 1
            return None

    @contextlib.contextmanager
    def served(command, env, log_path, port, startup_s):
        Path(log_path).write_text("INFO ready\n")
        yield Proc()

    def bench(cmd, env, check, timeout):
        seen_env.append(env)
        Proc.benches += 1
        folder = cmd[cmd.index("--result-dir") + 1]
        name = cmd[cmd.index("--result-filename") + 1]
        (Path(folder) / name).write_text(json_.dumps(results))
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(serve_bench.serve_process, "served", served)
    monkeypatch.setattr(serve_bench.subprocess, "run", bench)


def test_a_run_writes_every_concurrency_with_the_caller_s_environment(
    tmp_path, monkeypatch, capsys
):
    """The whole run on stand-ins: the client gets the caller's environment (vLLM's path
    on the device is PYTHONPATH), the JSON holds each concurrency and the step budget."""
    import json as json_
    import os

    seen: list = []
    _stand_ins(monkeypatch, _row(prompts=64) | {"num_prompts": 64}, seen)
    monkeypatch.setenv("PYTHONPATH", "/where/vllm/lives")
    monkeypatch.setattr(serve_bench, "PROMPTS", {1: 64, 8: 64})
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(serve_bench.tempfile, "tempdir", str(scratch))
    out = tmp_path / "ll.json"
    rc = serve_bench.main(
        ["--config", "ll", "--shape", "tiny", "--concurrency", "1,8", "--out", str(out)]
    )
    assert rc == 0, capsys.readouterr().out
    assert list(scratch.iterdir()) == []  # the 0.5 GB tiny model is not left behind
    doc = json_.loads(out.read_text())
    assert list(doc["rows"]) == ["1", "8"] and doc["max_num_batched_tokens"] == 256
    assert all(env["PYTHONPATH"] == os.environ["PYTHONPATH"] for env in seen)


def test_a_server_that_dies_mid_run_is_a_problem(tmp_path, monkeypatch, capsys):
    seen: list = []
    _stand_ins(monkeypatch, _row(), seen, server_exits_at=1)
    rc = serve_bench.main(
        [
            "--config",
            "no_ep",
            "--shape",
            "tiny",
            "--concurrency",
            "1,8",
            "--out",
            str(tmp_path / "x"),
        ]
    )
    assert rc == 1
    assert "PROBLEM the server exited during concurrency 1" in capsys.readouterr().out
