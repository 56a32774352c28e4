"""--tensor-parallel-size and --pipeline-parallel-size with the flashinfer_ep backends, on
real vLLM 0.33.0 engine configs (CPU): accepted as designed (docs/architecture.md, "Tensor
and pipeline parallelism"), and said so at config time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep.backends import BACKENDS
from vllm_flashinfer_ep.vllm import config_rules

vllm_flashinfer_ep.register()

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe-tp-pp"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_runs_sequence_parallel_moe_over_dp_x_tp(tiny_moe, backend, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, backend, tensor_parallel_size=2)
    par = cfg.parallel_config
    assert par.use_sequence_parallel_moe and par.use_all2all
    # The EP group (the fleet's NCCL-EP world) is DP x TP.
    assert config_rules.ep_world_size(par) == 4 == par.world_size_across_dp
    assert "one NCCL-EP fleet per EP group of 4 ranks (DP x TP)" in caplog.text
    assert (
        "--tensor-parallel-size 2: sequence-parallel MoE, each TP rank dispatches its 1/2"
        in caplog.text
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_parallel_has_one_ep_group_per_stage(tiny_moe, backend, caplog):
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, backend, pipeline_parallel_size=2)
    par = cfg.parallel_config
    assert par.use_all2all and not par.use_sequence_parallel_moe
    assert config_rules.ep_world_size(par) == 2  # DP only: each stage's own group
    assert "one NCCL-EP fleet per EP group of 2 ranks (DP x TP)" in caplog.text
    assert "--pipeline-parallel-size 2: one EP group (and fleet) per pipeline stage" in caplog.text


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_without_dp_leaves_the_backend_idle_and_says_so(tiny_moe, backend, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = engine_config(tiny_moe, backend, tensor_parallel_size=2, data_parallel_size=1)
    assert not cfg.parallel_config.use_all2all
    assert "does nothing here" in caplog.text


def test_no_layout_line_without_tp_or_pp(tiny_moe, caplog):
    with caplog.at_level(logging.INFO):
        engine_config(tiny_moe, BACKENDS[0])
    assert "per EP group of" not in caplog.text


def test_architecture_documents_both_flags():
    text = ARCHITECTURE.read_text()
    section = text.split("## Tensor and pipeline parallelism", 1)[1].split("\n## ", 1)[0]
    assert "`--tensor-parallel-size N`" in section and "`--pipeline-parallel-size N`" in section
    assert "nothing multi-GPU\nhas run" in section or "nothing multi-GPU has run" in section
