"""CPU-checkable parts of the fault-tolerance e2e tests (tests/fault_tolerance/ft_utils.py).

The generated sitecustomize really patches a module at import in a fresh interpreter
and raises on the chosen rank and step only; the per-rank `vllm serve` command lines
parse with vLLM's plugin-enabled parser as external-LB FT ranks; the REST helpers
speak the FT API's shape to a stand-in server within their deadlines.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import parse_serve_args
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import LOW_LATENCY

FT_UTILS = Path(__file__).resolve().parents[1] / "fault_tolerance" / "ft_utils.py"


def _load_ft_utils():
    if "ft_utils" in sys.modules:
        return sys.modules["ft_utils"]
    spec = importlib.util.spec_from_file_location("ft_utils", FT_UTILS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ft_utils"] = module
    spec.loader.exec_module(module)
    return module


ft = _load_ft_utils()

FAKE_MODULE = """
CALLS = []

def sync_cudagraph_and_dp_padding(manager, desc, num_tokens, num_reqs, uniform, dp_size, dp_rank,
                                  max_query_len=None):
    CALLS.append(dp_rank)
    return ("synced", dp_rank)
"""

PROBE = textwrap.dedent(
    """
    import json, sys
    import fakevllm.dp_utils as m
    out = {"patched": getattr(m.sync_cudagraph_and_dp_padding, MARK, False), "events": []}
    for rank, step in [(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2), (1, 3), (1, 4)]:
        try:
            # rank passed by keyword on even steps, positionally on odd ones
            if step % 2:
                r = m.sync_cudagraph_and_dp_padding(None, None, 8, 1, None, 2, rank)
            else:
                r = m.sync_cudagraph_and_dp_padding(None, None, 8, 1, None, dp_size=2, dp_rank=rank)
            out["events"].append([rank, step, "ok", list(r)])
        except RuntimeError as e:
            out["events"].append([rank, step, "raised", str(e)])
    out["calls"] = m.CALLS
    print(json.dumps(out))
    """
)


def _fake_package(root: Path) -> Path:
    pkg = root / "fakevllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "dp_utils.py").write_text(FAKE_MODULE)
    return root


def test_sitecustomize_is_valid_python_naming_the_real_target(tmp_path: Path) -> None:
    path = ft.write_fault_injection_sitecustomize(tmp_path / "site", rank=1, step=50)
    assert path.name == "sitecustomize.py"
    tree = ast.parse(path.read_text())
    consts = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }
    assert consts == {
        "_MODULE": "vllm.v1.worker.gpu.dp_utils",
        "_FUNCTION": "sync_cudagraph_and_dp_padding",
        "_RANK": 1,
        "_STEP": 50,
    }


def test_real_injection_target_still_takes_dp_rank() -> None:
    """The wrapper finds the rank by parameter name; vLLM must still call it dp_rank."""
    module = importlib.import_module(ft.INJECT_MODULE)
    params = inspect.signature(getattr(module, ft.INJECT_FUNCTION)).parameters
    assert "dp_rank" in params and "dp_size" in params


def test_sitecustomize_raises_on_chosen_rank_and_step_only(tmp_path: Path) -> None:
    site = tmp_path / "site"
    ft.write_fault_injection_sitecustomize(
        site, rank=1, step=3, module="fakevllm.dp_utils", function="sync_cudagraph_and_dp_padding"
    )
    root = _fake_package(tmp_path / "pkgs")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{root}"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.replace("MARK", repr(ft.INJECT_MARK))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["patched"] is True
    outcomes = {(rank, step): kind for rank, step, kind, _ in result["events"]}
    assert [k for k, v in outcomes.items() if v == "raised"] == [(1, 3)]
    raised = [e for e in result["events"] if e[2] == "raised"][0]
    assert "dp rank 1, step 3" in raised[3]
    # The original ran on every call, the faulting one included (the DP sync completes).
    assert result["calls"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "[ft-test] injecting fault on dp rank 1 at step 3" in out.stderr


def test_sitecustomize_patches_the_real_vllm_module_at_import(tmp_path: Path) -> None:
    site = tmp_path / "site"
    ft.write_fault_injection_sitecustomize(site, rank=1, step=50)
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_TARGET_DEVICE": "cpu"}
    code = (
        f"import {ft.INJECT_MODULE} as m, inspect; f = m.{ft.INJECT_FUNCTION}; "
        f"print(getattr(f, {ft.INJECT_MARK!r}, False), 'dp_rank' in inspect.signature(f).parameters)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "True"]


def test_sitecustomize_rejects_bad_rank_or_step(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ft.write_fault_injection_sitecustomize(tmp_path, rank=1, step=0)
    with pytest.raises(ValueError):
        ft.write_fault_injection_sitecustomize(tmp_path, rank=-1, step=5)


@pytest.mark.parametrize("has_nixl", [False, True])
def test_ft_backends_follow_vllm_nixl_ep_probe(
    monkeypatch: pytest.MonkeyPatch, has_nixl: bool
) -> None:
    from vllm.utils import import_utils

    monkeypatch.setattr(import_utils, "has_nixl_ep", lambda: has_nixl)
    assert ft.ft_backends() == ([LOW_LATENCY, "nixl_ep"] if has_nixl else [LOW_LATENCY])


@pytest.mark.parametrize("backend", [LOW_LATENCY, "nixl_ep"])
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_command_parses_as_external_lb_ft_rank(backend: str, rank: int) -> None:
    command = ft.build_rank_command(backend, rank, model="org/moe", base_port=8000, rpc_port=29650)
    assert command[:3] == ["vllm", "serve", "org/moe"]
    args = parse_serve_args(command[2:])
    assert args.all2all_backend == backend
    assert (args.data_parallel_size, args.data_parallel_rank) == (2, rank)
    assert args.data_parallel_size_local == 1
    assert args.data_parallel_address == "127.0.0.1" and args.host == "127.0.0.1"
    assert args.data_parallel_rpc_port == 29650
    assert args.port == 8000 + rank
    assert args.api_server_count == 1
    assert args.enable_fault_tolerance is True
    assert args.enable_expert_parallel is True
    assert args.cpu_distributed_timeout_seconds == ft.CPU_DISTRIBUTED_TIMEOUT_S


def test_rank_env(tmp_path: Path) -> None:
    base = {"PYTHONPATH": "/old", "CUDA_VISIBLE_DEVICES": "4,5", "VLLM_TARGET_DEVICE": "cpu"}
    env = ft.build_rank_env(1, base, site_dir=tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert "VLLM_TARGET_DEVICE" not in env  # ranks run on GPUs
    assert env["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/old"
    assert env[envs.FT_TIMEOUT_MS] == str(ft.TRANSPORT_TIMEOUT_MS)
    assert ft.TRANSPORT_TIMEOUT_MS / 1000 < ft.FAULT_DETECTION_DEADLINE_S
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert ft.build_rank_env(0, {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert "PYTHONPATH" not in ft.build_rank_env(0, {})
    with pytest.raises(ValueError, match="no GPU"):
        ft.build_rank_env(2, base)


class _FakeFT(BaseHTTPRequestHandler):
    """FT status goes unhealthy after `flip_at`; /apply records bodies and answers 202."""

    flip_at = 0.0
    applied: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        status = "unhealthy" if time.monotonic() >= self.flip_at else "healthy"
        engine = {"id": 0, "status": status}
        if status == "unhealthy":
            engine["fault_info"] = {"type": "RuntimeError"}
        self._send(200, {"schema_version": 1, "total_engines": 1, "engines": [engine]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/fault_tolerance/apply" or body.get("instruction") != "retry":
            self._send(400, {"error": "bad"})
            return
        _FakeFT.applied.append(body)
        self._send(202, {"message": "accepted", "request_id": "r-1"})


@pytest.fixture()
def fake_ft_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeFT)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_status_wait_sees_transition_and_respects_deadline(fake_ft_port: int) -> None:
    _FakeFT.flip_at = time.monotonic() + 0.5
    found = ft.wait_for_engine_status([fake_ft_port], "status", {"unhealthy"}, 10, poll_s=0.1)
    assert found[0] is not None and found[0]["fault_info"]
    started = time.monotonic()
    _FakeFT.flip_at = time.monotonic() + 60
    dead_port = fake_ft_port + 1 if fake_ft_port < 65535 else fake_ft_port - 1
    got = ft.wait_for_engine_status([fake_ft_port, dead_port], "status", {"unhealthy"}, 0.6, 0.1)
    assert got == [None, None]
    assert time.monotonic() - started < 5


def test_apply_ft_posts_retry_and_returns_202(fake_ft_port: int) -> None:
    _FakeFT.applied.clear()
    code, body = ft.apply_ft(fake_ft_port, "retry")
    assert (code, body["request_id"]) == (202, "r-1")
    assert _FakeFT.applied == [{"instruction": "retry", "params": {}}]
    code, _ = ft.apply_ft(fake_ft_port, "pause")
    assert code == 400


def test_find_worker_pids_matches_vllm_worker_titles(tmp_path: Path) -> None:
    # parent -> child titled like a vLLM worker, plus an unrelated child
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "VLLM::Worker_DP1_EP1"])
        b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "VLLM::EngineCore_DP1"])
        print(a.pid, b.pid, flush=True)
        time.sleep(30)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        worker, other = map(int, parent.stdout.readline().split())  # type: ignore[union-attr]
        assert ft.find_worker_pids(parent.pid) == [worker]
        assert other not in ft.find_worker_pids(parent.pid)
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(timeout=10)


FAKE_RANK_SERVER = textwrap.dedent(
    """
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    with open(os.path.join(os.environ["FAKE_OUT"], f"{port}.json"), "w") as fh:
        json.dump({"argv": argv, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "pid": os.getpid(), "pythonpath": os.environ.get("PYTHONPATH")}, fh)

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _two_free_ports() -> int:
    import random
    import socket

    for _ in range(200):
        base = random.randint(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            return base
        except OSError:
            continue
    pytest.skip("no two consecutive free ports found")


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(")")[-1].split()[0] != "Z"


def test_cluster_starts_every_rank_and_tears_all_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fake_rank.py"
    fake.write_text(FAKE_RANK_SERVER)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = _two_free_ports()
    cluster = ft.ExternalLBCluster(
        LOW_LATENCY,
        tmp_path / "logs",
        site_dir=tmp_path / "site",
        model="org/moe",
        base_port=base,
        vllm_executable=(sys.executable, str(fake)),
        grace_s=5,
    )
    with cluster:
        assert cluster.ports == [base, base + 1]
        seen = [json.loads((out / f"{p}.json").read_text()) for p in cluster.ports]
        for rank, info in enumerate(seen):
            assert (
                info["argv"]
                == ft.build_rank_command(LOW_LATENCY, rank, model="org/moe", base_port=base)[1:]
            )
            assert info["cuda"] == str(rank)
            assert info["pythonpath"].split(os.pathsep)[0] == str(tmp_path / "site")
        assert all(_pid_alive(info["pid"]) for info in seen)
        # A second cluster on the same ports is refused before anything starts.
        with pytest.raises(RuntimeError, match="are taken"):
            ft.ExternalLBCluster(LOW_LATENCY, tmp_path / "logs2", base_port=base).__enter__()
    deadline = time.monotonic() + 10
    while any(_pid_alive(info["pid"]) for info in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_pid_alive(info["pid"]) for info in seen)
    assert (tmp_path / "logs" / "rank0.log").exists() and (tmp_path / "logs" / "rank1.log").exists()
