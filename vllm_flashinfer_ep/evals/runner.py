"""One gsm8k eval end to end: serve, wait, score with lm-eval, judge, tear down, record.

The server is torn down on every path out (pass, fail, error, Ctrl-C, SIGTERM to the
runner) and a result JSON is written on every path that gets that far, so a CI job
always has both a free GPU set and a record afterwards.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

from vllm_flashinfer_ep.evals.config import Gsm8kConfig, option_value
from vllm_flashinfer_ep.evals.gsm8k_task import STOCK_TASK, offline_mode, write_offline_task
from vllm_flashinfer_ep.evals.lm_eval_client import completions_model_args, run_gsm8k
from vllm_flashinfer_ep.evals.requirements import unmet_requirement
from vllm_flashinfer_ep.evals.result import EvalResult, Status, judge
from vllm_flashinfer_ep.evals.serve_command import LOOPBACK, build_serve_command, build_serve_env
from vllm_flashinfer_ep.evals.server import DEFAULT_GRACE_S, ServerProcess, ServerStartError


@dataclass
class RunOptions:
    """How to run a config; defaults suit `vllm-flashinfer-ep eval gsm8k`."""

    port: int = 8000
    data_dir: Path | None = None
    output: Path | None = None
    limit: int | None = None
    metric: str = "both"
    server_log: Path | None = None
    grace_s: float = DEFAULT_GRACE_S
    check_gpus: bool = True
    vllm_executable: Sequence[str] = field(default_factory=lambda: default_vllm_executable())
    progress: TextIO = sys.stderr


def default_vllm_executable() -> tuple[str, ...]:
    """`vllm` from PATH, else the one beside this interpreter (an un-activated venv)."""
    if shutil.which("vllm"):
        return ("vllm",)
    beside = Path(sys.executable).parent / "vllm"
    return (str(beside),) if beside.is_file() else ("vllm",)


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


def served_model_name(config: Gsm8kConfig) -> str:
    """The name requests must use: --served-model-name's first value, else the model."""
    return option_value(config.server_args, "--served-model-name") or config.model_name


def run_eval(config: Gsm8kConfig, options: RunOptions) -> EvalResult:
    """Run one config and return its judged result (also written to options.output)."""
    limit = options.limit if options.limit is not None else config.num_questions
    command = build_serve_command(config, options.port, vllm_executable=options.vllm_executable)
    result = EvalResult(
        config=str(config.path),
        model_name=config.model_name,
        all2all_backend=config.all2all_backend,
        status=Status.ERROR,
        reason="not started",
        accuracy_threshold=config.accuracy_threshold,
        tolerance=config.tolerance,
        pass_bound=config.pass_bound,
        metric=options.metric,
        num_fewshot=config.num_fewshot,
        limit=limit,
        serve_command=command,
        env=dict(config.env),
        server_log=str(options.server_log) if options.server_log else None,
    )
    try:
        with sigterm_as_keyboard_interrupt():
            _run(config, options, limit, command, result)
    except KeyboardInterrupt:
        result.status, result.reason = Status.ERROR, "interrupted"
        raise
    finally:
        if options.output is not None:
            options.output.parent.mkdir(parents=True, exist_ok=True)
            result.write(options.output)
    return result


def _run(
    config: Gsm8kConfig,
    options: RunOptions,
    limit: int,
    command: list[str],
    result: EvalResult,
) -> None:
    unmet = unmet_requirement(config, check_gpus=options.check_gpus, check_model=False)
    if unmet is not None:
        result.status, result.reason = Status.SKIPPED, unmet
        return
    if port_in_use(options.port):
        result.reason = f"port {options.port} on {LOOPBACK} is already in use"
        return

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="vllm-fi-ep-gsm8k-"))
        task, include_path = STOCK_TASK, None
        if options.data_dir is not None:
            stack.enter_context(offline_mode())
            include_path = Path(tmp) / "tasks"
            task = write_offline_task(options.data_dir, include_path, Path(tmp) / "hf-datasets")
        result.task = task

        server = ServerProcess(
            command,
            build_serve_env(config),
            health_url=f"http://{LOOPBACK}:{options.port}/health",
            log_path=options.server_log,
            grace_s=options.grace_s,
            name=f"vllm serve ({config.name})",
        )
        print(f"[eval] starting: {' '.join(command)}", file=options.progress, flush=True)
        try:
            server.start()
            result.startup_seconds = server.wait_healthy(
                config.startup_max_wait_seconds, progress=options.progress
            )
            started = time.monotonic()
            scores = run_gsm8k(
                "local-completions",
                completions_model_args(
                    f"http://{LOOPBACK}:{options.port}",
                    served_model_name(config),
                    max_tokens=config.max_tokens,
                    seed=config.seed,
                    concurrency=config.max_concurrency,
                    timeout_s=config.request_timeout_seconds,
                ),
                num_fewshot=config.num_fewshot,
                limit=limit,
                seed=config.seed,
                task=task,
                include_path=include_path,
                temperature=config.temperature,
            )
            result.eval_seconds = time.monotonic() - started
            result.scores = scores.by_filter()
            result.num_questions_scored = scores.num_questions
            result.status, result.reason = judge(scores, config, options.metric)
        except ServerStartError as exc:
            result.reason = str(exc)
        except Exception as exc:  # the record must say what broke
            traceback.print_exc(file=options.progress)
            result.reason = f"{type(exc).__name__}: {exc}"
        finally:
            print("[eval] stopping the server", file=options.progress, flush=True)
            result.server_exit_code = server.stop()
