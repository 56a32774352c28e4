"""doctor gives the engine's config-time verdicts: what the engine refuses is [FAIL] with the
engine's own message, what it changes or cannot check is [warn]; serve arguments reach
doctor through the command line; a broken config.json is named with the right hint."""

from __future__ import annotations

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import cli, doctor, envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

GIB = 1 << 30
# Qwen3-30B-A3B's MoE shape in a tiny model.
BIG = dict(num_experts=128, num_experts_per_tok=8, hidden_size=2048, max_position_embeddings=32768)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("big-shape"), **BIG)


def _gpu(monkeypatch, total: int | None) -> None:
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: total)


def _doctor(monkeypatch, model: str, *serve_args: str):
    """Run `vllm-flashinfer-ep doctor --model MODEL SERVE_ARGS...` and return its checks of
    the serve arguments and the model, by name."""
    seen = []
    for name in ("serve_checks", "model_checks"):
        monkeypatch.setattr(doctor, name, _recording(getattr(doctor, name), seen))
    rc = cli.main(["doctor", "--model", model, *serve_args])
    return rc, {c.name: c for c in seen}


def _recording(real, seen: list):
    def checks(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.extend(result)
        return result

    return checks


def _engine_refusal(model: str, backend: str = LOW_LATENCY, **kwargs) -> str:
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(model, backend, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------- dtype
def test_float16_checkpoint_fails_in_both_with_the_same_reason(tmp_path, monkeypatch, capsys):
    model = write_model(tmp_path / "fp16", torch_dtype="float16")
    reason = _engine_refusal(model)
    rc, checks = _doctor(monkeypatch, model)
    assert rc == 1
    assert not checks["dtype"].ok and checks["dtype"].fix == reason
    assert "Pass --dtype bfloat16" in reason
    out = capsys.readouterr().out
    assert "[FAIL] dtype: float16 (checkpoint float16, --dtype auto)" in out
    assert f"  - dtype: {reason}" in out


def test_dtype_flag_decides_in_both(tmp_path, monkeypatch):
    model = write_model(tmp_path / "fp16", torch_dtype="float16")
    engine_config(model, LOW_LATENCY, dtype="bfloat16")
    assert _doctor(monkeypatch, model, "--dtype", "bfloat16")[1]["dtype"].ok
    bf16 = write_model(tmp_path / "bf16")
    reason = _engine_refusal(bf16, dtype="half")
    assert _doctor(monkeypatch, bf16, "--dtype", "half")[1]["dtype"].fix == reason


def test_float32_checkpoint_is_served_in_bfloat16_by_both(tmp_path, monkeypatch):
    model = write_model(tmp_path / "fp32", torch_dtype="float32")
    engine_config(model, LOW_LATENCY)
    check = _doctor(monkeypatch, model)[1]["dtype"]
    assert check.ok and check.detail.startswith("bfloat16 (checkpoint float32")


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
    ],
    ids=["awq", "fp8-block-64"],
)
def test_quantization_refusals_match(tmp_path, monkeypatch, quant):
    model = write_model(tmp_path / "q", quantization_config=quant)
    try:
        reason = _engine_refusal(model)
    except Exception as exc:  # noqa: BLE001 - vLLM itself may refuse the config first
        pytest.skip(f"vLLM refuses this config before the plugin: {exc}")
    check = _doctor(monkeypatch, model)[1]["checkpoint precision"]
    assert not check.ok and check.fix == reason


# ------------------------------------------------------------------------ memory
def test_memory_refusal_is_doctor_s_failure(big, monkeypatch):
    _gpu(monkeypatch, 4 * GIB)  # 165 tokens fit, fewer than --max-num-seqs 256
    flags = dict(max_num_batched_tokens=4096, max_num_seqs=256, gpu_memory_utilization=0.9)
    reason = _engine_refusal(big, **flags)
    rc, checks = _doctor(
        monkeypatch,
        big,
        "--max-num-batched-tokens",
        "4096",
        "--max-num-seqs",
        "256",
        "--gpu-memory-utilization",
        "0.9",
    )
    est = checks["LL memory estimate"]
    assert rc == 1 and not est.ok and est.fix == reason
    assert "--max-num-seqs 256" in reason


def test_a_round_fleet_that_does_not_fit_fails_both_with_the_same_reason(big, monkeypatch):
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS sizes the LL fleet: one that does not fit is the
    engine's refusal and doctor's failure, in the same words."""
    _gpu(monkeypatch, 16 * GIB)
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "4096")
    reason = _engine_refusal(big, max_num_batched_tokens=8192, gpu_memory_utilization=0.9)
    rc, checks = _doctor(
        monkeypatch, big, "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.9"
    )
    est = checks["LL memory estimate"]
    assert rc == 1 and not est.ok and est.fix == reason
    assert f"{envs.LL_ROUND_TOKENS}=4096" in reason and "Set it to at most" in reason


def test_rounds_without_data_parallel_ranks_fail_both_with_the_same_reason(big, monkeypatch):
    """Rounds are cut from vLLM's data parallel token counts: an EP group of two context
    parallel ranks without DP has none, so the engine refuses at config time (not a
    startup crash or a hang) and doctor fails in the same words."""
    _gpu(monkeypatch, 80 * GIB)
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "512")
    sizes = dict(data_parallel_size=1, prefill_context_parallel_size=2)
    reason = _engine_refusal(big, max_num_batched_tokens=4096, **sizes)
    rc, checks = _doctor(
        monkeypatch, big, "-dp", "1", "-pcp", "2", "-ep", "--max-num-batched-tokens", "4096"
    )
    rounds = checks["LL rounds"]
    assert rc == 1 and not rounds.ok and rounds.fix == reason
    assert "needs --data-parallel-size > 1" in reason and f"{envs.LL_ROUND_TOKENS}=512" in reason


def test_thousands_of_gib_are_not_ok_on_a_gpu(big, monkeypatch):
    """vLLM's own parser for the flag (20m = 20,000,000); the engine lowers the budget, doctor
    says so as a warning with the engine's figure instead of [ok]."""
    _gpu(monkeypatch, 141 * GIB)
    args = (
        "--max-num-batched-tokens",
        "20m",
        "--max-num-seqs",
        "1024",
        "--gpu-memory-utilization",
        "0.9",
    )
    est = _doctor(monkeypatch, big, *args)[1]["LL memory estimate"]
    assert "GiB per GPU at --max-num-batched-tokens 20000000" in est.detail
    assert float(est.detail.split()[1]) > 1000
    cfg = engine_config(
        big,
        LOW_LATENCY,
        max_num_batched_tokens=20_000_000,
        max_num_seqs=1024,
        gpu_memory_utilization=0.9,
    )
    fit = cfg.scheduler_config.max_num_batched_tokens
    assert est.warn and f"lowers --max-num-batched-tokens from 20000000 to {fit}:" in est.fix


def test_lowered_step_budget_is_a_warning_with_the_engine_s_value(big, monkeypatch):
    _gpu(monkeypatch, 80 * GIB)
    cfg = engine_config(
        big,
        LOW_LATENCY,
        max_num_batched_tokens=100_000,
        max_num_seqs=256,
        gpu_memory_utilization=0.9,
    )
    fit = cfg.scheduler_config.max_num_batched_tokens
    assert fit < 100_000
    est = _doctor(
        monkeypatch,
        big,
        "--max-num-batched-tokens",
        "100000",
        "--max-num-seqs",
        "256",
        "--gpu-memory-utilization",
        "0.9",
    )[1]["LL memory estimate"]
    assert est.ok and est.warn
    assert f"the engine lowers --max-num-batched-tokens from 100000 to {fit}" in est.fix


def test_unchunked_refusal_matches(big, monkeypatch):
    _gpu(monkeypatch, 80 * GIB)
    reason = _engine_refusal(
        big,
        max_num_batched_tokens=32768,
        max_model_len=32768,
        max_num_seqs=256,
        enable_chunked_prefill=False,
        gpu_memory_utilization=0.9,
    )
    est = _doctor(
        monkeypatch,
        big,
        "--max-num-batched-tokens",
        "32768",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "256",
        "--no-enable-chunked-prefill",
        "--gpu-memory-utilization",
        "0.9",
    )[1]["LL memory estimate"]
    assert not est.ok and est.fix == reason


def test_without_a_gpu_the_estimate_is_a_warning_not_ok(big, monkeypatch, capsys):
    _gpu(monkeypatch, None)
    est = _doctor(monkeypatch, big, "--max-num-batched-tokens", "1000000")[1]["LL memory estimate"]
    assert est.ok and est.warn and "not checked: no GPU visible here" in est.detail
    assert "[warn] LL memory estimate: about " in capsys.readouterr().out


def test_fitting_estimate_is_ok(big, monkeypatch):
    _gpu(monkeypatch, 141 * GIB)
    engine_config(big, LOW_LATENCY, max_num_seqs=256)
    est = _doctor(monkeypatch, big, "--max-num-seqs", "256")[1]["LL memory estimate"]
    assert est.ok and not est.warn and "fits the budget of" in est.detail


def test_ht_has_no_ll_estimate_in_either(big, monkeypatch):
    _gpu(monkeypatch, 1 * GIB)
    engine_config(big, HIGH_THROUGHPUT, max_num_batched_tokens=4096)
    checks = _doctor(monkeypatch, big, "--all2all-backend", HIGH_THROUGHPUT)[1]
    assert "LL memory estimate" not in checks and checks["hidden size"].ok


def test_rdma_buffer_refusal_matches(big, monkeypatch):
    _gpu(monkeypatch, None)
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(envs.rdma_min_bytes()))
    reason = _engine_refusal(big)
    check = _doctor(monkeypatch, big, "--data-parallel-size", "2")[1]["RDMA buffer"]
    assert not check.ok and check.fix == reason


# --------------------------------------------------------------- serve arguments
def test_serve_arguments_only_the_engine_config_reads_are_listed_not_refused(
    big, monkeypatch, capsys
):
    _gpu(monkeypatch, None)
    _, checks = _doctor(
        monkeypatch,
        big,
        "--port",
        "9000",
        "--served-model-name",
        "a",
        "b",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--all2all-backend",
        LOW_LATENCY,
        "--max-num-batched-tokens",
        "512",
    )
    assert "at --max-num-batched-tokens 512" in checks["LL memory estimate"].detail
    assert checks["expert parallel"].ok and not checks["expert parallel"].warn
    out = capsys.readouterr().out
    assert (
        "(vllm serve arguments only the engine config reads: --port 9000 --served-model-name a b)"
        in out
    )


def test_other_commands_still_refuse_unknown_arguments():
    with pytest.raises(SystemExit):
        cli.main(["bench", "--port", "1"])


# --------------------------------------------------------------- broken config.json
def test_malformed_config_json_is_named_with_a_repair_hint(tmp_path, monkeypatch):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_text('{"hidden_size": 2048,')
    rc, checks = _doctor(monkeypatch, str(bad))
    check = checks["model config"]
    assert rc == 1 and not check.ok
    assert check.detail.startswith(f"{bad / 'config.json'} is not valid JSON (")
    assert "line 1" in check.detail
    assert (
        check.fix
        == f"repair {bad / 'config.json'}: it must be the model's Hugging Face config (a JSON object)"
    )
    assert "reachable HF id" not in check.fix


def test_config_json_that_is_not_an_object(tmp_path):
    bad = tmp_path / "list"
    bad.mkdir()
    (bad / "config.json").write_text("[1, 2]")
    [check] = doctor.model_checks(str(bad))
    assert check.detail == f"{bad / 'config.json'} holds a JSON list, not an object"


def test_damaged_hub_download_names_the_cached_file(tmp_path, monkeypatch):
    cached = tmp_path / "hub" / "config.json"
    cached.parent.mkdir()
    cached.write_text("not json")
    import huggingface_hub

    monkeypatch.setattr(doctor.model_config, "_hub_unreachable", lambda model: False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(cached))
    [check] = doctor.model_checks("org/model")
    assert check.detail.startswith(f"{cached} is not valid JSON")
    assert (
        check.fix
        == f"the cached download is damaged: delete {cached} and run again to fetch it anew"
    )


# ------------------------------------------------------------- experts per EP rank
@pytest.mark.parametrize(
    ("engine_kwargs", "serve_args"),
    [
        ({"data_parallel_size": 3}, ("--data-parallel-size", "3")),
        (
            {"enable_eplb": True, "eplb_config": {"num_redundant_experts": 1}},
            ("--enable-eplb", "--eplb-config", '{"num_redundant_experts": 1}'),
        ),
    ],
    ids=["8-experts-over-3-ranks", "8+1-redundant-over-2-ranks"],
)
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_experts_that_do_not_split_over_the_ep_ranks_fail_in_both(
    tmp_path, monkeypatch, backend, engine_kwargs, serve_args
):
    # NCCL-EP gives every rank the same number of experts; vLLM's linear placement would
    # accept the uneven split and the worker would fail at load, naming no flag.
    import vllm.config.parallel as parallel

    monkeypatch.setattr(parallel.current_platform, "is_cuda_alike", lambda: True)  # EPLB
    model = write_model(tmp_path / "m", num_experts=8)
    reason = _engine_refusal(model, backend, **engine_kwargs)
    assert "do not split evenly" in reason and "--data-parallel-size" in reason
    argv = ["--all2all-backend", backend, "--enable-expert-parallel", *serve_args]
    if "--data-parallel-size" not in serve_args:
        argv += ["--data-parallel-size", "2"]
    rc, checks = _doctor(monkeypatch, model, *argv)
    assert rc == 1 and checks["experts per EP rank"].fix == reason


def test_experts_that_split_pass_in_both(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m", num_experts=12)
    engine_config(model, LOW_LATENCY, data_parallel_size=3)
    argv = ["--enable-expert-parallel", "--data-parallel-size", "3"]
    assert _doctor(monkeypatch, model, *argv)[1]["experts per EP rank"].ok


# ------------------------------------------------------- --moe-backend for BF16 models
@pytest.mark.parametrize(
    ("backend", "moe_backend"),
    [
        (LOW_LATENCY, "flashinfer_trtllm"),  # vLLM: no batched activation format
        (LOW_LATENCY, "deep_gemm"),  # vLLM: not for unquantized MoE
        (HIGH_THROUGHPUT, "cutlass"),
        (HIGH_THROUGHPUT, "batched_triton"),  # batched experts behind HT's flat rows
    ],
)
def test_a_moe_backend_that_cannot_serve_bf16_experts_fails_in_both(
    tmp_path, monkeypatch, backend, moe_backend
):
    model = write_model(tmp_path / "bf16")
    reason = _engine_refusal(model, backend, moe_backend=moe_backend)
    assert f"--moe-backend {moe_backend}" in reason and "Pass --moe-backend auto" in reason
    argv = ["--all2all-backend", backend, "--moe-backend", moe_backend]
    argv += ["--enable-expert-parallel", "--data-parallel-size", "2"]
    rc, checks = _doctor(monkeypatch, model, *argv)
    assert rc == 1 and checks["experts"].fix == reason


@pytest.mark.parametrize(
    ("backend", "moe_backend"),
    [(LOW_LATENCY, "triton"), (LOW_LATENCY, "batched_triton"), (HIGH_THROUGHPUT, "triton")],
)
def test_triton_experts_serve_bf16_in_both(tmp_path, monkeypatch, backend, moe_backend):
    model = write_model(tmp_path / "bf16")
    engine_config(model, backend, moe_backend=moe_backend)
    argv = ["--all2all-backend", backend, "--moe-backend", moe_backend]
    argv += ["--enable-expert-parallel", "--data-parallel-size", "2"]
    assert _doctor(monkeypatch, model, *argv)[1]["experts"].ok


# ------------------------------------------- refusals doctor used to list as not checked
def test_nixl_transport_without_nixl_fails_in_both(tiny_moe_model, monkeypatch):
    monkeypatch.setenv(envs.TRANSPORT, "nixl_ep")
    monkeypatch.setattr(config_rules, "transport_reason", _nixl_missing(config_rules))
    from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

    with pytest.raises(FlashInferEPEnvVarError) as info:
        engine_config(tiny_moe_model, LOW_LATENCY)
    rc, _ = _doctor(monkeypatch, tiny_moe_model)
    assert rc == 1
    from vllm_flashinfer_ep.doctor.host import variables_check

    check = variables_check()
    assert not check.ok and check.fix == str(info.value)


def _nixl_missing(rules):
    """The real rule with FlashInfer saying it has no NIXL-EP (what the PyPI wheel says)."""
    import sys
    import types

    real = rules.transport_reason

    def reason():
        fake = types.ModuleType("flashinfer.moe_ep")
        fake.have_nixl_ep = lambda: False
        saved = sys.modules.get("flashinfer.moe_ep")
        sys.modules["flashinfer.moe_ep"] = fake
        try:
            return real()
        finally:
            if saved is None:
                sys.modules.pop("flashinfer.moe_ep", None)
            else:
                sys.modules["flashinfer.moe_ep"] = saved

    return reason


@pytest.fixture()
def tiny_moe_model(tmp_path):
    return write_model(tmp_path / "m")


def test_round_robin_placement_fails_in_both(tiny_moe_model, monkeypatch):
    reason = _engine_refusal(tiny_moe_model, expert_placement_strategy="round_robin")
    argv = ["--enable-expert-parallel", "-dp", "2", "--expert-placement-strategy", "round_robin"]
    rc, checks = _doctor(monkeypatch, tiny_moe_model, *argv)
    assert rc == 1 and checks["expert placement"].fix == reason


def test_hf_overrides_reach_doctor_as_they_reach_the_engine(tiny_moe_model, monkeypatch):
    overrides = {"num_experts_per_tok": 20}  # past the LL top_k limit
    reason = _engine_refusal(tiny_moe_model, hf_overrides=overrides)
    rc, checks = _doctor(
        monkeypatch, tiny_moe_model, "--hf-overrides", '{"num_experts_per_tok": 20}'
    )
    assert rc == 1 and checks["top_k"].fix == reason


def test_overrides_merge_as_vllm_merges_them():
    """Against vLLM's own ModelConfig._apply_dict_overrides on the transformers config the
    same config.json loads as: a nested model config is updated recursively (dicts in it
    too), a top-level dict attribute is replaced."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig
    from vllm.config.model import ModelConfig

    from vllm_flashinfer_ep.model_shape import with_overrides

    cfg = {
        "text_config": {"hidden_size": 1, "top": 2, "quantization_config": {"a": 1, "b": 2}},
        "quantization_config": {"a": 1, "b": 2},
    }
    overrides = {
        "text_config": {"hidden_size": 3, "quantization_config": {"a": 5}},
        "quantization_config": {"a": 5},
    }
    hf = PretrainedConfig(quantization_config=dict(cfg["quantization_config"]))
    hf.text_config = PretrainedConfig(**{k: v for k, v in cfg["text_config"].items()})
    hf.text_config.quantization_config = dict(cfg["text_config"]["quantization_config"])
    shim = SimpleNamespace()  # vLLM's methods, without building a whole ModelConfig
    shim._update_nested = lambda target, updates: ModelConfig._update_nested(shim, target, updates)
    ModelConfig._apply_dict_overrides(shim, hf, overrides)
    got = with_overrides(cfg, overrides)
    assert got["quantization_config"] == hf.quantization_config == {"a": 5}
    assert got["text_config"]["quantization_config"] == hf.text_config.quantization_config
    assert got["text_config"]["quantization_config"] == {"a": 5, "b": 2}
    assert got["text_config"]["hidden_size"] == hf.text_config.hidden_size == 3
    assert got["text_config"]["top"] == 2


def test_an_fp8_checkpoint_in_another_format_is_told_which_fp8_format_is_served(tmp_path):
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    model = write_model(tmp_path / "ct", quantization_config=quant)
    [check] = [c for c in doctor.model_checks(model) if c.name == "checkpoint precision"]
    assert not check.ok and "quantized with compressed-tensors" in check.fix
    assert "vLLM's fp8 format (quant_method fp8" in check.fix


def test_an_ht_hidden_size_not_divisible_by_8_fails_in_both(tmp_path, monkeypatch):
    # nccl_ep.h: HT's max_token_bytes (hidden x 2) must be a multiple of 16 bytes.
    model = write_model(tmp_path / "odd", hidden_size=132)
    reason = _engine_refusal(model, HIGH_THROUGHPUT)
    assert "multiples of 16 bytes" in reason
    argv = ["--all2all-backend", HIGH_THROUGHPUT, "-dp", "2", "-ep"]
    rc, checks = _doctor(monkeypatch, model, *argv)
    assert rc == 1 and checks["hidden size"].fix == reason
    engine_config(model, LOW_LATENCY)  # LL pads it to 2048
    engine_config(write_model(tmp_path / "even", hidden_size=136), HIGH_THROUGHPUT)


@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_elastic_ep_fails_in_both(tiny_moe_model, monkeypatch, backend):
    # Elastic EP's groups are stateless: no torch.distributed group to bootstrap NCCL-EP.
    import vllm.config.parallel as parallel

    monkeypatch.setattr(parallel.current_platform, "is_cuda_alike", lambda: True)  # EPLB
    kwargs = dict(enable_elastic_ep=True, enable_eplb=True, eplb_config={"use_async": False})
    reason = _engine_refusal(tiny_moe_model, backend, **kwargs)
    assert "Remove --enable-elastic-ep" in reason
    argv = ["--all2all-backend", backend, "-dp", "2", "-ep", "--enable-elastic-ep"]
    rc, checks = _doctor(monkeypatch, tiny_moe_model, *argv, "--enable-eplb")
    assert rc == 1 and checks["elastic EP"].fix == reason


@pytest.mark.parametrize(
    ("value", "ok"), [("other", False), ("", False), ("x,flashinfer_ep", True)]
)
def test_vllm_plugins_that_leave_the_plugin_out_fail_doctor(monkeypatch, value, ok):
    # vLLM loads only the general plugins VLLM_PLUGINS names (plugins/__init__.py); without
    # ours, `vllm serve` refuses --all2all-backend flashinfer_ep_* as an invalid choice.
    from vllm_flashinfer_ep.doctor.host import package_checks

    monkeypatch.setenv("VLLM_PLUGINS", value)
    [check] = [c for c in package_checks() if c.name == "VLLM_PLUGINS"]
    assert check.ok is ok
    monkeypatch.delenv("VLLM_PLUGINS")
    assert not [c for c in package_checks() if c.name == "VLLM_PLUGINS"]


def _draft_seen(monkeypatch, model: str, spec: str):
    from vllm_flashinfer_ep.doctor import model_verdicts

    seen = []
    real = model_verdicts.draft_check
    monkeypatch.setattr(doctor, "draft_check", lambda *a: seen.append(real(*a)) or seen[-1])
    argv = ["doctor", "--model", model, "-dp", "2", "-ep", "--speculative-config", spec]
    return cli.main(argv), seen[0]


def test_a_moe_draft_model_draft_fails_in_both(tmp_path, monkeypatch):
    import json

    target, draft = write_model(tmp_path / "t"), write_model(tmp_path / "d")
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    reason = _engine_refusal(target, speculative_config=spec)
    rc, check = _draft_seen(monkeypatch, target, json.dumps(spec))
    assert rc == 1 and not check.ok and check.fix == reason


def test_a_dense_draft_model_draft_passes_doctor(tmp_path, monkeypatch):
    import json

    from tiny_models import QWEN3_MOE

    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    dense = {k: v for k, v in QWEN3_MOE.items() if k not in moe_keys}
    dense.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    target, draft = write_model(tmp_path / "t"), write_model(tmp_path / "d", base=dense)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    engine_config(target, LOW_LATENCY, speculative_config=spec)
    assert _draft_seen(monkeypatch, target, json.dumps(spec))[1].ok
