"""vLLM's batched DeepGEMM experts on the LL receive buffer, against its batched Triton experts (GPU).

`--moe-backend deep_gemm` (vllm/deep_gemm_experts.py): a 128x128 block-FP8 layer's
receive buffer as the FP8 wire delivers it (E4M3 rows [experts, rows, hidden], FP32
scales [experts, rows, hidden / 128] row-major, NaN past each expert's count) goes
through vLLM 0.33.0's `BatchedDeepGemmExperts.apply` with the scales the LL prepare hands
it (`mn_major`, the rows the senders can fill), and through vLLM's
`BatchedTritonExperts.apply` with the wire's scales as they are; likewise the BF16
arrival quantized as the LL prepare quantizes it. Both read the weights as vLLM prepares
them for DeepGEMM (`prepare_fp8_moe_layer_for_deepgemm`: on this GPU the block scales may
be rounded to powers of two), so what differs is the GEMM kernels and the order of their
FP32 sums: bound 2e-2 relative L2 over the received rows and 0.1 for the worst single
row (a wrong scale layout, row or expert is off by O(1)). Edge counts (0, 1, a full
expert, one short of full) and a captured graph replayed with new counts and rows.
Printed values (pytest -s) say how far below the bounds the H200 lands. Needs the real
vLLM runtime with DeepGEMM (docs/device_vllm.md).
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
    for seed in (11, 12):
        counts = _routed_counts(tokens, seed)
        p.load(counts, seed=seed)
        graph.replay()
        want = torch.zeros_like(got)
        p.run(batched, tokens, want, "fp8-wire")
        torch.cuda.synchronize()
        assert _rel(counts, got, want, f"deep_gemm graph replay {seed}") < BOUND
        assert _worst_row(counts, got, want, f"deep_gemm graph replay {seed}") < ROW_BOUND
    del graph
