"""Parsers for doctor's copies of `vllm serve` arguments: vLLM's spellings and value forms
(8k token counts, --enable-X / --disable-X switches, --eplb-config.KEY VALUE)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def _at_least(low: int, text: str, parse: Callable[[str], int], expected: str) -> int:
    try:
        value = parse(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive(text: str) -> int:
    return _at_least(1, text, int, "a positive integer")


def non_negative(text: str) -> int:
    return _at_least(0, text, int, "an integer >= 0")


def tokens(text: str) -> int:
    """vLLM's parser for --max-num-batched-tokens (accepts 8k, 2K, ...)."""
    from vllm.utils.argparse_utils import human_readable_int

    return _at_least(1, text, human_readable_int, "a positive integer")


def model_len(text: str) -> int | None:
    """vLLM's parser for --max-model-len (8k, 32K, -1 / auto: from the model)."""
    from vllm.utils.argparse_utils import human_readable_int_or_auto

    value = human_readable_int_or_auto(text)
    return value if value > 0 else None


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def split_eplb_overrides(extra: list[str]) -> tuple[dict[str, Any], list[str]]:
    """vLLM's dotted form `--eplb-config.KEY VALUE` (or `=VALUE`) among arguments the
    parser did not know: ({KEY: value}, the rest)."""
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--eplb-config."):
            key, eq, value = arg[len("--eplb-config.") :].partition("=")
            if not eq and i + 1 < len(extra):
                i += 1
                value = extra[i]
            try:
                overrides[key.replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key.replace("-", "_")] = value
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


class EnableDisable(argparse.Action):
    """vLLM's boolean flags: --enable-X / --disable-X (and --no-enable-X)."""

    def __call__(self, parser, namespace, values, option_string=None):
        negative = option_string.startswith(("--disable-", "--no-"))
        setattr(namespace, self.dest, not negative)


def switch(group, flag: str, *aliases: str, default: bool | None = False) -> None:
    stem = flag.removeprefix("--enable-")
    group.add_argument(
        flag,
        *aliases,
        f"--disable-{stem}",
        f"--no-enable-{stem}",
        action=EnableDisable,
        nargs=0,
        default=default,
    )
