"""Every shipped gsm8k config is valid and builds a `vllm serve` command vLLM accepts.

The command is parsed by vLLM's real `vllm serve` parser with general plugins loaded,
so a config naming `flashinfer_ep_*` passes only if the plugin registered the names.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tests.helpers import parse_serve_args
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.evals.config import KNOWN_KEYS, load_config, load_config_list
from vllm_flashinfer_ep.evals.gsm8k import HARNESS_FLAGS
from vllm_flashinfer_ep.evals.gsm8k import serve_command as build_serve_command
from vllm_flashinfer_ep.evals.gsm8k import serve_env as build_serve_env

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "gsm8k"
LIST_FILES = sorted(CONFIG_DIR.glob("*.txt"))
YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))
MODEL = "Qwen/Qwen3-30B-A3B"


def test_config_dir_has_configs_and_a_list() -> None:
    assert LIST_FILES, f"no .txt config list in {CONFIG_DIR}"
    assert len(YAMLS) >= 4


def test_every_yaml_is_listed_and_every_listed_file_exists() -> None:
    listed = {p.resolve() for lst in LIST_FILES for p in load_config_list(lst)}
    assert listed == {p.resolve() for p in YAMLS}


def test_required_matrix_is_covered() -> None:
    """LL (graphs on), HT, LL over nixl_ep, and the default-backend baseline."""
    configs = [load_config(p) for p in YAMLS]
    by_kind: dict[tuple[str, str], list] = {}
    for c in configs:
        assert c.model_name == MODEL
        assert c.data_parallel_size == 2
        assert "--enable-expert-parallel" in c.server_args
        by_kind.setdefault((c.all2all_backend, c.env.get(envs.TRANSPORT, "nccl_ep")), []).append(c)
    assert set(by_kind) == {
        ("allgather_reducescatter", "nccl_ep"),
        (LOW_LATENCY, "nccl_ep"),
        (HIGH_THROUGHPUT, "nccl_ep"),
        (LOW_LATENCY, "nixl_ep"),
    }
    for ll in by_kind[(LOW_LATENCY, "nccl_ep")]:
        assert "--enforce-eager" not in ll.server_args, "LL config must keep CUDA graphs on"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_yaml_uses_only_vllm_harness_keys_and_cites_its_threshold(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    assert set(data) <= set(KNOWN_KEYS)
    config = load_config(path)
    # vLLM's published BF16 DP-EP expectation for this model: 0.88, 5-shot, full test set.
    assert (config.accuracy_threshold, config.num_fewshot, config.num_questions) == (0.88, 5, 1319)
    assert "Qwen3-30B-A3B-BF16-triton.yaml" in text, "threshold source must be named"
    # vLLM's harness shlex-splits server_args; both runners must see the same argv.
    assert tuple(shlex.split(data["server_args"])) == config.server_args


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_serve_command_is_exact_and_accepted_by_vllm_parser(path: Path) -> None:
    config = load_config(path)
    command = build_serve_command(config, port=8123)
    assert command == [
        "vllm",
        "serve",
        MODEL,
        *shlex.split(yaml.safe_load(path.read_text())["server_args"]),
        *HARNESS_FLAGS,
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
    ]
    args = parse_serve_args(command[2:])
    assert args.model_tag == MODEL
    assert args.port == 8123
    assert args.data_parallel_size == 2
    assert args.enable_expert_parallel is True
    assert args.all2all_backend == config.all2all_backend
    assert args.enforce_eager == ("--enforce-eager" in config.server_args)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_serve_env_carries_config_env(path: Path) -> None:
    config = load_config(path)
    env = build_serve_env(config, base={"PATH": "/bin", envs.TRANSPORT: "stale"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == str(int(config.startup_max_wait_seconds))
    for key, value in config.env.items():
        assert env[key] == value
    if envs.TRANSPORT not in config.env:
        assert env[envs.TRANSPORT] == "stale"


def test_the_package_s_copy_of_vllm_s_backend_names_is_vllm_s() -> None:
    from typing import get_args

    from vllm.config.parallel import ParallelConfig

    from vllm_flashinfer_ep.backends import VLLM_BACKENDS

    field = ParallelConfig.__dataclass_fields__["all2all_backend"].type
    ours = {n for n in get_args(field) if n.startswith("flashinfer_ep_")}  # the plugin's patch
    assert set(get_args(field)) - ours == set(VLLM_BACKENDS)


def test_the_eval_cli_does_not_import_vllm_or_torch(tmp_path) -> None:
    """The eval CLI only starts `vllm serve` and lm-eval: importing vLLM (and torch) in it,
    to check the config's --all2all-backend, made it slow to start and to exit on a busy
    host, past what its Ctrl-C test waits for."""
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model_name": "tiny/model",
                "accuracy_threshold": 0.9,
                "num_questions": 3,
                "num_fewshot": 2,
                "server_args": f"--data-parallel-size 2 --all2all-backend {LOW_LATENCY}",
            }
        )
    )
    code = (
        "import sys; from vllm_flashinfer_ep.evals.cli import main; "
        f"rc = main(['gsm8k', '--config', {str(cfg)!r}, '--port', '8000', '--dry-run']); "
        "print(rc, sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "0 []", out.stdout + out.stderr


def test_vllm_parser_still_rejects_unknown_backends() -> None:
    """Guards the check above: the parser really validates --all2all-backend."""
    with pytest.raises(ValueError, match="all2all-backend"):
        parse_serve_args([MODEL, "--all2all-backend", "no_such_backend"])


@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_plugin_backends_accepted_by_vllm_parser(backend: str) -> None:
    args = parse_serve_args([MODEL, "--all2all-backend", backend])
    assert args.all2all_backend == backend
