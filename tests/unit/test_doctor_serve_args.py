"""doctor and the engine agree on the parallel `vllm serve` arguments (real vLLM 0.33.0
objects, CPU): fault tolerance with HT, the HT per-rank step budget, dual-batch overlap /
micro-batching, the backend unused at EP world 1 or without expert parallelism, and a
--all2all-backend name vLLM's parser refuses. What the engine refuses is doctor's [FAIL]
with the engine's message, what it changes or warns about is doctor's [warn]."""

from __future__ import annotations

import logging

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import backends, cli, doctor, envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.limits import HT_MAX_TOKENS_PER_RANK
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

HT_TOKENS = f"HT tokens per rank (at most {HT_MAX_TOKENS_PER_RANK})"
EP = ("--data-parallel-size", "2", "--enable-expert-parallel")
# vLLM refuses fault tolerance without external load balancing before the plugin sees it.
FT_ENGINE = dict(enable_fault_tolerance=True, data_parallel_external_lb=True, data_parallel_rank=0)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve-args"), max_position_embeddings=32768)


def _doctor(monkeypatch, model: str, *serve_args: str):
    """`vllm-flashinfer-ep doctor --model MODEL SERVE_ARGS...`: (exit code, checks by name)."""
    seen = []

    def recording(real):
        def checks(*args, **kwargs):
            result = real(*args, **kwargs)
            seen.extend(result)
            return result

        return checks

    for name in ("serve_checks", "model_checks"):
        monkeypatch.setattr(doctor, name, recording(getattr(doctor, name)))
    rc = cli.main(["doctor", "--model", model, *serve_args])
    return rc, {c.name: c for c in seen}


def _engine_refusal(model: str, backend: str, **kwargs) -> str:
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(model, backend, **kwargs)
    return str(info.value)


def _engine_warnings(caplog, model: str, backend: str, **kwargs):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cfg = engine_config(model, backend, **kwargs)
    return cfg, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------ 1. fault tolerance
def test_fault_tolerance_with_ht_fails_in_both(tiny, monkeypatch, capsys):
    reason = _engine_refusal(tiny, HIGH_THROUGHPUT, **FT_ENGINE)
    rc, checks = _doctor(
        monkeypatch, tiny, "--all2all-backend", HIGH_THROUGHPUT, "--enable-fault-tolerance", *EP
    )
    ft = checks["fault tolerance"]
    assert rc == 1 and not ft.ok and ft.fix == reason
    out = capsys.readouterr().out
    assert "does not check" not in out
    assert f"[FAIL] fault tolerance: --enable-fault-tolerance with {HIGH_THROUGHPUT}" in out
    assert f"  - fault tolerance: {reason}" in out


def test_fault_tolerance_config_turns_it_on_in_both(tiny, monkeypatch):
    """vLLM: --fault-tolerance-config enables fault tolerance (EngineArgs.__post_init__)."""
    engine_kwargs = {k: v for k, v in FT_ENGINE.items() if k != "enable_fault_tolerance"}
    reason = _engine_refusal(
        tiny,
        HIGH_THROUGHPUT,
        fault_tolerance_config={"engine_recovery_timeout_sec": 60},
        **engine_kwargs,
    )
    _, checks = _doctor(
        monkeypatch,
        tiny,
        "--all2all-backend",
        HIGH_THROUGHPUT,
        "--fault-tolerance-config",
        '{"engine_recovery_timeout_sec": 60}',
        *EP,
    )
    assert not checks["fault tolerance"].ok and checks["fault tolerance"].fix == reason


def test_fault_tolerance_with_ll_passes_in_both(tiny, monkeypatch):
    engine_config(tiny, LOW_LATENCY, **FT_ENGINE)
    _, checks = _doctor(monkeypatch, tiny, "--enable-fault-tolerance", *EP)
    assert checks["fault tolerance"].ok and not checks["fault tolerance"].warn
    _, checks = _doctor(
        monkeypatch, tiny, "--all2all-backend", HIGH_THROUGHPUT, "--disable-fault-tolerance", *EP
    )
    assert "fault tolerance" not in checks


# ----------------------------------------------------- 1. HT per-rank step budget
def test_ht_budget_above_the_limit_is_lowered_by_the_engine_and_a_doctor_warning(
    tiny, monkeypatch, caplog
):
    cfg, warnings = _engine_warnings(caplog, tiny, HIGH_THROUGHPUT, max_num_batched_tokens=16384)
    lowered = cfg.scheduler_config.max_num_batched_tokens
    assert lowered == HT_MAX_TOKENS_PER_RANK
    assert any("lowered from 16384 to 8192" in w for w in warnings)
    _, checks = _doctor(
        monkeypatch,
        tiny,
        "--all2all-backend",
        HIGH_THROUGHPUT,
        "--max-num-batched-tokens",
        "16384",
        *EP,
    )
    check = checks[HT_TOKENS]
    assert check.ok and check.warn
    assert check.detail == "--max-num-batched-tokens 16384"
    assert f"the engine lowers --max-num-batched-tokens from 16384 to {lowered}:" in check.fix


def test_ht_budget_within_the_limit_is_kept_by_both(tiny, monkeypatch):
    cfg = engine_config(tiny, HIGH_THROUGHPUT, max_num_batched_tokens=8192)
    assert cfg.scheduler_config.max_num_batched_tokens == 8192
    _, checks = _doctor(
        monkeypatch, tiny, "--all2all-backend", HIGH_THROUGHPUT, "--max-num-batched-tokens", "8k"
    )
    assert checks[HT_TOKENS].ok and not checks[HT_TOKENS].warn


def test_ht_budget_without_chunked_prefill_is_refused_by_both(tiny, monkeypatch):
    reason = _engine_refusal(
        tiny,
        HIGH_THROUGHPUT,
        max_num_batched_tokens=16384,
        max_model_len=16384,
        enable_chunked_prefill=False,
    )
    rc, checks = _doctor(
        monkeypatch,
        tiny,
        "--all2all-backend",
        HIGH_THROUGHPUT,
        "--max-num-batched-tokens",
        "16384",
        "--max-model-len",
        "16384",
        "--disable-chunked-prefill",
        *EP,
    )
    assert rc == 1 and not checks[HT_TOKENS].ok and checks[HT_TOKENS].fix == reason


def test_ht_default_budget_is_vllm_s_for_the_gpu_in_both(tiny, monkeypatch):
    """Unset, the budget is vLLM's `vllm serve` default for the GPU (16384 on a 180 GiB
    GPU): the engine lowers it, doctor says so; without a GPU doctor cannot know it."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    _, checks = _doctor(monkeypatch, tiny, "--all2all-backend", HIGH_THROUGHPUT, *EP)
    assert checks[HT_TOKENS].warn and "not checked: no GPU visible here" in checks[HT_TOKENS].detail

    big_gpu = {UsageContext.OPENAI_API_SERVER: 16384, UsageContext.LLM_CLASS: 16384}
    monkeypatch.setattr(
        EngineArgs, "get_batch_defaults", classmethod(lambda cls, world: (big_gpu, {}))
    )
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: 180 << 30)
    cfg = EngineArgs(
        model=tiny,
        skip_tokenizer_init=True,
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend=HIGH_THROUGHPUT,
    ).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    lowered = cfg.scheduler_config.max_num_batched_tokens
    assert lowered == HT_MAX_TOKENS_PER_RANK
    _, checks = _doctor(monkeypatch, tiny, "--all2all-backend", HIGH_THROUGHPUT, *EP)
    check = checks[HT_TOKENS]
    assert check.warn and check.detail.startswith("--max-num-batched-tokens 16384 (vLLM's default")
    assert f"from 16384 to {lowered}:" in check.fix


# ------------------------------------------------- 2. dual-batch overlap / ubatching
@pytest.mark.parametrize(
    "engine_kwargs,flags",
    [
        (dict(enable_dbo=True), ("--enable-dbo",)),
        (dict(ubatch_size=2), ("--ubatch-size", "2")),
    ],
    ids=["dbo", "ubatch-size"],
)
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_micro_batching_fails_in_both(tiny, monkeypatch, capsys, backend, engine_kwargs, flags):
    reason = _engine_refusal(tiny, backend, **engine_kwargs)
    rc, checks = _doctor(monkeypatch, tiny, "--all2all-backend", backend, *flags, *EP)
    check = checks["micro-batching"]
    assert rc == 1 and not check.ok and check.fix == reason and check.detail == " ".join(flags)
    assert "does not check" not in capsys.readouterr().out


def test_micro_batching_off_passes_in_both(tiny, monkeypatch):
    engine_config(tiny, LOW_LATENCY, enable_dbo=False, ubatch_size=1)
    _, checks = _doctor(monkeypatch, tiny, "--disable-dbo", "--ubatch-size", "1", *EP)
    assert "micro-batching" not in checks


# ------------------------------------- 3. backend unused: EP world 1, no expert parallel
@pytest.mark.parametrize(
    "engine_kwargs,flags",
    [
        (dict(data_parallel_size=1), ("--data-parallel-size", "1", "--enable-expert-parallel")),
        (dict(data_parallel_size=1, enable_expert_parallel=False), ()),
        (dict(enable_expert_parallel=False), ("--data-parallel-size", "2")),
        (dict(enable_expert_parallel=False), ("-dp", "2", "--disable-expert-parallel")),
    ],
    ids=["dp1", "defaults", "dp2-no-ep", "dp2-disable-ep"],
)
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_unused_backend_warns_in_both(tiny, monkeypatch, caplog, backend, engine_kwargs, flags):
    _, warnings = _engine_warnings(caplog, tiny, backend, **engine_kwargs)
    [engine] = [w for w in warnings if w.startswith(f"{backend} is selected")]
    rc, checks = _doctor(monkeypatch, tiny, "--all2all-backend", backend, *flags)
    check = checks["expert parallel"]
    assert check.ok and check.warn and check.fix == engine


@pytest.mark.parametrize("flags", [EP, ("-dp", "2", "-ep")], ids=["long", "short"])
def test_dp_with_expert_parallel_is_quiet_in_both(tiny, monkeypatch, caplog, flags):
    _, warnings = _engine_warnings(caplog, tiny, LOW_LATENCY)
    assert not [w for w in warnings if " is selected " in w]
    _, checks = _doctor(monkeypatch, tiny, *flags)
    check = checks["expert parallel"]
    assert check.ok and not check.warn
    assert check.detail == (
        "EP world 2 (--data-parallel-size 2 x --tensor-parallel-size 1), --enable-expert-parallel"
    )


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("pcp", [1, 2])
@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("dbo,ubatch", [(False, 0), (True, 0), (False, 2)])
def test_doctor_reads_vllm_s_parallel_properties(dp, tp, pcp, ep, dbo, ubatch):
    """ServeSettings answers use_all2all / use_ubatching as a real ParallelConfig does."""
    from vllm.config import ParallelConfig

    kwargs = dict(
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        enable_expert_parallel=ep,
        enable_dbo=dbo,
        ubatch_size=ubatch,
    )
    par = ParallelConfig(all2all_backend=LOW_LATENCY, **kwargs)
    settings = doctor.ServeSettings(backend=LOW_LATENCY, **kwargs)
    assert settings.use_all2all == par.use_all2all
    assert settings.use_ubatching == par.use_ubatching
    assert settings.ep_world == config_rules.ep_world_size(par)


def test_prefill_context_parallel_reaches_the_verdict(tiny, monkeypatch):
    """-pcp 2 with expert parallel runs the all2all at --data-parallel-size 1 (vLLM's
    use_all2all): no "does nothing" warning, an EP world of 2."""
    from vllm.config import ParallelConfig

    par = ParallelConfig(
        all2all_backend=LOW_LATENCY, prefill_context_parallel_size=2, enable_expert_parallel=True
    )
    assert par.use_all2all and config_rules.ep_world_size(par) == 2
    _, checks = _doctor(monkeypatch, tiny, "-pcp", "2", "-ep")
    check = checks["expert parallel"]
    assert check.ok and not check.warn
    assert check.detail.startswith(
        "EP world 2 (--data-parallel-size 1 x --prefill-context-parallel-size 2 x "
    )


# ----------------------------------------------------- 4. --all2all-backend name
def _vllm_parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def test_doctor_accepts_what_vllm_s_parser_accepts():
    [action] = [a for a in _vllm_parser()._actions if "--all2all-backend" in a.option_strings]
    assert set(doctor.accepted_backends()) == set(action.choices)
    assert set(backends.BACKENDS) <= set(action.choices)


def test_unknown_backend_fails_in_both(tiny, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _vllm_parser().parse_args(["--all2all-backend", "bogus"])
    with pytest.raises(Exception, match="all2all_backend"):
        engine_config(tiny, "bogus")
    capsys.readouterr()
    rc, checks = _doctor(monkeypatch, tiny, "--all2all-backend", "bogus", *EP)
    check = checks["all2all backend"]
    assert rc == 1 and not check.ok
    assert (
        check.fix == f"pass --all2all-backend {LOW_LATENCY} or --all2all-backend {HIGH_THROUGHPUT}"
    )
    out = capsys.readouterr().out
    assert "[FAIL] all2all backend: bogus is not a name vLLM accepts" in out
    assert f"  - all2all backend: {check.fix}" in out


def test_another_vllm_backend_is_a_warning(tiny, monkeypatch):
    """vLLM accepts it, the plugin leaves it alone: doctor checks as for low latency, warns."""
    assert _vllm_parser().parse_args(["--all2all-backend", "deepep_low_latency"])
    _, checks = _doctor(monkeypatch, tiny, "--all2all-backend", "deepep_low_latency", *EP)
    check = checks["all2all backend"]
    assert check.ok and check.warn and "not a flashinfer_ep backend" in check.detail
    assert "LL memory estimate" in checks


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_our_backends_are_ok(tiny, monkeypatch, backend):
    _vllm_parser().parse_args(["--all2all-backend", backend])
    _, checks = _doctor(monkeypatch, tiny, "--all2all-backend", backend, *EP)
    check = checks["all2all backend"]
    assert check.ok and not check.warn and check.detail == backend


# ------------------------------------------------------------------- no --model
def test_serve_arguments_are_checked_without_a_model(capsys):
    assert cli.main(["doctor", "--no-gpu", "--enable-dbo"]) == 1
    out = capsys.readouterr().out
    assert "vllm serve arguments:\n" in out and "[FAIL] micro-batching: --enable-dbo" in out


def test_plain_doctor_has_no_serve_section(capsys):
    cli.main(["doctor", "--no-gpu"])
    assert "vllm serve arguments:" not in capsys.readouterr().out
