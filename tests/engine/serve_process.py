"""A `vllm serve` process for a test or benchmark: started, waited for, always stopped.

The server runs vLLM's real multi-process layout; its log goes to a file the caller
names (the device suite collects them). It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def serve_command(model: str, port: int, *args: str) -> list[str]:
    """vLLM's console script through this interpreter (the device's PATH need not hold it)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def post(port: int, path: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200
        return json.loads(r.read())


# What a server log says when a round could not run on a handle made at load.
OFF_THE_POOL = ("runs on a per-forward handle", "no warmed flashinfer_ep handle")


def off_the_pool(log_text: str) -> list[str]:
    """The server log's lines that say a round ran off the handles made at load."""
    return [line.strip() for line in log_text.splitlines() if any(m in line for m in OFF_THE_POOL)]


class ServerError(RuntimeError):
    """The server exited or did not come up; the message ends with its log's tail."""


@contextmanager
def served(
    command: list[str], env: dict[str, str], log_path: Path, port: int, startup_s: float = 480
) -> Iterator[subprocess.Popen]:
    """Start `command`, wait until /health answers, yield the process; stop its whole
    process group on the way out (SIGTERM, then SIGKILL).

    A server that already answers on `port` (one a killed call left behind) is refused
    before anything starts: its answers would be counted as this server's. While waiting,
    our process must still be running for /health to count."""
    if healthy(port):
        raise ServerError(
            f"a server already answers on 127.0.0.1:{port} (left by an earlier run?); stop "
            "it or pick another port"
        )
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + startup_s
            while proc.poll() is None and not healthy(port):
                if time.monotonic() > deadline:
                    break
                time.sleep(2)
            if proc.poll() is not None or not healthy(port):
                why = "exited" if proc.poll() is not None else f"not up in {startup_s} s"
                tail = Path(log_path).read_text(errors="replace")[-4000:]
                raise ServerError(f"vllm serve {why}; log tail:\n{tail}")
            yield proc
        finally:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
