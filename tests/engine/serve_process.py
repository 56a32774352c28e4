"""A `vllm serve` process for a test or benchmark: started, waited for, always stopped.

The server runs vLLM's real multi-process layout; its log goes to a file the caller
names (the device suite collects them). It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers import NO_MULTICAST, forget_group, no_interrupts, remember_group
from vllm_flashinfer_ep.evals.server import ServerProcess, ServerStartError, port_in_use


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
    command: list[str],
    env: dict[str, str],
    log_path: Path,
    port: int,
    startup_s: float = 300,
    grace_s: float = 30,
) -> Iterator[subprocess.Popen]:
    """Start `command`, wait until /health answers, yield the process; stop its whole
    process group on the way out (the package's ServerProcess: SIGTERM, SIGKILL after a
    grace, and SIGKILL to group members that outlive the leader).

    Anything already listening on `port` (a server a killed call left behind) is refused
    before anything starts: its answers would be counted as this server's. The group is
    recorded (tests.helpers.remember_group) until it is stopped."""
    if port_in_use(port):
        raise ServerError(
            f"something already listens on 127.0.0.1:{port} (a server left by an earlier "
            "run?); stop it or pick another port"
        )
    Path(log_path).write_text("")
    server = ServerProcess(
        command,
        {**env, **NO_MULTICAST},
        health_url=f"http://127.0.0.1:{port}/health",
        log_path=Path(log_path),
        grace_s=grace_s,
        name="vllm serve",
    )
    server.start()
    remember_group(server.pid)
    try:
        try:
            server.wait_healthy(startup_s, progress=None)
        except ServerStartError as exc:
            tail = Path(log_path).read_text(errors="replace")[-4000:]
            raise ServerError(f"{exc}; log tail:\n{tail}") from None
        yield server.proc
    finally:
        with no_interrupts():
            server.stop()
            forget_group(server.pid)
