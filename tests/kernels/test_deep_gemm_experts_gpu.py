"""vLLM's batched DeepGEMM experts on the LL receive buffer, against its batched Triton experts (GPU).

`--moe-backend deep_gemm` (vllm/deep_gemm_experts.py): a 128x128 block-FP8 layer's
receive buffer as the FP8 wire delivers it (E4M3 rows [experts, rows, hidden], FP32
scales [experts, rows, hidden / 128] row-major, NaN past each expert's count) goes
through vLLM 0.33.0's `BatchedDeepGemmExperts.apply` with the scales re-laid as the
package's wrapper hands them (`mn_major`, the rows the senders can fill), and through vLLM's
`BatchedTritonExperts.apply` with the wire's scales as they are; likewise the BF16
arrival quantized as the LL prepare quantizes it. Both read the weights as vLLM prepares
them for DeepGEMM (`prepare_fp8_moe_layer_for_deepgemm`: on this GPU the block scales may
be rounded to powers of two), so what differs is the GEMM kernels and the order of their
FP32 sums: bound 2e-2 relative L2 over the received rows and 0.1 for the worst single
row (a wrong scale layout, row or expert is off by O(1)). Edge counts (0, 1, a full
expert, one short of full) and a captured graph replayed with new counts and rows. The
per-forward choice (vllm/deep_gemm_per_batch.py) is checked on both of its sides the same
way: the received rows on DeepGEMM's weights, and DeepGEMM behind the wrapper that re-lays
the wire's row-major scales.
Printed values (pytest -s) say how far below the bounds the H200 lands. Needs the real
vLLM runtime with DeepGEMM (docs/contributing/gpu_runs.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_compact_experts_fp8_gpu import (
    EXPERTS,
    HIDDEN,
    ROWS,
    Problem,
    _edge_counts,
    _experts,
    _rel,
    _routed_counts,
)
from tests.kernels.test_vllm_join_gpu import (
    _moe_config,
    vllm_env,  # noqa: F401 - fixture
)
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu
BOUND = 2e-2
ROW_BOUND = 0.1  # one row's relative L2: bulk noise is ~1e-3, a wrong row or tile ~1


@pytest.fixture(scope="module")
def deep_gemm():
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    if not is_deep_gemm_supported():
        pytest.skip("DeepGEMM is not supported in this vLLM runtime (VLLM_USE_DEEP_GEMM?)")


class DeepGemmProblem(Problem):
    """The compact test's receive buffer, with the weights vLLM prepares for DeepGEMM."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            prepare_fp8_moe_layer_for_deepgemm,
        )

        w1, w2, s1, s2 = prepare_fp8_moe_layer_for_deepgemm(
            self.q1.clone(),
            self.q2.clone(),
            self.qc.w1_scale.clone(),
            self.qc.w2_scale.clone(),
            (128, 128),
        )
        assert s1.dtype == torch.float32, f"block scales for DeepGEMM came back as {s1.dtype}"
        self.q1, self.q2 = w1, w2
        self.dg_qc = fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128])
        # vLLM's Triton experts read the same values in their own (row-major) layout.
        self.qc = fp8_w8a8_moe_quant_config(
            s1.contiguous(), s2.contiguous(), block_shape=[128, 128]
        )


def _deep_gemm_experts(p: DeepGemmProblem):
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    moe = _moe_config(HIDDEN, ROWS, num_experts=EXPERTS)
    return BatchedDeepGemmExperts(
        moe_config=moe, quant_config=p.dg_qc, max_num_tokens=ROWS, num_dispatchers=1
    )


CASES = [
    pytest.param(1, _routed_counts(1, 1), id="decode-1"),
    pytest.param(13, _routed_counts(13, 2), id="decode-13"),
    pytest.param(200, _routed_counts(200, 3), id="batch-200"),
    pytest.param(ROWS, _edge_counts(), id="buffer-edges"),  # 0, 1, full, full - 1, 17
    pytest.param(ROWS, _routed_counts(ROWS, 4), id="whole-buffer"),
]


def _worst_row(counts, got, want, what: str) -> float:
    """The largest relative L2 error of one received row: an O(1) error on a few rows
    (a wrong row or tile) hides in the whole buffer's norm, not here."""
    valid = Problem.received(counts)
    g, w = got[valid].float(), want[valid].float()
    worst = float(((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-6)).max())
    print(f"{what}: worst row {worst:.3g}")
    return worst


def _replays_match(graph, p: DeepGemmProblem, batched, tokens: int, got, seeds, what: str):
    """Each seed: new counts and rows loaded in place, `graph` replayed into `got`, which
    must match vLLM's batched Triton experts run eagerly on the same buffer."""
    for seed in seeds:
        counts = _routed_counts(tokens, seed)
        p.load(counts, seed=seed)
        graph.replay()
        want = torch.zeros_like(got)
        p.run(batched, tokens, want, "fp8-wire")
        torch.cuda.synchronize()
        assert _rel(counts, got, want, f"{what} {seed}") < BOUND
        assert _worst_row(counts, got, want, f"{what} {seed}") < ROW_BOUND


@pytest.mark.parametrize("arrival", ["fp8-wire", "prepare-quantized"])
@pytest.mark.parametrize(("tokens", "counts"), CASES)
def test_deep_gemm_matches_vllm_s_batched_triton_on_the_receive_buffer(
    vllm_env,  # noqa: F811
    deep_gemm,
    arrival,
    tokens,
    counts,
):
    p = DeepGemmProblem(seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, compact=False), tokens, want, arrival)
    p.run(_deep_gemm_experts(p), tokens, got, f"{arrival}-mn-major")
    torch.cuda.synchronize()
    # buffer-edges: expert 1 (one row short of full) follows a full expert 0, whose last
    # tile must not write over expert 1's first rows (`rows_reason`).
    assert _rel(counts, got, want, f"deep_gemm {arrival} T={tokens}") < BOUND
    assert _worst_row(counts, got, want, f"deep_gemm {arrival} T={tokens}") < ROW_BOUND


def test_captured_deep_gemm_follows_new_counts_and_rows(vllm_env, deep_gemm):  # noqa: F811
    p = DeepGemmProblem(seed=5)
    tokens = 32
    dg, batched = _deep_gemm_experts(p), _experts(p.qc, compact=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(tokens, 10), seed=10)
    p.run(
        dg, tokens, got, "fp8-wire-mn-major"
    )  # eager first: DeepGEMM compiles outside the capture
    graph = capture_graph(lambda: p.run(dg, tokens, got, "fp8-wire-mn-major"))
    _replays_match(graph, p, batched, tokens, got, (11, 12), "deep_gemm graph replay")
    del graph


def test_after_the_warm_up_no_expected_m_compiles_while_serving(vllm_env, deep_gemm, monkeypatch):  # noqa: F811
    """EP world > 1 (vllm/deep_gemm_warmup.py): the first eager call with DP metadata
    compiles DeepGEMM's masked tiles for every expected_m vLLM can estimate; afterwards a
    forward of any size launches at once (a compile takes seconds; a launch of a compiled
    kernel, milliseconds) and matches vLLM's batched Triton experts."""
    import time
    from types import SimpleNamespace

    import vllm.forward_context as fc

    from tests.kernels.test_compact_experts_fp8_gpu import TOP_K
    from vllm_flashinfer_ep.vllm import deep_gemm_warmup

    def dp(total_tokens: int) -> None:  # vLLM's forward context at EP world 2
        across = torch.tensor([total_tokens // 2, total_tokens - total_tokens // 2])
        monkeypatch.setattr(
            fc,
            "_forward_context",
            SimpleNamespace(dp_metadata=SimpleNamespace(num_tokens_across_dp_cpu=across)),
        )

    deep_gemm_warmup.reset()
    p = DeepGemmProblem(seed=21)
    dg, batched = _deep_gemm_experts(p), _experts(p.qc, compact=False)
    assert deep_gemm_warmup.install(dg)
    tokens = 32
    counts = _routed_counts(tokens, 22)
    p.load(counts, seed=22)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dp(tokens)
    start = time.monotonic()
    p.run(dg, tokens, got, "fp8-wire-mn-major")  # the warm-up, then the call
    torch.cuda.synchronize()
    print(f"warm-up + first call: {time.monotonic() - start:.1f} s")
    slowest = 0.0
    bound = deep_gemm_warmup.largest_estimate(ROWS, TOP_K, EXPERTS)
    for m in deep_gemm_warmup.expected_m_values(ROWS, bound):  # what a forward can ask for
        dp(-(-m * EXPERTS // TOP_K))  # vLLM's estimate for this many tokens is m
        assert dg.estimate_expected_m(EXPERTS, ROWS, TOP_K) == m
        start = time.monotonic()
        p.run(dg, tokens, got, "fp8-wire-mn-major")
        torch.cuda.synchronize()
        slowest = max(slowest, time.monotonic() - start)
    print(f"slowest call after the warm-up: {slowest * 1e3:.1f} ms")
    assert slowest < 0.5, f"a call after the warm-up took {slowest:.2f} s (a compile)"
    want = torch.zeros_like(got)
    p.run(batched, tokens, want, "fp8-wire")
    torch.cuda.synchronize()
    assert _rel(counts, got, want, "deep_gemm after the warm-up") < BOUND
    deep_gemm_warmup.reset()


def _per_batch(p: DeepGemmProblem, monkeypatch, bound: float):
    """DeepGEMM experts with vllm/deep_gemm_per_batch.py's wrapper at `bound` rows per
    expert, and a list that counts the forwards the received rows took."""
    from vllm_flashinfer_ep.vllm import compact_experts, deep_gemm_per_batch

    monkeypatch.setattr(deep_gemm_per_batch, "RECEIVED_ROWS_UP_TO", bound)
    took: list[int] = []
    real = compact_experts.compact_apply

    def counting(fused_experts, kw, sent_per_rank=None):
        took.append(kw["topk_ids"].shape[0])
        return real(fused_experts, kw, sent_per_rank)

    monkeypatch.setattr(compact_experts, "compact_apply", counting)
    dg = _deep_gemm_experts(p)
    assert deep_gemm_per_batch.install(dg)
    return dg, took


@pytest.mark.parametrize("arrival", ["fp8-wire", "prepare-quantized"])
@pytest.mark.parametrize("bound", [float("inf"), 0.0], ids=["received-rows", "deep-gemm"])
@pytest.mark.parametrize(("tokens", "counts"), CASES)
def test_each_side_of_the_per_batch_choice_matches_vllm_s_batched_triton(
    vllm_env,  # noqa: F811
    deep_gemm,
    monkeypatch,
    arrival,
    bound,
    tokens,
    counts,
):
    """vllm/deep_gemm_per_batch.py on DeepGEMM's weights and row-major scales (the wire's,
    or the LL prepare's quantization after receive: what the prepare hands it): every forward on the received rows, or every one on
    DeepGEMM with the scales the wrapper re-lays; each matches vLLM's batched Triton
    experts on the same buffer, at edge counts too."""
    p = DeepGemmProblem(seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, compact=False), tokens, want, arrival)
    dg, took = _per_batch(p, monkeypatch, bound)
    p.run(dg, tokens, got, arrival)
    torch.cuda.synchronize()
    assert took == ([tokens] if bound else [])
    what = f"per batch ({'received rows' if bound else 'DeepGEMM'}) {arrival} T={tokens}"
    assert _rel(counts, got, want, what) < BOUND
    assert _worst_row(counts, got, want, what) < ROW_BOUND


@pytest.mark.parametrize("tokens", [1, 32])
def test_a_captured_choice_replays_for_new_counts(vllm_env, deep_gemm, monkeypatch, tokens):  # noqa: F811
    """Bound 1 row per expert (64 experts, top_k 8: up to 8 tokens): a one-token graph
    holds the received rows, a 32-token one DeepGEMM; both replay new counts and rows as
    vLLM's batched Triton experts compute them."""
    p = DeepGemmProblem(seed=30 + tokens)
    dg, took = _per_batch(p, monkeypatch, 1.0)
    batched = _experts(p.qc, compact=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(tokens, 31), seed=31)
    p.run(dg, tokens, got, "fp8-wire")  # eager first: compiles outside the capture
    graph = capture_graph(lambda: p.run(dg, tokens, got, "fp8-wire"))
    # every call of the one-token graph's (eager, capture_graph's warm-up and capture) took
    # the received rows; none of the 32-token one's
    assert took == [tokens] * len(took) and bool(took) is (tokens == 1)
    _replays_match(graph, p, batched, tokens, got, (32, 33), f"per batch T={tokens} replay")
    del graph
