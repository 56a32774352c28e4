"""Block-FP8 received-rows LL experts (vllm/compact_experts.py) against vLLM's batched FP8 kernel (GPU).

A 128x128 block-FP8 layer (E4M3 weights, FP32 scales per 128x128 block, dynamic
activation groups of 128: vLLM's `fp8_w8a8_moe_quant_config(..., block_shape=[128, 128])`)
runs the same expert-major receive buffer through vLLM 0.33.0's `BatchedTritonExperts.apply`
as vLLM ships it and through the same class with the package's wrapper. The buffer is
what the FP8 wire delivers: E4M3 rows [experts, rows, hidden] and FP32 scales
[experts, rows, hidden / 128] row-major, amax / 448 per 128 elements; rows past each
expert's count hold NaN (neither path may read them). A second arrival hands the experts
BF16 rows (the wire off, quantization left to the experts): the wrapper quantizes the
listed rows with vLLM's group quantization, vLLM's kernel gets the buffer the prepare's
`quantize_expert_buffer` would hand it.

Bound (received rows, relative L2): 1e-2, expected well under it. Both sides read the
same E4M3 bytes and FP32 scales and the same weights, multiply them with the same Triton
`tl.dot` on FP8 and accumulate per 128-element K group in FP32 with the same scale
products; GEMM1 writes BF16, the activation is the same vLLM call, the intermediate is
quantized by the same vLLM function (same E8M0 setting). What differs is the tile (vLLM's
batched lookup at the buffer's 256 rows vs the fused kernel's at the batch) and so the
order of the FP32 sums inside a K group: it flips a BF16 rounding of GEMM1's output now
and then, which flips an E4M3 rounding of the intermediate more rarely still. That is
noise of order 1e-3 at most; a wrong scale view, row or block shape is off by O(1).
Printed values (pytest -s) say how far below the bound the H200 lands.
Needs the real vLLM runtime on the GPU (docs/device_vllm.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_fp8_join_gpu import _quantize_weight
from tests.kernels.test_vllm_join_gpu import INTERMEDIATE as INTER
from tests.kernels.test_vllm_join_gpu import (
    TOP_K,
    _modules,
    _moe_config,
    vllm_env,  # noqa: F401 - fixture
)
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fp8_path_on(monkeypatch):
    """The block-FP8 case is off in production until this GPU test has run
    (compact_experts.FP8_ENABLED); these tests exercise it."""
    from vllm_flashinfer_ep.vllm import compact_experts as ce

    monkeypatch.setattr(ce, "FP8_ENABLED", True)


EXPERTS, HIDDEN, ROWS = 64, 2048, 256  # INTER 512 (w1 N 1024), TOP_K 8: the join test's
FP8 = torch.float8_e4m3fn
G = 128
BOUND = 1e-2  # see the module docstring


def _block_quant_config(seed: int):
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1 = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
    ).bfloat16()
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5).bfloat16()
    q1, s1 = _quantize_weight(w1, "block")
    q2, s2 = _quantize_weight(w2, "block")
    return q1, q2, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128])


def _experts(qc, compact: bool, sent_per_rank=None):
    _, _, _, batched_experts, *_ = _modules()
    from vllm_flashinfer_ep.vllm import compact_experts

    moe = _moe_config(HIDDEN, ROWS, num_experts=EXPERTS)
    experts = batched_experts(
        moe_config=moe, quant_config=qc, max_num_tokens=ROWS, num_dispatchers=1
    )
    if compact:
        assert compact_experts.install(experts, sent_per_rank)
    return experts


class Problem:
    """Weights, the receive buffer (both arrivals) and workspaces, reused in place so a
    captured graph sees new rows and counts."""

    def __init__(self, seed: int) -> None:
        self.q1, self.q2, self.qc = _block_quant_config(seed)
        dev = torch.device("cuda", 0)
        self.x = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.wire_x = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=FP8)
        self.wire_scales = torch.empty(EXPERTS, ROWS, HIDDEN // G, device=dev, dtype=torch.float32)
        self.counts = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
        self.ws13 = torch.empty(
            EXPERTS * ROWS * max(2 * INTER, HIDDEN), device=dev, dtype=torch.bfloat16
        )
        self.ws2 = torch.empty(EXPERTS * ROWS * 2 * INTER, device=dev, dtype=torch.bfloat16)

    def load(self, counts: torch.Tensor, seed: int) -> None:
        """New received rows (rows of very different loudness) and counts, in place."""
        from vllm_flashinfer_ep.runtime import fp8_wire

        gen = torch.Generator(device="cuda").manual_seed(seed)
        loud = 1 + 8 * torch.rand(EXPERTS, ROWS, 1, device="cuda", generator=gen)
        x = (torch.randn(EXPERTS, ROWS, HIDDEN, device="cuda", generator=gen) * loud / 4).bfloat16()
        q, s = fp8_wire.group_quantize(x.view(-1, HIDDEN))  # the wire's numerics
        received = self.received(counts)
        x[~received] = float("nan")
        q.view(torch.uint8).view(EXPERTS, ROWS, HIDDEN)[~received] = 0x7F  # E4M3 NaN
        s = s.view(EXPERTS, ROWS, HIDDEN // G).clone()
        s[~received] = float("nan")
        self.x.copy_(x)
        self.wire_x.copy_(q.view(EXPERTS, ROWS, HIDDEN))
        self.wire_scales.copy_(s)
        self.counts.copy_(counts)

    @staticmethod
    def received(counts: torch.Tensor) -> torch.Tensor:
        return torch.arange(ROWS, device="cuda")[None, :] < counts.cuda()[:, None]

    def run(self, experts, tokens: int, output: torch.Tensor, arrival: str) -> None:
        _, mk, act, *_ = _modules()
        if arrival == "fp8-wire":
            hidden, scales = self.wire_x, self.wire_scales
        elif arrival == "bf16":
            hidden, scales = self.x, None
        else:  # "prepare-quantized": what the LL prepare hands vLLM's experts from BF16
            from vllm_flashinfer_ep.vllm import receive_quant

            hidden, scales = receive_quant.quantize_expert_buffer(
                self.x, self.counts, self.qc, False
            )
        experts.apply(
            output=output,
            hidden_states=hidden,
            w1=self.q1,
            w2=self.q2,
            topk_weights=torch.ones(tokens, TOP_K, device="cuda"),
            topk_ids=torch.zeros(tokens, TOP_K, dtype=torch.int64, device="cuda"),
            activation=act.SILU,
            global_num_experts=EXPERTS,
            expert_map=None,
            a1q_scale=scales,
            a2_scale=None,
            workspace13=self.ws13,
            workspace2=self.ws2,
            expert_tokens_meta=mk.ExpertTokensMetadata(
                expert_num_tokens=self.counts, expert_num_tokens_cpu=None
            ),
            apply_router_weight_on_input=False,
        )

    def torch_reference(self, counts: torch.Tensor) -> torch.Tensor:
        """The received rows' expert outputs from the dequantized wire rows and weights
        (fp32, no intermediate quantization): a sanity bound that vLLM's side computes."""
        s1, s2 = self.qc.w1_scale, self.qc.w2_scale
        out = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda")
        for e in torch.nonzero(counts).flatten().tolist():
            n = int(counts[e])
            x = self.wire_x[e, :n].float() * self.wire_scales[e, :n].repeat_interleave(G, -1)
            d1 = self.q1[e].float() * s1[e].repeat_interleave(G, 0).repeat_interleave(G, 1)
            d2 = self.q2[e].float() * s2[e].repeat_interleave(G, 0).repeat_interleave(G, 1)
            h = x @ d1.T
            out[e, :n] = (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]) @ d2.T
        return out


def _routed_counts(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=EXPERTS).to(torch.int32)


def _edge_counts() -> torch.Tensor:
    counts = torch.zeros(EXPERTS, dtype=torch.int32)  # most experts receive nothing
    counts[0], counts[1], counts[EXPERTS - 1] = ROWS, ROWS - 1, 17  # full, one short, odd
    counts[2:TOP_K] = 1
    return counts


def _rel(counts, got, want, what: str) -> float:
    valid = Problem.received(counts)
    g, w = got[valid].float(), want[valid].float()
    assert torch.isfinite(w).all() and float(w.norm()) > 0, f"{what}: vLLM's side computed nothing"
    assert torch.isfinite(g).all(), f"{what}: non-finite received rows"
    rel = float((g - w).norm() / w.norm())
    print(f"{what}: relative L2 {rel:.3g} over {int(valid.sum())} rows")
    return rel


CASES = [
    pytest.param(1, _routed_counts(1, 1), None, id="decode-1"),
    pytest.param(13, _routed_counts(13, 2), None, id="decode-13"),
    pytest.param(200, _routed_counts(200, 3), None, id="batch-200"),
    pytest.param(ROWS, _edge_counts(), None, id="buffer-edges"),
    # One real token on a 256-token pooled handle: 256 x top_k rows arrive; the pool's
    # sent_per_rank makes the list cover them all.
    pytest.param(1, _routed_counts(ROWS, 13), ROWS, id="padded-round"),
    # A list as long as the buffer: the intermediate is quantized over the whole buffer.
    pytest.param(ROWS, _routed_counts(ROWS, 4), EXPERTS * ROWS, id="whole-buffer-quantization"),
]


@pytest.mark.parametrize("arrival", ["fp8-wire", "bf16"])
@pytest.mark.parametrize(("tokens", "counts", "sent"), CASES)
def test_block_fp8_received_rows_match_vllm_s_batched_kernel(
    vllm_env,  # noqa: F811
    arrival,
    tokens,
    counts,
    sent,
):
    p = Problem(seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    # vLLM's side: the wire's FP8 as is, or the BF16 rows quantized as the prepare does.
    p.run(
        _experts(p.qc, compact=False),
        tokens,
        want,
        "fp8-wire" if arrival == "fp8-wire" else "prepare-quantized",
    )
    p.run(
        _experts(p.qc, compact=True, sent_per_rank=(lambda: sent) if sent else None),
        tokens,
        got,
        arrival,
    )
    torch.cuda.synchronize()
    assert _rel(counts, got, want, f"{arrival} T={tokens}") < BOUND
    if arrival == "fp8-wire":  # both sides within FP8 error of the exact products
        assert _rel(counts, want, p.torch_reference(counts), "vLLM batched vs fp32") < 0.1


@pytest.mark.parametrize("arrival", ["fp8-wire", "bf16"])
def test_captured_block_fp8_experts_follow_new_counts_and_rows(vllm_env, arrival):  # noqa: F811
    p = Problem(seed=5)
    tokens = 32
    compact, batched = _experts(p.qc, compact=True), _experts(p.qc, compact=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(tokens, 10), seed=10)
    p.run(compact, tokens, got, arrival)  # eager first: Triton compiles outside the capture
    graph = capture_graph(lambda: p.run(compact, tokens, got, arrival))
    reference = "fp8-wire" if arrival == "fp8-wire" else "prepare-quantized"
    for seed in (11, 12):
        counts = _routed_counts(tokens, seed)
        p.load(counts, seed=seed)
        graph.replay()
        want = torch.zeros_like(got)
        p.run(batched, tokens, want, reference)
        torch.cuda.synchronize()
        assert _rel(counts, got, want, f"{arrival} graph replay {seed}") < BOUND
    del graph


def test_listed_rows_quantize_to_the_bytes_of_the_whole_buffer(vllm_env):  # noqa: F811
    """On the real CUDA kernel (and this machine's E8M0 setting): vLLM's group
    quantization of the gathered listed rows gives the bytes it gives them in the whole
    buffer, which is what vLLM's batched experts quantize."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    from vllm_flashinfer_ep.vllm.compact_experts import (
        expert_blocks,
        max_blocks,
        quantize_listed_rows,
    )

    _, _, qc = _block_quant_config(3)
    counts = _routed_counts(13, 5).cuda()
    gen = torch.Generator(device="cuda").manual_seed(3)
    loud = 1 + 100 * torch.rand(EXPERTS * ROWS, 1, device="cuda", generator=gen)
    x = (torch.randn(EXPERTS * ROWS, INTER, device="cuda", generator=gen) * loud).bfloat16()
    listed, _, _ = expert_blocks(counts, ROWS, 16, max_blocks(13 * TOP_K, EXPERTS, ROWS, 16))
    q, s = quantize_listed_rows(x, listed, qc)
    whole_q, whole_s = moe_kernel_quantize_input(x, None, FP8, False, [128, 128])
    rows = listed[listed < EXPERTS * ROWS].long()
    assert rows.numel() == int(counts.sum())
    assert torch.equal(q.view(torch.uint8)[rows], whole_q.view(torch.uint8)[rows])
    assert torch.equal(s[rows], whole_s[rows])
