"""`--moe-backend deep_gemm` under LL at config time (vllm/fp8_experts_choice.py), on CPU.

Block-FP8 LL layers may run vLLM 0.33.0's batched DeepGEMM experts (in the package's
`ReceivedRowsOrDeepGemmExperts`, tested in test_deep_gemm_experts.py): the engine config
keeps the choice (logged, with where small forwards go) or refuses it with one error
naming the flag, `--moe-backend auto` takes it where it can run, and doctor gives the
same verdict. The rules' inputs: the LL buffer's rows per expert (whole DeepGEMM row
tiles), vLLM's DeepGEMM switch, the checkpoint's ignore list, a speculative draft.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import DEEPSEEK_V3_MTP, engine_config, write_model
from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)

import vllm_flashinfer_ep
from tests.helpers import moe_config
from vllm_flashinfer_ep import cli, doctor, envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm import fp8_experts_choice, receive_quant

vllm_flashinfer_ep.register()

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 8, 2, 256
FLAG = f"--all2all-backend {LOW_LATENCY}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    for name in (fp8_experts_choice.DEEP_GEMM_SWITCH, "VLLM_MOE_USE_DEEP_GEMM"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-dg"))


# ------------------------------------------------------------------ engine config
def test_ll_block_fp8_keeps_deep_gemm_and_says_so(tiny_moe, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(
            tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="deep_gemm"
        )
    assert cfg.kernel_config.moe_backend == "deep_gemm"
    assert "DeepGEMM batched experts (--moe-backend deep_gemm)" in caplog.text
    assert "at most 4 rows per expert run the package's received-rows" in caplog.text


SMALL_FORWARDS = {  # what the config-time line says for each kind of bound
    "off": "every forward on DeepGEMM (VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS=0)",
    "bound": "rows per expert run the package's received-rows",
    "all": "every forward on the package's received-rows Triton experts",
}


@pytest.mark.parametrize(
    ("rows", "kind", "says"),
    [
        ("0", "off", ""),
        ("1.5", "bound", "at most 1.5 rows"),
        ("0.5", "bound", "at most 0.5 rows"),
        ("inf", "all", "=inf"),
    ],
)
def test_the_named_deep_gemm_logs_where_small_forwards_go(
    tiny_moe, caplog, monkeypatch, rows, kind, says
):
    monkeypatch.setenv("VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS", rows)
    with caplog.at_level(logging.INFO):
        engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="deep_gemm")
    assert says in caplog.text
    assert [k for k, line in SMALL_FORWARDS.items() if line in caplog.text] == [kind]


@pytest.mark.parametrize("quantization", ["fp8_per_block", None])
def test_a_bad_small_forwards_bound_fails_the_engine_config(tiny_moe, monkeypatch, quantization):
    """Refused with the other variables, whatever the model (a BF16 one has no DeepGEMM)."""
    from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

    monkeypatch.setenv("VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS", "-2")
    kwargs = {"quantization": quantization} if quantization else {}
    with pytest.raises(
        FlashInferEPEnvVarError, match="VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS='-2'"
    ):
        engine_config(tiny_moe, LOW_LATENCY, **kwargs)


def test_a_block_fp8_checkpoint_keeps_deep_gemm(tmp_path):
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    model = write_model(tmp_path / "m", quantization_config=quant)
    cfg = engine_config(model, LOW_LATENCY, moe_backend="deep_gemm")
    assert cfg.kernel_config.moe_backend == "deep_gemm"


REFUSED = [
    (HIGH_THROUGHPUT, dict(quantization="fp8_per_block"), "under flashinfer_ep_low_latency only"),
    (LOW_LATENCY, dict(quantization="fp8_per_tensor"), "128x128 block-FP8 layers only"),
    (LOW_LATENCY, dict(quantization="fp8_per_channel"), "128x128 block-FP8 layers only"),
    # dp=2: 200 x 2 = 400 rows per expert; 192 x 2 = 384 would do.
    (
        LOW_LATENCY,
        dict(quantization="fp8_per_block", max_num_batched_tokens=200),
        "Pass --max-num-batched-tokens a multiple of 64",
    ),
]


@pytest.mark.parametrize("backend,kwargs,message", REFUSED)
def test_deep_gemm_where_it_cannot_run_is_one_clear_error(tiny_moe, backend, kwargs, message):
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(tiny_moe, backend, moe_backend="deep_gemm", **kwargs)
    assert type(info.value) is FlashInferEPConfigError
    assert message in str(info.value) and "--moe-backend triton" in str(info.value)


def test_with_rounds_the_round_not_the_budget_must_fill_whole_tiles(tiny_moe, monkeypatch):
    """Under VLLM_FLASHINFER_EP_LL_ROUND_TOKENS DeepGEMM's experts are built for one round:
    a budget of 1000 (refused alone: 2000 rows per expert) serves with rounds of 512, and
    rounds of 500 are refused naming the variable (dp=2: a multiple of 64 is needed)."""
    block = dict(quantization="fp8_per_block", moe_backend="deep_gemm")
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "512")
    cfg = engine_config(tiny_moe, LOW_LATENCY, max_num_batched_tokens=1000, **block)
    assert cfg.kernel_config.moe_backend == "deep_gemm"
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "500")
    with pytest.raises(FlashInferEPConfigError, match="Set a multiple of 64") as info:
        engine_config(tiny_moe, LOW_LATENCY, max_num_batched_tokens=1000, **block)
    assert f"{envs.LL_ROUND_TOKENS}=500" in str(info.value)
    monkeypatch.delenv(envs.LL_ROUND_TOKENS)
    with pytest.raises(FlashInferEPConfigError, match="a multiple of 64"):
        engine_config(tiny_moe, LOW_LATENCY, max_num_batched_tokens=1000, **block)


def test_a_capacity_that_fills_whole_tiles_is_kept(tiny_moe):
    cfg = engine_config(
        tiny_moe,
        LOW_LATENCY,
        quantization="fp8_per_block",
        moe_backend="deep_gemm",
        max_num_batched_tokens=192,
    )
    assert cfg.kernel_config.moe_backend == "deep_gemm"


def test_vllm_s_deep_gemm_switch_at_zero_is_named(tiny_moe, monkeypatch):
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    with pytest.raises(FlashInferEPConfigError, match="VLLM_USE_DEEP_GEMM=0 turns DeepGEMM off"):
        engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="deep_gemm")


def test_the_moe_only_switch_does_not_override_an_explicit_choice(tiny_moe, monkeypatch):
    """vLLM's oracle honours --moe-backend deep_gemm before it reads VLLM_MOE_USE_DEEP_GEMM."""
    monkeypatch.setenv("VLLM_MOE_USE_DEEP_GEMM", "0")
    cfg = engine_config(
        tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="deep_gemm"
    )
    assert cfg.kernel_config.moe_backend == "deep_gemm"


def test_other_experts_stay_refused(tiny_moe):
    with pytest.raises(FlashInferEPConfigError, match="Pass --moe-backend triton"):
        engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="cutlass")


def test_doctor_gives_the_engine_s_verdict(tiny_moe, monkeypatch):
    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    args = ["-q", "fp8_per_block", "--moe-backend", "deep_gemm", "-dp", "2", "-ep"]
    cli.main(["doctor", "--model", tiny_moe, *args, "--max-num-batched-tokens", "200"])
    check = {c.name: c for c in seen}["FP8 experts"]
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(
            tiny_moe,
            LOW_LATENCY,
            quantization="fp8_per_block",
            moe_backend="deep_gemm",
            max_num_batched_tokens=200,
        )
    assert not check.ok and check.fix == str(info.value)
    seen.clear()
    cli.main(["doctor", "--model", tiny_moe, *args])
    check = {c.name: c for c in seen}["FP8 experts"]
    assert check.ok and "DeepGEMM" in check.detail


def test_ht_refuses_deep_gemm_experts():
    """HT hands flat rows with row-major scales: vLLM's Triton experts only."""
    cfg = moe_config(experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, inter=INTER, max_num_tokens=128)
    one = torch.ones(EXPERTS, dtype=torch.float32)
    qc = fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])
    experts = BatchedDeepGemmExperts(cfg, qc, max_num_tokens=128, num_dispatchers=1)
    with pytest.raises(FlashInferEPConfigError, match="--moe-backend triton"):
        receive_quant.check_ht_experts(experts, FLAG)


# ---------------------------------------------------------------------- the rules
@pytest.mark.parametrize(
    "tokens,world,ok",
    [(128, 1, True), (64, 2, True), (256, 3, True), (100, 1, False), (96, 2, False)],
)
def test_rows_rule(tokens, world, ok):
    assert (fp8_experts_choice.rows_reason(FLAG, tokens, world) is None) == ok


@pytest.mark.parametrize(
    "value,refused",
    [("0", True), ("00", True), (" 0", True), ("1", False), ("", False), ("--0", False)],
)
def test_switch_values_read_as_vllm_reads_them(value, refused):
    """int(value) == 0 is off, as vLLM reads it; what int() cannot read is vLLM's to refuse."""
    reason = fp8_experts_choice.switches_reason(FLAG, {"VLLM_USE_DEEP_GEMM": value})
    assert (reason is not None) == refused


# A budget the memory rule must lower on an 80 GiB GPU (dp=2, block FP8 online).
MEMORY_BOUND = dict(
    quantization="fp8_per_block",
    max_num_batched_tokens=100_001,
    max_num_seqs=256,
    gpu_memory_utilization=0.9,
)


def _memory_bound_model(tmp_path, monkeypatch) -> str:
    """A 128-expert model and an 80 GiB GPU, where MEMORY_BOUND's budget does not fit."""
    from vllm_flashinfer_ep.vllm import config_rules

    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: 80 * (1 << 30))
    return write_model(
        tmp_path / "big",
        num_experts=128,
        num_experts_per_tok=8,
        hidden_size=2048,
        max_position_embeddings=32768,
    )


def test_a_lowered_step_budget_keeps_whole_deep_gemm_tiles(tmp_path, monkeypatch):
    """The memory rule lowers --max-num-batched-tokens to what fits (an arbitrary count);
    with DeepGEMM experts it lowers to a multiple of their step instead of to a value the
    rows rule would then refuse. doctor reports the same budget and verdict."""
    big = _memory_bound_model(tmp_path, monkeypatch)
    cfg = engine_config(big, LOW_LATENCY, **MEMORY_BOUND, moe_backend="deep_gemm")
    fit = cfg.scheduler_config.max_num_batched_tokens
    assert fit < 100_001 and fit % 64 == 0  # dp=2: 64 tokens x 2 ranks = one 128-row tile
    without = engine_config(big, LOW_LATENCY, **MEMORY_BOUND)
    assert fit <= without.scheduler_config.max_num_batched_tokens < fit + 64

    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    cli.main(
        ["doctor", "--model", big, "-dp", "2", "-ep", "-q", "fp8_per_block"]
        + ["--moe-backend", "deep_gemm", "--max-num-batched-tokens", "100001"]
        + ["--max-num-seqs", "256", "--gpu-memory-utilization", "0.9"]
    )
    checks = {c.name: c for c in seen}
    assert checks["FP8 experts"].ok and "DeepGEMM" in checks["FP8 experts"].detail
    assert f"from 100001 to {fit}:" in checks["LL memory estimate"].fix


# ------------------------------------------------------------------ --moe-backend auto
@pytest.fixture
def hopper(monkeypatch):
    """A host where vLLM's DeepGEMM runs (this CPU machine is not one)."""
    monkeypatch.setattr(fp8_experts_choice, "platform_reason", lambda: None)


@pytest.mark.usefixtures("hopper")
def test_auto_takes_deep_gemm_for_ll_block_fp8_on_hopper(tiny_moe, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block")
    assert cfg.kernel_config.moe_backend == "deep_gemm"
    assert "--moe-backend auto -> deep_gemm" in caplog.text
    assert "DeepGEMM: forwards of at most 4 rows per expert run" in caplog.text


@pytest.mark.usefixtures("hopper")
@pytest.mark.parametrize(
    "backend,kwargs",
    [
        (HIGH_THROUGHPUT, dict(quantization="fp8_per_block")),
        (LOW_LATENCY, dict(quantization="fp8_per_channel")),
        (LOW_LATENCY, dict(quantization="fp8_per_block", max_num_batched_tokens=200)),
    ],
    ids=["ht", "per-channel", "rows-not-whole-tiles"],
)
def test_auto_keeps_triton_where_deep_gemm_cannot_run(tiny_moe, backend, kwargs, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, backend, **kwargs)
    assert cfg.kernel_config.moe_backend == "triton"
    assert "--moe-backend auto -> triton" in caplog.text
    assert "received-rows Triton experts, faster" not in caplog.text  # no DeepGEMM layers


def test_auto_keeps_triton_off_hopper(tiny_moe, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block")
    assert cfg.kernel_config.moe_backend == "triton"
    assert "not a Hopper GPU" in caplog.text


@pytest.mark.usefixtures("hopper")
def test_doctor_says_what_auto_becomes(tiny_moe, monkeypatch):
    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    cli.main(["doctor", "--model", tiny_moe, "-q", "fp8_per_block", "-dp", "2", "-ep"])
    check = {c.name: c for c in seen}["FP8 experts"]
    assert check.ok and "--moe-backend auto -> deep_gemm" in check.detail
    assert "forwards of at most 4 rows per expert run the package's received-rows" in check.detail


@pytest.mark.usefixtures("hopper")
def test_doctor_with_a_bad_small_forwards_bound_reports_it_once(tiny_moe, monkeypatch):
    """The variables' check names the bad value; the FP8 experts line does not crash."""
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "-1")
    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    cli.main(["doctor", "--model", tiny_moe, "-q", "fp8_per_block", "-dp", "2", "-ep"])
    check = {c.name: c for c in seen}["FP8 experts"]
    assert check.ok and "rows per expert" not in check.detail


# ------------------------------------------------ MoE layers that stay unquantized
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def experts_left_bf16(tmp_path_factory):
    """A block-FP8 checkpoint whose ignore list keeps one layer's experts in BF16: vLLM
    runs that layer with its unquantized MoE, which takes triton but not deep_gemm."""
    quant = dict(BLOCK, ignored_layers=["lm_head", "model.layers.0.mlp.experts"])
    return write_model(tmp_path_factory.mktemp("bf16-experts"), quantization_config=quant)


@pytest.mark.usefixtures("hopper")
def test_auto_keeps_triton_when_the_checkpoint_leaves_experts_unquantized(
    experts_left_bf16, caplog
):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(experts_left_bf16, LOW_LATENCY)
    assert cfg.kernel_config.moe_backend == "triton"
    assert "leaves MoE layers unquantized (model.layers.0.mlp.experts)" in caplog.text


@pytest.mark.usefixtures("hopper")
def test_an_ignore_list_without_experts_keeps_deep_gemm(tmp_path):
    """Qwen3's FP8 checkpoints leave the router gates (mlp.gate) unquantized, not the
    experts."""
    quant = dict(BLOCK, modules_to_not_convert=["lm_head", "model.layers.0.mlp.gate"])
    model = write_model(tmp_path / "m", quantization_config=quant)
    assert engine_config(model, LOW_LATENCY).kernel_config.moe_backend == "deep_gemm"


def test_deep_gemm_with_unquantized_experts_is_one_clear_error(experts_left_bf16):
    with pytest.raises(FlashInferEPConfigError) as err:
        engine_config(experts_left_bf16, LOW_LATENCY, moe_backend="deep_gemm")
    assert "leaves MoE layers unquantized" in str(err.value)
    assert "Pass --moe-backend auto or triton" in str(err.value)


@pytest.mark.usefixtures("hopper")
def test_doctor_reads_the_ignore_list_as_the_engine_does(experts_left_bf16, monkeypatch):
    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    cli.main(["doctor", "--model", experts_left_bf16, "-dp", "2", "-ep"])
    check = {c.name: c for c in seen}["FP8 experts"]
    assert check.ok and "--moe-backend auto -> triton" in check.detail
    assert "leaves MoE layers unquantized" in check.detail


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("dsv3-mtp"), base=DEEPSEEK_V3_MTP)


def _with_mtp(**spec) -> dict:
    config = dict(method="mtp", num_speculative_tokens=1, **spec)
    return dict(quantization="fp8_per_block", speculative_config=config)


@pytest.mark.usefixtures("hopper")
def test_auto_gives_deep_gemm_to_an_mtp_draft_quantized_like_its_target(mtp_target, caplog):
    """An MTP draft inherits --moe-backend and the target's quantization: its MoE layers
    are 128x128 block FP8 too, so `auto` keeps DeepGEMM for both."""
    with caplog.at_level(logging.INFO):
        cfg = engine_config(mtp_target, LOW_LATENCY, **_with_mtp())
    assert cfg.speculative_config.draft_model_config.is_moe
    assert cfg.kernel_config.moe_backend == "deep_gemm"
    assert "speculative draft's MoE layers" not in caplog.text


@pytest.mark.usefixtures("hopper")
def test_a_draft_with_its_own_moe_backend_leaves_deep_gemm_to_the_target(mtp_target):
    cfg = engine_config(mtp_target, LOW_LATENCY, **_with_mtp(moe_backend="triton"))
    assert cfg.kernel_config.moe_backend == "deep_gemm"


@pytest.mark.usefixtures("hopper")
def test_a_budget_lowered_under_auto_keeps_deep_gemm_tiles(tmp_path, monkeypatch):
    """`auto` decides for DeepGEMM before the memory rule lowers the budget, so the
    lowered budget is whole tiles and DeepGEMM still runs."""
    cfg = engine_config(_memory_bound_model(tmp_path, monkeypatch), LOW_LATENCY, **MEMORY_BOUND)
    fit = cfg.scheduler_config.max_num_batched_tokens
    assert fit < 100_001 and fit % 64 == 0
    assert cfg.kernel_config.moe_backend == "deep_gemm"


@pytest.mark.usefixtures("hopper")
def test_under_rounds_auto_decides_for_the_round(tiny_moe, monkeypatch, caplog):
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS with `auto`: rounds of whole tiles get DeepGEMM,
    rounds of part tiles keep Triton with the reason logged (only deep_gemm asked by name
    refuses them), as doctor says."""
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "512")
    cfg = engine_config(
        tiny_moe, LOW_LATENCY, max_num_batched_tokens=1000, quantization="fp8_per_block"
    )
    assert cfg.kernel_config.moe_backend == "deep_gemm"
    monkeypatch.setenv(envs.LL_ROUND_TOKENS, "500")
    with caplog.at_level(logging.INFO):
        cfg = engine_config(
            tiny_moe, LOW_LATENCY, max_num_batched_tokens=1000, quantization="fp8_per_block"
        )
    assert cfg.kernel_config.moe_backend == "triton"
    assert "--moe-backend auto -> triton" in caplog.text and "multiple of 64" in caplog.text
    seen = []
    real = doctor.model_checks
    monkeypatch.setattr(doctor, "model_checks", lambda *a, **k: seen.extend(real(*a, **k)) or seen)
    argv = ["doctor", "--model", tiny_moe, "-q", "fp8_per_block", "-dp", "2", "-ep"]
    for tokens, choice in (("500", "triton"), ("512", "deep_gemm")):
        monkeypatch.setenv(envs.LL_ROUND_TOKENS, tokens)
        seen.clear()
        cli.main([*argv, "--max-num-batched-tokens", "1000"])
        assert f"--moe-backend auto -> {choice}" in {c.name: c for c in seen}["FP8 experts"].detail


@pytest.mark.usefixtures("hopper")
def test_a_moe_draft_quantized_otherwise_keeps_auto_off_deep_gemm(mtp_target):
    """A MoE draft that is not 128x128 block FP8 (an EAGLE head of a BF16 checkpoint; on
    CPU, the real MTP config with its draft's quantization taken away) cannot take
    DeepGEMM, and inherits --moe-backend unless the speculative config names its own."""
    from vllm_flashinfer_ep.vllm.fp8_experts_choice import draft_moe

    cfg = engine_config(mtp_target, LOW_LATENCY, **_with_mtp())
    assert draft_moe(cfg) is None  # quantized like the target
    cfg.speculative_config.draft_model_config.quantization = None
    assert "inherit --moe-backend" in draft_moe(cfg)
    cfg.speculative_config.moe_backend = "triton"
    assert draft_moe(cfg) is None
