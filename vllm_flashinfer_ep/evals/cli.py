"""`vllm-flashinfer-ep eval gsm8k --config FILE ...`.

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
from vllm_flashinfer_ep.evals.gsm8k import (
    DataDirError,
    RunOptions,
    Status,
    run_eval,
    serve_command,
    serve_env,
    validate_data_dir,
)


def add_parser(subparsers) -> None:
    evals = subparsers.add_parser(
        "eval", help="accuracy evals (gsm8k) of a served model", description=__doc__
    )
    sub = evals.add_subparsers(dest="eval_name", metavar="EVAL", required=True)
    p = sub.add_parser(
        "gsm8k",
        help="serve a config's model and score lm-eval's gsm8k",
        description="Serve the config with `vllm serve`, run lm-eval's gsm8k over "
        "/v1/completions, pass iff the score reaches accuracy_threshold - "
        "tolerance. The server is always torn down.",
    )
    p.add_argument("--config", required=True, type=Path, help="gsm8k config YAML")
    p.add_argument("--data-dir", type=Path, help="dir with gsm8k train.jsonl/test.jsonl (offline)")
    p.add_argument("--port", type=int, default=8000, help="server port on 127.0.0.1")
    p.add_argument("--output", type=Path, help="write the result JSON here")
    p.add_argument("--limit", type=int, help="questions to score (default: num_questions)")
    p.add_argument("--server-log", type=Path, help="send the server's output to this file")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="SIGTERM-to-SIGKILL grace")
    p.add_argument("--no-gpu-check", action="store_true", help="start even without dp x tp GPUs")
    p.add_argument("--dry-run", action="store_true", help="validate, print env and command only")
    p.set_defaults(func=run_gsm8k_command)


def run_gsm8k_command(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)  # backend names and env values checked here
        if args.data_dir is not None:
            validate_data_dir(args.data_dir)
        if args.limit is not None and args.limit <= 0:
            raise ConfigError(f"--limit must be > 0, got {args.limit}")
    except (ConfigError, DataDirError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Status.ERROR.exit_code
    if args.dry_run:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(serve_env(config, {}).items()))
        print(f"{env} {shlex.join(serve_command(config, args.port))}")
        return 0
    if importlib.util.find_spec("lm_eval") is None:
        print("error: lm-eval not installed; pip install 'lm-eval[api]==0.4.13'", file=sys.stderr)
        return Status.ERROR.exit_code
    options = RunOptions(
        port=args.port,
        data_dir=args.data_dir,
        output=args.output,
        limit=args.limit,
        server_log=args.server_log,
        grace_s=args.grace_seconds,
        check_gpus=not args.no_gpu_check,
    )
    try:
        result = run_eval(config, options)
    except KeyboardInterrupt:
        print("interrupted; server stopped", file=sys.stderr)
        return 130
    print(f"{result.status.value.upper()}: {config.name}: {result.reason}")
    return result.status.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_flashinfer_ep.evals")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))
