"""Block-FP8 LL layers on DeepGEMM (experts/deep_gemm.py), on CPU with vLLM's own classes.

`ReceivedRowsOrDeepGemmExperts` (vLLM's FallbackExperts pattern) runs a forward on the
received-rows experts when its rows per expert over all ranks (tokens x top_k / global
experts) are at most the bound its constructor got, else on `DeepGemmExperts` (vLLM's
`BatchedDeepGemmExperts` handed MN-major activation scales, its masked tiles warmed on the
first eager forward with DP metadata). DeepGEMM itself does not run here: vLLM's
`BatchedDeepGemmExperts.apply` is replaced by a recorder of what it was handed (and of the
`expected_m` its own estimate gives); the received-rows side runs with the stand-ins of
test_received_rows_experts.py. Config-time rules: test_deep_gemm_config.py; on the GPU:
tests/kernels/test_deep_gemm_experts_gpu.py.
"""

from __future__ import annotations

import logging
import math
import types
from dataclasses import dataclass

import pytest
import torch
import vllm.forward_context as fc
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
)

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import vllm_apply
from tests.unit.test_received_rows_experts import (  # noqa: F401 - fixtures
    EXPERTS,
    FP8,
    HIDDEN,
    INTER,
    Layer,
    bf16_buffer,
    fp8_arrivals,
    kernel_apply,
    make_layer,
    moe_cfg,
    rec,
    received_mask,
    rel,
    selection,
    standins,
    tokens_for,
    torch_moe,
    vllm_rows,
)
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.experts import deep_gemm
from vllm_flashinfer_ep.experts.deep_gemm import (
    DeepGemmExperts,
    ReceivedRowsOrDeepGemmExperts,
    dp_estimate,
    expected_m_values,
    mn_major,
    takes_received_rows,
)
from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts
from vllm_flashinfer_ep.vllm import receive_quant
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

ROWS = 128  # rows per expert: DeepGEMM's whole row tiles
TOP_K = 2


@dataclass
class DeepGemmCall:
    expected_m: int  # what vLLM's apply would hand DeepGEMM (the experts' own estimate)
    rows: int  # received rows it would compute
    hidden: torch.Tensor
    scales: torch.Tensor | None
    meta: mk.ExpertTokensMetadata


class DeepGemm:
    """vLLM's BatchedDeepGemmExperts.apply as far as these tests see it."""

    def __init__(self) -> None:
        self.calls: list[DeepGemmCall] = []
        self.fail_on_empty = False

    def real(self) -> list[DeepGemmCall]:
        return [c for c in self.calls if c.rows]


@pytest.fixture(autouse=True)
def vllm_deep_gemm(monkeypatch):
    """DeepGEMM recorded, the warm-up's per-process memory empty, no forward context."""
    seen = DeepGemm()

    @vllm_apply
    def apply(self, kw):
        meta = kw["expert_tokens_meta"]
        m = self.estimate_expected_m(
            global_num_experts=kw["global_num_experts"],
            max_tokens_per_expert=kw["hidden_states"].shape[1],
            topk=kw["topk_ids"].size(-1),
        )
        rows = int(meta.expert_num_tokens.sum())
        seen.calls.append(DeepGemmCall(m, rows, kw["hidden_states"], kw["a1q_scale"], meta))
        if seen.fail_on_empty and rows == 0:
            raise RuntimeError("no kernel for this tile")

    monkeypatch.setattr(BatchedDeepGemmExperts, "apply", apply)
    monkeypatch.setattr(deep_gemm, "_warmed", set())
    monkeypatch.setattr(deep_gemm, "is_capturing", lambda: False)
    monkeypatch.setattr(fc, "_forward_context", None)
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    return seen


def dp_metadata(monkeypatch, tokens_per_rank: list[int] | None) -> None:
    """vLLM's forward context of a data parallel forward (None: no DP metadata)."""
    meta = None
    if tokens_per_rank is not None:
        across = torch.tensor(tokens_per_rank, dtype=torch.int32)
        meta = types.SimpleNamespace(num_tokens_across_dp_cpu=across)
    monkeypatch.setattr(fc, "_forward_context", types.SimpleNamespace(dp_metadata=meta))


def is_mn_major(s: torch.Tensor) -> bool:
    experts, rows, groups = s.shape
    return s.stride() == (rows * groups, 1, rows)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Value for value, NaN included (rows nobody received hold NaN)."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def build(bound: float, *, dispatchers: int = 1, sent=None, seed: int = 0, capacity=None):
    layer = make_layer("block", seed)
    capacity = capacity or ROWS // dispatchers
    experts = ReceivedRowsOrDeepGemmExperts(
        moe_cfg(TOP_K, capacity),
        layer.qc,
        capacity,
        dispatchers,
        received_rows_up_to=bound,
        sent_per_rank=(lambda: sent) if sent is not None else None,
    )
    return experts, layer


def counts_for(tokens: int, top_k: int = TOP_K, rows: int = ROWS) -> list[int]:
    """tokens x top_k rows spread over the experts, none above the buffer."""
    counts = [0] * EXPERTS
    for r in range(tokens * top_k):
        counts[(r * 3) % EXPERTS] += 1
    return [min(c, rows) for c in counts]


def run(experts, layer: Layer, hidden, scales, counts, tokens, *, top_k=TOP_K, global_experts=None):
    """One call as vLLM's modular kernel makes it; the output starts NaN."""
    e, rows, h = hidden.shape
    out = torch.full((e, rows, h), float("nan"), dtype=torch.bfloat16)
    experts.apply(
        output=out,
        hidden_states=hidden,
        w1=layer.w1,
        w2=layer.w2,
        topk_weights=None,
        topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64),
        activation=experts.moe_config.activation,
        global_num_experts=global_experts or EXPERTS,
        expert_map=None,
        a1q_scale=scales,
        a2_scale=None,
        workspace13=torch.empty(e * rows * max(2 * INTER, h), dtype=torch.bfloat16),
        workspace2=torch.empty(e * rows * INTER, dtype=torch.bfloat16),
        expert_tokens_meta=mk.ExpertTokensMetadata(
            expert_num_tokens=counts, expert_num_tokens_cpu=counts.clone()
        ),
        apply_router_weight_on_input=False,
    )
    return out


def wire_buffer(counts: list[int], seed: int, rows: int = ROWS):
    """E4M3 rows and row-major scales [E, rows, H / 128] as the FP8 wire fills them."""
    x, c = bf16_buffer(counts, seed, rows)
    q, s = fp8_arrivals("block", x, c)
    return q, s, c


# ------------------------------------------------------------------ the choice
@pytest.mark.parametrize(
    ("bound", "tokens", "received_rows"),
    [
        # 8 experts, top_k 2: bound b takes forwards of at most 4b tokens
        pytest.param(1.0, 1, True, id="one-token"),
        pytest.param(1.0, 4, True, id="at-the-bound"),
        pytest.param(1.0, 5, False, id="one-token-above"),
        pytest.param(0.5, 2, True, id="fractional-at-the-bound"),
        pytest.param(0.5, 3, False, id="fractional-above"),
        pytest.param(0.0, 1, False, id="off"),
        pytest.param(0.0, 0, False, id="off-for-an-empty-forward-too"),
        pytest.param(math.inf, ROWS, True, id="every-forward"),
    ],
)
def test_small_forwards_run_the_received_rows_and_the_others_deep_gemm(
    vllm_deep_gemm, bound, tokens, received_rows
):
    experts, layer = build(bound)
    q, s, c = wire_buffer(counts_for(tokens), seed=tokens)
    out = run(experts, layer, q, s, c, tokens)
    received = received_mask(c, ROWS)
    if received_rows:
        assert not vllm_deep_gemm.calls and len(rec.gemms) == 2
        # the received-rows side reads the wire's row-major scales in place
        assert rec.gemms[0]["A_scale"].data_ptr() == s.data_ptr() and not is_mn_major(s)
        want = vllm_rows(layer, q, s, c)
        assert rel(out[received], want[received]) < 1e-3
        assert torch.isnan(out[~received].float()).all()
        return
    assert not rec.gemms and len(vllm_deep_gemm.calls) == 1
    got = vllm_deep_gemm.calls[0]
    assert got.hidden is q and is_mn_major(got.scales) and same(got.scales, s)


@pytest.mark.parametrize(
    ("tokens_across", "bound", "takes"),
    [(4, 1.0, True), (5, 1.0, False), (0, 0.0, False), (10**9, math.inf, True), (1, 0.25, True)],
)
def test_the_rule_is_tokens_across_times_top_k_at_most_bound_times_experts(
    tokens_across, bound, takes
):
    assert takes_received_rows(tokens_across, TOP_K, EXPERTS, bound) is takes


@pytest.mark.parametrize(
    ("bound", "received_rows"), [(4.0, True), (3.9, False)], ids=["at-4", "below-4"]
)
def test_a_round_s_size_counts_every_sender_not_this_rank(vllm_deep_gemm, bound, received_rows):
    """Two senders, a pooled round of 8 tokens each: 16 tokens x 2 = 32 rows over 8
    experts, 4 per expert, whatever this rank's own count (1 token here)."""
    experts, layer = build(bound, dispatchers=2, sent=8)
    q, s, c = wire_buffer([4] * EXPERTS, seed=3)
    run(experts, layer, q, s, c, 1)
    assert bool(rec.gemms) is received_rows and bool(vllm_deep_gemm.calls) is not received_rows


@pytest.mark.parametrize(
    ("dp", "bound", "received_rows"),
    [
        pytest.param([3, 9], 4.5, True, id="largest-rank-9-at-4.5"),
        pytest.param([3, 9], 4.4, False, id="largest-rank-9-below"),
        pytest.param(None, 32.0, True, id="no-metadata-capacity-at-32"),
        pytest.param(None, 31.9, False, id="no-metadata-capacity-below"),
    ],
)
def test_without_the_round_s_size_vllm_s_dp_metadata_or_the_capacity_counts(
    monkeypatch, vllm_deep_gemm, dp, bound, received_rows
):
    """Two senders: 9 tokens from the largest rank x 2 ranks x top_k 2 = 36 rows over 8
    experts (4.5 each); without DP metadata each rank may send its capacity (64: 32 each)."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    if dp is not None:
        dp_metadata(monkeypatch, dp)
    experts, layer = build(bound, dispatchers=2)
    q, s, c = wire_buffer([3] * EXPERTS, seed=4)
    run(experts, layer, q, s, c, 3)
    assert bool(rec.gemms) is received_rows and bool(vllm_deep_gemm.real()) is not received_rows


def test_rows_per_expert_count_every_rank_s_experts(vllm_deep_gemm):
    """EP world 2, 8 of 16 experts here: 2 senders x 4 tokens x top_k 2 = 16 rows over 16
    experts, 1 per expert: at a bound of 1 the received rows, not 2 per local expert."""
    experts, layer = build(1.0, dispatchers=2, sent=4)
    q, s, c = wire_buffer(counts_for(4), seed=5)
    run(experts, layer, q, s, c, 4, global_experts=2 * EXPERTS)
    assert not vllm_deep_gemm.calls and len(rec.gemms) == 2
    rec.clear()
    run(experts, layer, q, s, c, 4)  # 16 rows over 8 experts: 2 each, above the bound
    assert len(vllm_deep_gemm.calls) == 1 and not rec.gemms


def test_the_bound_off_looks_no_token_count_up(monkeypatch, vllm_deep_gemm):
    def no_lookup(*args):
        raise AssertionError("the token count was looked up with the bound off")

    monkeypatch.setattr(deep_gemm, "senders_tokens", no_lookup)
    experts, layer = build(0.0, dispatchers=2, sent=1)
    q, s, c = wire_buffer(counts_for(1), seed=6)
    run(experts, layer, q, s, c, 1)
    assert len(vllm_deep_gemm.calls) == 1


def test_a_pooled_round_s_rows_are_all_computed_whatever_this_rank_sent(vllm_deep_gemm):
    """World 1, a pooled round of 8 tokens carrying 1 real one: every row the 8 tokens
    put in the buffer is computed (the list sized from the round, not the batch)."""
    experts, layer = build(math.inf, sent=8)
    q, s, c = wire_buffer(counts_for(8), seed=7)
    out = run(experts, layer, q, s, c, 1)
    received = received_mask(c, ROWS)
    assert not vllm_deep_gemm.calls
    assert rel(out[received], vllm_rows(layer, q, s, c)[received]) < 1e-3


def test_scales_already_mn_major_are_read_right_by_both_sides(vllm_deep_gemm):
    q, s, c = wire_buffer(counts_for(2), seed=8)
    mn = mn_major(s)
    experts, layer = build(math.inf)
    out = run(experts, layer, q, mn, c, 2)
    received = received_mask(c, ROWS)
    assert rel(out[received], vllm_rows(layer, q, s, c)[received]) < 1e-3
    experts, layer = build(0.0)
    run(experts, layer, q, mn, c, 2)
    assert same(vllm_deep_gemm.calls[0].scales, s) and is_mn_major(vllm_deep_gemm.calls[0].scales)


def test_the_prepare_s_quantized_rows_take_either_side(monkeypatch, vllm_deep_gemm):
    """A block layer whose wire is off: the LL prepare quantizes what arrived (these
    experts never defer it) and both sides read its E4M3 rows with row-major scales."""
    from tests.unit.test_receive_quant import emulated_quantize

    monkeypatch.setattr(receive_quant, "_vllm_quantize", emulated_quantize)
    experts, layer = build(1.0)
    assert experts.expects_unquantized_inputs is False
    x, c = bf16_buffer(counts_for(2), seed=9, rows=ROWS)
    xq, xs = receive_quant.quantize_expert_buffer(x.nan_to_num(), c, layer.qc, False)
    out = run(experts, layer, xq, xs, c, 2)
    received = received_mask(c, ROWS)
    assert not vllm_deep_gemm.calls and rec.gemms[0]["A"].data_ptr() == xq.data_ptr()
    assert rel(out[received], vllm_rows(layer, xq, xs, c)[received]) < 1e-3
    run(experts, layer, xq, xs, c, 5)  # above the bound
    got = vllm_deep_gemm.calls[0]
    assert got.hidden is xq and is_mn_major(got.scales) and same(got.scales, xs)


# ------------------------------------------------------------------ MN-major scales
@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize(
    ("sent", "dispatchers", "copied"),
    [(8, 1, 8), (8, 2, 16), (None, 1, None)],
    ids=["pooled-8", "pooled-8-two-senders", "unknown-every-row"],
)
def test_deep_gemm_gets_mn_major_scales_holding_the_rows_the_round_can_fill(
    monkeypatch, vllm_deep_gemm, sent, dispatchers, copied
):
    """Each sender puts at most its round's tokens in an expert's slot: the copy covers
    sent x senders rows per expert (every row when the round's size is unknown)."""
    asked = []
    monkeypatch.setattr(
        deep_gemm, "mn_major", lambda s, rows=None: asked.append(rows) or mn_major(s, rows)
    )
    experts, layer = build(0.0, dispatchers=dispatchers, sent=sent)
    q, s, c = wire_buffer([min(8, 4 * dispatchers)] * EXPERTS, seed=10)
    s = s.nan_to_num(7.0)  # rows past the counts: an earlier round's leftovers
    run(experts, layer, q, s, c, 4)
    assert asked == [copied]
    scales = vllm_deep_gemm.calls[0].scales
    filled = ROWS if copied is None else copied
    assert is_mn_major(scales) and scales.shape == s.shape
    assert same(scales[:, :filled], s[:, :filled])
    assert scales[:, filled:].isnan().all()  # nothing past what the round can fill


def test_mn_major_keeps_every_value_and_takes_any_layout():
    s = torch.rand(3, 128, 16, generator=torch.Generator().manual_seed(4))
    out = mn_major(s)
    assert is_mn_major(out) and torch.equal(out, s) and out.data_ptr() != s.data_ptr()
    assert torch.equal(mn_major(out), s)  # already MN-major: a new tensor, same values


@pytest.fixture
def nan_empty(monkeypatch):
    """New tensors NaN-filled, so rows nobody copied show as such (not as leftovers)."""
    real = torch.empty_strided

    def empty_strided(*args, **kwargs):
        return real(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty_strided", empty_strided)


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("rows", [0, 1, 17, 128, 500])
def test_mn_major_copies_the_rows_asked_for_and_no_others(rows):
    """The copy is the cost the round's size saves: rows past `rows` stay untouched."""
    s = torch.rand(3, 128, 16, generator=torch.Generator().manual_seed(5))
    out = mn_major(s, rows)
    kept = min(rows, 128)
    assert is_mn_major(out) and torch.equal(out[:, :kept], s[:, :kept])
    assert out[:, kept:].isnan().all()


# ------------------------------------------------------------------ through vLLM's kernel
def ll_kernel(bound: str, monkeypatch, *, wire=True, sizes=(8,)):
    """vLLM's FusedMoEKernel over the LL prepare/finalize with vLLM's BatchedDeepGemmExperts
    (what its oracle builds for --moe-backend deep_gemm), the bound from the variable."""
    monkeypatch.setenv("VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS", bound)
    layer = make_layer("block", seed=11)
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=ROWS,
        top_k=TOP_K,
        sizes=list(sizes),
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=wire)
    vllm_experts = BatchedDeepGemmExperts(moe_cfg(TOP_K, ROWS), layer.qc, ROWS, 1)
    kernel = mk.FusedMoEKernel(pf, vllm_experts)
    experts = kernel.fused_experts
    assert type(experts) is ReceivedRowsOrDeepGemmExperts
    assert experts.received_rows_up_to == float(bound)
    return rt, kernel, layer


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("tokens", [5, 9], ids=["pooled-8", "fresh"])
def test_through_the_kernel_deep_gemm_gets_the_wire_s_scales_mn_major(
    monkeypatch, vllm_deep_gemm, tokens
):
    asked = []
    monkeypatch.setattr(
        deep_gemm, "mn_major", lambda s, rows=None: asked.append(rows) or mn_major(s, rows)
    )
    rt, kernel, layer = ll_kernel("0", monkeypatch)
    x, ids, weights = tokens_for(tokens, TOP_K, seed=tokens)
    kernel_apply(kernel, layer, x, ids, weights)
    got = vllm_deep_gemm.calls[0]
    wire = rt.fp8_wire
    assert got.hidden is wire.tokens and is_mn_major(got.scales) and not is_mn_major(wire.scales)
    # a pooled round's size (8 tokens from the one rank); a fresh handle's round says
    # nothing, so every row
    filled = 8 if tokens <= 8 else ROWS
    assert asked == [None if tokens > 8 else 8]
    assert int(got.meta.expert_num_tokens.max()) <= filled
    assert same(got.scales[:, :filled], wire.scales[:, :filled])


@pytest.mark.usefixtures("selection")
def test_through_the_kernel_small_forwards_match_a_torch_moe(monkeypatch, vllm_deep_gemm):
    rt, kernel, layer = ll_kernel("inf", monkeypatch)
    x, ids, weights = tokens_for(5, TOP_K, seed=12)
    out = kernel_apply(kernel, layer, x, ids, weights)
    assert not vllm_deep_gemm.calls and len(rec.gemms) == 2
    assert rec.gemms[0]["A_scale"].data_ptr() == rt.fp8_wire.scales.data_ptr()  # row-major
    assert rel(out, torch_moe(x, layer.d1, layer.d2, ids, weights)) < 8e-2


@pytest.mark.usefixtures("selection")
def test_through_the_kernel_the_wire_off_prepare_quantizes_for_deep_gemm(
    monkeypatch, vllm_deep_gemm
):
    from tests.unit.test_receive_quant import emulated_quantize

    monkeypatch.setattr(receive_quant, "_vllm_quantize", emulated_quantize)
    rt, kernel, layer = ll_kernel("0", monkeypatch, wire=False)
    assert kernel.fused_experts.expects_unquantized_inputs is False
    x, ids, weights = tokens_for(3, TOP_K, seed=13)
    kernel_apply(kernel, layer, x, ids, weights)
    got = vllm_deep_gemm.calls[0]
    assert got.hidden.dtype == FP8 and is_mn_major(got.scales)
    assert rt.fp8_wire is None or rt.fp8_wire.dispatches == 0


# ------------------------------------------------------------------ the warm-up
TOP_K_WARM = 8  # 128 rows x top_k 8 / 8 experts: estimates up to the rows per expert


def warm_call(experts, layer, tokens=5, rows=ROWS):
    q, s, c = wire_buffer([3, 0, 1, 0, 0, 0, 0, 2], seed=14, rows=rows)
    run(experts, layer, q, s, c, tokens, top_k=TOP_K_WARM)
    return q


def test_the_first_eager_call_with_dp_metadata_warms_every_expected_m_once(
    monkeypatch, vllm_deep_gemm, caplog
):
    """vLLM's apply once per `expected_m` a forward can give, every count zero (no row
    computed, each tile compiled), then the forward's own call with vLLM's estimate; once
    per weight shape and process."""
    dp_metadata(monkeypatch, [40, 24])  # 64 tokens x 8 / 8 experts = 64 per expert
    experts, layer = build(0.0)
    with caplog.at_level(logging.INFO):
        hidden = warm_call(experts, layer)
    values = expected_m_values(ROWS, TOP_K_WARM, EXPERTS)
    assert values == list(range(16, ROWS + 1, 16))
    got = [(c.expected_m, c.rows) for c in vllm_deep_gemm.calls]
    assert got == [(m, 0) for m in values] + [(64, 6)]
    warm = vllm_deep_gemm.calls[0]
    assert warm.hidden is hidden and warm.meta.expert_num_tokens_cpu is None
    assert experts.experts._fixed_m is None  # vLLM's estimate again
    assert f"warmed for {len(values)} expected_m values" in caplog.text
    vllm_deep_gemm.calls.clear()
    warm_call(experts, layer)
    assert [(c.expected_m, c.rows) for c in vllm_deep_gemm.calls] == [(64, 6)]
    other, _ = build(0.0, seed=1)  # another layer of the same shape: nothing to compile
    warm_call(other, layer)
    assert len(vllm_deep_gemm.calls) == 2
    bigger, _ = build(0.0, capacity=2 * ROWS)  # another buffer shape: its own tiles
    vllm_deep_gemm.calls.clear()
    warm_call(bigger, layer, rows=2 * ROWS)
    assert len(vllm_deep_gemm.calls) == len(expected_m_values(2 * ROWS, TOP_K_WARM, EXPERTS)) + 1


@pytest.mark.parametrize("why", ["no-dp-metadata", "capturing"])
def test_no_warm_up_outside_an_eager_forward_with_dp_metadata(monkeypatch, vllm_deep_gemm, why):
    """World 1 has no DP metadata (nothing to warm); a capture must not launch more: the
    next eager forward with DP metadata warms."""
    if why == "capturing":
        dp_metadata(monkeypatch, [8, 8])
        monkeypatch.setattr(deep_gemm, "is_capturing", lambda: True)
    experts, layer = build(0.0)
    warm_call(experts, layer)
    assert [c.rows for c in vllm_deep_gemm.calls] == [6]
    dp_metadata(monkeypatch, [8, 8])
    monkeypatch.setattr(deep_gemm, "is_capturing", lambda: False)
    vllm_deep_gemm.calls.clear()
    warm_call(experts, layer)
    assert len(vllm_deep_gemm.calls) == len(expected_m_values(ROWS, TOP_K_WARM, EXPERTS)) + 1


def test_vllm_s_skip_setting_skips_the_warm_up(monkeypatch, vllm_deep_gemm, caplog):
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    dp_metadata(monkeypatch, [8, 8])
    experts, layer = build(0.0)
    with caplog.at_level(logging.INFO):
        warm_call(experts, layer)
    assert [c.rows for c in vllm_deep_gemm.calls] == [6]
    assert "VLLM_DEEP_GEMM_WARMUP=skip" in caplog.text


def test_a_failed_warm_up_is_logged_and_the_forward_still_runs(monkeypatch, vllm_deep_gemm, caplog):
    vllm_deep_gemm.fail_on_empty = True
    dp_metadata(monkeypatch, [8, 8])  # 16 tokens x 8 / 8 experts: vLLM's estimate 16
    experts, layer = build(0.0)
    with caplog.at_level(logging.WARNING):
        warm_call(experts, layer)
    assert "warming DeepGEMM's masked tiles failed (RuntimeError" in caplog.text
    assert vllm_deep_gemm.calls[-1].rows == 6 and vllm_deep_gemm.calls[-1].expected_m == 16
    assert experts.experts._fixed_m is None


def test_the_warm_up_stops_at_the_largest_estimate_a_forward_can_give(monkeypatch, vllm_deep_gemm):
    """128 rows x top_k 8 over 64 global experts: at most 16 rows per expert."""
    dp_metadata(monkeypatch, [64, 64])
    experts, layer = build(0.0)
    q, s, c = wire_buffer([3, 0, 1, 0, 0, 0, 0, 2], seed=15)
    run(experts, layer, q, s, c, 5, top_k=TOP_K_WARM, global_experts=64)
    assert [c.expected_m for c in vllm_deep_gemm.calls if c.rows == 0] == [16]


@pytest.mark.parametrize("rows", [8, 128, 256, 512, 2048])
@pytest.mark.parametrize("global_experts", [8, 64, 256, 384])
def test_the_values_warmed_are_every_estimate_vllm_makes(monkeypatch, rows, global_experts):
    """vLLM's own estimate over every token count the DP metadata can hold (at most the
    buffer's rows over all ranks) gives exactly `expected_m_values`."""
    experts = BatchedDeepGemmExperts(moe_cfg(TOP_K, 128), make_layer("block", 0).qc, 128, 1)
    seen = set()
    for tokens in range(rows + 1):
        dp_metadata(monkeypatch, [tokens // 2, tokens - tokens // 2])
        seen.add(experts.estimate_expected_m(global_experts, rows, TOP_K_WARM))
    assert seen == set(expected_m_values(rows, TOP_K_WARM, global_experts))


def test_dp_estimate_is_vllm_s_estimate_for_any_token_count(monkeypatch):
    experts = BatchedDeepGemmExperts(moe_cfg(TOP_K, 128), make_layer("block", 0).qc, 128, 1)
    for rows in (128, 256):
        for global_experts in (8, 64, 384):
            for top_k in (1, 8):
                for tokens in range(0, 2 * rows + 64, 7):
                    dp_metadata(monkeypatch, [tokens // 2, tokens - tokens // 2])
                    vllm_m = experts.estimate_expected_m(global_experts, rows, top_k)
                    assert dp_estimate(tokens, top_k, global_experts, rows) == vllm_m


# ------------------------------------------------------------------ construction
@pytest.mark.parametrize(
    ("capacity", "dispatchers", "step"), [(100, 1, 128), (96, 2, 64), (200, 3, 128)]
)
def test_a_buffer_deep_gemm_would_overrun_is_refused(capacity, dispatchers, step):
    with pytest.raises(FlashInferEPConfigError) as info:
        build(4.0, capacity=capacity, dispatchers=dispatchers)
    assert f"--max-num-batched-tokens a multiple of {step}" in str(info.value)
    assert "--moe-backend triton" in str(info.value)


def test_gpus_that_want_packed_ue8m0_scales_are_refused(monkeypatch):
    """Blackwell with vLLM's E8M0 setting: DeepGEMM wants packed power-of-two scales."""
    monkeypatch.setattr(BatchedDeepGemmExperts, "supports_packed_ue8m0_act_scales", lambda s: True)
    with pytest.raises(FlashInferEPConfigError, match="packed UE8M0.*--moe-backend triton"):
        build(4.0)


def test_a_layer_with_expert_biases_is_refused():
    """vLLM's DeepGEMM experts drop expert biases; the received rows apply them, so the
    pair would be right only below the bound: refused whole, with the flag that serves it."""
    biased = make_layer("block", 0, biased=True)
    with pytest.raises(FlashInferEPConfigError, match="expert biases.*--moe-backend triton"):
        ReceivedRowsOrDeepGemmExperts(moe_cfg(TOP_K, ROWS), biased.qc, ROWS, 1)


@pytest.mark.usefixtures("selection")
def test_vllm_s_kernel_build_raises_the_refusal(monkeypatch):
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=100, sizes=[1]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    layer = make_layer("block", 0)
    with pytest.raises(FlashInferEPConfigError, match="multiple of 128"):
        mk.FusedMoEKernel(pf, BatchedDeepGemmExperts(moe_cfg(TOP_K, 100), layer.qc, 100, 1))


def test_what_the_pair_declares_to_vllm():
    experts, layer = build(4.0, sent=3)
    assert type(experts.experts) is DeepGemmExperts
    assert type(experts.fallback_experts) is ReceivedRowsExperts
    assert experts.get_clses() == (DeepGemmExperts, ReceivedRowsExperts)
    assert experts.activation_format() == mk.FusedMoEActivationFormat.BatchedExperts
    assert experts.expects_unquantized_inputs is False  # DeepGEMM reads FP8 only
    assert experts.fallback_experts.expects_unquantized_inputs is False
    assert experts.supports_packed_ue8m0_act_scales() is False
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceDelegate)
    for inner in (experts.experts, experts.fallback_experts):
        assert inner._sent_per_rank() == 3 and inner.max_num_tokens == ROWS
        assert inner.quant_config is layer.qc
    args = (4, 2 * INTER, HIDDEN, TOP_K, EXPERTS, EXPERTS, None, experts.moe_config.activation)
    ours = experts.workspace_shapes(*args)
    a, b = experts.experts.workspace_shapes(*args), experts.fallback_experts.workspace_shapes(*args)
    assert ours == tuple(tuple(map(max, x, y)) for x, y in zip(a, b))
