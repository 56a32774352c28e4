"""Block-FP8 LL layers on DeepGEMM (experts/deep_gemm.py) against vLLM's batched Triton experts.

A 128x128 block-FP8 layer's receive buffer as the FP8 wire delivers it (E4M3 rows, FP32
scales [experts, rows, hidden / 128] row-major, NaN past each expert's count), or as the LL
prepare quantizes BF16 arrivals, goes through the package's `DeepGemmExperts` (vLLM's
`BatchedDeepGemmExperts`, handed the scales MN-major for the rows the round can fill) and
through vLLM's `BatchedTritonExperts` with the scales as they are. Both read the weights as
vLLM prepares them for DeepGEMM (`prepare_fp8_moe_layer_for_deepgemm`: the block scales
may be rounded to powers of two), so what differs is the GEMM kernels and the order of
their FP32 sums: bound 2e-2 relative L2 over the received rows and 0.1 for the worst row
(a wrong scale layout, row or expert is off by O(1)). Edge counts and captured graphs
replayed with new counts and rows; `ReceivedRowsOrDeepGemmExperts` on both sides of its
per-forward choice; the masked-tile warm-up leaves nothing to compile while serving.
Command: python3 -m pytest tests/kernels/test_deep_gemm_experts_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_received_rows_experts_gpu import (
    EXPERTS,
    HIDDEN,
    ROWS,
    TOP_K,
    Layer,
    _edge_counts,
    _experts,
    _moe_config,
    _received,
    _rel,
    _routed_counts,
)
from tests.kernels.test_vllm_join_gpu import vllm_env  # noqa: F401 - fixture
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu
BOUND = 2e-2
ROW_BOUND = 0.1  # one row's relative L2: bulk noise is ~1e-3, a wrong row or tile ~1


@pytest.fixture(scope="module")
def deep_gemm():
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    if not is_deep_gemm_supported():
        pytest.skip("DeepGEMM is not supported in this vLLM runtime (VLLM_USE_DEEP_GEMM?)")


class DeepGemmLayer(Layer):
    """A block layer with the weights vLLM prepares for DeepGEMM; `qc` the same scales
    row-major, as vLLM's batched Triton experts read them."""

    def __init__(self, seed: int) -> None:
        super().__init__("block", seed)
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            prepare_fp8_moe_layer_for_deepgemm,
        )

        w1, w2, s1, s2 = prepare_fp8_moe_layer_for_deepgemm(
            self.w1.clone(), self.w2.clone(), self.qc.w1_scale.clone(), self.qc.w2_scale.clone(),
            (128, 128),
        )  # fmt: skip
        assert s1.dtype == torch.float32, f"block scales for DeepGEMM came back as {s1.dtype}"
        self.w1, self.w2 = w1, w2
        self.dg_qc = fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128])
        self.qc = fp8_w8a8_moe_quant_config(
            s1.contiguous(), s2.contiguous(), block_shape=[128, 128]
        )


def _deep_gemm(p: DeepGemmLayer, sent=None):
    from vllm_flashinfer_ep.experts.deep_gemm import DeepGemmExperts

    return DeepGemmExperts(
        _moe_config("silu"), p.dg_qc, ROWS, 1, sent_per_rank=(lambda: sent) if sent else None
    )


def _choice(p: DeepGemmLayer, bound: float, monkeypatch):
    """`ReceivedRowsOrDeepGemmExperts` at `bound` rows per expert, and the token counts of
    the forwards its received-rows side took."""
    from vllm_flashinfer_ep.experts.deep_gemm import ReceivedRowsOrDeepGemmExperts

    experts = ReceivedRowsOrDeepGemmExperts(
        _moe_config("silu"), p.dg_qc, ROWS, 1, received_rows_up_to=bound
    )
    took: list[int] = []
    real = experts.fallback_experts.apply

    def counting(*args, **kwargs):
        took.append(kwargs["topk_ids"].shape[0] if "topk_ids" in kwargs else args[5].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(experts.fallback_experts, "apply", counting)
    return experts, took


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
    valid = _received(counts)
    g, w = got[valid].float(), want[valid].float()
    worst = float(((g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-6)).max())
    print(f"{what}: worst row {worst:.3g}")
    return worst


def _close(counts, got, want, what: str) -> None:
    assert _rel(counts, got, want, what) < BOUND
    assert _worst_row(counts, got, want, what) < ROW_BOUND


def _replays_match(graph, p, triton, tokens: int, got, seeds, what: str) -> None:
    """Each seed: new counts and rows in place, `graph` replayed into `got`, against vLLM's
    batched Triton experts run eagerly on the same buffer."""
    for seed in seeds:
        counts = _routed_counts(tokens, seed)
        p.load(counts, seed=seed)
        graph.replay()
        want = torch.zeros_like(got)
        p.run(triton, tokens, want, "wire")
        torch.cuda.synchronize()
        _close(counts, got, want, f"{what} {seed}")


@pytest.mark.parametrize("arrival", ["wire", "prepared"])
@pytest.mark.parametrize(("tokens", "counts"), CASES)
def test_deep_gemm_matches_vllm_s_batched_triton(vllm_env, deep_gemm, arrival, tokens, counts):  # noqa: F811
    """buffer-edges: expert 1 (one row short of full) follows a full expert 0, whose last
    tile must not write over expert 1's first rows (the 128-row rule)."""
    p = DeepGemmLayer(seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, ours=False), tokens, want, arrival)
    p.run(_deep_gemm(p, sent=tokens), tokens, got, arrival)  # MN-major for the rows sent
    torch.cuda.synchronize()
    _close(counts, got, want, f"deep_gemm {arrival} T={tokens}")


def test_captured_deep_gemm_follows_new_counts_and_rows(vllm_env, deep_gemm):  # noqa: F811
    p = DeepGemmLayer(seed=5)
    tokens = 32
    dg, triton = _deep_gemm(p), _experts(p.qc, ours=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(tokens, 10), seed=10)
    graph = capture_graph(lambda: p.run(dg, tokens, got, "wire"))
    _replays_match(graph, p, triton, tokens, got, (11, 12), "deep_gemm graph replay")
    del graph


def test_after_the_warm_up_no_expected_m_compiles_while_serving(vllm_env, deep_gemm, monkeypatch):  # noqa: F811
    """EP world > 1: the first eager call with DP metadata compiles DeepGEMM's masked tiles
    for every expected_m vLLM can estimate; afterwards a forward of any size launches at
    once (a compile takes seconds, a launch milliseconds) and matches vLLM's batched
    Triton experts."""
    import time
    from types import SimpleNamespace

    import vllm.forward_context as fc

    from vllm_flashinfer_ep.experts import deep_gemm as dgm

    def dp(total_tokens: int) -> None:  # vLLM's forward context at EP world 2
        across = torch.tensor([total_tokens // 2, total_tokens - total_tokens // 2])
        monkeypatch.setattr(
            fc,
            "_forward_context",
            SimpleNamespace(dp_metadata=SimpleNamespace(num_tokens_across_dp_cpu=across)),
        )

    monkeypatch.setattr(dgm, "_warmed", set())
    p = DeepGemmLayer(seed=21)
    dg, triton = _deep_gemm(p), _experts(p.qc, ours=False)
    tokens = 32
    counts = _routed_counts(tokens, 22)
    p.load(counts, seed=22)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    dp(tokens)
    start = time.monotonic()
    p.run(dg, tokens, got, "wire")  # the warm-up, then the call
    torch.cuda.synchronize()
    print(f"warm-up + first call: {time.monotonic() - start:.1f} s")
    assert len(dgm._warmed) == 1 and dg._fixed_m is None
    slowest = 0.0
    for m in dgm.expected_m_values(ROWS, TOP_K, EXPERTS):  # what a forward can ask for
        dp(-(-m * EXPERTS // TOP_K))  # vLLM's estimate for this many tokens is m
        assert dg.estimate_expected_m(EXPERTS, ROWS, TOP_K) == m
        start = time.monotonic()
        p.run(dg, tokens, got, "wire")
        torch.cuda.synchronize()
        slowest = max(slowest, time.monotonic() - start)
    print(f"slowest call after the warm-up: {slowest * 1e3:.1f} ms")
    assert slowest < 0.5, f"a call after the warm-up took {slowest:.2f} s (a compile)"
    want = torch.zeros_like(got)
    p.run(triton, tokens, want, "wire")
    torch.cuda.synchronize()
    assert _rel(counts, got, want, "deep_gemm after the warm-up") < BOUND


@pytest.mark.parametrize("arrival", ["wire", "prepared"])
@pytest.mark.parametrize("bound", [float("inf"), 0.0], ids=["received-rows", "deep-gemm"])
@pytest.mark.parametrize(("tokens", "counts"), CASES)
def test_each_side_of_the_choice_matches_vllm_s_batched_triton(
    vllm_env,  # noqa: F811
    deep_gemm,
    monkeypatch,
    arrival,
    bound,
    tokens,
    counts,
):
    """Every forward on the received rows (DeepGEMM's weights and the row-major scales as
    they arrive), or every one on DeepGEMM: each matches vLLM's batched Triton experts."""
    p = DeepGemmLayer(seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, ours=False), tokens, want, arrival)
    experts, took = _choice(p, bound, monkeypatch)
    p.run(experts, tokens, got, arrival)
    torch.cuda.synchronize()
    assert took == ([tokens] if bound else [])
    _close(counts, got, want, f"choice ({'received rows' if bound else 'DeepGEMM'}) {arrival}")


@pytest.mark.parametrize("tokens", [1, 32])
def test_a_captured_choice_replays_for_new_counts(vllm_env, deep_gemm, monkeypatch, tokens):  # noqa: F811
    """Bound 1 row per expert (64 experts, top_k 8: up to 8 tokens): a one-token graph
    holds the received rows, a 32-token one DeepGEMM; both replay new counts and rows as
    vLLM's batched Triton experts compute them."""
    p = DeepGemmLayer(seed=30 + tokens)
    experts, took = _choice(p, 1.0, monkeypatch)
    triton = _experts(p.qc, ours=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(tokens, 31), seed=31)
    graph = capture_graph(lambda: p.run(experts, tokens, got, "wire"))
    # every call of the one-token graph's (the warm-up and the capture) took the received
    # rows; none of the 32-token one's
    assert took == [tokens] * len(took) and bool(took) is (tokens == 1)
    _replays_match(graph, p, triton, tokens, got, (32, 33), f"choice T={tokens} replay")
    del graph
