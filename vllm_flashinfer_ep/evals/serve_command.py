"""Building the `vllm serve` command line and environment for an eval config.

Kept apart from process handling so the exact command can be printed (`--dry-run`)
and checked against vLLM's real parser without starting anything.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Mapping, Sequence
from typing import NoReturn

from vllm_flashinfer_ep.evals.config import Gsm8kConfig

LOOPBACK = "127.0.0.1"
# Flags vLLM's gsm8k harness appends to every config's server_args.
HARNESS_FLAGS: tuple[str, ...] = ("--trust-remote-code", "--disable-uvicorn-access-log")


def build_serve_command(
    config: Gsm8kConfig,
    port: int,
    host: str = LOOPBACK,
    vllm_executable: Sequence[str] = ("vllm",),
) -> list[str]:
    """`vllm serve <model> <server_args> <harness flags> --host H --port P`."""
    return [
        *vllm_executable,
        "serve",
        config.model_name,
        *config.server_args,
        *HARNESS_FLAGS,
        "--host",
        host,
        "--port",
        str(port),
    ]


def build_serve_env(config: Gsm8kConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of the server: ours plus the config's `env` (config wins).

    Spawned workers match what vLLM's harness uses; a CUDA-initialised parent cannot fork.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    env["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(config.startup_max_wait_seconds))
    env.update(config.env)
    return env


class _ParseError(Exception):
    pass


def _raise_parse_error(message: str) -> NoReturn:
    raise _ParseError(message)


@functools.cache
def _serve_parser() -> argparse.ArgumentParser:
    """vLLM's `vllm serve` parser, built once (it takes seconds), plugins loaded."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
    parser.error = _raise_parse_error  # type: ignore[method-assign]
    return parser


def parse_serve_args(serve_argv: Sequence[str]) -> argparse.Namespace:
    """Parse `vllm serve` arguments (without `vllm serve`) with vLLM's real parser.

    Loads vLLM's general plugins first, as `vllm serve` does, so plugin-added
    `--all2all-backend` names are accepted. Needs a vLLM that can infer a device
    (VLLM_TARGET_DEVICE=cpu on a host without GPUs). Raises ValueError with
    argparse's message instead of exiting.
    """
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

    try:
        args = _serve_parser().parse_args(list(serve_argv))
    except (argparse.ArgumentError, _ParseError) as exc:
        raise ValueError(f"vllm serve rejects {list(serve_argv)}: {exc}") from exc
    args.subparser = "serve"
    validate_parsed_serve_args(args)
    return args
