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

from tests.helpers import free_port  # noqa: E402

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
        with pytest.raises(serve_process.ServerError, match="already answers"):
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
        assert serve_process.healthy(port) and proc.poll() is None
    assert proc.poll() is not None
    assert not serve_process.healthy(port)
