"""Config-time bounds: VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES against what NCCL-EP needs, and
the LL memory estimate when no GPU is visible (a WARNING, not an INFO line)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvVarError
from vllm_flashinfer_ep.runtime import buffer_sizes
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

GIB = 1 << 30
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    # hidden 128 -> LL 2048, 8 experts, top_k 2; dp 2: EP world 2, 256 tokens per rank
    # vLLM gives 128 sequences on this machine (no GPU): capture sizes to 256, LL keeps 256
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe-bounds"))


def _gpu(monkeypatch, total: int | None) -> None:
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: total)


# ------------------------------------------------------------------ the layout itself
def test_layout_is_what_nccl_ep_allocated_at_the_first_handle():
    """The measured first-handle growth (docs/results) holds the layout with < 1 % to spare."""
    for name, hidden in (
        ("bench_world1_h2048_final.json", 2048),
        ("bench_world1_h7168.json", 7168),
    ):
        rows = json.loads((RESULTS / name).read_text())["rows"]
        measured = {r["first_handle_bytes"] for r in rows if r.get("first_handle_bytes")}
        layout = buffer_sizes.ll_layout_bytes(256, hidden, 128, 8, 1)
        for m in measured:
            assert layout <= m <= layout * 1.01, (name, layout, m)


def test_layout_by_hand_where_dispatch_sizes_it():
    """LowLatencyLayout (nccl/ep common.hpp) worked by hand: T 3, hidden 4096, 4 experts,
    top_k 8, EP world 16, so the dispatch side (one row per rank) is the larger slot."""
    token = 4096 * 2
    header = 32  # token id (4) + 8 x 2-byte expert ids = 20, aligned to 16
    dispatch = 3 * (header + token) * (1 + 16)  # send + receive from every rank
    combine = 3 * (token + token // 2 // 128 * 4) * (4 + 8)  # + bfloat162 per 128 elements
    assert dispatch > combine
    signal = 128  # 4 experts x 4 bytes, aligned to 128
    total = 2 * dispatch + 2 * signal
    assert buffer_sizes.ll_layout_bytes(3, 4096, 4, 8, 16) == (total + 128) // 128 * 128


def test_layout_grows_with_each_term():
    base = buffer_sizes.ll_layout_bytes(256, 2048, 128, 8, 2)
    assert buffer_sizes.ll_layout_bytes(512, 2048, 128, 8, 2) > 1.9 * base
    assert buffer_sizes.ll_layout_bytes(256, 4096, 128, 8, 2) > 1.9 * base
    assert buffer_sizes.ll_layout_bytes(256, 2048, 256, 8, 2) > 1.8 * base
    # Dispatch (one row per rank) outgrows combine only when the world outnumbers the experts.
    assert buffer_sizes.ll_layout_bytes(256, 2048, 8, 2, 64) > buffer_sizes.ll_layout_bytes(
        256, 2048, 8, 2, 2
    )
    assert buffer_sizes.ll_layout_bytes(1, 2048, 1, 1, 1) == envs.rdma_min_bytes()
    assert base % buffer_sizes.NCCL_EP_BUFFER_ALIGNMENT == 0


# ------------------------------------------------------------- the variable's range
@pytest.mark.parametrize(
    "raw", ["1", "4096", str(envs.rdma_min_bytes() - 1), str(envs.RDMA_MAX_BYTES + 1)]
)
def test_out_of_range_value_is_refused_with_the_range(tiny_moe, monkeypatch, raw):
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, raw)
    with pytest.raises(FlashInferEPEnvVarError) as info:
        engine_config(tiny_moe, LOW_LATENCY)
    message = str(info.value)
    assert f"{envs.RDMA_BUFFER_BYTES}={raw!r}" in message
    assert (
        f"from {envs.rdma_min_bytes()} (NCCL-EP's smallest low-latency layout) to {envs.RDMA_MAX_BYTES} (1 TiB)"
        in message
    )


def _layout_of_tiny(tokens: int = 256) -> int:
    return buffer_sizes.ll_layout_bytes(tokens, 2048, 8, 2, 2)


def test_below_the_fleet_s_layout_is_refused_naming_the_range(tiny_moe, monkeypatch):
    _gpu(monkeypatch, None)
    need = _layout_of_tiny()
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(need - 128))
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(tiny_moe, LOW_LATENCY)
    message = str(info.value)
    assert (
        f"{envs.RDMA_BUFFER_BYTES}={need - 128} is outside the range this fleet accepts" in message
    )
    assert (
        f"from {need} (NCCL-EP's low-latency layout for 256 tokens per rank, hidden 2048, 8 experts, top_k 2, EP world 2)"
        in message
    )
    assert f"to {envs.RDMA_MAX_BYTES} (1 TiB; no GPU is visible here)" in message


def test_the_fleet_s_layout_is_accepted(tiny_moe, monkeypatch):
    _gpu(monkeypatch, None)
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(_layout_of_tiny()))
    engine_config(tiny_moe, LOW_LATENCY)


def test_tensor_parallel_widens_the_ep_world(tmp_path, monkeypatch):
    """The EP world is DP x TP: 2 experts go one per rank at dp 2, and do not split over
    dp 2 x tp 2. (With experts split evenly, E + top_k >= world + 1, so the combine side
    always sizes the layout and the world never shows in it.)"""
    _gpu(monkeypatch, None)
    model = write_model(tmp_path / "few", num_experts=2, num_experts_per_tok=1)
    monkeypatch.setenv(
        envs.RDMA_BUFFER_BYTES,
        str(buffer_sizes.ll_layout_bytes(256, 2048, 2, 1, 2)),
    )
    engine_config(model, LOW_LATENCY)
    with pytest.raises(FlashInferEPConfigError, match="2 experts do not split evenly over 4 EP"):
        engine_config(model, LOW_LATENCY, tensor_parallel_size=2)


def test_above_the_gpu_budget_is_refused(tiny_moe, monkeypatch):
    _gpu(monkeypatch, 8 * GIB)
    budget = int(int(8 * GIB * 0.9) * buffer_sizes.LL_BUFFER_BUDGET_FRACTION)
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(budget + 1))
    with pytest.raises(
        FlashInferEPConfigError, match=f"to {budget} \\(25% of the memory vLLM may use\\)"
    ):
        engine_config(tiny_moe, LOW_LATENCY, gpu_memory_utilization=0.9)
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(budget))
    engine_config(tiny_moe, LOW_LATENCY, gpu_memory_utilization=0.9)


def test_ht_checks_the_range_only(tiny_moe, monkeypatch):
    _gpu(monkeypatch, None)
    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, str(envs.rdma_min_bytes()))
    engine_config(tiny_moe, HIGH_THROUGHPUT)


# ------------------------------------------------------- no GPU: a WARNING that says so
def _ours(caplog, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == level and "flashinfer_ep" in r.name
    ]


def test_unchecked_estimate_is_a_warning_with_the_estimate(tmp_path, monkeypatch, caplog):
    _gpu(monkeypatch, None)
    model = write_model(tmp_path / "m", num_experts=128, num_experts_per_tok=8, hidden_size=2048)
    with caplog.at_level(logging.INFO):
        cfg = engine_config(model, LOW_LATENCY, max_num_batched_tokens=1_000_000)
    assert cfg.scheduler_config.max_num_batched_tokens == 1_000_000  # nothing to check against
    [warning] = [m for m in _ours(caplog, logging.WARNING) if "GPU memory" in m]
    need = buffer_sizes.ll_memory_bytes(
        1_000_000, 2048, 128, 8, handles=len(buffer_sizes.served_pool_sizes(1_000_000))
    )
    assert (
        f"needs about {need / GIB:.2f} GiB per GPU for --max-num-batched-tokens 1000000" in warning
    )
    assert "no GPU is visible here, so this estimate is not checked against GPU memory" in warning
    assert not [m for m in _ours(caplog, logging.INFO) if "needs about" in m]


def test_checked_estimate_stays_an_info_line(tiny_moe, monkeypatch, caplog):
    _gpu(monkeypatch, 141 * GIB)
    with caplog.at_level(logging.INFO):
        engine_config(tiny_moe, LOW_LATENCY)
    assert any("needs about" in m and "budget" in m for m in _ours(caplog, logging.INFO))
    assert not [m for m in _ours(caplog, logging.WARNING) if "needs about" in m]


# ------------------------------------------------ refusals whose advice the user can act on
def test_a_budget_no_step_fits_asks_only_for_more_gpu_memory(tmp_path, monkeypatch):
    # The buffers' fixed part alone is over the budget: no --max-num-batched-tokens or
    # --max-num-seqs helps, so the refusal must not suggest "<= 0".
    _gpu(monkeypatch, 80 * GIB)
    model = write_model(tmp_path / "m", num_experts=128, num_experts_per_tok=8, hidden_size=2048)
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(model, LOW_LATENCY, gpu_memory_utilization=0.02)
    message = str(info.value)
    assert "Raise --gpu-memory-utilization." in message
    assert "<= 0" not in message and "--max-num-seqs" not in message


def test_ht_does_not_lower_the_step_budget_below_max_num_seqs(tiny_moe):
    # vLLM refuses a step budget below --max-num-seqs; the HT clamp must not make one.
    with pytest.raises(FlashInferEPConfigError, match="Pass --max-num-seqs <= 8192"):
        engine_config(tiny_moe, HIGH_THROUGHPUT, max_num_seqs=10_000, max_num_batched_tokens=20_000)
    cfg = engine_config(tiny_moe, HIGH_THROUGHPUT, max_num_seqs=256, max_num_batched_tokens=20_000)
    assert cfg.scheduler_config.max_num_batched_tokens == 8192  # lowered, with a warning
