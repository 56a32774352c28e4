"""HT: a step budget above NCCL-EP's per-rank limit is lowered at config time, with a log line.

Found through the engine on the H200: with vLLM's default budget (16384 for `vllm.LLM`)
the profile run sent more tokens through the HT fleet than its 8192-token capacity.
"""

from __future__ import annotations

import logging

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.limits import HT_MAX_TOKENS_PER_RANK

vllm_flashinfer_ep.register()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe-ht"), max_position_embeddings=32768)


def test_ht_budget_above_the_limit_is_lowered_and_logged(tiny_moe, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = engine_config(tiny_moe, HIGH_THROUGHPUT, max_num_batched_tokens=16384)
    assert cfg.scheduler_config.max_num_batched_tokens == HT_MAX_TOKENS_PER_RANK
    assert "--max-num-batched-tokens lowered from 16384 to 8192" in caplog.text


def test_ht_budget_within_the_limit_is_kept(tiny_moe, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = engine_config(tiny_moe, HIGH_THROUGHPUT, max_num_batched_tokens=4096)
    assert cfg.scheduler_config.max_num_batched_tokens == 4096
    assert "lowered" not in caplog.text


def test_ll_budget_is_not_clamped(tiny_moe):
    cfg = engine_config(tiny_moe, LOW_LATENCY, max_num_batched_tokens=16384)
    assert cfg.scheduler_config.max_num_batched_tokens == 16384


def test_ht_without_chunked_prefill_and_long_context_is_refused(tiny_moe):
    with pytest.raises(FlashInferEPConfigError, match="--max-model-len"):
        engine_config(
            tiny_moe,
            HIGH_THROUGHPUT,
            max_num_batched_tokens=16384,
            max_model_len=16384,
            enable_chunked_prefill=False,
        )
