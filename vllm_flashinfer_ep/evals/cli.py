"""The `eval` sub-command: `vllm-flashinfer-ep eval gsm8k --config FILE ...`.

Exit codes: 0 passed, 1 scored below the bound, 2 error (bad config, server or eval
broke), 3 skipped (a requirement such as GPUs or the NIXL-EP transport is missing),
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_flashinfer_ep.evals.config import ConfigError, load_config
from vllm_flashinfer_ep.evals.gsm8k_task import DataDirError, validate_data_dir
from vllm_flashinfer_ep.evals.result import METRIC_CHOICES, Status
from vllm_flashinfer_ep.evals.runner import RunOptions, run_eval
from vllm_flashinfer_ep.evals.serve_command import build_serve_command, build_serve_env

EXIT_INTERRUPTED = 130


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `eval` (with its `gsm8k` sub-command) to a parent CLI's subparsers."""
    eval_parser = subparsers.add_parser(
        "eval", help="accuracy evals (gsm8k) of a served model", description=__doc__
    )
    evals = eval_parser.add_subparsers(dest="eval_name", metavar="EVAL", required=True)
    gsm8k = evals.add_parser(
        "gsm8k",
        help="serve a config's model and score lm-eval's gsm8k against its threshold",
        description=(
            "Start `vllm serve` as the config says, run lm-eval's gsm8k task against "
            "/v1/completions (greedy, seed from config), and pass iff the score reaches "
            "accuracy_threshold - tolerance. The server is always torn down."
        ),
    )
    gsm8k.add_argument("--config", required=True, type=Path, help="gsm8k config YAML")
    gsm8k.add_argument(
        "--data-dir",
        type=Path,
        help="directory with gsm8k train.jsonl/test.jsonl; runs lm-eval offline from it",
    )
    gsm8k.add_argument("--port", type=int, default=8000, help="server port on 127.0.0.1")
    gsm8k.add_argument("--output", type=Path, help="write the result JSON here")
    gsm8k.add_argument(
        "--limit", type=int, help="questions to score (default: the config's num_questions)"
    )
    gsm8k.add_argument(
        "--metric",
        choices=METRIC_CHOICES,
        default="both",
        help="lm-eval filter(s) that must reach the bound (default: both)",
    )
    gsm8k.add_argument("--server-log", type=Path, help="send the server's output to this file")
    gsm8k.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="SIGTERM-to-SIGKILL grace period at teardown",
    )
    gsm8k.add_argument(
        "--no-gpu-check",
        action="store_true",
        help="start the server even if fewer GPUs are visible here than dp x tp needs",
    )
    gsm8k.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and print the server command and env, start nothing",
    )
    gsm8k.set_defaults(func=run_gsm8k_command)


def run_gsm8k_command(args: argparse.Namespace) -> int:
    """Entry for `eval gsm8k`; returns the process exit code."""
    try:
        config = load_config(args.config)
        if args.data_dir is not None:
            validate_data_dir(args.data_dir)
        if args.limit is not None and args.limit <= 0:
            raise ConfigError(f"--limit must be > 0, got {args.limit}")
    except (ConfigError, DataDirError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Status.ERROR.exit_code

    if args.dry_run:
        env = build_serve_env(config, base={})
        env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        print(f"{env_prefix} {shlex.join(build_serve_command(config, args.port))}")
        return 0

    missing = [m for m in ("lm_eval", "aiohttp", "tenacity") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"error: {', '.join(missing)} not installed; pip install 'lm-eval[api]==0.4.13'",
            file=sys.stderr,
        )
        return Status.ERROR.exit_code

    options = RunOptions(
        port=args.port,
        data_dir=args.data_dir,
        output=args.output,
        limit=args.limit,
        metric=args.metric,
        server_log=args.server_log,
        grace_s=args.grace_seconds,
        check_gpus=not args.no_gpu_check,
    )
    try:
        result = run_eval(config, options)
    except KeyboardInterrupt:
        print("interrupted; server stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"{result.status.value.upper()}: {config.name}: {result.reason}")
    if args.output is not None:
        print(f"result written to {args.output}", file=sys.stderr)
    return result.status.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vllm_flashinfer_ep.evals gsm8k ...` without the package's main CLI."""
    parser = argparse.ArgumentParser(prog="python -m vllm_flashinfer_ep.evals")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))
