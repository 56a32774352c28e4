"""The received-rows experts (experts/received_rows.py) against vLLM's batched Triton experts.

The same expert-major buffer, counts and weights through vLLM 0.33.0's
`BatchedTritonExperts` as vLLM ships it and through `ReceivedRowsExperts`; the received
rows must agree, for every row of the scheme table: BF16, 128x128 block FP8 (arriving as
the FP8 wire delivers it: E4M3 rows and FP32 scales [experts, rows, hidden / 128]
row-major; or in BF16, quantized by the experts), per-tensor (dynamic and static) and
per-channel / per-token FP8 (arriving as the LL prepare quantizes the buffer, or in BF16).
Rows past each expert's count hold NaN: neither side may read them, and the received rows
experts may write nothing there. Counts include the buffer's edges, a padded round (the
pool's sent_per_rank), a list as long as the buffer; plain SiLU runs the fused
activation kernels, GELU vLLM's masked activation then the quantizer; each is captured
in a CUDA graph and replayed with new rows and counts.

Bound (received rows, relative L2): 1e-2. Both sides read the same E4M3 bytes, scales and
weights and multiply them with the same Triton dot, accumulating per K group in FP32;
what differs is the tile (vLLM's batched lookup at the buffer's rows vs the fused kernel's
at the batch), so the order of FP32 sums, which flips a BF16 rounding of GEMM1's output
now and then: noise of order 1e-3. A wrong scale, row or block is off by O(1).
Command: python3 -m pytest tests/kernels/test_received_rows_experts_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_fp8_join_gpu import _quantize_weight
from tests.kernels.test_vllm_join_gpu import INTERMEDIATE as INTER
from tests.kernels.test_vllm_join_gpu import (
    TOP_K,
    _modules,
    vllm_env,  # noqa: F401 - fixture
)
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu

EXPERTS, HIDDEN, ROWS = 64, 2048, 256  # INTER 512 (w1 N 1024), TOP_K 8: the join test's
FP8 = torch.float8_e4m3fn
G = 128
BOUND = 1e-2  # see the module docstring
STATIC_A1, STATIC_A2 = 0.025, 0.05  # about max |x| / 448 of the rows and intermediates here


def _moe_config(activation: str):
    cfg, _, act, *_ = _modules()
    return cfg.FusedMoEConfig(
        num_experts=EXPERTS,
        experts_per_token=TOP_K,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_logical_experts=EXPERTS,
        activation=act(activation),
        device=torch.device("cuda", 0),
        routing_method=cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=cfg.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        max_num_tokens=ROWS,
    )


def _experts(qc, ours: bool, activation: str = "silu", sent=None, quantizes_input=False):
    """vLLM's BatchedTritonExperts, or the received-rows experts built as the LL kernel
    builds them (`quantizes_input`: an FP8 layer not on the wire)."""
    from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts

    _, _, _, batched_experts, *_ = _modules()
    cls = ReceivedRowsExperts if ours else batched_experts
    kwargs = {"quantizes_input": quantizes_input} if ours else {}
    if ours and sent is not None:
        kwargs["sent_per_rank"] = lambda: sent
    return cls(_moe_config(activation), qc, ROWS, 1, **kwargs)


def _bf16_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w1 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5
    return w1.bfloat16(), w2.bfloat16()


def _quant_config(kind: str, seed: int):
    """(w1, w2, quant config) of a layer: bf16, block, tensor-dynamic, tensor-static,
    token-channel (per-channel weights) or token-tensor (per-expert weights)."""
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        fp8_w8a8_moe_quant_config,
    )

    w1, w2 = _bf16_weights(seed)
    if kind == "bf16":
        return w1, w2, FUSED_MOE_UNQUANTIZED_CONFIG
    weights = {"block": "block", "token-channel": "token"}.get(kind, "tensor")
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
        block_shape=[G, G] if kind == "block" else None,
    )
    return q1, q2, qc


def _received(counts: torch.Tensor) -> torch.Tensor:
    return torch.arange(ROWS, device="cuda")[None, :] < counts.cuda()[:, None]


class Layer:
    """One layer's weights, its receive buffer in every arrival and the workspaces, reused
    in place so a captured graph sees new rows and counts. Arrivals: "bf16" (the rows),
    "prepared" (the LL prepare's quantization of the buffer, what vLLM's batched experts
    get), "wire" (block layers: the FP8 wire's E4M3 rows and row-major group scales)."""

    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.w1, self.w2, self.qc = _quant_config(kind, seed)
        dev = torch.device("cuda", 0)
        self.x = torch.empty(EXPERTS, ROWS, HIDDEN, device=dev, dtype=torch.bfloat16)
        self.counts = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
        self.ws13 = torch.empty(
            EXPERTS * ROWS * max(2 * INTER, HIDDEN), device=dev, dtype=torch.bfloat16
        )
        self.ws2 = torch.empty(EXPERTS * ROWS * 2 * INTER, device=dev, dtype=torch.bfloat16)
        self.arrivals: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def load(self, counts: torch.Tensor, seed: int) -> None:
        """New received rows (of very different loudness) and counts, in place, and their
        FP8 arrivals (NaN past the counts)."""
        from vllm_flashinfer_ep.runtime import fp8_wire
        from vllm_flashinfer_ep.vllm import receive_quant

        gen = torch.Generator(device="cuda").manual_seed(seed)
        loud = 1 + 8 * torch.rand(EXPERTS, ROWS, 1, device="cuda", generator=gen)
        x = (torch.randn(EXPERTS, ROWS, HIDDEN, device="cuda", generator=gen) * loud / 4).bfloat16()
        received = _received(counts)
        x[~received] = float("nan")
        self.x.copy_(x)
        self.counts.copy_(counts)
        fresh = {"bf16": (self.x, None)}
        if self.kind != "bf16":
            fresh["prepared"] = receive_quant.quantize_expert_buffer(
                self.x, self.counts, self.qc, False
            )
        if self.kind == "block":
            q, s = fp8_wire.group_quantize(x.view(-1, HIDDEN))
            q.view(torch.uint8).view(EXPERTS, ROWS, HIDDEN)[~received] = 0x7F  # E4M3 NaN
            s = s.view(EXPERTS, ROWS, HIDDEN // G).clone()
            s[~received] = float("nan")
            fresh["wire"] = (q.view(EXPERTS, ROWS, HIDDEN), s)
        for name, (q, s) in fresh.items():  # into the same storage every load
            if name not in self.arrivals:
                self.arrivals[name] = (q.clone(), None if s is None else s.clone())
            else:
                self.arrivals[name][0].copy_(q)
                if s is not None:
                    self.arrivals[name][1].copy_(s)

    def run(self, experts, tokens: int, output: torch.Tensor, arrival: str) -> None:
        _, mk, _, *_ = _modules()
        hidden, scales = self.arrivals[arrival]
        experts.apply(
            output=output,
            hidden_states=hidden,
            w1=self.w1,
            w2=self.w2,
            topk_weights=torch.ones(tokens, TOP_K, device="cuda"),
            topk_ids=torch.zeros(tokens, TOP_K, dtype=torch.int64, device="cuda"),
            activation=experts.moe_config.activation,
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

    def torch_reference(self) -> torch.Tensor:
        """Block layers: the received rows' outputs from the dequantized wire rows and
        weights in FP32 (no intermediate quantization), a bound vLLM's side must meet."""
        s1, s2 = self.qc.w1_scale, self.qc.w2_scale
        out = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda")
        wire_x, wire_s = self.arrivals["wire"]
        for e in torch.nonzero(self.counts).flatten().tolist():
            n = int(self.counts[e])
            x = wire_x[e, :n].float() * wire_s[e, :n].repeat_interleave(G, -1)
            d1 = self.w1[e].float() * s1[e].repeat_interleave(G, 0).repeat_interleave(G, 1)
            d2 = self.w2[e].float() * s2[e].repeat_interleave(G, 0).repeat_interleave(G, 1)
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
    valid = _received(counts)
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
    # A list as long as the buffer.
    pytest.param(ROWS, _routed_counts(ROWS, 4), EXPERTS * ROWS, id="whole-buffer"),
]
# (scheme, our side's arrival): block layers from the wire (both sides) or in BF16 (vLLM's
# side gets the prepare's quantization), the others as the LL prepare quantizes them or in
# BF16, quantized by the received rows themselves.
SCHEME_ARRIVALS = [("bf16", "bf16"), ("block", "wire"), ("block", "bf16")] + [
    (kind, arrival)
    for kind in ("tensor-dynamic", "tensor-static", "token-channel", "token-tensor")
    for arrival in ("prepared", "bf16")
]


def _pair(p: Layer, arrival: str, activation: str = "silu", sent=None):
    """((vLLM's experts, their arrival), (the received-rows experts, ours)) over `p`."""
    theirs = _experts(p.qc, ours=False, activation=activation)
    quantizes = p.kind != "bf16" and arrival == "bf16"
    ours = _experts(p.qc, True, activation, sent, quantizes_input=quantizes)
    assert ours.expects_unquantized_inputs == quantizes
    their_arrival = arrival if p.kind == "bf16" or arrival != "bf16" else "prepared"
    return (theirs, their_arrival), (ours, arrival)


@pytest.mark.parametrize(("kind", "arrival"), SCHEME_ARRIVALS)
@pytest.mark.parametrize(("tokens", "counts", "sent"), CASES)
def test_received_rows_match_vllm_s_batched_experts(vllm_env, kind, arrival, tokens, counts, sent):  # noqa: F811
    p = Layer(kind, seed=tokens + int(counts.sum()))
    p.load(counts, seed=7 * tokens + 1)
    (theirs, their_arrival), (ours, arrival) = _pair(p, arrival, sent=sent)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(theirs, tokens, want, their_arrival)
    p.run(ours, tokens, got, arrival)
    torch.cuda.synchronize()
    assert _rel(counts, got, want, f"{kind} {arrival} T={tokens}") < BOUND
    assert torch.isnan(got[~_received(counts)].float()).all()  # nothing else written
    if arrival == "wire":  # both within FP8 error of the exact products
        assert _rel(counts, want, p.torch_reference(), "vLLM batched vs fp32") < 0.1


@pytest.mark.parametrize(
    ("kind", "arrival"),
    [
        ("bf16", "bf16"),
        ("block", "bf16"),
        ("token-channel", "prepared"),
        ("tensor-dynamic", "bf16"),
    ],
)
def test_another_activation_runs_vllm_s_then_the_quantizer(vllm_env, kind, arrival):  # noqa: F811
    """GELU: vLLM's masked activation over the buffer, then the scheme's quantizer over
    the received rows (no fused kernel takes it)."""
    counts = _routed_counts(13, 2)
    p = Layer(kind, seed=1)
    p.load(counts, seed=3)
    (theirs, their_arrival), (ours, arrival) = _pair(p, arrival, activation="gelu")
    assert not ours._fused_activation
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(theirs, 13, want, their_arrival)
    p.run(ours, 13, got, arrival)
    torch.cuda.synchronize()
    assert _rel(counts, got, want, f"{kind} {arrival} gelu") < BOUND


@pytest.mark.parametrize(("kind", "arrival"), SCHEME_ARRIVALS)
def test_experts_without_rows_write_nothing(vllm_env, kind, arrival):  # noqa: F811
    p = Layer(kind, seed=1)
    p.load(torch.zeros(EXPERTS, dtype=torch.int32), seed=1)
    _, (ours, arrival) = _pair(p, arrival)
    got = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    p.run(ours, 1, got, arrival)
    torch.cuda.synchronize()
    assert torch.isnan(got.float()).all()


@pytest.mark.parametrize(("kind", "arrival"), SCHEME_ARRIVALS)
def test_captured_experts_follow_new_counts_and_rows(vllm_env, kind, arrival):  # noqa: F811
    """Both sides captured, each in its own graph (vLLM's batched experts quantize a
    dynamic per-tensor intermediate in-graph over the buffer, as the received rows do over
    theirs), replayed with new rows and counts, the edges included."""
    p = Layer(kind, seed=5)
    tokens = ROWS  # a list that can cover the edge counts
    (theirs, their_arrival), (ours, arrival) = _pair(p, arrival)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    want = torch.zeros_like(got)
    p.load(_routed_counts(32, 10), seed=10)
    our_graph = capture_graph(lambda: p.run(ours, tokens, got, arrival))
    their_graph = capture_graph(lambda: p.run(theirs, tokens, want, their_arrival))
    for seed, counts in (
        (11, _routed_counts(32, 11)),
        (12, _edge_counts()),
        (13, _routed_counts(1, 13)),
    ):
        p.load(counts, seed=seed)
        our_graph.replay()
        their_graph.replay()
        torch.cuda.synchronize()
        assert _rel(counts, got, want, f"{kind} {arrival} graph replay {seed}") < BOUND
    del our_graph, their_graph


# ------------------------------------------------------------------ gpt-oss: biases, SwiGLU-OAI
# vLLM's batched experts drop expert biases, so the reference here is vLLM's no-EP Triton
# path (`fused_experts`: the same fused-MoE kernel with B_bias, its unmasked
# `swigluoai_and_mul` op), each received row one token routed to its expert with weight 1.
GPT_OSS_KINDS = [("bf16", "bf16"), ("block", "bf16"), ("block", "wire"), ("token-channel", "bf16")]


def _with_biases(p: Layer, seed: int) -> None:
    """gpt-oss's expert biases on `p`'s layer (BF16; GEMM1's loud enough that the SwiGLU's
    clamp at 7 bites)."""
    from vllm.model_executor.layers.fused_moe.config import (
        biased_moe_quant_config,
        fp8_w8a8_moe_quant_config,
    )

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b1 = (torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=gen) * 6).bfloat16()
    b2 = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen).bfloat16()
    if p.kind == "bf16":
        p.qc = biased_moe_quant_config(b1, b2)
        return
    p.qc = fp8_w8a8_moe_quant_config(
        p.qc.w1_scale,
        p.qc.w2_scale,
        per_act_token_quant=p.kind.startswith("token"),
        per_out_ch_quant=p.kind == "token-channel",
        block_shape=[G, G] if p.kind == "block" else None,
        w1_bias=b1,
        w2_bias=b2,
    )


def _vllm_no_ep(p: Layer, counts: torch.Tensor, activation: str) -> torch.Tensor:
    """vLLM's fused_experts over the received rows as tokens (top_k 1, weight 1), NaN
    elsewhere."""
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    _, _, act, *_ = _modules()
    valid = _received(counts)
    owner = torch.arange(EXPERTS, device="cuda")[:, None].expand(EXPERTS, ROWS)[valid]
    rows = fused_experts(
        p.x[valid].contiguous(),
        p.w1,
        p.w2,
        torch.ones(owner.numel(), 1, device="cuda"),
        owner[:, None].to(torch.int32),
        activation=act(activation),
        global_num_experts=EXPERTS,
        quant_config=p.qc,
    )
    out = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    out[valid] = rows
    return out


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
@pytest.mark.parametrize(("kind", "arrival"), GPT_OSS_KINDS)
@pytest.mark.parametrize(("tokens", "counts", "sent"), CASES[:4])
def test_gpt_oss_biases_and_swiglu_match_vllm_s_fused_experts(
    vllm_env,  # noqa: F811
    kind,
    arrival,
    activation,
    tokens,
    counts,
    sent,
):
    """Expert biases (w1's after GEMM1, w2's after GEMM2) and vLLM's swigluoai
    (interleaved gate/up, alpha 1.702, limit 7) over the received rows, against vLLM's own
    no-EP Triton experts on the same rows; the biases must matter (vLLM's batched experts,
    which drop them, are far off) and nothing past the counts is written."""
    p = Layer(kind, seed=tokens + 3)
    _with_biases(p, seed=tokens + 5)
    p.load(counts, seed=7 * tokens + 2)
    ours = _experts(
        p.qc, True, activation, sent, quantizes_input=kind != "bf16" and arrival == "bf16"
    )
    got = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    p.run(ours, tokens, got, arrival)
    want = _vllm_no_ep(p, counts, activation)
    dropped = torch.full_like(got, float("nan"))
    p.run(
        _experts(p.qc, False, activation), tokens, dropped, "bf16" if kind == "bf16" else "prepared"
    )
    torch.cuda.synchronize()
    bound = BOUND if kind == "bf16" else 5e-2  # FP8: the wire's or vLLM's quantization
    assert _rel(counts, got, want, f"{kind} {arrival} {activation} biased T={tokens}") < bound
    assert torch.isnan(got[~_received(counts)].float()).all()
    assert _rel(counts, dropped, want, "vLLM batched (no biases)") > 0.1


def test_captured_gpt_oss_experts_follow_new_counts_and_rows(vllm_env):  # noqa: F811
    """Biases and swigluoai captured in a graph, replayed with new rows and counts."""
    p = Layer("bf16", seed=9)
    _with_biases(p, seed=10)
    ours = _experts(p.qc, True, "swigluoai")
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.load(_routed_counts(32, 20), seed=20)
    graph = capture_graph(lambda: p.run(ours, ROWS, got, "bf16"))
    for seed, counts in ((21, _routed_counts(32, 21)), (22, _edge_counts())):
        p.load(counts, seed=seed)
        graph.replay()
        torch.cuda.synchronize()
        want = _vllm_no_ep(p, counts, "swigluoai")
        assert _rel(counts, got, want, f"gpt-oss graph replay {seed}") < BOUND
    del graph
