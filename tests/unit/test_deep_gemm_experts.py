"""`--moe-backend deep_gemm` under LL (vllm/deep_gemm_experts.py), on CPU with real vLLM objects.

Block-FP8 LL layers may run vLLM 0.33.0's BatchedDeepGemmExperts: the engine config keeps
the choice (logged) or refuses it with one error naming the flag, doctor gives the same
verdict, and the LL prepare hands those experts the activation scales MN-major (what
DeepGEMM reads) with the wire's values, leaving Triton experts theirs row-major. DeepGEMM
itself does not run here: tests/kernels/test_deep_gemm_experts_gpu.py runs it on the
receive buffer against vLLM's batched Triton experts.
"""

from __future__ import annotations

import logging

import pytest
import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from tiny_models import engine_config, write_model
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts

import vllm_flashinfer_ep
from tests.helpers import moe_config
from vllm_flashinfer_ep import cli, doctor, envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm import compact_experts, deep_gemm_experts, receive_quant
from vllm_flashinfer_ep.vllm.patches import _helper
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

vllm_flashinfer_ep.register()

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 8, 2, 256
FLAG = f"--all2all-backend {LOW_LATENCY}"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    for name in deep_gemm_experts.DEEP_GEMM_SWITCHES:
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


def test_a_capacity_that_fills_whole_tiles_is_kept(tiny_moe):
    cfg = engine_config(
        tiny_moe,
        LOW_LATENCY,
        quantization="fp8_per_block",
        moe_backend="deep_gemm",
        max_num_batched_tokens=192,
    )
    assert cfg.kernel_config.moe_backend == "deep_gemm"


@pytest.mark.parametrize("switch", deep_gemm_experts.DEEP_GEMM_SWITCHES)
def test_vllm_s_deep_gemm_switch_at_zero_is_named(tiny_moe, monkeypatch, switch):
    monkeypatch.setenv(switch, "0")
    with pytest.raises(FlashInferEPConfigError, match=f"{switch}=0 turns DeepGEMM off"):
        engine_config(tiny_moe, LOW_LATENCY, quantization="fp8_per_block", moe_backend="deep_gemm")


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


# ---------------------------------------------------------------- the LL prepare
def _moe_config() -> FusedMoEConfig:
    return moe_config(
        experts=EXPERTS,
        top_k=TOP_K,
        hidden=HIDDEN,
        inter=INTER,
        max_num_tokens=128,
        backend=LOW_LATENCY,
    )


def _block_qc():
    one = torch.ones(EXPERTS, dtype=torch.float32)
    return fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])


@pytest.fixture
def kernel(fake):
    """An LL prepare/finalize over a fake runtime (capacity 128, FP8 on the wire) set up by
    vLLM's modular kernel with the experts a test names; instance patches undone after."""
    from tests.fakes.runtime import build_fake_runtime
    from vllm_flashinfer_ep.backends import Algorithm

    def build(cls, capacity=128, fp8_dispatch=True):
        rt, _ = build_fake_runtime(
            Algorithm.LOW_LATENCY,
            hidden=HIDDEN,
            num_experts=EXPERTS,
            capacity=capacity,
            top_k=TOP_K,
            sizes=[4],
        )
        if fp8_dispatch:
            rt.enable_fp8_wire()
        pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=fp8_dispatch)
        experts = cls(_moe_config(), _block_qc(), max_num_tokens=capacity, num_dispatchers=1)
        mk.FusedMoEKernel(pf, experts)  # post_init_setup
        return rt, pf, experts

    yield build
    _helper.undo_instances()


def _layer(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16() * 3
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, torch.device("cpu"), gen)
    return x, ids, weights


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Value for value, NaN included (the fake leaves NaN in rows nobody received)."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _is_mn_major(s: torch.Tensor) -> bool:
    experts, rows, groups = s.shape
    return s.stride() == (rows * groups, 1, rows)


def test_deep_gemm_experts_get_the_wire_s_scales_mn_major(kernel):
    rt, pf, experts = kernel(BatchedDeepGemmExperts)
    assert compact_experts.PATCH.name not in [r.patch for r in _helper._chain(experts, "apply")]
    x, ids, weights = _layer(5, seed=1)
    a1q, scales, meta, _, _ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc())
    wire = rt.fp8_wire.scales
    assert a1q is rt.fp8_wire.tokens
    assert _is_mn_major(scales) and not _is_mn_major(wire)
    assert scales.shape == wire.shape and _same(scales, wire)
    assert int(meta.expert_num_tokens.sum()) == 5 * TOP_K
    rt.round.end()


def test_scales_quantized_after_receive_are_mn_major_too(kernel, monkeypatch):
    from tests.unit.test_receive_quant import emulated_quantize

    monkeypatch.setattr(receive_quant, "_vllm_quantize", emulated_quantize)
    seen = {}
    real = receive_quant.quantize_expert_buffer

    def spy(*args, **kwargs):
        seen["row_major"] = real(*args, **kwargs)
        return seen["row_major"]

    monkeypatch.setattr(receive_quant, "quantize_expert_buffer", spy)
    rt, pf, _ = kernel(BatchedDeepGemmExperts, fp8_dispatch=False)
    x, ids, weights = _layer(3, seed=2)
    a1q, scales, *_ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc())
    q, row_major = seen["row_major"]
    assert a1q is q and a1q.dtype == torch.float8_e4m3fn
    assert _is_mn_major(scales) and not _is_mn_major(row_major)
    assert _same(scales, row_major)
    rt.round.end()


def test_triton_experts_keep_the_wire_s_row_major_scales(kernel):
    rt, pf, _ = kernel(BatchedTritonExperts)
    x, ids, weights = _layer(5, seed=3)
    _, scales, *_ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc())
    assert scales is rt.fp8_wire.scales
    rt.round.end()


def test_a_buffer_deep_gemm_would_overrun_is_refused_at_load(kernel):
    with pytest.raises(FlashInferEPConfigError, match="--max-num-batched-tokens a multiple of 128"):
        kernel(BatchedDeepGemmExperts, capacity=100)


def test_ht_refuses_deep_gemm_experts():
    experts = BatchedDeepGemmExperts(
        _moe_config(), _block_qc(), max_num_tokens=128, num_dispatchers=1
    )
    receive_quant.check_experts(experts, FLAG, batched=True)
    with pytest.raises(FlashInferEPConfigError, match="--moe-backend triton"):
        receive_quant.check_experts(experts, FLAG, batched=False)


# ---------------------------------------------------------------------- the rules
def test_mn_major_keeps_every_value_and_takes_any_layout():
    gen = torch.Generator().manual_seed(4)
    s = torch.rand(3, 128, 16, generator=gen)
    out = deep_gemm_experts.mn_major(s)
    assert _is_mn_major(out) and torch.equal(out, s)
    assert torch.equal(deep_gemm_experts.mn_major(out), s)  # already MN-major: same values


@pytest.mark.parametrize(
    "tokens,world,ok",
    [(128, 1, True), (64, 2, True), (256, 3, True), (100, 1, False), (96, 2, False)],
)
def test_rows_rule(tokens, world, ok):
    assert (deep_gemm_experts.rows_reason(FLAG, tokens, world) is None) == ok


@pytest.mark.parametrize("value,refused", [("0", True), ("00", True), ("1", False), ("", False)])
def test_switch_values_read_as_vllm_reads_them(value, refused):
    reason = deep_gemm_experts.switches_reason(FLAG, {"VLLM_USE_DEEP_GEMM": value})
    assert (reason is not None) == refused
