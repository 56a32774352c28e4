"""gsm8k: serve a config, run lm-eval (`local-completions`) against it, judge, tear down.
Offline (`--data-dir`), a renamed copy of lm-eval's gsm8k task reads local JSONL files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TextIO

import yaml

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.evals.config import Gsm8kConfig, option_value
from vllm_flashinfer_ep.evals.server import (
    LOOPBACK,
    ServerProcess,
    ServerStartError,
    port_in_use,
    sigterm_as_keyboard_interrupt,
)

# Flags vLLM's gsm8k harness appends to every config's server_args.
HARNESS_FLAGS: tuple[str, ...] = ("--trust-remote-code", "--disable-uvicorn-access-log")
FILTERS: tuple[str, ...] = ("strict-match", "flexible-extract")
STOCK_TASK = "gsm8k"
OFFLINE_TASK = "gsm8k_local_jsonl"
SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class DataDirError(ValueError):
    """The data dir lacks a split file or holds malformed records."""


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"  # scored below the bound
    SKIPPED = "skipped"  # a requirement (GPUs, transport) is missing here
    ERROR = "error"  # the server or the eval broke

    @property
    def exit_code(self) -> int:
        return {"passed": 0, "failed": 1, "error": 2, "skipped": 3}[self.value]


@dataclass
class EvalResult:
    """The record of one run, written as JSON on every path out."""

    config: str
    model_name: str
    all2all_backend: str
    pass_bound: float
    limit: int
    serve_command: list[str]
    env: dict[str, str]
    status: Status = Status.ERROR
    reason: str = "not started"
    scores: dict[str, float] = field(default_factory=dict)
    num_questions_scored: int = 0
    task: str | None = None
    server_exit_code: int | None = None
    server_log: str | None = None

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**asdict(self), "status": self.status.value}
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@dataclass
class RunOptions:
    """How to run a config; defaults suit `vllm-flashinfer-ep eval gsm8k`."""

    port: int = 8000
    data_dir: Path | None = None
    output: Path | None = None
    limit: int | None = None
    server_log: Path | None = None
    grace_s: float = 30.0
    check_gpus: bool = True
    vllm_executable: tuple[str, ...] | None = None  # default: default_vllm_executable()
    progress: TextIO = sys.stderr


def default_vllm_executable() -> tuple[str, ...]:
    """`vllm` from PATH, else the one beside this interpreter (an un-activated venv)."""
    if shutil.which("vllm"):
        return ("vllm",)
    beside = Path(sys.executable).parent / "vllm"
    return (str(beside),) if beside.is_file() else ("vllm",)


def serve_command(
    config: Gsm8kConfig, port: int, vllm_executable: tuple[str, ...] = ("vllm",)
) -> list[str]:
    head = [*vllm_executable, "serve", config.model_name, *config.server_args, *HARNESS_FLAGS]
    return head + ["--host", LOOPBACK, "--port", str(port)]


def serve_env(config: Gsm8kConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours plus the config's `env` (config wins); spawned
    workers, as vLLM's harness uses (a CUDA-initialised parent cannot fork)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(config.startup_max_wait_seconds))
    env.update(config.env)
    return env


def unmet_requirement(config: Gsm8kConfig, check_gpus: bool = True) -> str | None:
    """Why this host cannot run the config (a skip, not a failure), or None."""
    if config.env.get(envs.TRANSPORT, "").strip() == "nixl_ep":
        try:
            from flashinfer.moe_ep import have_nixl_ep

            has_nixl = bool(have_nixl_ep())
        except Exception:  # noqa: BLE001 - any failure means "not available"
            has_nixl = False
        if not has_nixl:
            return (
                f"{envs.TRANSPORT}=nixl_ep needs a FlashInfer built with NIXL-EP "
                "(the PyPI wheel ships none)"
            )
    if check_gpus:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < config.gpus_needed:
            return f"needs {config.gpus_needed} GPU(s) (dp x tp), {have} visible"
    return None


def validate_data_dir(data_dir: Path) -> dict[str, Path]:
    """Absolute split paths after checking each file's first record."""
    files: dict[str, Path] = {}
    for split, name in SPLIT_FILES.items():
        path = (data_dir / name).resolve()
        if not path.is_file():
            raise DataDirError(f"{data_dir}: missing {name} (gsm8k {split} split as JSONL)")
        try:
            record = json.loads(path.open(encoding="utf-8").readline())
        except json.JSONDecodeError as exc:
            raise DataDirError(f"{path}: first line is not JSON: {exc}") from exc
        if not isinstance(record, dict) or not {"question", "answer"} <= set(record):
            raise DataDirError(f"{path}: records need 'question' and 'answer' keys")
        if "####" not in str(record["answer"]):
            raise DataDirError(f"{path}: 'answer' must end with '#### <number>'")
        files[split] = path
    return files


def stock_task_yaml() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"


def write_offline_task(data_dir: Path, include_dir: Path, cache_dir: Path | None = None) -> str:
    """lm-eval's stock gsm8k task, renamed, over local JSONL files; returns its name."""
    task = yaml.safe_load(stock_task_yaml().read_text(encoding="utf-8"))
    task["task"] = OFFLINE_TASK
    task.pop("tag", None)  # keep the copy out of the stock task groups
    task.pop("dataset_name", None)  # "main" is a hub config name; json has none
    task["dataset_path"] = "json"
    kwargs: dict[str, Any] = {
        "data_files": {k: str(v) for k, v in validate_data_dir(data_dir).items()}
    }
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    task["dataset_kwargs"] = kwargs
    include_dir.mkdir(parents=True, exist_ok=True)
    (include_dir / f"{OFFLINE_TASK}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return OFFLINE_TASK


def completions_model_args(config: Gsm8kConfig, base_url: str) -> str:
    """lm-eval `local-completions` arguments: text prompts (the server tokenizes)."""
    name = option_value(config.server_args, "--served-model-name") or config.model_name
    return (
        f"model={name},base_url={base_url}/v1/completions,tokenizer_backend=none,"
        f"tokenized_requests=False,num_concurrent={config.max_concurrency},max_retries=3,"
        f"max_gen_toks={config.max_tokens},seed={config.seed},"
        f"timeout={int(config.request_timeout_seconds)}"
    )


def lm_eval_command(
    model: str,
    model_args: str,
    *,
    task: str,
    num_fewshot: int,
    limit: int,
    seed: int,
    output_dir: Path,
    include_path: Path | None = None,
    temperature: float = 0.0,
) -> list[str]:
    command = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args]
    command += ["--tasks", task, "--num_fewshot", str(num_fewshot), "--limit", str(limit)]
    command += ["--gen_kwargs", f"temperature={temperature}", "--seed", str(seed)]
    command += ["--output_path", str(output_dir)]
    return command + (["--include_path", str(include_path)] if include_path else [])


def run_lm_eval(
    command: list[str], output_dir: Path, task: str, env: dict[str, str] | None = None
) -> tuple[dict[str, float], int]:
    """Run lm-eval; ({filter: exact-match}, questions scored) from its results JSON."""
    proc = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"lm-eval exited with code {proc.returncode}")
    found = sorted(output_dir.rglob("results_*.json"))
    if not found:
        raise RuntimeError(f"lm-eval wrote no results under {output_dir}")
    results = json.loads(found[-1].read_text(encoding="utf-8"))
    metrics = results["results"][task]
    scores = {name: float(metrics[f"exact_match,{name}"]) for name in FILTERS}
    samples = results.get("n-samples", {}).get(task, {})
    return scores, int(samples.get("effective", samples.get("original", 0)))


def judge(scores: dict[str, float], config: Gsm8kConfig) -> tuple[Status, str]:
    """Pass iff both lm-eval filters reach accuracy_threshold - tolerance (vLLM's rule)."""
    bound = config.pass_bound
    low = [f"{n} {scores[n]:.4f}" for n in FILTERS if scores[n] < bound]
    if low:
        return Status.FAILED, (
            f"{', '.join(low)} < {config.accuracy_threshold:.4f} - "
            f"{config.tolerance:.4f} = {bound:.4f}"
        )
    return Status.PASSED, ", ".join(f"{n} {scores[n]:.4f}" for n in FILTERS) + f" >= {bound:.4f}"


def run_eval(config: Gsm8kConfig, options: RunOptions) -> EvalResult:
    """Serve, score, judge, tear down; the record is written on every path out."""
    limit = options.limit if options.limit is not None else config.num_questions
    vllm = options.vllm_executable or default_vllm_executable()
    result = EvalResult(
        config=str(config.path),
        model_name=config.model_name,
        all2all_backend=config.all2all_backend,
        pass_bound=config.pass_bound,
        limit=limit,
        serve_command=serve_command(config, options.port, vllm),
        env=dict(config.env),
        server_log=str(options.server_log) if options.server_log else None,
    )
    try:
        with sigterm_as_keyboard_interrupt():
            _run(config, options, result)
    except KeyboardInterrupt:
        result.status, result.reason = Status.ERROR, "interrupted"
        raise
    finally:
        if options.output is not None:
            result.write(options.output)
    return result


def _run(config: Gsm8kConfig, options: RunOptions, result: EvalResult) -> None:
    unmet = unmet_requirement(config, check_gpus=options.check_gpus)
    if unmet is not None:
        result.status, result.reason = Status.SKIPPED, unmet
        return
    if port_in_use(options.port):
        result.reason = f"port {options.port} on {LOOPBACK} is already in use"
        return
    with tempfile.TemporaryDirectory(prefix="vllm-fi-ep-gsm8k-") as tmp:
        work = Path(tmp)
        env = dict(os.environ)
        result.task, include = STOCK_TASK, None
        if options.data_dir is not None:
            env.update(OFFLINE_ENV)
            include = work / "tasks"
            result.task = write_offline_task(options.data_dir, include, work / "hf-datasets")
        base_url = f"http://{LOOPBACK}:{options.port}"
        server = ServerProcess(
            result.serve_command,
            serve_env(config, env),
            health_url=f"{base_url}/health",
            log_path=options.server_log,
            grace_s=options.grace_s,
            name=f"vllm serve ({config.name})",
        )
        print(
            f"[eval] starting: {' '.join(result.serve_command)}", file=options.progress, flush=True
        )
        try:
            server.start()
            server.wait_healthy(config.startup_max_wait_seconds, progress=options.progress)
            started = time.monotonic()
            command = lm_eval_command(
                "local-completions",
                completions_model_args(config, base_url),
                task=result.task,
                num_fewshot=config.num_fewshot,
                limit=result.limit,
                seed=config.seed,
                output_dir=work / "lm-eval",
                include_path=include,
                temperature=config.temperature,
            )
            result.scores, result.num_questions_scored = run_lm_eval(
                command, work / "lm-eval", result.task, env
            )
            print(f"[eval] lm-eval took {time.monotonic() - started:.0f}s", file=options.progress)
            result.status, result.reason = judge(result.scores, config)
        except (ServerStartError, RuntimeError, KeyError) as exc:
            result.reason = (
                f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, ServerStartError)
                else str(exc)
            )
        finally:
            print("[eval] stopping the server", file=options.progress, flush=True)
            result.server_exit_code = server.stop()
