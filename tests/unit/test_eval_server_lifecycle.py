"""The runner always stops the server it started, and the offline eval runs end to end.

A small stdlib HTTP server stands in for `vllm serve`: it answers /health and
/v1/completions (gsm8k answers looked up from the local test file, right or wrong on
request), can ignore SIGTERM, fork a child that ignores it too, or die at start. lm-eval
runs for real (its CLI, `local-completions` over HTTP, the offline task from --data-dir).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import default_sigint, free_port
from vllm_flashinfer_ep.evals.config import load_config
from vllm_flashinfer_ep.evals.gsm8k import RunOptions, Status, run_eval
from vllm_flashinfer_ep.evals.server import ServerProcess

FAKE_SERVER = textwrap.dedent(
    '''
    """Stand-in for `vllm serve`: argv `serve MODEL ... --port P`; behaviour from env."""
    import json, os, re, signal, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    if os.environ.get("FAKE_RECORD"):
        with open(os.environ["FAKE_RECORD"], "w") as fh:
            env = {k: v for k, v in os.environ.items() if k.startswith(("VLLM", "FAKE_CFG", "HF_"))}
            json.dump({"argv": argv, "env": env}, fh)
    if os.environ.get("FAKE_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.fork() == 0:  # a grandchild that also ignores SIGTERM (like a worker)
            while True:
                time.sleep(1)
    if os.environ.get("FAKE_PIDS"):
        with open(os.environ["FAKE_PIDS"], "a") as fh:
            fh.write(f"{os.getpid()}\\n")
    if os.environ.get("FAKE_EXIT"):
        sys.exit(int(os.environ["FAKE_EXIT"]))
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0")))

    answers = {}
    if os.environ.get("FAKE_GSM8K_TEST"):
        for line in open(os.environ["FAKE_GSM8K_TEST"]):
            rec = json.loads(line)
            answers[rec["question"]] = rec["answer"]
    wrong = os.environ.get("FAKE_WRONG") == "1"

    def reply(prompt):
        question = prompt.rsplit("Question: ", 1)[-1].rsplit("\\nAnswer:", 1)[0]
        solution = answers[question]
        if wrong:
            number = int(solution.rsplit("#### ", 1)[1].replace(",", ""))
            solution = solution.rsplit("#### ", 1)[0] + f"#### {number + 1}"
        return " " + solution + "\\n\\n"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or body.get("model") != os.environ["FAKE_MODEL"]:
                self._send(404, {"error": self.path})
                return
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
            choices = [{"index": i, "text": reply(p)} for i, p in enumerate(prompts)]
            self._send(200, {"choices": choices})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    '''
)

QUESTIONS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", 3 + 4),
    ("A box holds 12 pens. How many pens are in 5 boxes?", 12 * 5),
    ("Sara had 50 dollars and spent 18. How much is left?", 50 - 18),
    ("There are 7 days in a week. How many days are in 9 weeks?", 7 * 9),
    ("A train travels 60 miles per hour for 3 hours. How far does it go?", 60 * 3),
    ("Ben reads 15 pages a day. How many pages does he read in 4 days?", 15 * 4),
]


def _write_gsm8k(dir_: Path) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", QUESTIONS[:3]), ("test", QUESTIONS[3:])):
        with (dir_ / f"{split}.jsonl").open("w") as fh:
            for q, n in rows:
                fh.write(json.dumps({"question": q, "answer": f"Work it out.\n#### {n}"}) + "\n")
    return dir_


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().split(")")[-1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.fixture()
def fake_server(tmp_path: Path) -> Path:
    path = tmp_path / "fake_vllm.py"
    path.write_text(FAKE_SERVER)
    return path


@pytest.fixture()
def gsm8k_dir(tmp_path: Path) -> Path:
    return _write_gsm8k(tmp_path / "gsm8k")


def _config(tmp_path: Path, **extra: object) -> Path:
    cfg = {
        "model_name": "tiny/model",
        "accuracy_threshold": 0.9,
        "tolerance": 0.1,
        "num_questions": 3,
        "num_fewshot": 2,
        "max_tokens": 64,
        "startup_max_wait_seconds": 30,
        "server_args": "--data-parallel-size 1 --all2all-backend allgather_reducescatter",
        "env": {"FAKE_CFG_MARK": "from-config"},
        **extra,
    }
    path = tmp_path / "cfg.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    return path


def _options(fake: Path, port: int, tmp_path: Path, **kw: object) -> RunOptions:
    return RunOptions(
        port=port,
        output=tmp_path / "result.json",
        vllm_executable=(sys.executable, str(fake)),
        check_gpus=False,
        grace_s=2.0,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("wrong", [False, True], ids=["right-answers", "wrong-answers"])
def test_offline_eval_end_to_end(
    tmp_path: Path, fake_server: Path, gsm8k_dir: Path, monkeypatch: pytest.MonkeyPatch, wrong: bool
) -> None:
    port = free_port()
    record = tmp_path / "record.json"
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("FAKE_GSM8K_TEST", str(gsm8k_dir / "test.jsonl"))
    monkeypatch.setenv("FAKE_MODEL", "tiny/model")
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    monkeypatch.setenv("FAKE_WRONG", "1" if wrong else "0")
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)

    config = load_config(_config(tmp_path))
    result = run_eval(config, _options(fake_server, port, tmp_path, data_dir=gsm8k_dir))

    assert result.reason and result.task == "gsm8k_local_jsonl"
    # Offline only while the run lasted (the server saw it), restored afterwards.
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ
    expected = 0.0 if wrong else 1.0
    assert result.scores == {"strict-match": expected, "flexible-extract": expected}
    assert result.num_questions_scored == 3
    assert result.status is (Status.FAILED if wrong else Status.PASSED), result.reason
    # The server got the exact command and the config's env.
    seen = json.loads(record.read_text())
    assert seen["argv"] == result.serve_command[2:]
    assert seen["argv"][:2] == ["serve", "tiny/model"]
    assert seen["argv"][-2:] == ["--port", str(port)]
    assert seen["env"]["FAKE_CFG_MARK"] == "from-config"
    assert seen["env"]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert seen["env"]["HF_HUB_OFFLINE"] == "1" and seen["env"]["HF_DATASETS_OFFLINE"] == "1"
    # Torn down, and the record on disk says the same as the returned result.
    assert not any(_alive(int(p)) for p in pids.read_text().split())
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk["status"] == result.status.value
    assert on_disk["scores"] == result.scores


def test_limit_overrides_num_questions(
    tmp_path: Path, fake_server: Path, gsm8k_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_GSM8K_TEST", str(gsm8k_dir / "test.jsonl"))
    monkeypatch.setenv("FAKE_MODEL", "tiny/model")
    config = load_config(_config(tmp_path))
    result = run_eval(
        config, _options(fake_server, free_port(), tmp_path, data_dir=gsm8k_dir, limit=1)
    )
    assert result.num_questions_scored == 1 and result.limit == 1
    assert result.status is Status.PASSED, result.reason


def test_server_that_dies_at_start_is_an_error_with_exit_code(
    tmp_path: Path, fake_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_EXIT", "7")
    config = load_config(_config(tmp_path))
    result = run_eval(config, _options(fake_server, free_port(), tmp_path))
    assert result.status is Status.ERROR
    assert "exited with code 7" in result.reason
    assert result.server_exit_code == 7
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "error"


def test_health_timeout_is_an_error_and_server_is_stopped(
    tmp_path: Path, fake_server: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids.txt"
    monkeypatch.setenv("FAKE_STARTUP_S", "60")
    monkeypatch.setenv("FAKE_PIDS", str(pids))
    config = load_config(_config(tmp_path, startup_max_wait_seconds=2))
    started = time.monotonic()
    result = run_eval(config, _options(fake_server, free_port(), tmp_path))
    assert time.monotonic() - started < 20
    assert result.status is Status.ERROR and "not healthy" in result.reason
    assert not any(_alive(int(p)) for p in pids.read_text().split())


def test_busy_port_is_refused_before_starting(tmp_path: Path, fake_server: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_eval(load_config(_config(tmp_path)), _options(fake_server, port, tmp_path))
    assert result.status is Status.ERROR and "already in use" in result.reason
    assert result.server_exit_code is None  # nothing was started


def _start_fake(fake: Path, port: int, env: dict[str, str], grace_s: float = 1.0) -> ServerProcess:
    server = ServerProcess(
        [sys.executable, str(fake), "serve", "m", "--port", str(port)],
        {**os.environ, **env},
        health_url=f"http://127.0.0.1:{port}/health",
        grace_s=grace_s,
        name="fake",
    )
    server.start()
    server.wait_healthy(30, progress=None)
    return server


def test_sigterm_ignoring_group_is_killed(tmp_path: Path, fake_server: Path) -> None:
    server = _start_fake(fake_server, free_port(), {"FAKE_IGNORE_SIGTERM": "1"})
    pgid = server.pid
    assert pgid is not None
    deadline = time.monotonic() + 10
    while len(_group_pids(pgid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    members = _group_pids(pgid)
    assert len(members) == 2, members  # server + its forked child
    started = time.monotonic()
    code = server.stop()
    assert code == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - started < 15  # waited the grace period, then killed
    deadline = time.monotonic() + 5
    while _group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_pids(pgid) == []
    assert server.stop() == code  # idempotent


def test_exception_inside_context_still_stops_server(tmp_path: Path, fake_server: Path) -> None:
    port = free_port()
    holder: list[ServerProcess] = []
    with pytest.raises(RuntimeError, match="boom"):
        with ServerProcess(
            [sys.executable, str(fake_server), "serve", "m", "--port", str(port)],
            health_url=f"http://127.0.0.1:{port}/health",
            grace_s=5,
        ) as server:
            holder.append(server)
            server.wait_healthy(30, progress=None)
            raise RuntimeError("boom")
    assert holder[0].proc is not None and holder[0].proc.poll() == -signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_of_the_cli_stops_server(
    tmp_path: Path, fake_server: Path, gsm8k_dir: Path, sig: signal.Signals
) -> None:
    """SIGINT/SIGTERM to a real `python -m vllm_flashinfer_ep.evals` run: server gone, 130."""
    port = free_port()
    pids = tmp_path / "pids.txt"
    exe = tmp_path / "bin"
    exe.mkdir()
    # The CLI runs `vllm serve ...`; put a `vllm` on PATH that is the fake server.
    (exe / "vllm").write_text(f'#!/bin/sh\nexec {sys.executable} {fake_server} "$@"\n')
    (exe / "vllm").chmod(0o755)
    cfg = _config(tmp_path, startup_max_wait_seconds=120)
    env = {
        **os.environ,
        "PATH": f"{exe}{os.pathsep}{os.environ['PATH']}",
        "FAKE_PIDS": str(pids),
        "FAKE_STARTUP_S": "120",  # never healthy: the run is still waiting when we interrupt
        "VLLM_TARGET_DEVICE": "cpu",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_flashinfer_ep.evals",
            "gsm8k",
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--output",
            str(tmp_path / "out.json"),
            "--grace-seconds",
            "5",
            "--no-gpu-check",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,  # Ctrl-C reaches it even where the suite ignores SIGINT
    )
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not (pids.exists() and any("waiting for" in line for line in err_lines)):
        assert time.monotonic() < deadline, "".join(err_lines)
        assert proc.poll() is None, "".join(err_lines)
        time.sleep(0.2)
    server_pid = int(pids.read_text().split()[0])
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 130
    reader.join(timeout=5)
    assert not _alive(server_pid)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["status"] == "error" and out["reason"] == "interrupted"
    assert "--port" in out["serve_command"]


def test_vllm_executable_prefers_path_then_interpreter_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_flashinfer_ep.evals.gsm8k import default_vllm_executable

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    beside = Path(sys.executable).parent / "vllm"
    assert default_vllm_executable() == ((str(beside),) if beside.is_file() else ("vllm",))
    (empty / "vllm").write_text("#!/bin/sh\n")
    (empty / "vllm").chmod(0o755)
    assert default_vllm_executable() == ("vllm",)
