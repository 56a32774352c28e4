"""Loading and validating gsm8k eval configs (vLLM's tests/evals/gsm8k schema). Only its
keys are accepted, so the files stay usable by vLLM's harness and a typo is no silent
default."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vllm_flashinfer_ep.backends import BACKENDS, VLLM_BACKENDS
from vllm_flashinfer_ep.envs import validate_env

# Keys of vLLM's gsm8k eval config and the type each must have.
_REQUIRED: dict[str, tuple[type, ...]] = {
    "model_name": (str,),
    "accuracy_threshold": (int, float),
    "num_questions": (int,),
    "num_fewshot": (int,),
}
_OPTIONAL: dict[str, tuple[type, ...]] = {
    "server_args": (str,),
    "env": (dict,),
    "startup_max_wait_seconds": (int, float),
    "request_timeout_seconds": (int, float),
    "rocm_request_timeout_seconds": (int, float),
    "max_tokens": (int,),
    "use_chat_completions": (bool,),
    "temperature": (int, float),
    "seed": (int,),
    "gen_prefix": (str,),
    "max_concurrency": (int,),
    "tolerance": (int, float),
    "startup_rpc_checks": (list, dict),
    "min_acceptance_length": (int, float),
}
KNOWN_KEYS: tuple[str, ...] = tuple(_REQUIRED) + tuple(_OPTIONAL)

# Defaults of vLLM's harness, so both runners judge a config alike.
DEFAULT_STARTUP_MAX_WAIT_S = 1200.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = 256
DEFAULT_TOLERANCE = 0.08
DEFAULT_SEED = 42
DEFAULT_MAX_CONCURRENCY = 64


class ConfigError(ValueError):
    """A config file that cannot be run; the message names the file and the key."""


@dataclass(frozen=True)
class Gsm8kConfig:
    """One gsm8k eval: which model, served how, and what score it must reach."""

    path: Path
    model_name: str
    accuracy_threshold: float
    num_questions: int
    num_fewshot: int
    server_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    startup_max_wait_seconds: float = DEFAULT_STARTUP_MAX_WAIT_S
    request_timeout_seconds: float = DEFAULT_REQUEST_TIMEOUT_S
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    seed: int = DEFAULT_SEED
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    tolerance: float = DEFAULT_TOLERANCE
    use_chat_completions: bool = False

    @property
    def name(self) -> str:
        """Test id, as vLLM's harness derives it: the YAML file's stem."""
        return self.path.stem

    @property
    def pass_bound(self) -> float:
        """Lowest passing score: vLLM's rule is `measured >= threshold - tolerance`."""
        return self.accuracy_threshold - self.tolerance

    @property
    def data_parallel_size(self) -> int:
        """DP size from server_args (GPUs needed with TP=1); 1 when absent."""
        value = option_value(self.server_args, "--data-parallel-size", "-dp")
        return int(value) if value is not None else 1

    @property
    def tensor_parallel_size(self) -> int:
        value = option_value(self.server_args, "--tensor-parallel-size", "-tp")
        return int(value) if value is not None else 1

    @property
    def gpus_needed(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size

    @property
    def all2all_backend(self) -> str:
        """The all2all backend the server will use (vLLM's default when unset)."""
        return option_value(self.server_args, "--all2all-backend") or "allgather_reducescatter"


def option_value(args: tuple[str, ...] | list[str], *names: str) -> str | None:
    """Value of the last `--name V` / `--name=V` among args, like argparse keeps it."""
    found: str | None = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def _check_type(path: Path, key: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass; a `true` where a number belongs is a mistake.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        wanted = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{path}: '{key}' must be {wanted}, got {type(value).__name__} {value!r}")


def parse_config(data: Any, path: Path) -> Gsm8kConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    unknown = sorted(set(data) - set(KNOWN_KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(KNOWN_KEYS)}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"{path}: missing required key(s) {', '.join(missing)}")
    for key, value in data.items():
        _check_type(path, key, value, {**_REQUIRED, **_OPTIONAL}[key])

    if not data["model_name"].strip():
        raise ConfigError(f"{path}: 'model_name' is empty")
    threshold = float(data["accuracy_threshold"])
    if not 0.0 < threshold <= 1.0:
        raise ConfigError(f"{path}: 'accuracy_threshold' must be in (0, 1], got {threshold}")
    tolerance = float(data.get("tolerance", DEFAULT_TOLERANCE))
    if not 0.0 <= tolerance < threshold:
        raise ConfigError(
            f"{path}: 'tolerance' must be in [0, accuracy_threshold), got {tolerance}"
        )
    for key in ("num_questions", "max_tokens", "max_concurrency"):
        if key in data and data[key] <= 0:
            raise ConfigError(f"{path}: '{key}' must be > 0, got {data[key]}")
    if data["num_fewshot"] < 0:
        raise ConfigError(f"{path}: 'num_fewshot' must be >= 0, got {data['num_fewshot']}")
    for key in ("startup_max_wait_seconds", "request_timeout_seconds"):
        if key in data and data[key] <= 0:
            raise ConfigError(f"{path}: '{key}' must be > 0, got {data[key]}")
    if data.get("use_chat_completions"):
        raise ConfigError(
            f"{path}: 'use_chat_completions: true' is not supported; this runner scores "
            "gsm8k over /v1/completions like vLLM's harness does by default"
        )

    env = data.get("env") or {}
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{path}: 'env' must map names to scalar values; bad entry {key!r}")
    try:
        server_args = tuple(shlex.split(data.get("server_args", "")))
    except ValueError as exc:
        raise ConfigError(f"{path}: 'server_args' is not valid shell syntax: {exc}") from exc
    for reserved in ("--port", "--host"):
        if option_value(server_args, reserved) is not None:
            raise ConfigError(f"{path}: 'server_args' must not set {reserved}; the runner sets it")
    backend = option_value(server_args, "--all2all-backend")
    if backend is not None and backend not in known_backends():
        raise ConfigError(
            f"{path}: --all2all-backend {backend!r} in 'server_args' is not a known backend; "
            f"known: {', '.join(known_backends())}"
        )
    try:  # the checks the engine applies to the package's variables
        validate_env({k: _env_str(v) for k, v in env.items()})
    except ValueError as exc:
        raise ConfigError(f"{path}: 'env': {exc}") from exc

    return Gsm8kConfig(
        path=path,
        model_name=data["model_name"],
        accuracy_threshold=threshold,
        num_questions=data["num_questions"],
        num_fewshot=data["num_fewshot"],
        server_args=server_args,
        env={k: _env_str(v) for k, v in env.items()},
        startup_max_wait_seconds=float(
            data.get("startup_max_wait_seconds", DEFAULT_STARTUP_MAX_WAIT_S)
        ),
        request_timeout_seconds=float(
            data.get("request_timeout_seconds", DEFAULT_REQUEST_TIMEOUT_S)
        ),
        max_tokens=data.get("max_tokens", DEFAULT_MAX_TOKENS),
        temperature=float(data.get("temperature", 0.0)),
        seed=data.get("seed", DEFAULT_SEED),
        max_concurrency=data.get("max_concurrency", DEFAULT_MAX_CONCURRENCY),
        tolerance=tolerance,
    )


def known_backends() -> tuple[str, ...]:
    """vLLM 0.33.0's `--all2all-backend` names plus this package's, without importing
    vLLM: the eval CLI only starts `vllm serve` and lm-eval, and importing vLLM (torch,
    transformers) would make its start and its exit slow wherever the CPUs are busy."""
    return tuple(dict.fromkeys((*VLLM_BACKENDS, *BACKENDS)))


def _env_str(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def load_config(path: str | Path) -> Gsm8kConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse_config(data, path)


def load_config_list(path: str | Path) -> list[Path]:
    """YAML paths named in a `.txt` list (one per line, `#` comments), relative to it, as
    vLLM's conftest reads it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config list not found")
    entries: list[Path] = []
    for lineno, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = path.parent / line
        if not entry.is_file():
            raise ConfigError(f"{path}:{lineno}: listed config {line!r} does not exist")
        entries.append(entry)
    if not entries:
        raise ConfigError(f"{path}: lists no configs")
    return entries
