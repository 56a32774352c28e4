"""Lifecycle of one server process: start, wait for /health, always tear down. `vllm serve`
spawns engine cores and workers, so teardown signals its whole process group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, TextIO

LOOPBACK = "127.0.0.1"
DEFAULT_GRACE_S = 30.0
_POLL_S = 0.5


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True if something already listens there (its /health would fool the wait)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


@contextlib.contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Let `kill <runner>` unwind like Ctrl-C, so teardown code runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message says which."""


def http_ok(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (loopback)
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class ServerProcess:
    """A server command in its own process group, usable as a context manager."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        health_url: str,
        log_path: Path | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        name: str = "server",
    ) -> None:
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.health_url, self.log_path = health_url, log_path
        self.grace_s, self.name = grace_s, name
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        stdout: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
            stdout = self._log
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout is not None else None,
            start_new_session=True,  # own process group: teardown reaches every child
        )

    def wait_healthy(
        self,
        timeout_s: float,
        progress: TextIO | None = sys.stderr,
        progress_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> float:
        """Poll the health URL until 200; return the seconds it took."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        start = clock()
        next_report = start
        while True:
            elapsed = clock() - start
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {code} after {elapsed:.0f}s before "
                    f"{self.health_url} answered{self._log_hint()}"
                )
            if http_ok(self.health_url, timeout_s=min(5.0, max(timeout_s - elapsed, 0.1))):
                if progress is not None:
                    print(f"[{self.name}] healthy after {elapsed:.0f}s", file=progress, flush=True)
                return elapsed
            if elapsed >= timeout_s:
                raise ServerStartError(
                    f"{self.name} not healthy at {self.health_url} within {timeout_s:.0f}s"
                    f"{self._log_hint()}"
                )
            if progress is not None and clock() >= next_report:
                print(
                    f"[{self.name}] waiting for {self.health_url}: {elapsed:.0f}s / "
                    f"{timeout_s:.0f}s",
                    file=progress,
                    flush=True,
                )
                next_report = clock() + progress_every_s
            time.sleep(_POLL_S)

    def _log_hint(self) -> str:
        return f"; see {self.log_path}" if self.log_path is not None else ""

    def stop(self) -> int | None:
        """SIGTERM the process group, SIGKILL it after grace_s; return the exit code. Safe
        to repeat; the group is signalled even when the leader exited (children may live)."""
        proc = self.proc
        if proc is None:
            return None
        try:
            self._signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            # Group members that outlived the leader (e.g. ignored SIGTERM) get SIGKILL.
            if _group_alive(proc.pid):
                deadline = time.monotonic() + self.grace_s
                while _group_alive(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                self._signal_group(proc.pid, signal.SIGKILL)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        return proc.returncode

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
