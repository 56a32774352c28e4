"""DeepGEMM's masked GEMM tiles compiled at load for EP world > 1 (vllm/deep_gemm_warmup.py).

On CPU with vLLM 0.33.0's own `BatchedDeepGemmExperts` and forward context: the values
warmed are exactly those vLLM's `estimate_expected_m` can produce; the wrapper warms on
the first eager call that carries DP metadata (vLLM's profile run at EP world > 1), once
per shape, never under capture or at world 1 or with `VLLM_DEEP_GEMM_WARMUP=skip`, with
zero received rows, and leaves vLLM's estimate in place for the real call. DeepGEMM does
not run here: tests/kernels/test_deep_gemm_experts_gpu.py shows on the GPU that no tile
compiles after the warm-up.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import vllm.forward_context as fc
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)

from tests.unit.test_deep_gemm_experts import (  # noqa: F401 - fixture
    EXPERTS,
    _block_qc,
    _moe_config,
    kernel,
)
from vllm_flashinfer_ep.vllm import deep_gemm_warmup, patches
from vllm_flashinfer_ep.vllm.patches import _helper

ROWS, TOP_K = 256, 8


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    deep_gemm_warmup.reset()
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    monkeypatch.setattr(deep_gemm_warmup, "is_capturing", lambda: False)
    yield
    deep_gemm_warmup.reset()


def _dp(monkeypatch, tokens_per_rank):
    """vLLM's forward context for a forward with DP metadata (None: EP world 1, none)."""
    if tokens_per_rank is None:
        ctx = SimpleNamespace(dp_metadata=None)
    else:
        across = torch.tensor(tokens_per_rank, dtype=torch.int32)
        ctx = SimpleNamespace(dp_metadata=SimpleNamespace(num_tokens_across_dp_cpu=across))
    monkeypatch.setattr(fc, "_forward_context", ctx)


def _experts():
    return BatchedDeepGemmExperts(
        _moe_config(), _block_qc(), max_num_tokens=ROWS, num_dispatchers=1
    )


def _estimates(monkeypatch, experts, rows, global_experts, totals):
    seen = set()
    for tokens in totals:
        _dp(monkeypatch, [tokens // 2, tokens - tokens // 2])
        seen.add(
            experts.estimate_expected_m(
                global_num_experts=global_experts, max_tokens_per_expert=rows, topk=TOP_K
            )
        )
    return seen


def test_the_values_are_every_estimate_vllm_makes(monkeypatch):
    experts = _experts()
    for rows in (128, 256, 512, 2048):
        for global_experts in (8, 64, 256, 384):  # 384: rows x top_k / experts not whole
            # What a forward can carry: at most the buffer's rows in tokens over all ranks.
            seen = _estimates(monkeypatch, experts, rows, global_experts, range(0, rows + 1, 3))
            seen.add(_estimates(monkeypatch, experts, rows, global_experts, [rows]).pop())
            bound = deep_gemm_warmup.largest_estimate(rows, TOP_K, global_experts)
            assert seen == set(deep_gemm_warmup.expected_m_values(rows, bound)), (
                rows,
                global_experts,
            )
        # Unbounded token counts: every value up to the rows per expert.
        seen = _estimates(monkeypatch, experts, rows, 8, range(0, 2 * rows + 64, 7))
        _dp(monkeypatch, None)  # no DP metadata: the rows per expert
        seen.add(
            experts.estimate_expected_m(global_num_experts=8, max_tokens_per_expert=rows, topk=1)
        )
        assert seen == set(deep_gemm_warmup.expected_m_values(rows)), rows
    assert deep_gemm_warmup.expected_m_values(256) == list(range(16, 257, 16))
    assert deep_gemm_warmup.expected_m_values(8) == [8]  # vLLM clamps to the rows
    # DeepSeek-V3 (256 experts, top_k 8) on 8 ranks at capacity 256: 2048 rows per expert
    assert deep_gemm_warmup.expected_m_values(
        2048, deep_gemm_warmup.largest_estimate(2048, 8, 256)
    ) == [16, 32, 48, 64]


class Recorder:
    """vLLM's apply as far as the warm-up can see it: the expected_m it would hand
    DeepGEMM (the experts object's own estimate) and the rows it would compute."""

    def __init__(self, experts, fail_on_empty=False):
        self.experts, self.fail_on_empty, self.calls = experts, fail_on_empty, []

    def __call__(self, **kw):
        m = self.experts.estimate_expected_m(
            global_num_experts=EXPERTS,
            max_tokens_per_expert=kw["hidden_states"].shape[1],
            topk=TOP_K,
        )
        rows = int(kw["expert_tokens_meta"].expert_num_tokens.sum())
        self.calls.append((m, rows))
        if self.fail_on_empty and rows == 0:
            raise RuntimeError("no kernel for this tile")
        return "vllm's result"


def _kw(rows=ROWS, counts=None):
    counts = torch.tensor([3, 0, 1, 0, 0, 0, 0, 2] if counts is None else counts, dtype=torch.int32)
    return {
        "topk_ids": torch.zeros(5, TOP_K, dtype=torch.int64),
        "global_num_experts": EXPERTS,
        "hidden_states": torch.zeros(EXPERTS, rows, 4),
        "w1": torch.zeros(EXPERTS, 512, 2048),
        "w2": torch.zeros(EXPERTS, 2048, 256),
        "expert_tokens_meta": mk.ExpertTokensMetadata(
            expert_num_tokens=counts, expert_num_tokens_cpu=counts.clone()
        ),
    }


def test_first_eager_call_with_dp_metadata_warms_every_value_once(monkeypatch, caplog):
    experts = _experts()
    inner = Recorder(experts)
    apply = deep_gemm_warmup._warming_apply(experts, inner)
    _dp(monkeypatch, [40, 24])  # 64 tokens x top_k 8 / 8 experts = 64 per expert
    with caplog.at_level(logging.INFO):
        assert apply(**_kw()) == "vllm's result"
    values = deep_gemm_warmup.expected_m_values(ROWS)
    assert inner.calls == [(m, 0) for m in values] + [(64, 6)]
    assert "estimate_expected_m" not in vars(experts)  # vLLM's own method again
    assert "warmed for 16 expected_m values" in caplog.text
    inner.calls.clear()
    assert apply(**_kw()) == "vllm's result"
    assert inner.calls == [(64, 6)]  # once per shape and process
    other = Recorder(_experts())  # another layer of the same shape: nothing more to compile
    deep_gemm_warmup._warming_apply(other.experts, other)(**_kw())
    assert other.calls == [(64, 6)]
    wider = Recorder(_experts())  # another buffer shape: its own tiles
    deep_gemm_warmup._warming_apply(wider.experts, wider)(**_kw(rows=512))
    assert len(wider.calls) == len(deep_gemm_warmup.expected_m_values(512)) + 1


@pytest.mark.parametrize("why", ["world 1", "capturing", "skip"])
def test_no_warm_up_where_nothing_needs_it_or_the_user_skips_it(monkeypatch, caplog, why):
    experts = _experts()
    inner = Recorder(experts)
    apply = deep_gemm_warmup._warming_apply(experts, inner)
    _dp(monkeypatch, None if why == "world 1" else [64, 64])
    if why == "capturing":
        monkeypatch.setattr(deep_gemm_warmup, "is_capturing", lambda: True)
    if why == "skip":
        monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    with caplog.at_level(logging.INFO):
        apply(**_kw())
    assert len(inner.calls) == 1 and inner.calls[0][1] == 6
    if why == "skip":
        assert "VLLM_DEEP_GEMM_WARMUP=skip" in caplog.text
        return
    # world 1 and a capture leave the warm-up to the next eager call with DP metadata
    _dp(monkeypatch, [64, 64])
    monkeypatch.setattr(deep_gemm_warmup, "is_capturing", lambda: False)
    inner.calls.clear()
    apply(**_kw())
    assert len(inner.calls) == len(deep_gemm_warmup.expected_m_values(ROWS)) + 1


def test_a_failed_warm_up_is_logged_and_vllm_s_call_still_runs(monkeypatch, caplog):
    experts = _experts()
    own = experts.estimate_expected_m
    experts.estimate_expected_m = own  # an attribute of the object's own, to be kept
    inner = Recorder(experts, fail_on_empty=True)
    _dp(monkeypatch, [8, 8])
    with caplog.at_level(logging.WARNING):
        assert deep_gemm_warmup._warming_apply(experts, inner)(**_kw()) == "vllm's result"
    assert "warming DeepGEMM's masked GEMM tiles failed (RuntimeError" in caplog.text
    assert vars(experts)["estimate_expected_m"] is own
    assert inner.calls[-1] == (16, 6)  # vLLM's estimate for 16 tokens x 8 / 8 experts


def test_the_ll_setup_hook_installs_it_on_deep_gemm_experts_only(kernel):  # noqa: F811
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        BatchedTritonExperts,
    )

    _, _, experts = kernel(BatchedDeepGemmExperts)
    assert [r.patch for r in _helper._chain(experts, "apply")] == [
        "deep_gemm_per_batch",  # outermost: vllm/deep_gemm_per_batch.py
        "deep_gemm_masked_warmup",
    ]
    _, _, triton = kernel(BatchedTritonExperts)
    assert "deep_gemm_masked_warmup" not in [r.patch for r in _helper._chain(triton, "apply")]
    assert deep_gemm_warmup.PATCH in patches.instance_patches()
    owner, attr, method = _helper.check(deep_gemm_warmup.PATCH)
    assert (owner, attr, method) == (BatchedDeepGemmExperts, "apply", BatchedDeepGemmExperts.apply)
    assert deep_gemm_warmup.PATCH.entry() in patches.index()
    from vllm_flashinfer_ep.vllm import deep_gemm_per_batch

    with pytest.raises(_helper.PatchTargetError, match="'deep_gemm_per_batch' wraps it"):
        _helper.undo_instance(deep_gemm_warmup.PATCH, experts)
    assert _helper.undo_instance(deep_gemm_per_batch.PATCH, experts)
    assert _helper.undo_instance(deep_gemm_warmup.PATCH, experts)
    assert "apply" not in vars(experts)


def test_the_warm_up_stops_at_the_largest_estimate_a_forward_can_give(monkeypatch):
    experts = _experts()
    inner = Recorder(experts)
    kw = {**_kw(), "global_num_experts": 64}  # 256 rows x top_k 8 / 64 experts: at most 32
    _dp(monkeypatch, [128, 128])
    deep_gemm_warmup._warming_apply(experts, inner)(**kw)
    assert [m for m, rows in inner.calls if rows == 0] == [16, 32]


def test_dp_estimate_is_vllm_s_estimate_for_any_token_count(monkeypatch):
    """What the FP8 experts probe hands DeepGEMM as the data parallel ranks' `expected_m`."""
    experts = _experts()
    for rows in (128, 256):
        for global_experts in (8, 64, 384):
            for tokens in range(0, 2 * rows + 64, 5):
                _dp(monkeypatch, [tokens // 2, tokens - tokens // 2])
                vllm_m = experts.estimate_expected_m(
                    global_num_experts=global_experts, max_tokens_per_expert=rows, topk=TOP_K
                )
                assert deep_gemm_warmup.dp_estimate(tokens, TOP_K, global_experts, rows) == vllm_m
