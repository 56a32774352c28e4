"""The `vllm serve` process helper (tests/engine/serve_process.py) with stand-in servers:
what the serving benchmark and the serve tests count as their server, and that it stops."""

from __future__ import annotations

import http.server
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import serve_process  # noqa: E402

from tests.helpers import default_sigint, free_port  # noqa: E402
from vllm_flashinfer_ep.evals.server import http_ok  # noqa: E402

# A stand-in for `vllm serve`: answers /health on the port it is given.
HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_server_already_on_the_port_is_refused_before_starting(tmp_path):
    port = free_port()
    other = http.server.HTTPServer(("127.0.0.1", port), _Health)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    try:
        with pytest.raises(serve_process.ServerError, match="already listens"):
            with serve_process.served(command, dict(os.environ), tmp_path / "log", port, 5):
                pytest.fail("yielded a server that is not ours")
    finally:
        other.shutdown()
    time.sleep(0.2)
    assert not marker.exists()  # nothing was started


def test_a_server_that_exits_is_an_error_with_its_log(tmp_path):
    command = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    start = time.monotonic()
    with pytest.raises(serve_process.ServerError, match="exited") as info:
        with serve_process.served(command, dict(os.environ), tmp_path / "log", free_port(), 60):
            pytest.fail("yielded a server that exited")
    assert "boom" in str(info.value)
    assert time.monotonic() - start < 30  # not the whole start-up timeout


def test_a_healthy_server_is_yielded_and_stopped(tmp_path):
    port = free_port()
    command = [sys.executable, "-c", HEALTH_SERVER, str(port)]
    with serve_process.served(command, dict(os.environ), tmp_path / "log", port, 60) as proc:
        assert http_ok(f"http://127.0.0.1:{port}/health") and proc.poll() is None
    assert proc.poll() is not None
    assert not http_ok(f"http://127.0.0.1:{port}/health")


# A stand-in whose child ignores SIGTERM and outlives the leader (an engine core stuck in a
# collective): it writes the child's pid, then serves /health.
STUBBORN_CHILD = (
    """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
"""
    + HEALTH_SERVER
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose: its GPU memory and ports are released
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def test_the_whole_group_is_stopped_and_forgotten(tmp_path, monkeypatch):
    groups = tmp_path / "groups"
    monkeypatch.setenv("FLASHINFER_EP_TEST_SERVER_GROUPS", str(groups))
    port, pidfile = free_port(), tmp_path / "child.pid"
    command = [sys.executable, "-c", STUBBORN_CHILD, str(port), str(pidfile)]
    log = tmp_path / "log"
    with serve_process.served(command, dict(os.environ), log, port, 60, grace_s=2) as proc:
        assert groups.read_text().split() == [str(proc.pid)]  # recorded while it runs
        child = int(pidfile.read_text())
        assert _alive(child)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "a group member outlived the server"
    assert groups.read_text().split() == []  # forgotten once stopped


def test_a_second_interrupt_does_not_cut_the_teardown_short(tmp_path):
    """`timeout -s INT` signals pytest, then its process group: the second SIGINT lands in
    the teardown. The server group must still be stopped (a stand-in pytest here)."""
    import subprocess

    port, pidfile = free_port(), tmp_path / "child.pid"
    script = f"""
import os, signal, sys, time, threading
sys.path.insert(0, {str(Path(serve_process.__file__).parent)!r})
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
import serve_process
from vllm_flashinfer_ep.evals import server as evals_server
real_stop = evals_server.ServerProcess.stop
def slow_stop(self):  # a second SIGINT arrives while the group is being stopped
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    return real_stop(self)
evals_server.ServerProcess.stop = slow_stop
cmd = [sys.executable, "-c", {STUBBORN_CHILD!r}, "{port}", {str(pidfile)!r}]
try:
    log = {str(tmp_path / "log")!r}
    with serve_process.served(cmd, dict(os.environ), log, {port}, 60, grace_s=2):
        os.kill(os.getpid(), signal.SIGINT)  # the first one
        time.sleep(30)
except KeyboardInterrupt:
    print("interrupted")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=default_sigint,  # its SIGINTs count even where the suite ignores SIGINT
    )
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "interrupted" in done.stdout, done.stderr[-2000:]
    assert not _alive(child), "the server group outlived an interrupted teardown"
