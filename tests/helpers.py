"""Small helpers shared by the test folders (import as `tests.helpers`)."""

from __future__ import annotations

import argparse
import functools
import json
import socket
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def model_is_local(model: str) -> bool:
    """The model's config and every weight shard are on disk (a dir, or the HF cache)."""
    path = Path(model)
    if path.is_dir():
        return (path / "config.json").is_file()
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> str | None:
        hit = try_to_load_from_cache(model, filename)
        return hit if isinstance(hit, str) else None

    if cached("config.json") is None:
        return False
    index = cached("model.safetensors.index.json")
    if index is not None:
        shards = set(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"].values())
        return all(cached(shard) is not None for shard in shards)
    return cached("model.safetensors") is not None


class _ParseError(Exception):
    pass


@functools.cache
def _serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()  # as `vllm serve` does: plugin backend names become choices
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))

    def error(message: str):
        raise _ParseError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def parse_serve_args(serve_argv: Sequence[str]) -> argparse.Namespace:
    """`vllm serve` arguments parsed by vLLM's real parser; ValueError instead of exit."""
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

    try:
        args = _serve_parser().parse_args(list(serve_argv))
    except (argparse.ArgumentError, _ParseError) as exc:
        raise ValueError(f"vllm serve rejects {list(serve_argv)}: {exc}") from exc
    args.subparser = "serve"
    validate_parsed_serve_args(args)
    return args
