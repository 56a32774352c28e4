"""doctor's verdict on `vllm serve` arguments is the engine's, case by case, tried as a new
user would: doctor with `--model MODEL ARGS` against `vllm serve MODEL ARGS`'s own route
to its engine config (vLLM's parser and its argument checks, then
`AsyncEngineArgs.create_engine_config`, the plugin's validation inside). doctor fails a config check exactly where the engine
refuses, and then names the engine's reason; the host checks (GPU stack, packages) are
left out, a CPU host fails them whatever the arguments.
"""

from __future__ import annotations

import pytest
from tiny_models import write_model

import vllm_flashinfer_ep
from tests.helpers import parse_serve_args
from vllm_flashinfer_ep import cli, envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.doctor.engine_config import refusal_text
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

EP = ("--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", LOW_LATENCY)
HOST_SECTIONS = ("GPU stack", "packages", "image (no GPU needed)")

# name -> (serve arguments, package variables set)
CASES = {
    # the issue's five
    "misspelt flag": (("--data-paralel-size", "2", *EP[2:]), {}),
    "fault tolerance without external LB": (("--enable-fault-tolerance", *EP), {}),
    "HT with more sequences than the default budget": (
        (*EP[:3], "--all2all-backend", HIGH_THROUGHPUT, "--max-num-seqs", "10000"),
        {},
    ),
    "bad package variable with another backend": (
        (*EP[:3], "--all2all-backend", "allgather_reducescatter"),
        {envs.HANDLE_POOL: "maybe"},
    ),
    "elastic EP": ((*EP, "--enable-elastic-ep"), {}),
    # and others
    "plain LL": (EP, {}),
    "fault tolerance with an external LB": (
        ("--enable-fault-tolerance", *EP, "--data-parallel-rank", "0"),
        {},
    ),
    "bad package variable with our backend": (EP, {envs.HANDLE_POOL: "maybe"}),
    "dual-batch overlap": ((*EP, "--enable-dbo"), {}),
    "an unknown backend": ((*EP[:3], "--all2all-backend", "no_such_backend"), {}),
    "an fp16 model's dtype": ((*EP, "--dtype", "float16"), {}),
    "another backend with round-robin placement": (
        (
            *EP[:3],
            "--all2all-backend",
            "allgather_reducescatter",
            "--expert-placement-strategy",
            "round_robin",
        ),
        {},
    ),
    "round-robin placement": ((*EP, "--expert-placement-strategy", "round_robin"), {}),
    # refused by `vllm serve`'s own argument checks, before any engine config
    "auto tool choice without a parser": (("--enable-auto-tool-choice", *EP), {}),
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("doctor-engine"), max_position_embeddings=32768)


def engine_verdict(model: str, serve_args: tuple[str, ...]) -> str | None:
    """None where `vllm serve MODEL ARGS` builds its engine config, else why it stops."""
    import vllm
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext

    try:
        args = parse_serve_args([model, *serve_args])
        validate_parsed_serve_args(args)  # what `vllm serve` checks first
        args.model = args.model_tag
        vllm.AsyncEngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=bool(args.headless)
        )
    except Exception as exc:  # noqa: BLE001 - whatever stops vllm serve
        return refusal_text(exc)
    return None


def doctor_failures(capsys, model: str, serve_args: tuple[str, ...]) -> list[str]:
    """The [FAIL] lines of `vllm-flashinfer-ep doctor --model MODEL ARGS` outside the host
    sections."""
    capsys.readouterr()
    cli.main(["doctor", "--model", model, *serve_args])
    failures, section = [], ""
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            section = line[:-1]
        elif line.strip().startswith("[FAIL]") and section not in HOST_SECTIONS:
            failures.append(line.strip())
    return failures


@pytest.mark.parametrize("case", list(CASES))
def test_doctor_fails_exactly_where_the_engine_refuses_and_says_why(
    tiny, monkeypatch, capsys, case
):
    serve_args, variables = CASES[case]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    engine = engine_verdict(tiny, serve_args)
    failures = doctor_failures(capsys, tiny, serve_args)
    if engine is None:
        assert failures == [], failures
        return
    assert failures, f"the engine refuses ({engine}) and doctor passes"
    said = " ".join(failures)
    assert engine.split(": ")[-1][:60] in said, (engine, failures)


def test_the_issue_s_cases_are_the_ones_it_names(tiny, monkeypatch):
    """What the engine says in the issue's five cases (so the cases above test them)."""
    monkeypatch.setenv(envs.HANDLE_POOL, "maybe")
    other = CASES["bad package variable with another backend"][0]
    assert engine_verdict(tiny, other) is None  # another backend reads none of ours
    monkeypatch.delenv(envs.HANDLE_POOL)
    said = {
        case: engine_verdict(tiny, CASES[case][0])
        for case in (
            "misspelt flag",
            "fault tolerance without external LB",
            "HT with more sequences than the default budget",
            "elastic EP",
        )
    }
    assert "--data-paralel-size" in said["misspelt flag"]
    assert "external load balancer" in said["fault tolerance without external LB"]
    assert "max_num_seqs (10000)" in said["HT with more sequences than the default budget"]
    assert "enable_eplb" in said["elastic EP"]
    assert LOW_LATENCY  # the default backend of the other cases


def test_without_a_backend_doctor_builds_the_config_with_the_one_it_checks(tiny, capsys):
    """doctor checks flashinfer_ep_low_latency unless told otherwise; its engine config is
    that backend's too (plain `vllm serve` would pick vLLM's default and read none of it)."""
    failures = doctor_failures(capsys, tiny, ("--dtype", "float16"))
    engine = engine_verdict(tiny, ("--dtype", "float16", "--all2all-backend", LOW_LATENCY))
    assert engine is not None and "--dtype bfloat16" in engine
    assert any(
        line.startswith(
            "[FAIL] engine config: vllm serve refuses the configuration (with "
            f"--all2all-backend {LOW_LATENCY}, doctor's default)"
        )
        for line in failures
    ), failures


def test_without_a_model_a_bad_package_variable_fails_only_where_the_engine_reads_it(
    monkeypatch, capsys
):
    """No model: no engine config to build, doctor's variables line is the verdict."""
    monkeypatch.setenv(envs.HANDLE_POOL, "maybe")
    for backend, fails in (("allgather_reducescatter", False), (LOW_LATENCY, True)):
        capsys.readouterr()
        cli.main(["doctor", "--all2all-backend", backend, "-dp", "2", "-ep"])
        out = capsys.readouterr().out
        assert ("[FAIL] VLLM_FLASHINFER_EP_* variables" in out) is fails, out
        assert ("[warn] VLLM_FLASHINFER_EP_* variables" in out) is not fails, out


def test_doctor_without_a_model_still_refuses_what_vllm_s_parser_refuses(capsys):
    rc = cli.main(["doctor", "--data-paralel-size", "2"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[FAIL] engine config: vllm serve refuses the arguments" in out
    assert "unrecognized arguments: --data-paralel-size" in out
