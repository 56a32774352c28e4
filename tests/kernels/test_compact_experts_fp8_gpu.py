"""FP8 received-rows LL experts (vllm/compact_experts_fp8.py) against vLLM's batched FP8 kernel (GPU).

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
Per-tensor and per-channel layers: the second half of this module. The `fp8_intermediate`
fixture runs each received-rows test three ways: vLLM's masked activation, the listed
activation, and the listed activation and quantization in one kernel (vllm/listed_quant.py,
which writes vLLM's bytes up to the last bit of exp: tests/kernels/test_listed_quant_gpu.py);
dynamic per-tensor layers take listed_quant's two launches (activation inside) every way
while `TENSOR_ENABLED` is on.
Needs the real vLLM runtime on the GPU (docs/contributing/gpu_runs.md).
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
    """On in production (compact_experts.FP8_ENABLED, FP8_DYNAMIC_TENSOR); set here so a
    build with either switched off still tests every case."""
    from vllm_flashinfer_ep.vllm import compact_experts as ce

    monkeypatch.setattr(ce, "FP8_ENABLED", True)
    monkeypatch.setattr(ce, "FP8_DYNAMIC_TENSOR", True)


EXPERTS, HIDDEN, ROWS = 64, 2048, 256  # INTER 512 (w1 N 1024), TOP_K 8: the join test's
FP8 = torch.float8_e4m3fn
G = 128
BOUND = 1e-2  # see the module docstring


def _bf16_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5
    return w1.bfloat16(), w2.bfloat16()


def _block_quant_config(seed: int):
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    w1, w2 = _bf16_weights(seed)
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


class _Layer:
    """One layer's weights, a BF16 receive buffer, the counts and the workspaces, reused in
    place so a captured graph sees new rows and counts; `apply` runs an experts object
    over them as vLLM's modular kernel calls it."""

    def __init__(self, q1: torch.Tensor, q2: torch.Tensor, qc) -> None:
        self.q1, self.q2, self.qc = q1, q2, qc
        dev = torch.device("cuda", 0)
        self.x = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.counts = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
        self.ws13 = torch.empty(
            EXPERTS * ROWS * max(2 * INTER, HIDDEN), device=dev, dtype=torch.bfloat16
        )
        self.ws2 = torch.empty(EXPERTS * ROWS * 2 * INTER, device=dev, dtype=torch.bfloat16)

    @staticmethod
    def received(counts: torch.Tensor) -> torch.Tensor:
        return torch.arange(ROWS, device="cuda")[None, :] < counts.cuda()[:, None]

    def apply(self, experts, tokens: int, output, hidden, scales) -> None:
        _, mk, act, *_ = _modules()
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
            a2_scale=experts.a2_scale,  # what vLLM's modular kernel passes
            workspace13=self.ws13,
            workspace2=self.ws2,
            expert_tokens_meta=mk.ExpertTokensMetadata(
                expert_num_tokens=self.counts, expert_num_tokens_cpu=None
            ),
            apply_router_weight_on_input=False,
        )


class Problem(_Layer):
    """A block-FP8 layer and its receive buffer in both arrivals (the FP8 wire's, BF16)."""

    def __init__(self, seed: int) -> None:
        super().__init__(*_block_quant_config(seed))
        dev = torch.device("cuda", 0)
        self.wire_x = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=FP8)
        self.wire_scales = torch.empty(EXPERTS, ROWS, HIDDEN // G, device=dev, dtype=torch.float32)

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

    def run(self, experts, tokens: int, output: torch.Tensor, arrival: str) -> None:
        """`arrival`: fp8-wire, bf16, prepare-quantized (what the LL prepare hands vLLM's
        experts from BF16); a -mn-major suffix: the scales re-laid as the package hands
        them to DeepGEMM experts, the rows `tokens` senders can fill (world 1)."""
        base = arrival.removesuffix("-mn-major")
        if base == "fp8-wire":
            hidden, scales = self.wire_x, self.wire_scales
        elif base == "bf16":
            hidden, scales = self.x, None
        else:
            assert base == "prepare-quantized", arrival
            from vllm_flashinfer_ep.vllm import receive_quant

            hidden, scales = receive_quant.quantize_expert_buffer(
                self.x, self.counts, self.qc, False
            )
        if arrival.endswith("-mn-major"):
            from vllm_flashinfer_ep.vllm.deep_gemm_experts import mn_major

            scales = mn_major(scales, tokens)
        self.apply(experts, tokens, output, hidden, scales)

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


@pytest.mark.usefixtures("fp8_intermediate")
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


@pytest.mark.usefixtures("fp8_intermediate")
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


# ------------------------------------------------- per-tensor and per-channel FP8 layers
# vllm/compact_experts_fp8.py: per-tensor (one weight scale per expert, a dynamic or static
# activation scale) and per-channel (per-output-channel weight scales, per-token dynamic
# activations; also per-tensor weights with per-token activations) against vLLM's
# batched kernel on the same receive buffer, which the LL prepare quantizes as it does in
# serving (vllm/receive_quant.py). Bound and reasoning as for block FP8 (module
# docstring): the same E4M3 bytes and FP32 scales on both sides, the same FP32 products
# (accumulator x activation scale x weight scale); the tile, and so the order of the FP32
# sums, differs. A dynamic per-tensor intermediate scale is per expert eagerly and one
# over every received row inside a graph, on both sides: eager runs are compared with
# eager ones, graph replays with vLLM's batched experts replayed in their own graph.
SCHEMES = ["tensor-dynamic", "tensor-static", "token-channel", "token-tensor"]
STATIC_A1, STATIC_A2 = 0.025, 0.05  # about max |x| / 448 of the rows and intermediates here


def _scheme_quant_config(kind: str, seed: int):
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    w1, w2 = _bf16_weights(seed)
    weights = "token" if kind == "token-channel" else "tensor"  # per channel / per expert
    q1, s1 = _quantize_weight(w1, weights)
    q2, s2 = _quantize_weight(w2, weights)
    static = kind == "tensor-static"
    qc = fp8_w8a8_moe_quant_config(
        s1,
        s2,
        a1_scale=torch.tensor([STATIC_A1], device="cuda") if static else None,
        a2_scale=torch.tensor([STATIC_A2], device="cuda") if static else None,
        per_act_token_quant=kind.startswith("token"),
        per_out_ch_quant=kind == "token-channel",
    )
    return q1, q2, qc


class SchemeProblem(_Layer):
    """A per-tensor or per-channel layer, the BF16 receive buffer and what the LL prepare
    makes of it (E4M3 rows and their scales)."""

    def __init__(self, kind: str, seed: int) -> None:
        super().__init__(*_scheme_quant_config(kind, seed))
        self.kind = kind
        dev = torch.device("cuda", 0)
        self.xq = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=FP8)
        scale_rows = ROWS if kind.startswith("token") else 1
        self.xs = torch.empty(EXPERTS, scale_rows, 1, device=dev, dtype=torch.float32)

    def load(self, counts: torch.Tensor, seed: int) -> None:
        from vllm_flashinfer_ep.vllm import receive_quant

        gen = torch.Generator(device="cuda").manual_seed(seed)
        loud = 1 + 8 * torch.rand(EXPERTS, ROWS, 1, device="cuda", generator=gen)
        x = (torch.randn(EXPERTS, ROWS, HIDDEN, device="cuda", generator=gen) * loud / 4).bfloat16()
        x[~Problem.received(counts)] = float("nan")
        self.x.copy_(x)
        self.counts.copy_(counts)
        xq, xs = receive_quant.quantize_expert_buffer(self.x, self.counts, self.qc, False)
        self.xq.copy_(xq)
        self.xs.copy_(xs.view(self.xs.shape))

    def run(self, experts, tokens: int, output: torch.Tensor, arrival: str = "prepared") -> None:
        hidden, scales = (self.x, None) if arrival == "bf16" else (self.xq, self.xs)
        self.apply(experts, tokens, output, hidden, scales)


def _takes_the_path(experts, p: SchemeProblem, arrival: str) -> None:
    """The wrapper's decision for this layer (not a silent fall back to vLLM's kernel)."""
    from vllm_flashinfer_ep.vllm import compact_experts, compact_experts_fp8

    _, mk, act, *_ = _modules()
    hidden, scales = (p.x, None) if arrival == "bf16" else (p.xq, p.xs)
    kw = {
        "hidden_states": hidden,
        "output": torch.empty(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16),
        "w1": p.q1,
        "w2": p.q2,
        "a1q_scale": scales,
        "a2_scale": experts.a2_scale,
        "activation": act.SILU,
        "expert_tokens_meta": mk.ExpertTokensMetadata(
            expert_num_tokens=p.counts, expert_num_tokens_cpu=None
        ),
    }
    want = "token" if p.kind.startswith("token") else "tensor"
    assert compact_experts.eligible(experts, kw)
    assert compact_experts_fp8.scheme(experts, kw) == want


# bf16: what the LL prepare hands the received-rows experts of a layer without FP8 on the
# wire (compact_experts.quantizes_input); they quantize the listed rows as it would.
SCHEME_ARRIVALS = [(kind, "prepared") for kind in SCHEMES] + [(kind, "bf16") for kind in SCHEMES]
# and the dynamic per-tensor layer both ways: with listed_quant's two-launch kernels
# (TENSOR_ENABLED, on by default) for its BF16 input and its intermediate, and without
# them ("tensor-dynamic" here: the gathered rows, vLLM's quantization, the scatters)
SCHEME_ARRIVALS += [("tensor-dynamic-kernels", "prepared"), ("tensor-dynamic-kernels", "bf16")]


@pytest.fixture
def scheme_kind(request, monkeypatch):
    """The kind under test; "tensor-dynamic-kernels" is "tensor-dynamic" with
    listed_quant.TENSOR_ENABLED on, and "tensor-dynamic" has it off (the fallback)."""
    from vllm_flashinfer_ep.vllm import listed_quant

    kind = request.param
    if kind.startswith("tensor-dynamic"):
        monkeypatch.setattr(listed_quant, "TENSOR_ENABLED", kind == "tensor-dynamic-kernels")
        kind = "tensor-dynamic"
    return kind


@pytest.mark.usefixtures("fp8_intermediate")
@pytest.mark.parametrize(("scheme_kind", "arrival"), SCHEME_ARRIVALS, indirect=["scheme_kind"])
@pytest.mark.parametrize(("tokens", "counts", "sent"), CASES)
def test_per_tensor_and_per_channel_received_rows_match_vllm_s_batched_kernel(
    vllm_env,  # noqa: F811
    scheme_kind,
    arrival,
    tokens,
    counts,
    sent,
):
    kind = scheme_kind
    p = SchemeProblem(kind, seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 3)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, compact=False), tokens, want)  # the prepare's E4M3 buffer
    compact = _experts(p.qc, compact=True, sent_per_rank=(lambda: sent) if sent else None)
    _takes_the_path(compact, p, arrival)
    p.run(compact, tokens, got, arrival)
    torch.cuda.synchronize()
    assert _rel(counts, got, want, f"{kind} {arrival} T={tokens}") < BOUND
    assert torch.isnan(got[~Problem.received(counts)].float()).all()  # nothing else written


@pytest.mark.usefixtures("fp8_intermediate")
@pytest.mark.parametrize("kind", SCHEMES)
def test_per_tensor_and_per_channel_experts_without_rows_write_nothing(vllm_env, kind):  # noqa: F811
    p = SchemeProblem(kind, seed=1)
    p.load(torch.zeros(EXPERTS, dtype=torch.int32), seed=1)
    got = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    p.run(_experts(p.qc, compact=True), 1, got)
    torch.cuda.synchronize()
    assert torch.isnan(got.float()).all()


@pytest.mark.usefixtures("fp8_intermediate")
@pytest.mark.parametrize(("scheme_kind", "arrival"), SCHEME_ARRIVALS, indirect=["scheme_kind"])
def test_captured_per_tensor_and_per_channel_experts_follow_new_counts_and_rows(
    vllm_env,  # noqa: F811
    scheme_kind,
    arrival,
):
    """Both sides captured, each in its own graph (vLLM's batched experts quantize the
    intermediate in-graph as they do in serving), and replayed with new rows and counts,
    the edges included."""
    kind = scheme_kind
    p = SchemeProblem(kind, seed=5)
    tokens = ROWS  # a list that can cover the edge counts
    compact, batched = _experts(p.qc, compact=True), _experts(p.qc, compact=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    want = torch.zeros_like(got)
    p.load(_routed_counts(32, 10), seed=10)
    compact_graph = capture_graph(lambda: p.run(compact, tokens, got, arrival))
    batched_graph = capture_graph(lambda: p.run(batched, tokens, want))
    for seed, counts in (
        (11, _routed_counts(32, 11)),
        (12, _edge_counts()),
        (13, _routed_counts(1, 13)),
    ):
        p.load(counts, seed=seed)
        compact_graph.replay()
        batched_graph.replay()
        torch.cuda.synchronize()
        assert _rel(counts, got, want, f"{kind} {arrival} graph replay {seed}") < BOUND
    del compact_graph, batched_graph


@pytest.mark.parametrize("kind", SCHEMES)
def test_bf16_the_path_does_not_take_reaches_vllm_s_kernel_quantized(vllm_env, monkeypatch, kind):  # noqa: F811
    """A BF16 call the received-rows path leaves to vLLM's batched kernel (here: its FP8
    switch off after install) gets the whole buffer quantized as the LL prepare would
    have, on the real ops: vLLM's output, bit for bit."""
    from vllm_flashinfer_ep.vllm import compact_experts

    p = SchemeProblem(kind, seed=9)
    counts = _routed_counts(32, 9)
    p.load(counts, seed=9)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(p.qc, compact=False), 32, want)
    compact = _experts(p.qc, compact=True)
    monkeypatch.setattr(compact_experts, "FP8_ENABLED", False)
    p.run(compact, 32, got, "bf16")
    torch.cuda.synchronize()
    received = Problem.received(counts)
    assert torch.equal(got[received], want[received])


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in-graph"])
def test_per_tensor_listed_rows_get_vllm_s_dynamic_quantization(vllm_env, monkeypatch, in_graph):  # noqa: F811
    """On the real CUDA ops: the per-tensor scale taken here (max |x| / 448 over an
    expert's listed rows, or over all of them in a graph) and vLLM's static quantization
    with it give the bytes and scales vLLM's own dynamic per-tensor quantization gives the
    rows vLLM's batched experts quantize (per expert eagerly; the buffer, rows past the
    counts zeroed, in a graph). Per-token rows: the bytes of the whole buffer's."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    from vllm_flashinfer_ep.vllm.compact_experts_fp8 import (
        quantize_listed_rows,
        quantize_listed_rows_per_tensor,
    )

    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: in_graph)
    _, _, qc = _scheme_quant_config("tensor-dynamic", 3)
    counts = _edge_counts().cuda()
    counts[TOP_K] = 3
    gen = torch.Generator(device="cuda").manual_seed(3)
    loud = 1 + 100 * torch.rand(EXPERTS, ROWS, 1, device="cuda", generator=gen)
    x = (torch.randn(EXPERTS, ROWS, INTER, device="cuda", generator=gen) * loud).bfloat16()
    received = Problem.received(counts)
    x[~received] = float("nan")
    for tokens in (13, EXPERTS * ROWS):  # a gathered list, and one as long as the buffer
        listed, _, _ = _blocks(counts, _max_blocks_for(tokens))
        q, s = quantize_listed_rows_per_tensor(x.view(-1, INTER), listed, ROWS, qc, None)
        q, s = q.view(EXPERTS, ROWS, INTER), s.reshape(EXPERTS, ROWS)
        if in_graph:
            whole = torch.where(received[..., None], x, torch.zeros_like(x))
            vq, vs = moe_kernel_quantize_input(whole.view(-1, INTER), None, FP8, False, None)
            vq = vq.view(EXPERTS, ROWS, INTER)
            assert torch.equal(q.view(torch.uint8)[received], vq.view(torch.uint8)[received])
            assert torch.equal(s[received], vs.expand(int(received.sum())))
            continue
        for e in torch.nonzero(counts).flatten().tolist():
            n = int(counts[e])
            vq, vs = moe_kernel_quantize_input(x[e, :n].contiguous(), None, FP8, False, None)
            assert torch.equal(q[e, :n].view(torch.uint8), vq.view(torch.uint8)), (tokens, e)
            assert torch.equal(s[e, :n], vs.expand(n)), (tokens, e)
    # Per token: each row on its own, the listed rows as in the whole buffer.
    _, _, token_qc = _scheme_quant_config("token-channel", 3)
    listed, _, _ = _blocks(counts, _max_blocks_for(13))
    q, s = quantize_listed_rows(x.view(-1, INTER), listed, token_qc)
    whole_q, whole_s = moe_kernel_quantize_input(x.view(-1, INTER), None, FP8, True, None)
    rows = listed[listed < EXPERTS * ROWS].long()
    assert torch.equal(q.view(torch.uint8)[rows], whole_q.view(torch.uint8)[rows])
    assert torch.equal(s[rows], whole_s[rows])


def _max_blocks_for(tokens: int, block_m: int = 16) -> int:
    from vllm_flashinfer_ep.vllm.compact_experts import max_blocks

    return max_blocks(tokens * TOP_K, EXPERTS, ROWS, block_m)


def _blocks(counts: torch.Tensor, bound: int, block_m: int = 16):
    from vllm_flashinfer_ep.vllm.compact_experts import expert_blocks

    return expert_blocks(counts, ROWS, block_m, bound)
