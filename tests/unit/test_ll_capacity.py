"""LL: a step budget whose NCCL-EP buffers would not fit is lowered or refused at config time.

The LL fleet is sized from --max-num-batched-tokens; its buffers are estimated from
measured sizes (runtime/buffer_sizes.py). GPU memory is faked here (CPU host).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime import buffer_sizes
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

GIB = 1 << 30
MEMORY_RESULTS = (
    Path(__file__).resolve().parents[2] / "docs" / "results" / "bench_memory_world1.json"
)
# Qwen3-30B-A3B's MoE shape: 128 experts, top_k 8, hidden 2048.
BIG = dict(num_experts=128, num_experts_per_tok=8, hidden_size=2048, max_position_embeddings=32768)


@pytest.fixture(scope="module")
def qwen30b_shape(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe-ll-cap"), **BIG)


def _config(model: str, backend: str = LOW_LATENCY, **kwargs):
    return engine_config(model, backend, **{"gpu_memory_utilization": 0.9, **kwargs})


def _gpu(monkeypatch, total: int | None) -> None:
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: total)


def _fit(total: int) -> int:
    budget = int(int(total * 0.9) * buffer_sizes.LL_BUFFER_BUDGET_FRACTION)
    return buffer_sizes.ll_max_tokens_within(budget, 2048, 128, 8)


def test_estimate_never_undershoots_a_measurement():
    for m in buffer_sizes.LL_MEASUREMENTS:
        est = buffer_sizes.ll_fleet_bytes(m.tokens_per_rank, m.hidden, m.num_experts, m.top_k)
        assert m.fleet_bytes <= est <= m.fleet_bytes * 1.01
    # 4096 was measured too (docs/benchmarks.md, 581 MB, rounded): within 1 %.
    assert buffer_sizes.ll_fleet_bytes(256, 4096, 128, 8) == pytest.approx(581e6, rel=0.01)


def test_total_estimate_never_undershoots_bench_memory_and_stays_close():
    """The fleet's whole cost, measured device-wide by bench-memory on the H200."""
    rows = json.loads(MEMORY_RESULTS.read_text())["rows"]
    assert len(rows) == 6
    for r in rows:
        est = buffer_sizes.ll_memory_bytes(r["capacity"], r["hidden"], 128, 8, handles=r["handles"])
        measured = (r["fleet_mb"] + r["rounds_mb"]) * 1e6
        assert measured <= est <= measured * 1.25, (r, est)
        recv = buffer_sizes.ll_receive_buffer_bytes(r["capacity"], r["hidden"], 128)
        assert recv == pytest.approx(r["rounds_mb"] * 1e6, rel=0.01)


def test_capacity_that_fits_a_budget_is_the_largest_whose_total_fits():
    budget = 20 * GIB
    fit = buffer_sizes.ll_max_tokens_within(budget, 7168, 128, 8)
    assert buffer_sizes.ll_memory_bytes(fit, 7168, 128, 8) <= budget
    assert buffer_sizes.ll_memory_bytes(fit + 1, 7168, 128, 8) > budget
    assert (
        buffer_sizes.ll_max_tokens_within(buffer_sizes.LL_FLEET_FIXED_BYTES // 2, 2048, 128, 8) == 0
    )


def test_estimate_scales_with_tokens_experts_and_hidden():
    one = buffer_sizes.ll_fleet_bytes(1000, 2048, 128, 8)
    assert buffer_sizes.ll_fleet_bytes(2000, 2048, 128, 8) == pytest.approx(2 * one, rel=1e-6)
    assert buffer_sizes.ll_fleet_bytes(1000, 4096, 128, 8) == pytest.approx(2 * one, rel=1e-6)
    assert buffer_sizes.ll_fleet_bytes(1000, 2048, 256, 8) > 1.9 * one


def test_budget_whose_buffers_do_not_fit_is_lowered_and_logged(qwen30b_shape, monkeypatch, caplog):
    _gpu(monkeypatch, 80 * GIB)
    with caplog.at_level(logging.INFO):
        cfg = _config(qwen30b_shape, max_num_batched_tokens=100_000)
    fit = _fit(80 * GIB)
    assert 1000 < fit < 100_000
    assert cfg.scheduler_config.max_num_batched_tokens == fit
    assert f"--max-num-batched-tokens lowered from 100000 to {fit}" in caplog.text
    assert "NCCL-EP buffers" in caplog.text


def test_budget_that_fits_is_kept_and_the_estimate_logged(qwen30b_shape, monkeypatch, caplog):
    _gpu(monkeypatch, 141 * GIB)
    with caplog.at_level(logging.INFO):
        cfg = _config(qwen30b_shape)
    assert cfg.scheduler_config.max_num_batched_tokens == 256  # LL's default at 128 sequences
    assert "lowered" not in caplog.text
    # 0.64 GiB fixed + 0.27 NCCL-EP buffers + 0.12 receive buffer + 2 MB padding staging
    assert "needs about 1.04 GiB per GPU for --max-num-batched-tokens 256" in caplog.text


def test_unknown_gpu_memory_logs_the_estimate_and_changes_nothing(
    qwen30b_shape, monkeypatch, caplog
):
    _gpu(monkeypatch, None)
    with caplog.at_level(logging.INFO):
        cfg = _config(qwen30b_shape, max_num_batched_tokens=100_000)
    assert cfg.scheduler_config.max_num_batched_tokens == 100_000
    assert "needs about 156.28 GiB" in caplog.text and "not checked" in caplog.text


def test_refused_when_chunked_prefill_is_off_and_prompts_exceed_the_fit(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 80 * GIB)
    with pytest.raises(FlashInferEPConfigError, match="--max-num-batched-tokens") as info:
        _config(
            qwen30b_shape,
            max_num_batched_tokens=32768,
            max_model_len=32768,
            enable_chunked_prefill=False,
        )
    assert "--max-model-len" in str(info.value)


def test_refused_when_not_even_max_num_seqs_tokens_fit(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 4 * GIB)  # about 165 tokens fit: fewer than 256 sequences
    with pytest.raises(FlashInferEPConfigError, match="--max-num-seqs") as info:
        _config(qwen30b_shape, max_num_batched_tokens=4096, max_num_seqs=256)
    assert "--max-num-batched-tokens" in str(info.value)


def test_ht_is_not_sized_by_the_ll_estimate(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 1 * GIB)
    cfg = _config(qwen30b_shape, backend=HIGH_THROUGHPUT, max_num_batched_tokens=4096)
    assert cfg.scheduler_config.max_num_batched_tokens == 4096


# ------------------------------------------------- rounds split (VLLM_FLASHINFER_EP_LL_ROUND_TOKENS)


def test_round_tokens_size_the_fleet_and_free_the_budget(qwen30b_shape, monkeypatch, caplog):
    """Rounds of 512 under vLLM's budget for engines without EP: LL no longer counts as
    batched DP MoE (no LL default budget), the budget is not lowered for the buffers, and the
    log says how many rounds a full step takes and what one round's fleet needs."""
    _gpu(monkeypatch, 80 * GIB)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "512")
    with caplog.at_level(logging.INFO):
        cfg = _config(qwen30b_shape, max_num_batched_tokens=16384)
    assert cfg.scheduler_config.max_num_batched_tokens == 16384
    assert "LL rounds carry at most 512 tokens per rank" in caplog.text
    assert "runs each MoE layer as up to 32 rounds" in caplog.text
    assert "needs about 1.44 GiB per GPU for --max-num-batched-tokens 512" in caplog.text
    assert "lowered" not in caplog.text
    assert cfg.parallel_config.use_batched_dp_moe is False


def test_without_round_tokens_ll_keeps_its_default_budget(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 80 * GIB)
    seqs = {"max_num_seqs": 256}  # vLLM's for `vllm serve` on an H100
    assert _config(qwen30b_shape, **seqs).scheduler_config.max_num_batched_tokens == 512
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "512")
    assert _config(qwen30b_shape, **seqs).scheduler_config.max_num_batched_tokens > 512


def test_round_tokens_below_a_capture_size_are_refused(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 80 * GIB)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "64")
    with pytest.raises(FlashInferEPConfigError, match="VLLM_FLASHINFER_EP_LL_ROUND_TOKENS=64"):
        _config(
            qwen30b_shape,
            max_num_batched_tokens=4096,
            compilation_config={
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "cudagraph_capture_sizes": [1, 8, 128],
            },
        )


def test_round_tokens_whose_fleet_does_not_fit_are_refused(qwen30b_shape, monkeypatch):
    _gpu(monkeypatch, 16 * GIB)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "4096")
    with pytest.raises(FlashInferEPConfigError, match="Set it to at most") as info:
        _config(qwen30b_shape, max_num_batched_tokens=8192)
    assert "VLLM_FLASHINFER_EP_LL_ROUND_TOKENS=4096" in str(info.value)


def test_round_tokens_at_or_above_the_budget_are_said_to_change_nothing(
    qwen30b_shape, monkeypatch, caplog
):
    _gpu(monkeypatch, 80 * GIB)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "4096")
    with caplog.at_level(logging.INFO):
        cfg = _config(qwen30b_shape, max_num_batched_tokens=2048)
    assert cfg.scheduler_config.max_num_batched_tokens == 2048
    assert (
        "VLLM_FLASHINFER_EP_LL_ROUND_TOKENS=4096 is at or above --max-num-batched-tokens 2048"
        in (caplog.text)
    )
