"""doctor's verdict on the `vllm serve` arguments: the engine config, built by the code
`vllm serve` runs.

Why: doctor's own lines read a copy of some serve flags and apply the plugin's rules;
anything else (a misspelt flag, vLLM's own refusals such as fault tolerance without an
external load balancer or more sequences than the step budget) would pass doctor and stop
the server. Here the arguments go through vLLM's `vllm serve` parser
(`ServeSubcommand.subparser_init`), `validate_parsed_serve_args`, and
`AsyncEngineArgs.create_engine_config`, whose `VllmConfig.__post_init__` runs the
plugin's config validation: the verdict is the engine's, with the engine's message.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from vllm_flashinfer_ep.runtime.env_checks import Check

NAME = "engine config"
# doctor's own options, not `vllm serve`'s: (option, takes a value).
DOCTOR_ONLY = {"--model": True, "--no-gpu": False, "--link-runtime": True}


class ServeArgsRefused(ValueError):
    """vLLM's `vllm serve` parser refuses the arguments (its message)."""


def serve_args_of(argv: Sequence[str]) -> list[str]:
    """The `vllm serve` arguments of a doctor command line (doctor's own options out)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        option, eq, _ = arg.partition("=")
        if option in DOCTOR_ONLY:
            skip = DOCTOR_ONLY[option] and not eq
            continue
        out.append(arg)
    return out[1:] if out[:1] == ["doctor"] else out


def parse_serve_args(model: str | None, serve_args: Sequence[str]) -> argparse.Namespace:
    """The arguments as `vllm serve MODEL ARGS...` parses them; ServeArgsRefused where its
    parser would exit."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    parser = ServeSubcommand().subparser_init(root.add_subparsers())

    def refuse(message: str) -> None:
        raise ServeArgsRefused(message)

    parser.error = refuse  # type: ignore[method-assign]
    argv = [model, *serve_args] if model else list(serve_args)
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # --help and alike
        raise ServeArgsRefused(f"the parser exited ({exc.code})") from None


def engine_check(model: str | None, serve_args: Sequence[str], backend: str) -> Check:
    """[ok] where `vllm serve MODEL SERVE_ARGS` builds its engine config, [FAIL] with the
    engine's message where it refuses (the parser's, vLLM's or the plugin's). Without an
    `--all2all-backend` among them, with doctor's `backend` (the one its lines check)."""
    given = any(a == "--all2all-backend" or a.startswith("--all2all-backend=") for a in serve_args)
    added = "" if given else f" (with --all2all-backend {backend}, doctor's default)"
    serve_args = list(serve_args) if given else [*serve_args, "--all2all-backend", backend]
    try:
        args = parse_serve_args(model, serve_args)
    except ServeArgsRefused as exc:
        return Check(NAME, False, "vllm serve refuses the arguments", f"vLLM's parser: {exc}")
    if not model:
        return Check(
            NAME,
            True,
            "vLLM's parser accepts the arguments; pass --model to build the engine config",
            "",
            warn=True,
        )
    try:
        import vllm
        from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext

        validate_parsed_serve_args(args)
        args.model = args.model_tag or args.model  # `vllm serve`: the positional wins
        engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
        with _quiet_vllm():
            engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER, headless=bool(args.headless)
            )
    except Exception as exc:  # noqa: BLE001 - the engine's refusal, whatever raised it
        return Check(NAME, False, f"vllm serve refuses the configuration{added}", refusal_text(exc))
    return Check(NAME, True, f"built as `vllm serve` builds it{added}")


def accepted(check: Check, backend: str) -> Check:
    """A config line doctor's own rules fail where `vllm serve` builds its engine config
    from the same arguments on this host (its backend may not be doctor's, or this host's
    platform changed a setting): the verdict is the engine's, the rule stays as a warning."""
    if check.ok:
        return check
    return Check(
        check.name,
        True,
        check.detail,
        f"vllm serve builds its config from these arguments here; doctor's rule for "
        f"--all2all-backend {backend} on a GPU host: {check.fix}",
        warn=True,
    )


def refusal_text(exc: BaseException) -> str:
    """The engine's message (a pydantic validation error's own words, not its dump)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            messages = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors()]
        except Exception:  # noqa: BLE001 - not a pydantic error after all
            messages = []
        if messages:
            return "; ".join(messages)
    return str(exc) or type(exc).__name__


@contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM's INFO and WARNING lines while it builds the config would interleave with
    doctor's report; doctor's own lines say what the plugin's warnings say."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
