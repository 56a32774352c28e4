"""Config, list, data-dir and CLI errors are caught early with messages naming the cause."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from vllm_flashinfer_ep.evals import cli
from vllm_flashinfer_ep.evals.config import ConfigError, load_config, load_config_list
from vllm_flashinfer_ep.evals.gsm8k import DataDirError, Status, judge, validate_data_dir

VALID = {
    "model_name": "org/model",
    "accuracy_threshold": 0.8,
    "num_questions": 10,
    "num_fewshot": 5,
    "server_args": "--data-parallel-size 2 --enable-expert-parallel --all2all-backend flashinfer_ep_low_latency",
    "env": {"A": "1", "B": 2, "C": True},
}


def _write(tmp_path: Path, data: object, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_valid_config_fields(tmp_path: Path) -> None:
    c = load_config(_write(tmp_path, VALID))
    assert (c.name, c.data_parallel_size, c.gpus_needed, c.all2all_backend) == (
        "c",
        2,
        2,
        "flashinfer_ep_low_latency",
    )
    assert c.env == {"A": "1", "B": "2", "C": "1"}
    assert c.pass_bound == pytest.approx(0.8 - 0.08)  # vLLM's default tolerance
    assert (c.max_tokens, c.seed, c.startup_max_wait_seconds) == (256, 42, 1200.0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_question": 5}, "unknown key(s) num_question; known keys: model_name"),
        ({"model_name": None}, "'model_name' must be str, got NoneType"),
        ({"num_questions": "10"}, "'num_questions' must be int, got str"),
        ({"num_questions": True}, "'num_questions' must be int, got bool"),
        ({"num_questions": 0}, "'num_questions' must be > 0"),
        ({"num_fewshot": -1}, "'num_fewshot' must be >= 0"),
        ({"accuracy_threshold": 88}, "'accuracy_threshold' must be in (0, 1]"),
        ({"tolerance": 0.9}, "'tolerance' must be in [0, accuracy_threshold)"),
        ({"server_args": ["--a"]}, "'server_args' must be str, got list"),
        ({"server_args": "--x 'unclosed"}, "'server_args' is not valid shell syntax"),
        ({"server_args": "--port 9000"}, "must not set --port; the runner sets it"),
        ({"server_args": "--host=0.0.0.0"}, "must not set --host"),
        ({"env": {"A": [1]}}, "'env' must map names to scalar values; bad entry 'A'"),
        ({"use_chat_completions": True}, "'use_chat_completions: true' is not supported"),
        ({"startup_max_wait_seconds": 0}, "'startup_max_wait_seconds' must be > 0"),
        (
            {"server_args": "--all2all-backend flashinfer_ep_bogus"},
            "'flashinfer_ep_bogus' in 'server_args' is not a known backend; known: naive",
        ),
        (
            {"env": {"VLLM_FLASHINFER_EP_FT_TIMEOUT_MS": "20s"}},
            "'env': VLLM_FLASHINFER_EP_FT_TIMEOUT_MS='20s' is not valid: accepted values are an integer number of milliseconds from 1 to 3600000 (one hour)",
        ),
        (
            {"env": {"VLLM_FLASHINFER_EP_TRANSPORT": "nvshmem"}},
            "'env': VLLM_FLASHINFER_EP_TRANSPORT='nvshmem' is not valid: accepted values are nccl_ep or nixl_ep",
        ),
        (
            {"env": {"VLLM_FLASHINFER_EP_HANDLEPOOL": "0"}},
            "VLLM_FLASHINFER_EP_HANDLEPOOL is not a vllm-flashinfer-ep variable",
        ),
    ],
)
def test_bad_values_are_named(tmp_path: Path, change: dict, message: str) -> None:
    path = _write(tmp_path, {**VALID, **change})
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


@pytest.mark.parametrize(
    "key", ["model_name", "accuracy_threshold", "num_questions", "num_fewshot"]
)
def test_missing_required_key(tmp_path: Path, key: str) -> None:
    data = {k: v for k, v in VALID.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing required key\\(s\\) {key}"):
        load_config(_write(tmp_path, data))


@pytest.mark.parametrize(
    ("text", "message"),
    [("- a\n- b\n", "expected a mapping of config keys, got list"), ("a: [1\n", "not valid YAML")],
)
def test_not_a_mapping_or_not_yaml(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_list_file_resolves_relative_and_reports_bad_lines(tmp_path: Path) -> None:
    _write(tmp_path, VALID, "a.yaml")
    good = tmp_path / "ok.txt"
    good.write_text("# comment\n\na.yaml  # trailing comment\n")
    assert load_config_list(good) == [tmp_path / "a.yaml"]
    bad = tmp_path / "bad.txt"
    bad.write_text("a.yaml\nmissing.yaml\n")
    with pytest.raises(
        ConfigError, match=r"bad.txt:2: listed config 'missing.yaml' does not exist"
    ):
        load_config_list(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no configs"):
        load_config_list(empty)


def _data_dir(tmp_path: Path, train: str | None, test: str | None) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    for name, text in (("train.jsonl", train), ("test.jsonl", test)):
        if text is not None:
            (d / name).write_text(text)
    return d


GOOD_LINE = json.dumps({"question": "q", "answer": "a\n#### 3"}) + "\n"


@pytest.mark.parametrize(
    ("train", "test", "message"),
    [
        (GOOD_LINE, None, "missing test.jsonl"),
        ("not json\n", GOOD_LINE, "first line is not JSON"),
        (json.dumps({"q": 1}) + "\n", GOOD_LINE, "need 'question' and 'answer'"),
        (GOOD_LINE, json.dumps({"question": "q", "answer": "3"}) + "\n", "'#### <number>'"),
    ],
)
def test_data_dir_errors(tmp_path: Path, train: str | None, test: str | None, message: str) -> None:
    with pytest.raises(DataDirError, match=message):
        validate_data_dir(_data_dir(tmp_path, train, test))


def _cli_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_bad_config_exits_2_with_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, {**VALID, "num_fewshots": 5})
    args = _cli_args(["eval", "gsm8k", "--config", str(path)])
    assert args.func(args) == 2
    assert "unknown key(s) num_fewshots" in capsys.readouterr().err


def test_cli_bad_limit_and_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, VALID)
    args = _cli_args(["eval", "gsm8k", "--config", str(path), "--limit", "0"])
    assert args.func(args) == 2 and "--limit must be > 0" in capsys.readouterr().err
    args = _cli_args(["eval", "gsm8k", "--config", str(path), "--data-dir", str(tmp_path)])
    assert args.func(args) == 2 and "missing train.jsonl" in capsys.readouterr().err


def test_cli_dry_run_prints_env_and_exact_command(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = _write(tmp_path, VALID)
    args = _cli_args(["eval", "gsm8k", "--config", str(path), "--port", "8011", "--dry-run"])
    assert args.func(args) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(
        "A=1 B=2 C=1 VLLM_ENGINE_READY_TIMEOUT_S=1200 VLLM_WORKER_MULTIPROC_METHOD=spawn "
    )
    assert out.endswith(
        "vllm serve org/model --data-parallel-size 2 --enable-expert-parallel --all2all-backend flashinfer_ep_low_latency"
        " --trust-remote-code --disable-uvicorn-access-log --host 127.0.0.1 --port 8011"
    )


def test_cli_requires_eval_name_and_config() -> None:
    with pytest.raises(SystemExit):
        _cli_args(["eval"])
    with pytest.raises(SystemExit):
        _cli_args(["eval", "gsm8k"])


@pytest.mark.parametrize(
    ("strict", "flexible", "status"),
    [
        (0.80, 0.80, Status.PASSED),  # exactly at the bound passes
        (0.79, 0.90, Status.FAILED),
        (0.90, 0.79, Status.FAILED),
    ],
)
def test_judge_uses_threshold_minus_tolerance(
    tmp_path: Path, strict: float, flexible: float, status: Status
) -> None:
    config = load_config(_write(tmp_path, {**VALID, "accuracy_threshold": 0.85, "tolerance": 0.05}))
    got, reason = judge({"strict-match": strict, "flexible-extract": flexible}, config)
    assert got is status, reason
    assert "0.8000" in reason


def test_bad_backend_is_an_error_before_any_gpu_check(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_flashinfer_ep.evals import gsm8k

    monkeypatch.setattr(gsm8k, "unmet_requirement", lambda *a, **k: pytest.fail("GPU check ran"))
    path = _write(tmp_path, {**VALID, "server_args": "--all2all-backend=flashinfer_ep_lowlatency"})
    args = _cli_args(["eval", "gsm8k", "--config", str(path), "--no-gpu-check"])
    assert args.func(args) == 2
    assert (
        "'flashinfer_ep_lowlatency' in 'server_args' is not a known backend"
        in capsys.readouterr().err
    )
