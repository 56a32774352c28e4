"""Block-FP8 LL experts over the received rows only (vllm/compact_experts_fp8.py), on CPU.

Which FP8 layers take the received-rows path is decided from vLLM's own
FusedMoEQuantConfig objects (`fp8_w8a8_moe_quant_config`), one per FP8 scheme vLLM's
batched experts take. The computation needs Triton on a GPU, so two vLLM functions are
replaced here by stand-ins that check the contract of the real ones and compute what they
document:
- `invoke_fused_moe_triton_kernel` (fused_moe.py): asserts the block-FP8 arguments
  (E4M3 A and B, A's FP32 scales [A rows, K / 128], B's [E, N / 128, K / 128],
  `use_fp8_w8a8`, `block_shape=[128, 128]`, top_k 1, the sentinel rows masked because A
  and C have the same row count) and computes c = (a * a_scale) @ (w * w_scale).T for the
  listed rows, reading the scales as the kernel does (row `row`, group `k // 128`).
- `per_token_group_quant_fp8` (fp8_utils.py, called by vLLM's `moe_kernel_quantize_input`):
  amax / 448 per 128 elements, and records what it was asked to quantize.
The real kernels are compared with vLLM's batched FP8 experts on the GPU
(tests/kernels/test_compact_experts_fp8_gpu.py). Per-tensor and per-channel layers:
tests/unit/test_compact_experts_fp8_schemes.py.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe
from vllm.model_executor.layers.fused_moe import utils as vllm_moe_utils
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import moe_config, vllm_apply
from tests.unit.test_prepare_finalize_cpu import reference_moe
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.runtime import fp8_wire
from vllm_flashinfer_ep.vllm import compact_experts, receive_quant
from vllm_flashinfer_ep.vllm.compact_experts import max_blocks
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize


@pytest.fixture(autouse=True)
def _fp8_path_on(monkeypatch):
    """On in production since its GPU test passed (compact_experts.FP8_ENABLED,
    tests/kernels/test_compact_experts_fp8_gpu.py); set here so a switched-off build still
    tests it."""
    from vllm_flashinfer_ep.vllm import compact_experts as ce

    monkeypatch.setattr(ce, "FP8_ENABLED", True)
    monkeypatch.setattr(ce, "FP8_DYNAMIC_TENSOR", True)


HIDDEN, INTER, EXPERTS, CAP = 2048, 128, 8, 64  # w1 [E, 2 * INTER, HIDDEN], w2 [E, HIDDEN, INTER]
FP8 = torch.float8_e4m3fn
FMAX = torch.finfo(FP8).max
G = 128
CPU = torch.device("cpu")


# ------------------------------------------------------------------ vLLM stand-ins
class Recorder:
    def __init__(self) -> None:
        self.gemms: list[dict] = []
        self.quantized: list[dict] = []


rec = Recorder()


def _expand_block_scales(s: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[ceil(n/128), ceil(k/128)] -> [n, k]"""
    return s.repeat_interleave(G, 0)[:n].repeat_interleave(G, 1)[:, :k]


def fused_moe_kernel_standin(
    A,
    B,
    C,
    A_scale,
    B_scale,
    topk_weights,
    sorted_token_ids,
    expert_ids,
    num_tokens_post_padded,
    mul_routed_weight,
    top_k,
    config,
    compute_type,
    use_fp8_w8a8,
    use_int8_w8a8,
    use_int8_w8a16,
    use_int4_w4a16,
    per_channel_quant,
    block_shape=None,
    B_bias=None,
):
    """vLLM 0.33.0's `invoke_fused_moe_triton_kernel` for 128x128 block FP8 and top_k 1."""
    assert use_fp8_w8a8 and not (use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16)
    assert block_shape == [128, 128] and not per_channel_quant
    assert top_k == 1 and not mul_routed_weight and topk_weights is None and B_bias is None
    assert compute_type == tl.bfloat16 and C.dtype == torch.bfloat16
    assert A.dtype == FP8 and B.dtype == FP8 and A.dim() == 2 and A.stride(-1) == 1
    e, n, k = B.shape
    assert A.shape[1] == k and C.dim() == 3 and C.shape[1] == 1 and C.shape[2] == n
    # The kernel masks row ids >= A's row count (top_k 1): that is the sentinel. A with
    # more rows than C would compute the sentinel rows into C's next row.
    assert A.shape[0] == C.shape[0]
    # What the launcher asserts, and what the kernel reads (2-D scales: its strides).
    assert B_scale.dtype == torch.float32 and tuple(B_scale.shape) == (e, -(-n // G), -(-k // G))
    assert A_scale is not None and A_scale.dtype == torch.float32 and A_scale.dim() == 2
    assert tuple(A_scale.shape) == (A.shape[0], k // G)
    assert sorted_token_ids.dtype == torch.int32 and sorted_token_ids.stride(0) == 1
    bm = config["BLOCK_SIZE_M"]
    assert sorted_token_ids.numel() % bm == 0
    rec.gemms.append(
        {
            "A": A,
            "A_scale": A_scale,
            "B_scale": B_scale,
            "config": dict(config),
            "blocks": sorted_token_ids.numel() // bm,
            "shape": (A.shape[0], n, k),
        }
    )
    for b in range(sorted_token_ids.numel() // bm):
        if b * bm >= int(num_tokens_post_padded):
            break
        ids = sorted_token_ids[b * bm : (b + 1) * bm].long()
        ids = ids[ids < A.shape[0]]
        ex = int(expert_ids[b])
        if ex < 0 or ids.numel() == 0:
            continue
        a = A[ids].float() * A_scale[ids].repeat_interleave(G, 1)
        w = B[ex].float() * _expand_block_scales(B_scale[ex], n, k)
        C[ids, 0] = (a @ w.T).to(C.dtype)


def group_quant_standin(
    x,
    group_size,
    eps=1e-10,
    dtype=None,
    column_major_scales=False,
    tma_aligned_scales=False,
    out_q=None,
    use_ue8m0=None,
):
    """vLLM's per_token_group_quant_fp8 (E8M0 off, as on this host): amax / 448 per group."""
    assert x.dim() == 2 and x.is_contiguous() and x.shape[-1] % group_size == 0
    rec.quantized.append(
        {
            "rows": x.shape[0],
            "width": x.shape[1],
            "group": group_size,
            "column_major": column_major_scales,
            "ue8m0": use_ue8m0,
        }
    )
    groups = x.float().view(x.shape[0], -1, group_size)
    s = groups.abs().amax(-1).clamp_min(eps) / FMAX
    q = (groups / s[..., None]).clamp(-FMAX, FMAX).to(FP8).view(x.shape)
    return q, s.contiguous()


@pytest.fixture(autouse=True)
def standins(monkeypatch, fake):
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    monkeypatch.setattr(vllm_fused_moe, "invoke_fused_moe_triton_kernel", fused_moe_kernel_standin)
    monkeypatch.setattr(vllm_moe_utils, "per_token_group_quant_fp8", group_quant_standin)
    rec.gemms.clear()
    rec.quantized.clear()
    return fake


# --------------------------------------------------------------------- experts
class VllmBatchedExperts(fused_batched_moe.BatchedTritonExperts):
    """vLLM's BatchedTritonExperts whose own apply (its batched kernel) only records that
    it ran; the activation is a torch SiLU-and-mul (vllm._C is absent here)."""

    own_applies: int = 0

    @vllm_apply
    def apply(self, kw):
        self.own_applies += 1

    def activation(self, activation, output, input, **kwargs) -> None:
        assert activation == MoEActivation.SILU
        d = input.shape[-1] // 2
        output.copy_(torch.nn.functional.silu(input[..., :d].float()) * input[..., d:].float())


def _moe_config(top_k: int) -> FusedMoEConfig:
    return moe_config(
        experts=EXPERTS,
        top_k=top_k,
        hidden=HIDDEN,
        inter=INTER,
        max_num_tokens=CAP,
        backend=LL_BACKEND,
    )


def _experts(qc, top_k=2, max_num_tokens=CAP, dispatchers=1, install=True):
    experts = VllmBatchedExperts(
        _moe_config(top_k), qc, max_num_tokens=max_num_tokens, num_dispatchers=dispatchers
    )
    if install:
        assert compact_experts.install(experts)
    return experts


def _block_weights(seed: int):
    """Block-FP8 weights (E4M3, FP32 scales per 128x128 block) and the BF16 they stand for."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        w = torch.randn(EXPERTS, n, k, generator=gen) / k**0.5
        blocks = w.view(EXPERTS, n // G, G, k // G, G)
        s = blocks.abs().amax(dim=(2, 4)) / FMAX
        q = (blocks / s[:, :, None, :, None]).clamp(-FMAX, FMAX).to(FP8).view(EXPERTS, n, k)
        deq = (q.float().view(EXPERTS, n // G, G, k // G, G) * s[:, :, None, :, None]).view(
            EXPERTS, n, k
        )
        out.append((q, s.contiguous(), deq))
    return out


def _qc(kind: str, w1_scale=None, w2_scale=None):
    """vLLM's quant config for each FP8 scheme its batched experts take."""
    per_expert = torch.ones(EXPERTS, dtype=torch.float32)
    if kind == "block":
        return fp8_w8a8_moe_quant_config(w1_scale, w2_scale, block_shape=[128, 128])
    if kind == "block-128x64":
        return fp8_w8a8_moe_quant_config(w1_scale, w2_scale, block_shape=[128, 64])
    if kind == "tensor-dynamic":
        return fp8_w8a8_moe_quant_config(per_expert, per_expert)
    if kind == "tensor-static":
        static = torch.tensor([0.02])
        return fp8_w8a8_moe_quant_config(per_expert, per_expert, a1_scale=static, a2_scale=static)
    if kind == "token-channel":
        return fp8_w8a8_moe_quant_config(
            torch.ones(EXPERTS, 2 * INTER, 1),
            torch.ones(EXPERTS, HIDDEN, 1),
            per_act_token_quant=True,
            per_out_ch_quant=True,
        )
    if kind == "channel-tensor":  # per-channel weights, per-tensor static activations
        return fp8_w8a8_moe_quant_config(
            torch.ones(EXPERTS, 2 * INTER, 1),
            torch.ones(EXPERTS, HIDDEN, 1),
            a1_scale=torch.tensor([0.02]),
            a2_scale=torch.tensor([0.02]),
            per_out_ch_quant=True,
        )
    raise ValueError(kind)


def _meta(counts: torch.Tensor) -> mk.ExpertTokensMetadata:
    return mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)


def _call(
    experts, hidden, scales, w1, w2, counts, tokens, top_k=2, out=None, rows=None, experts_all=None
):
    rows = rows or hidden.shape[1]
    out = (
        out
        if out is not None
        else torch.full((EXPERTS, rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    )
    experts.apply(
        output=out,
        hidden_states=hidden,
        w1=w1,
        w2=w2,
        topk_weights=None,
        topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64),
        activation=MoEActivation.SILU,
        global_num_experts=experts_all or EXPERTS,
        expert_map=None,
        a1q_scale=scales,
        a2_scale=None,
        workspace13=torch.empty(EXPERTS * rows * max(2 * INTER, HIDDEN), dtype=torch.bfloat16),
        workspace2=torch.empty(EXPERTS * rows * INTER, dtype=torch.bfloat16),
        expert_tokens_meta=_meta(counts),
        apply_router_weight_on_input=False,
    )
    return out


def _received_buffer(counts: list[int], rows: int, seed: int):
    """An LL receive buffer as the FP8 wire fills it: E4M3 rows [E, rows, H] and FP32
    scales [E, rows, H / 128] row-major; rows past each count hold NaN (never read)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(EXPERTS, rows, HIDDEN, generator=gen) * 0.5).bfloat16()
    received = torch.arange(rows)[None, :] < torch.tensor(counts)[:, None]
    q, s = fp8_wire.group_quantize(x.view(-1, HIDDEN))
    q, s = q.view(EXPERTS, rows, HIDDEN), s.view(EXPERTS, rows, HIDDEN // G)
    q.view(torch.uint8)[~received] = 0x7F  # E4M3 NaN
    s[~received] = float("nan")
    x[~received] = float("nan")
    return x, q, s, torch.tensor(counts, dtype=torch.int32), received


def _expert_outputs(x_deq, received, d1, d2):
    """What each received row's expert computes: fp32 products of the dequantized FP8
    activations and weights, GEMM1's output in BF16, the intermediate quantized per 128."""
    want = torch.zeros(EXPERTS, x_deq.shape[1], HIDDEN)
    for e in range(EXPERTS):
        r = received[e]
        if r.any():
            h = (x_deq[e][r] @ d1[e].T).bfloat16().float()  # GEMM1 writes BF16
            a = (torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]).bfloat16()
            aq, s = group_quant_standin(a, G)
            want[e][r] = (aq.float() * s.repeat_interleave(G, 1)) @ d2[e].T
    return want


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# ------------------------------------------------------------------- eligibility
def _eligible_kw(qc, hidden_dtype=FP8, scales="rows", out_dtype=torch.bfloat16, rows=CAP):
    (q1, s1, _), (q2, s2, _) = _block_weights(0)
    w1, w2 = q1, q2  # E4M3 weights; their scales are the quant config's
    hidden = torch.zeros(EXPERTS, rows, HIDDEN, dtype=hidden_dtype)
    a1q = {
        "rows": torch.ones(EXPERTS, rows, HIDDEN // G),
        "flat": torch.ones(EXPERTS * rows, HIDDEN // G),
        "mn-major": torch.ones(EXPERTS, HIDDEN // G, rows).transpose(1, 2),
        "per-expert": torch.ones(EXPERTS, 1, 1),
        "none": None,
    }[scales]
    return {
        "hidden_states": hidden,
        "output": torch.empty(EXPERTS, rows, HIDDEN, dtype=out_dtype),
        "w1": w1,
        "w2": w2,
        "a1q_scale": a1q,
        "a2_scale": None,
        "activation": MoEActivation.SILU,
        "expert_tokens_meta": _meta(torch.zeros(EXPERTS, dtype=torch.int32)),
    }


def _block_qc(seed=0):
    (_, s1, _), (_, s2, _) = _block_weights(seed)
    return _qc("block", s1, s2)


@pytest.mark.parametrize(
    "kind", ["tensor-dynamic", "tensor-static", "token-channel", "channel-tensor"]
)
def test_other_fp8_layers_with_block_scales_keep_vllm_s_batched_kernel(kind):
    """Per-tensor and per-channel layers take the path with their own activation scales
    (tests/unit/test_compact_experts_fp8_schemes.py), not with 128-element group scales;
    per-channel weights with per-tensor activations not at all."""
    experts = _experts(_qc(kind), install=False)
    arrivals = [(FP8, "rows")]
    if kind == "channel-tensor":
        arrivals += [(FP8, "per-expert"), (torch.bfloat16, "none")]
    for hidden_dtype, scales in arrivals:
        assert not compact_experts.eligible(
            experts, _eligible_kw(experts.quant_config, hidden_dtype, scales)
        )


def test_block_fp8_is_eligible_with_the_wire_s_scales_or_bf16_activations():
    experts = _experts(_block_qc(), install=False)
    qc = experts.quant_config
    assert qc.quant_dtype == FP8 and qc.block_shape == [128, 128]  # vLLM's real config
    assert compact_experts.eligible(experts, _eligible_kw(qc, FP8, "rows"))
    assert compact_experts.eligible(experts, _eligible_kw(qc, FP8, "flat"))
    assert compact_experts.eligible(experts, _eligible_kw(qc, torch.bfloat16, "none"))


@pytest.mark.parametrize(
    "case",
    [
        "fp8-without-scales",
        "column-major-scales",
        "per-expert-scales",
        "bf16-with-scales",
        "fp16-output",
        "fp16-activations",
        "block-128x64",
        "per-expert-weight-scales",
        "biases",
        "static-a2-scale",
        "activation-not-a-multiple-of-128",
    ],
)
def test_block_fp8_layouts_the_path_does_not_read_stay_on_vllm_s_kernel(case):
    (_, s1, _), (_, s2, _) = _block_weights(0)
    qc = _qc("block", s1, s2)
    kw_args = {"hidden_dtype": FP8, "scales": "rows"}
    if case == "fp8-without-scales":
        kw_args["scales"] = "none"
    elif case == "column-major-scales":
        kw_args["scales"] = "mn-major"
    elif case == "per-expert-scales":
        kw_args["scales"] = "per-expert"
    elif case == "bf16-with-scales":
        kw_args.update(hidden_dtype=torch.bfloat16, scales="rows")
    elif case == "fp16-output":
        kw_args["out_dtype"] = torch.float16
    elif case == "fp16-activations":
        kw_args.update(hidden_dtype=torch.float16, scales="none")
    elif case == "block-128x64":
        qc = _qc("block-128x64", s1, s2)
    elif case == "per-expert-weight-scales":
        qc = fp8_w8a8_moe_quant_config(
            torch.ones(EXPERTS), torch.ones(EXPERTS), block_shape=[128, 128]
        )
    elif case == "biases":
        qc = fp8_w8a8_moe_quant_config(
            s1,
            s2,
            block_shape=[128, 128],
            w1_bias=torch.zeros(EXPERTS, 2 * INTER),
            w2_bias=torch.zeros(EXPERTS, HIDDEN),
        )
    elif case == "static-a2-scale":
        qc = fp8_w8a8_moe_quant_config(
            s1, s2, a2_scale=torch.tensor([0.02]), block_shape=[128, 128]
        )
    experts = _experts(qc, install=False)
    kw = _eligible_kw(qc, **kw_args)
    if case == "activation-not-a-multiple-of-128":
        kw["w1"], kw["w2"] = kw["w1"][:, :192], kw["w2"][:, :, :96]
    assert not compact_experts.eligible(experts, kw)


def test_block_fp8_stays_on_vllm_s_kernel_while_the_path_is_off(monkeypatch):
    """Production default until the GPU run: FP8 layers keep vLLM's batched kernel, BF16
    layers keep the received-rows path."""
    monkeypatch.setattr(compact_experts, "FP8_ENABLED", False)
    experts = _experts(_block_qc(), install=False)
    assert not compact_experts.eligible(experts, _eligible_kw(experts.quant_config, FP8, "rows"))
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    bf16 = _eligible_kw(FUSED_MOE_UNQUANTIZED_CONFIG, torch.bfloat16, "none")
    bf16["w1"], bf16["w2"] = bf16["w1"].bfloat16(), bf16["w2"].bfloat16()
    assert compact_experts.eligible(_experts(FUSED_MOE_UNQUANTIZED_CONFIG, install=False), bf16)


def test_unquantized_layers_still_take_the_bf16_path():
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    experts = _experts(FUSED_MOE_UNQUANTIZED_CONFIG, install=False)
    kw = _eligible_kw(FUSED_MOE_UNQUANTIZED_CONFIG, torch.bfloat16, "none")
    kw["w1"], kw["w2"] = kw["w1"].bfloat16(), kw["w2"].bfloat16()
    assert compact_experts.eligible(experts, kw)
    assert not compact_experts.eligible(experts, _eligible_kw(_block_qc(), torch.bfloat16, "none"))


def test_ineligible_calls_reach_vllm_s_own_apply_and_the_kill_switch_holds(monkeypatch):
    (q1, _, _), (q2, _, _) = _block_weights(1)
    counts = torch.tensor([1] + [0] * (EXPERTS - 1), dtype=torch.int32)
    hidden = torch.zeros(EXPERTS, CAP, HIDDEN, dtype=FP8)
    channel_tensor = _experts(_qc("channel-tensor"))
    _call(channel_tensor, hidden, torch.ones(EXPERTS, 1, 1), q1, q2, counts, 1)
    assert channel_tensor.own_applies == 1 and not rec.gemms
    monkeypatch.setattr(compact_experts, "ENABLED", False)
    assert not compact_experts.install(_experts(_block_qc(), install=False))


# ------------------------------------------------------------------- plumbing
@pytest.mark.parametrize(
    ("tokens", "counts"),
    [
        pytest.param(1, [1, 0, 0, 1, 0, 0, 0, 0], id="decode-1"),
        pytest.param(CAP, [CAP, 0, 1, 7, 0, CAP - 1, 3, 5], id="full-expert-and-empty-ones"),
        pytest.param(4 * CAP, [CAP] * EXPERTS, id="every-row-of-the-buffer"),
    ],
)
def test_wire_rows_and_scales_reach_the_kernel_as_it_reads_them(tokens, counts):
    (q1, s1, d1), (q2, s2, d2) = _block_weights(2)
    experts = _experts(_qc("block", s1, s2))
    x, q, s, c, received = _received_buffer(counts, CAP, seed=tokens)
    out = _call(experts, q, s, q1, q2, c, tokens)
    assert experts.own_applies == 0 and len(rec.gemms) == 2
    g1, g2 = rec.gemms
    total = EXPERTS * CAP
    # GEMM1 reads the wire's E4M3 rows and scales in place: [E * rows, H / 128] views.
    assert g1["A"].data_ptr() == q.data_ptr() and g1["A_scale"].data_ptr() == s.data_ptr()
    assert g1["A_scale"].stride() == (HIDDEN // G, 1)
    assert g1["B_scale"] is experts.w1_scale and g2["B_scale"] is experts.w2_scale
    assert g1["shape"] == (total, 2 * INTER, HIDDEN) and g2["shape"] == (total, HIDDEN, INTER)
    # The tile: vLLM's lookup for this kernel with the FP8 dtype and the block shape.
    want_tile = try_get_optimal_moe_config(
        (EXPERTS, 2 * INTER, HIDDEN),
        (EXPERTS, HIDDEN, INTER),
        2,
        "fp8_w8a8",
        tokens,
        block_shape=[128, 128],
    )
    assert g1["config"] == g2["config"] == want_tile
    bound = max_blocks(tokens * 2, EXPERTS, CAP, want_tile["BLOCK_SIZE_M"])
    assert g1["blocks"] == g2["blocks"] == bound
    # The intermediate: vLLM's group quantization (128, row-major scales, vLLM's E8M0
    # default), over the listed rows only when they are fewer than the buffer's.
    assert [(r["width"], r["group"], r["column_major"], r["ue8m0"]) for r in rec.quantized] == [
        (INTER, G, False, None)
    ]
    assert rec.quantized[0]["rows"] == min(bound * want_tile["BLOCK_SIZE_M"], total)
    if tokens < CAP:  # a decode step: a few blocks, far from the buffer
        assert rec.quantized[0]["rows"] <= EXPERTS * CAP // 8
    # Every received row computed, nothing else written, each as its expert computes it.
    assert torch.isnan(out[~received].float()).all()
    want = _expert_outputs(q.float() * s.repeat_interleave(G, -1), received, d1, d2)
    # The same bytes and the same fp32 products, the output in BF16 as the kernel writes
    # it: only summation order differs.
    assert _rel(out[received], want[received].bfloat16()) < 1e-3


def test_bf16_activations_are_quantized_as_vllm_s_prepare_would():
    """BF16 arrives (the wire off and the quantization left to the experts): the listed
    rows get vLLM's group quantization, the same bytes as quantizing the whole buffer
    (what the prepare's `quantize_expert_buffer` hands over), and the same output."""
    (q1, s1, _), (q2, s2, _) = _block_weights(3)
    counts = [3, 0, 1, 0, 0, 2, 0, 2]
    x, _, _, c, received = _received_buffer(counts, CAP, seed=3)
    xq, xs = receive_quant.quantize_expert_buffer(x, c, _qc("block", s1, s2), False)
    want = _call(_experts(_qc("block", s1, s2)), xq, xs, q1, q2, c, 4)
    want_a2 = rec.gemms[1]["A"].clone(), rec.gemms[1]["A_scale"].clone()
    rec.gemms.clear()
    rec.quantized.clear()
    got = _call(_experts(_qc("block", s1, s2)), x, None, q1, q2, c, 4)
    a1, a1_scale = rec.gemms[0]["A"], rec.gemms[0]["A_scale"]
    flat = received.flatten()
    assert a1.dtype == FP8 and torch.equal(
        a1.view(torch.uint8)[flat], xq.view(-1, HIDDEN).view(torch.uint8)[flat]
    )
    assert torch.equal(a1_scale[flat], xs.view(-1, HIDDEN // G)[flat])
    # Two quantizations, each of the listed rows only (4 tokens x top_k 2: a few blocks).
    assert [r["width"] for r in rec.quantized] == [HIDDEN, INTER]
    assert all(r["rows"] <= EXPERTS * CAP // 4 for r in rec.quantized)
    a2, a2_scale = rec.gemms[1]["A"], rec.gemms[1]["A_scale"]
    assert torch.equal(a2.view(torch.uint8)[flat], want_a2[0].view(torch.uint8)[flat])
    assert torch.equal(a2_scale[flat], want_a2[1][flat])
    assert torch.equal(got[received], want[received])


@pytest.mark.parametrize("e8m0", [False, True])
def test_bf16_arrivals_reach_the_input_kernel_with_the_layer_s_groups(monkeypatch, e8m0):
    """With listed_quant's input kernel taken (INPUT_ENABLED on a GPU), a block layer's
    BF16 rows go to it in groups of 128 with vLLM's E8M0 choice, once per call; a
    stand-in returning the split path's bytes keeps the output vLLM's."""
    from vllm_flashinfer_ep.vllm import compact_experts_fp8, listed_quant

    (q1, s1, _), (q2, s2, _) = _block_weights(3)
    qc = _qc("block", s1, s2)
    x, _, _, c, received = _received_buffer([3, 0, 1, 0, 0, 2, 0, 2], CAP, seed=3)
    want = _call(_experts(qc), x, None, q1, q2, c, 4)
    seen = []

    def input_kernel(rows, blocks, group, ue8m0):
        seen.append((group, ue8m0, rows.shape))
        return compact_experts_fp8.quantize_listed_rows(rows, blocks[0], qc)

    monkeypatch.setattr(listed_quant, "takes_input", lambda x, group: True)
    monkeypatch.setattr(listed_quant, "quantize_rows", input_kernel)
    monkeypatch.setattr(compact_experts_fp8, "_e8m0_scales", lambda: e8m0)
    got = _call(_experts(qc), x, None, q1, q2, c, 4)
    assert seen == [(G, e8m0, (EXPERTS * CAP, HIDDEN))]
    assert torch.equal(got[received], want[received])


def test_listed_rows_get_the_bytes_of_the_whole_buffer_s_quantization():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=gen).bfloat16()
    listed = torch.tensor([5, 6, 7, 64, 40, 64, 64, 64, 0, 63, 64, 64], dtype=torch.int32)
    qc = _block_qc()
    q, s = compact_experts.quantize_listed_rows(x, listed, qc)
    assert q.shape == x.shape and s.shape == (64, 2) and q.dtype == FP8
    whole_q, whole_s = compact_experts.quantize_listed_rows(
        x, torch.arange(64, dtype=torch.int32), qc
    )
    assert [r["rows"] for r in rec.quantized] == [12, 64]  # gathered, then the whole buffer
    rows = torch.tensor([5, 6, 7, 40, 0, 63])
    assert torch.equal(q.view(torch.uint8)[rows], whole_q.view(torch.uint8)[rows])
    assert torch.equal(s[rows], whole_s[rows])


def test_several_senders_bound_the_list_by_the_per_rank_capacity():
    (q1, s1, _), (q2, s2, _) = _block_weights(5)
    senders, rows = 2, CAP * 2
    experts = _experts(_qc("block", s1, s2), dispatchers=senders)
    counts = [rows, 0, 0, 0, 0, 0, 0, 1]
    _, q, s, c, received = _received_buffer(counts, rows, seed=5)
    out = _call(experts, q, s, q1, q2, c, 3, rows=rows)
    bm = rec.gemms[0]["config"]["BLOCK_SIZE_M"]
    assert rec.gemms[0]["blocks"] == max_blocks(CAP * senders * 2, EXPERTS, rows, bm)
    assert torch.isfinite(out[received].float()).all()


# --------------------------------------------- through vLLM's modular kernel and the LL P/F
@pytest.mark.parametrize("wire", [True, False], ids=["fp8-wire", "quantized-after-receive"])
@pytest.mark.parametrize("num_tokens", [1, 5, 12])
def test_block_fp8_layer_through_the_ll_prepare_finalize(wire, num_tokens):
    top_k = 2
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=top_k,
        sizes=[1, 5, 12],
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=wire)
    (q1, s1, d1), (q2, s2, d2) = _block_weights(6)
    experts = VllmBatchedExperts(
        _moe_config(top_k),
        _qc("block", s1, s2),
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    kernel = mk.FusedMoEKernel(pf, experts)  # vLLM's setup hook installs the compact path
    gen = torch.Generator().manual_seed(num_tokens)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 0.5).bfloat16()
    ids, weights = random_routing(num_tokens, EXPERTS, top_k, CPU, gen)
    out = kernel.apply(
        hidden_states=x,
        w1=q1,
        w2=q2,
        topk_weights=weights,
        topk_ids=ids,
        activation=MoEActivation.SILU,
        global_num_experts=EXPERTS,
        expert_map=None,
        apply_router_weight_on_input=False,
    )
    assert experts.own_applies == 0 and len(rec.gemms) == 2
    if wire:
        assert rt.fp8_wire.dispatches == 1
        assert rec.gemms[0]["A"].data_ptr() == rt.fp8_wire.tokens.data_ptr()
        assert rec.gemms[0]["A_scale"].data_ptr() == rt.fp8_wire.scales.data_ptr()
    want = reference_moe(x, d1, d2, ids, weights, False)
    # FP8 activations (E4M3: 3 mantissa bits) twice against a BF16 MoE of the same weights
    # (measured 0.044-0.048 here; a wrong scale or row is off by O(1)).
    rel = _rel(out, want)
    assert torch.isfinite(out.float()).all() and rel < 8e-2, rel


def test_biased_block_fp8_experts_are_refused_at_load():
    from vllm_flashinfer_ep.errors import FlashInferEPConfigError

    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, top_k=2, sizes=[1]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    (_, s1, _), (_, s2, _) = _block_weights(7)
    qc = fp8_w8a8_moe_quant_config(
        s1,
        s2,
        block_shape=[128, 128],
        w1_bias=torch.zeros(EXPERTS, 2 * INTER),
        w2_bias=torch.zeros(EXPERTS, HIDDEN),
    )
    with pytest.raises(FlashInferEPConfigError, match="--all2all-backend"):
        mk.FusedMoEKernel(
            pf, VllmBatchedExperts(_moe_config(2), qc, max_num_tokens=CAP, num_dispatchers=1)
        )
