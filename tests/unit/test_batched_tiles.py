"""The LL batched experts' Triton tile, chosen per batch (vllm/batched_tiles.py), on CPU.

vLLM 0.33.0's BatchedTritonExperts needs Triton on a GPU to compute, so these tests use a
subclass whose `apply` (same parameters) asks vLLM for its tile exactly as vLLM's apply
does (`try_get_optimal_moe_config` at the buffer's rows per expert), records it, and
computes with vLLM's NaiveBatchedExperts loop. The GPU side (the tile's effect on a
decode step) is measured by tests/engine/batched_tile_probe.py and the engine benchmark.
"""

from __future__ import annotations

import pytest
import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import get_config, override_config
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
from vllm.model_executor.layers.fused_moe.fused_moe import (
    get_config_file_name,
    get_default_config,
    try_get_optimal_moe_config,
)

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import vllm_apply
from tests.unit.test_prepare_finalize_cpu import (
    HIDDEN,
    INTER,
    NUM_EXPERTS,
    TorchActNaiveBatchedExperts,
    _apply,
    _assert_bf16_close,
    _moe_config,
    _problem,
    reference_moe,
)
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.vllm import batched_tiles, compact_experts
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

CAPACITY = 256  # vLLM's default LL capacity: the buffer's rows per expert at world 1


@pytest.fixture(autouse=True)
def no_capture_probe(monkeypatch, fake):
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    # The tile is what vLLM's batched kernel runs with: the path quantized experts take
    # (unquantized ones go to vllm/compact_experts.py, tested in test_compact_experts.py).
    monkeypatch.setattr(compact_experts, "ENABLED", False)
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    return fake


def _vllm_tile(experts, hidden_states, w1, w2, topk_ids) -> dict:
    """The lookup of vLLM 0.33.0's BatchedTritonExperts.apply, verbatim in effect."""
    return try_get_optimal_moe_config(
        w1.size(),
        w2.size(),
        topk_ids.size(1),
        experts.quant_config.config_name(hidden_states.dtype),
        hidden_states.size(1),
        block_shape=experts.block_shape,
    )


class RecordingTritonExperts(fused_batched_moe.BatchedTritonExperts):
    """BatchedTritonExperts that records the tile vLLM's apply would launch with."""

    tiles: list[dict]

    @vllm_apply
    def apply(self, kw):
        self.tiles.append(_vllm_tile(self, kw["hidden_states"], kw["w1"], kw["w2"], kw["topk_ids"]))
        if self.fail:
            raise RuntimeError("planted experts failure")
        return TorchActNaiveBatchedExperts.apply(self, **kw)

    def activation(self, activation, output, input, **kwargs) -> None:
        TorchActNaiveBatchedExperts.activation(self, activation, output, input)


def _kernel(
    rt, top_k=2, cls=RecordingTritonExperts, fail=False, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG
):
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    experts = cls(
        _moe_config(top_k, LL_BACKEND),
        quant_config,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    experts.tiles, experts.fail = [], fail
    return mk.FusedMoEKernel(pf, experts), experts


def _runtime(sizes=(1, 200)):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=list(sizes)
    )
    return rt


def _default_tile(rows: int) -> dict:
    return get_default_config(rows, NUM_EXPERTS, INTER, HIDDEN, 2, None, None)


@pytest.mark.parametrize("num_tokens", [1, 200])
def test_tile_follows_the_batch_not_the_buffer(num_tokens):
    kernel, experts = _kernel(_runtime())
    x, w1, w2, ids, weights = _problem(num_tokens, 2, seed=num_tokens)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))  # same result
    assert experts.tiles == [_default_tile(num_tokens)]
    assert get_config() is None  # vLLM's override slot restored


def test_small_and_large_batches_get_different_tiles():
    # The point of the choice: a 1-token decode step does not get the 256-row tile.
    assert _default_tile(1)["BLOCK_SIZE_M"] < _default_tile(CAPACITY)["BLOCK_SIZE_M"]
    kernel, experts = _kernel(_runtime())
    for n in (1, 200):
        x, w1, w2, ids, weights = _problem(n, 2, seed=3)
        _apply(kernel, x, w1, w2, ids, weights, False)
    assert experts.tiles[0] != experts.tiles[1]


class RecordOnly(fused_batched_moe.BatchedTritonExperts):
    """Records the tile vLLM's apply would use; computes nothing (direct calls)."""

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        self.tiles.append(_vllm_tile(self, hidden_states, w1, w2, topk_ids))


def _wrapped(num_dispatchers: int, buffer_rows: int):
    experts = RecordOnly(
        _moe_config(2, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=buffer_rows // num_dispatchers,
        num_dispatchers=num_dispatchers,
    )
    experts.tiles = []
    assert batched_tiles.install(experts)
    return experts


def _call(experts, tokens: int, buffer_rows: int, positional: bool = False):
    bf16 = torch.bfloat16
    args = dict(
        output=None,
        hidden_states=torch.empty(NUM_EXPERTS, buffer_rows, HIDDEN, dtype=bf16),
        w1=torch.empty(NUM_EXPERTS, 2 * INTER, HIDDEN, dtype=bf16),
        w2=torch.empty(NUM_EXPERTS, HIDDEN, INTER, dtype=bf16),
        topk_weights=None,
        topk_ids=torch.zeros(tokens, 2, dtype=torch.int64),
        activation=None,
        global_num_experts=NUM_EXPERTS,
        expert_map=None,
        a1q_scale=None,
        a2_scale=None,
        workspace13=None,
        workspace2=None,
        expert_tokens_meta=None,
        apply_router_weight_on_input=False,
    )
    if positional:
        return experts.apply(*args.values())
    return experts.apply(**args)


def test_rows_scale_with_the_ep_world():
    # 9 tokens on each of 4 ranks: one expert may receive 36 rows (a 32-row tile, where
    # 9 rows alone would get 16).
    experts = _wrapped(num_dispatchers=4, buffer_rows=1024)
    _call(experts, tokens=9, buffer_rows=1024)
    assert _default_tile(36) != _default_tile(9)
    assert experts.tiles == [_default_tile(36)]


def test_rows_are_capped_at_the_buffer():
    experts = _wrapped(num_dispatchers=4, buffer_rows=64)
    _call(experts, tokens=200, buffer_rows=64)
    assert _default_tile(64) != _default_tile(800)
    assert experts.tiles == [_default_tile(64)]


def test_a_positional_call_reads_the_same_arguments():
    experts = _wrapped(num_dispatchers=1, buffer_rows=256)
    _call(experts, tokens=1, buffer_rows=256, positional=True)
    assert experts.tiles == [_default_tile(1)]


def test_installing_twice_wraps_once():
    experts = _wrapped(num_dispatchers=1, buffer_rows=256)
    wrapped = experts.apply
    assert batched_tiles.install(experts) and experts.apply is wrapped


def test_block_quantized_user_tables_are_found_by_vllm_s_file_name(tmp_path, monkeypatch):
    name = get_config_file_name(NUM_EXPERTS, INTER, "fp8_w8a8", [128, 128])
    (tmp_path / name).write_text("{}")
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    assert batched_tiles._user_tables(NUM_EXPERTS, INTER, "fp8_w8a8", (128, 128))
    assert not batched_tiles._user_tables(NUM_EXPERTS, INTER, None, None)


def test_override_slot_restored_when_the_experts_fail():
    kernel, _ = _kernel(_runtime(), fail=True)
    x, w1, w2, ids, weights = _problem(1, 2, seed=5)
    with pytest.raises(RuntimeError, match="planted"):
        _apply(kernel, x, w1, w2, ids, weights, False)
    assert get_config() is None


def test_an_explicit_override_config_wins():
    kernel, experts = _kernel(_runtime())
    x, w1, w2, ids, weights = _problem(1, 2, seed=6)
    mine = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
    with override_config(mine):
        _apply(kernel, x, w1, w2, ids, weights, False)
    assert experts.tiles == [mine]


def test_user_tuned_tables_are_left_in_charge(tmp_path, monkeypatch):
    table = {
        str(m): {
            "BLOCK_SIZE_M": 64,
            "BLOCK_SIZE_N": 64,
            "BLOCK_SIZE_K": 64,
            "GROUP_SIZE_M": 1,
            "num_warps": 4,
            "num_stages": 3,
        }
        for m in (1, 256)
    }
    (tmp_path / get_config_file_name(NUM_EXPERTS, INTER, None, None)).write_text(
        str(table).replace("'", '"')
    )
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    fm.get_moe_configs.cache_clear()
    try:
        kernel, experts = _kernel(_runtime())
        x, w1, w2, ids, weights = _problem(1, 2, seed=7)
        _apply(kernel, x, w1, w2, ids, weights, False)
    finally:
        fm.get_moe_configs.cache_clear()
    assert experts.tiles == [table["256"]]  # vLLM's own lookup in the user's table


def test_other_experts_are_not_touched():
    kernel, experts = _kernel(_runtime(), cls=TorchActNaiveBatchedExperts)
    assert "apply" not in vars(experts)
    assert batched_tiles.install(experts) is False


def test_a_changed_apply_signature_is_left_alone(caplog):
    class Moved(RecordingTritonExperts):
        def apply(self, output, hidden_states, w1, w2, **kwargs):  # not 0.33.0's parameters
            raise AssertionError

    _, experts = _kernel(_runtime(), cls=RecordingTritonExperts)
    moved = Moved.__new__(Moved)
    assert batched_tiles.install(moved) is False
    assert "leaving its tile choice to vLLM" in caplog.text
    assert "apply" in vars(experts)  # the real 0.33.0 shape was wrapped
