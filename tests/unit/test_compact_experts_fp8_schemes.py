"""Per-tensor and per-channel FP8 LL experts over the received rows (vllm/compact_experts_fp8.py), on CPU.

Which layers take the received-rows path is decided on vLLM 0.33.0's own quant configs
(`fp8_w8a8_moe_quant_config`). The numerics are compared with vLLM's own
`BatchedTritonExperts.apply` on the same receive buffer: its code runs as shipped (scale
normalization, its eager per-expert and its in-graph quantization of the intermediate,
the fills), with three stand-ins for what needs a GPU, each computing what vLLM's kernel
computes and reading the scales through the strides the kernel reads them with:
- `scaled_fp8_quant` (vLLM's CUDA quantization ops, called by `moe_kernel_quantize_input`):
  dynamic per tensor max |x| / 448 then x * (1 / scale); dynamic per token
  max(max |x| / 448, 1 / (448 * 512)) then x / scale; static per tensor or with a 2-D
  scale (per row), x * (1 / scale). NaN is skipped by the max, as fmaxf does.
- `invoke_moe_batched_triton_kernel` (vLLM's batched launcher and kernel) and
  `invoke_fused_moe_triton_kernel` (the fused one): accumulator x activation scale x
  weight scale in FP32, BF16 out. The E4M3 products are summed in FP64, where they are
  exact, so both kernels give the same bits for the same bytes and scales whatever the
  row grouping: the received rows must equal vLLM's exactly.
The real kernels are compared on the GPU (tests/kernels/test_compact_experts_fp8_gpu.py).
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
import vllm._custom_ops as vllm_ops
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEQuantConfig,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config
from vllm.model_executor.layers.fused_moe.utils import (
    moe_kernel_quantize_input,
    normalize_batched_scales_shape,
)

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import moe_config
from tests.unit.test_prepare_finalize_cpu import reference_moe
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.vllm import compact_experts, compact_experts_fp8, receive_quant
from vllm_flashinfer_ep.vllm.compact_experts import expert_blocks, max_blocks
from vllm_flashinfer_ep.vllm.compact_experts_fp8 import TENSOR, TOKEN
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

HIDDEN, INTER, EXPERTS, CAP = 2048, 128, 8, 64  # w1 [E, 2 * INTER, HIDDEN], w2 [E, HIDDEN, INTER]
N = 2 * INTER
FP8 = torch.float8_e4m3fn
FMAX = torch.finfo(FP8).max
MIN_TOKEN_SCALE = 1.0 / (FMAX * 512.0)  # vLLM's min_scaling_factor for E4M3
CPU = torch.device("cpu")
SCHEMES = ["tensor-dynamic", "tensor-static", "token-channel", "token-tensor"]


@pytest.fixture(autouse=True)
def _fp8_path_on(monkeypatch):
    """On in production (compact_experts.FP8_ENABLED, FP8_DYNAMIC_TENSOR); set here so a
    build with either switched off still tests every case."""
    monkeypatch.setattr(compact_experts, "FP8_ENABLED", True)
    monkeypatch.setattr(compact_experts, "FP8_DYNAMIC_TENSOR", True)


# ------------------------------------------------------------------ vLLM stand-ins
class Recorder:
    def __init__(self) -> None:
        self.quantized: list[dict] = []
        self.fused: list[dict] = []
        self.batched = 0


rec = Recorder()


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FMAX, FMAX).to(FP8)


def scaled_fp8_quant_standin(
    input,
    scale=None,
    num_token_padding=None,
    scale_ub=None,
    use_per_token_if_dynamic=False,
    output=None,
    group_shape=None,
):
    """vLLM 0.33.0's `_custom_ops.scaled_fp8_quant` on E4M3 (csrc/quantization/w8a8/fp8)."""
    assert input.dim() == 2 and num_token_padding is None and output is None and scale_ub is None
    x = input.float()
    rows = x.shape[0]
    if scale is None:
        amax = torch.nan_to_num(x.abs(), nan=0.0)
        if use_per_token_if_dynamic:
            s = torch.clamp_min(amax.amax(-1, keepdim=True) / FMAX, MIN_TOKEN_SCALE)
            rec.quantized.append({"kind": "dynamic-token", "rows": rows})
            return _to_fp8(x / s), s
        s = (amax.amax() / FMAX).reshape(1)
        rec.quantized.append({"kind": "dynamic-tensor", "rows": rows})
        return _to_fp8(x * (1.0 / s)), s
    assert scale.dtype == torch.float32 and group_shape is None
    if scale.numel() == 1:
        inv = 1.0 / scale.reshape(1, 1)
        rec.quantized.append({"kind": "static-tensor", "rows": rows})
    else:  # 2-D: groups inferred from its shape (here: one scale per row)
        assert scale.dim() == 2 and rows % scale.shape[0] == 0 and x.shape[1] % scale.shape[1] == 0
        inv = (1.0 / scale).repeat_interleave(rows // scale.shape[0], 0)
        inv = inv.repeat_interleave(x.shape[1] // scale.shape[1], 1)
        rec.quantized.append({"kind": "static-rows", "rows": rows})
    return _to_fp8(x * inv), scale


def _dot(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """E4M3 a [M, K] @ w [N, K].T: exact in FP64, then FP32 (the kernels' accumulator)."""
    return (a.double() @ w.double().T).float()


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
    """vLLM 0.33.0's `invoke_fused_moe_triton_kernel` for FP8 without blocks, top_k 1."""
    assert use_fp8_w8a8 and not (use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16)
    assert block_shape is None and B_scale is not None and A_scale is not None
    assert top_k == 1 and not mul_routed_weight and topk_weights is None and B_bias is None
    assert compute_type == tl.bfloat16 and C.dtype == torch.bfloat16
    assert A.dtype == FP8 and B.dtype == FP8 and A.dim() == 2 and A.stride(-1) == 1
    e, n, k = B.shape
    assert A.shape[1] == k and C.dim() == 3 and C.shape[1] == 1 and C.shape[2] == n
    assert A.shape[0] == C.shape[0]  # the sentinel rows masked: A's row count
    assert A_scale.dtype == B_scale.dtype == torch.float32
    assert sorted_token_ids.dtype == torch.int32 and sorted_token_ids.stride(0) == 1
    if A_scale.ndim == 0:
        A_scale = A_scale.reshape(1)
    # The strides the launcher hands the kernel.
    stride_asm = A_scale.stride(0) if A_scale.ndim == 2 else 0
    stride_bse = B_scale.stride(0)
    stride_bsn = B_scale.stride(1) if B_scale.ndim >= 2 and B_scale.size(1) > 1 else 0
    bm = config["BLOCK_SIZE_M"]
    rec.fused.append(
        {"A": A, "A_scale": A_scale, "B_scale": B_scale, "per_channel": per_channel_quant}
    )
    for b in range(sorted_token_ids.numel() // bm):
        if b * bm >= int(num_tokens_post_padded):
            break
        ids = sorted_token_ids[b * bm : (b + 1) * bm].long()
        ids = ids[ids < A.shape[0]]
        ex = int(expert_ids[b])
        if ex < 0 or ids.numel() == 0:
            continue
        acc = _dot(A[ids], B[ex])
        if per_channel_quant:  # a per row, w per output channel (stride 0: one for all)
            a_s = A_scale.as_strided((A.shape[0],), (stride_asm,))[ids][:, None]
            b_s = B_scale.as_strided((e, n), (stride_bse, stride_bsn))[ex][None, :]
        else:  # tensor-wise: a's first scale, w's at the expert's offset
            a_s = A_scale.reshape(-1)[0]
            b_s = B_scale.as_strided((e,), (1,))[ex]
        C[ids, 0] = (acc * a_s * b_s).to(C.dtype)


def batched_kernel_standin(
    A,
    B,
    C,
    expert_num_tokens,
    compute_type,
    A_scale,
    B_scale,
    B_zp,
    use_fp8_w8a8,
    use_int8_w8a16,
    use_int4_w4a16,
    config,
    per_act_token_quant,
    block_shape=None,
):
    """vLLM 0.33.0's `invoke_moe_batched_triton_kernel` for FP8 without blocks."""
    assert use_fp8_w8a8 and not (use_int8_w8a16 or use_int4_w4a16) and block_shape is None
    assert B_zp is None and compute_type == tl.bfloat16 and C.dtype == torch.bfloat16
    experts, max_tokens, _ = A.shape
    n = C.shape[2]
    A_scale = normalize_batched_scales_shape(A_scale, experts)  # as the launcher does
    if B_scale.ndim == 1:
        B_scale = B_scale.view(-1, 1, 1)
    assert A_scale.ndim == 3 and B_scale.ndim == 3
    stride_ase, stride_asm = A_scale.stride(0), A_scale.stride(1)
    stride_bse = B_scale.stride(0)
    stride_bsn = B_scale.stride(1) if B_scale.size(1) > 1 else 0
    rec.batched += 1
    for e in range(experts):
        num = int(expert_num_tokens[e])
        if num == 0:
            continue
        acc = _dot(A[e, :num], B[e])
        if per_act_token_quant:
            a_s = A_scale.as_strided((experts, max_tokens), (stride_ase, stride_asm))
            a_s = a_s[e, :num][:, None]
            b_s = B_scale.as_strided((experts, n), (stride_bse, stride_bsn))[e][None, :]
        else:
            a_s = A_scale.as_strided((experts,), (stride_ase,))[e]
            b_s = B_scale.as_strided((experts,), (stride_bse,))[e]
        C[e, :num] = (acc * a_s * b_s).to(C.dtype)


@pytest.fixture(autouse=True)
def standins(monkeypatch, fake):
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    # vLLM hands its modules a placeholder for triton.language without a GPU.
    monkeypatch.setattr(fused_batched_moe, "tl", tl)
    monkeypatch.setattr(vllm_fused_moe, "invoke_fused_moe_triton_kernel", fused_moe_kernel_standin)
    monkeypatch.setattr(
        fused_batched_moe, "invoke_moe_batched_triton_kernel", batched_kernel_standin
    )
    monkeypatch.setattr(vllm_ops, "scaled_fp8_quant", scaled_fp8_quant_standin)
    rec.quantized.clear()
    rec.fused.clear()
    rec.batched = 0
    return fake


def _in_graph(monkeypatch, on: bool) -> None:
    """What vLLM's batched experts see inside a CUDA graph (or torch.compile)."""
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: on)


# --------------------------------------------------------------------- experts
class VllmExperts(fused_batched_moe.BatchedTritonExperts):
    """vLLM's BatchedTritonExperts, its apply as shipped; the activation a torch
    SiLU-and-mul (vllm._C is absent here)."""

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


def _experts(qc, compact: bool, top_k: int = 2, max_num_tokens: int = CAP):
    experts = VllmExperts(_moe_config(top_k), qc, max_num_tokens=max_num_tokens, num_dispatchers=1)
    if compact:
        assert compact_experts.install(experts)
    return experts


def _quantize_weight(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (E4M3, FP32 scales [E, N, 1] per output channel or [E] per expert)."""
    amax = w.abs().amax(dim=2, keepdim=True) if per_channel else w.abs().amax(dim=(1, 2))
    s = (amax / FMAX).float().contiguous()
    q = _to_fp8(w / (s if per_channel else s[:, None, None]))
    return q, s


def _layer(kind: str, seed: int, w_scale_shape: str = "vllm"):
    """E4M3 weights and vLLM's quant config for `kind`."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(EXPERTS, N, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    per_channel = kind == "token-channel"
    (q1, s1), (q2, s2) = _quantize_weight(w1, per_channel), _quantize_weight(w2, per_channel)
    if w_scale_shape == "[E,1,1]":
        s1, s2 = s1.view(EXPERTS, 1, 1), s2.view(EXPERTS, 1, 1)
    static = torch.tensor([0.004]) if kind == "tensor-static" else None
    qc = fp8_w8a8_moe_quant_config(
        s1,
        s2,
        a1_scale=static,
        a2_scale=static,
        per_act_token_quant=kind.startswith("token"),
        per_out_ch_quant=per_channel,
    )
    return q1, q2, qc


def _meta(counts: torch.Tensor) -> mk.ExpertTokensMetadata:
    return mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)


def _received(counts: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.arange(rows)[None, :] < counts[:, None]


def _buffer(counts: list[int], seed: int, rows: int = CAP):
    """An LL receive buffer in BF16 [E, rows, H], rows of very different loudness; rows
    past each count hold NaN (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    loud = 1 + 8 * torch.rand(EXPERTS, rows, 1, generator=gen)
    x = (torch.randn(EXPERTS, rows, HIDDEN, generator=gen) * loud / 4).bfloat16()
    c = torch.tensor(counts, dtype=torch.int32)
    x[~_received(c, rows)] = float("nan")
    return x, c


def _leftovers(numel: int) -> torch.Tensor:
    """A workspace as earlier forwards leave it: loud finite values (a max over rows that
    are not received would be thrown off by them)."""
    gen = torch.Generator().manual_seed(numel)
    return (torch.randn(numel, generator=gen) * 1e3).bfloat16()


def _call(experts, hidden, scales, w1, w2, counts, tokens, top_k=2):
    """One experts call; the output starts as NaN (nothing but received rows may be
    written), the workspaces with leftovers."""
    rows = hidden.shape[1]
    out = torch.full((EXPERTS, rows, HIDDEN), float("nan"), dtype=torch.bfloat16)
    experts.apply(
        output=out,
        hidden_states=hidden,
        w1=w1,
        w2=w2,
        topk_weights=None,
        topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64),
        activation=MoEActivation.SILU,
        global_num_experts=EXPERTS,
        expert_map=None,
        a1q_scale=scales,
        a2_scale=experts.a2_scale,  # what vLLM's modular kernel passes
        workspace13=_leftovers(EXPERTS * rows * max(N, HIDDEN)),
        workspace2=_leftovers(EXPERTS * rows * INTER),
        expert_tokens_meta=_meta(counts),
        apply_router_weight_on_input=False,
    )
    return out


# ------------------------------------------------------------------- eligibility
def _kw(qc, hidden_dtype=FP8, scales="per-expert", rows=CAP, out_dtype=torch.bfloat16):
    q1 = torch.zeros(EXPERTS, N, HIDDEN, dtype=FP8)
    q2 = torch.zeros(EXPERTS, HIDDEN, INTER, dtype=FP8)
    a1q = {
        "per-expert": torch.ones(EXPERTS, 1, 1),
        "one": torch.ones(1),
        "rows": torch.ones(EXPERTS, rows, 1),
        "flat": torch.ones(EXPERTS * rows, 1),
        "per-expert-1d": torch.ones(EXPERTS),
        "none": None,
    }[scales]
    return {
        "hidden_states": torch.zeros(EXPERTS, rows, HIDDEN, dtype=hidden_dtype),
        "output": torch.empty(EXPERTS, rows, HIDDEN, dtype=out_dtype),
        "w1": q1,
        "w2": q2,
        "a1q_scale": a1q,
        "a2_scale": qc.a2_scale,
        "activation": MoEActivation.SILU,
        "expert_tokens_meta": _meta(torch.zeros(EXPERTS, dtype=torch.int32)),
    }


@pytest.mark.parametrize(
    ("kind", "w_scales", "hidden_dtype", "scales", "want"),
    [
        pytest.param("tensor-dynamic", "vllm", FP8, "per-expert", TENSOR, id="tensor-dynamic"),
        pytest.param("tensor-dynamic", "[E,1,1]", FP8, "one", TENSOR, id="tensor-[E,1,1]"),
        pytest.param("tensor-static", "vllm", FP8, "per-expert", TENSOR, id="tensor-static"),
        pytest.param("token-channel", "vllm", FP8, "rows", TOKEN, id="token-channel"),
        pytest.param("token-channel", "vllm", FP8, "flat", TOKEN, id="token-channel-flat"),
        pytest.param("token-channel", "vllm", torch.bfloat16, "none", TOKEN, id="token-bf16"),
        pytest.param("token-tensor", "vllm", FP8, "rows", TOKEN, id="token-tensor"),
    ],
)
def test_vllm_s_per_tensor_and_per_channel_configs_take_the_received_rows_path(
    kind, w_scales, hidden_dtype, scales, want
):
    _, _, qc = _layer(kind, 0, w_scales)
    assert isinstance(qc, FusedMoEQuantConfig) and qc.quant_dtype == FP8 and qc.block_shape is None
    experts = _experts(qc, compact=False)
    kw = _kw(qc, hidden_dtype, scales)
    assert compact_experts_fp8.scheme(experts, kw) == want
    assert compact_experts.eligible(experts, kw)


def test_switched_off_dynamic_per_tensor_intermediates_stay_on_vllm_s_kernel(monkeypatch):
    """FP8_DYNAMIC_TENSOR off (a measurement of vLLM's kernel): only those layers leave."""
    monkeypatch.setattr(compact_experts, "FP8_DYNAMIC_TENSOR", False)
    for kind, scales, taken in (
        ("tensor-dynamic", "per-expert", False),
        ("tensor-static", "per-expert", True),
        ("token-channel", "rows", True),
    ):
        _, _, qc = _layer(kind, 0)
        experts = _experts(qc, compact=False)
        assert compact_experts.eligible(experts, _kw(qc, FP8, scales)) is taken, kind


def test_the_fp8_switch_keeps_them_on_vllm_s_kernel(monkeypatch):
    monkeypatch.setattr(compact_experts, "FP8_ENABLED", False)
    for kind, scales in (("tensor-dynamic", "per-expert"), ("token-channel", "rows")):
        _, _, qc = _layer(kind, 0)
        assert not compact_experts.eligible(_experts(qc, compact=False), _kw(qc, FP8, scales))


def _ineligible(case: str):
    """(quant config, kw) of a layout the path does not reproduce exactly."""
    _, _, tensor_qc = _layer("tensor-dynamic", 0)
    _, _, token_qc = _layer("token-channel", 0)
    s1, s2 = tensor_qc.w1_scale, tensor_qc.w2_scale
    c1, c2 = token_qc.w1_scale, token_qc.w2_scale
    qc, args = tensor_qc, {}
    if case == "channel-weights-tensor-activations":  # vLLM's batched kernel reads channel 0
        qc = fp8_w8a8_moe_quant_config(c1, c2, per_out_ch_quant=True)
    elif case == "channel-weights-static-activations":
        static = torch.tensor([0.004])
        qc = fp8_w8a8_moe_quant_config(
            c1, c2, a1_scale=static, a2_scale=static, per_out_ch_quant=True
        )
    elif case == "per-expert-static-a2":  # vLLM's in-graph quantization refuses it
        qc = fp8_w8a8_moe_quant_config(s1, s2, a2_scale=torch.full((EXPERTS,), 0.004))
    elif case == "tensor-fp16-activations":  # BF16 ones are quantized here
        args = {"hidden_dtype": torch.float16, "scales": "none"}
    elif case == "tensor-bf16-with-scales":  # BF16 with scales: not what the prepare hands
        args = {"hidden_dtype": torch.bfloat16, "scales": "one"}
    elif case == "tensor-bf16-per-expert-static-a1":  # one scale for the listed rows
        qc = fp8_w8a8_moe_quant_config(
            s1, s2, a1_scale=torch.full((EXPERTS,), 0.004), a2_scale=torch.tensor([0.004])
        )
        args = {"hidden_dtype": torch.bfloat16, "scales": "none"}
    elif case == "tensor-per-row-scales":
        args = {"scales": "rows"}
    elif case == "tensor-1d-per-expert-scales":  # vLLM's scale normalization refuses it
        args = {"scales": "per-expert-1d"}
    elif case == "tensor-fp8-without-scales":
        args = {"scales": "none"}
    elif case == "token-per-expert-scales":
        qc, args = token_qc, {"scales": "per-expert"}
    elif case == "token-static-a1":
        qc = fp8_w8a8_moe_quant_config(
            c1, c2, a1_scale=torch.tensor([0.004]), per_act_token_quant=True, per_out_ch_quant=True
        )
        args = {"scales": "rows"}
    elif case == "channel-scales-2d":  # vLLM's batched launcher takes 1-D or 3-D only
        qc = fp8_w8a8_moe_quant_config(
            c1.view(EXPERTS, N),
            c2.view(EXPERTS, HIDDEN),
            per_act_token_quant=True,
            per_out_ch_quant=True,
        )
        args = {"scales": "rows"}
    elif case == "tensor-fp16-output":
        args = {"out_dtype": torch.float16}
    elif case == "zero-points":
        qc = FusedMoEQuantConfig.make(
            FP8, w1_scale=s1, w2_scale=s2, w1_zp=torch.zeros(EXPERTS), w2_zp=torch.zeros(EXPERTS)
        )
    elif case == "biases":
        qc = fp8_w8a8_moe_quant_config(
            s1, s2, w1_bias=torch.zeros(EXPERTS, N), w2_bias=torch.zeros(EXPERTS, HIDDEN)
        )
    else:
        raise ValueError(case)
    return qc, _kw(qc, **args)


@pytest.mark.parametrize(
    "case",
    [
        "channel-weights-tensor-activations",
        "channel-weights-static-activations",
        "per-expert-static-a2",
        "tensor-fp16-activations",
        "tensor-bf16-with-scales",
        "tensor-bf16-per-expert-static-a1",
        "tensor-per-row-scales",
        "tensor-1d-per-expert-scales",
        "tensor-fp8-without-scales",
        "token-per-expert-scales",
        "token-static-a1",
        "channel-scales-2d",
        "tensor-fp16-output",
        "zero-points",
        "biases",
    ],
)
def test_layouts_the_path_does_not_reproduce_stay_on_vllm_s_kernel(case):
    qc, kw = _ineligible(case)
    assert not compact_experts.eligible(_experts(qc, compact=False), kw)


def test_an_ineligible_call_reaches_vllm_s_own_apply():
    _, _, token_qc = _layer("token-channel", 1)
    q1, q2, _ = _layer("tensor-dynamic", 1)
    qc = fp8_w8a8_moe_quant_config(token_qc.w1_scale, token_qc.w2_scale, per_out_ch_quant=True)
    x, counts = _buffer([2, 0, 1, 0, 0, 0, 0, 0], seed=1)
    xq, xs = receive_quant.quantize_expert_buffer(x, counts, qc, False)
    _call(_experts(qc, compact=True), xq, xs, q1, q2, counts, 2)
    assert rec.batched == 2 and not rec.fused  # vLLM's two batched GEMMs, none of the path's


# ------------------------------------------------------------------- numerics
COUNTS = [
    # (tokens of the forward, received counts)
    pytest.param(1, [0] * EXPERTS, id="no-rows"),
    pytest.param(1, [0, 0, 0, 1, 0, 0, 0, 0], id="one-row"),
    pytest.param(2, [1, 0, 2, 0, 0, 1, 0, 0], id="decode-2"),
    pytest.param(CAP, [CAP, 0, 1, 7, 0, CAP - 1, 3, 5], id="full-expert-and-empty-ones"),
    pytest.param(4 * CAP, [CAP] * EXPERTS, id="every-row-of-the-buffer"),
]


def _listed_rows(tokens: int, top_k: int = 2) -> int:
    """Rows of the block list for a forward of `tokens` (one sender): vLLM's tile for the
    fused kernel at that count, the bound on its blocks; at most the buffer."""
    tile = try_get_optimal_moe_config(
        (EXPERTS, N, HIDDEN), (EXPERTS, HIDDEN, INTER), top_k, "fp8_w8a8", tokens
    )
    bm = tile["BLOCK_SIZE_M"]
    return min(max_blocks(tokens * top_k, EXPERTS, CAP, bm) * bm, EXPERTS * CAP)


def _prepared(kind: str, qc, x: torch.Tensor, counts: torch.Tensor):
    """What the LL prepare hands the experts for this buffer (vllm/receive_quant.py)."""
    return receive_quant.quantize_expert_buffer(x, counts, qc, False)


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in-graph"])
@pytest.mark.parametrize("kind", SCHEMES)
@pytest.mark.parametrize(("tokens", "counts"), COUNTS)
def test_received_rows_equal_vllm_s_batched_experts(monkeypatch, kind, tokens, counts, in_graph):
    q1, q2, qc = _layer(kind, seed=tokens)
    x, c = _buffer(counts, seed=tokens + 1)
    xq, xs = _prepared(kind, qc, x, c)
    _in_graph(monkeypatch, in_graph)
    want = _call(_experts(qc, compact=False), xq, xs, q1, q2, c, tokens)
    assert rec.batched == 2 and not rec.fused
    rec.quantized.clear()
    got = _call(_experts(qc, compact=True), xq, xs, q1, q2, c, tokens)
    assert rec.batched == 2 and len(rec.fused) == 2  # both GEMMs on the path's kernel
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])
    assert torch.isnan(got[~received].float()).all()  # nothing else written
    if received.any():
        assert torch.isfinite(got[received].float()).all() and got[received].abs().max() > 0
    # GEMM1 reads the prepare's E4M3 rows in place, each row its own (or its expert's) scale.
    g1, g2 = rec.fused
    assert g1["A"].data_ptr() == xq.data_ptr() and g1["per_channel"] and g2["per_channel"]
    a1_scale = g1["A_scale"].as_strided((EXPERTS * CAP,), (g1["A_scale"].stride(0),))
    flat = received.flatten()
    want_a1 = xs.expand(EXPERTS, CAP, 1) if kind.startswith("tensor") else xs
    assert torch.equal(a1_scale[flat], want_a1.reshape(-1)[flat])
    # The intermediate: vLLM's quantization, of the listed rows only (the buffer when the
    # list covers it): per expert as per-row static scales eagerly, one scale in a graph.
    listed = _listed_rows(tokens)
    if kind == "tensor-dynamic":
        want_kind = "static-tensor" if in_graph else "static-rows"
    else:
        want_kind = "static-tensor" if kind == "tensor-static" else "dynamic-token"
    assert [(r["kind"], r["rows"]) for r in rec.quantized] == [(want_kind, listed)]
    if tokens <= 2:  # a decode step: a few blocks, far from the buffer
        assert listed <= EXPERTS * CAP // 8


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in-graph"])
def test_per_tensor_intermediate_scale_follows_vllm_s_batched_experts(monkeypatch, in_graph):
    """Eagerly vLLM's batched experts quantize each expert's received rows with their own
    dynamic scale (its loop over experts); inside a graph the whole buffer with one (its
    rows past the counts zero: the max over every received row). The listed rows get the
    bytes vLLM's own dynamic quantization gives them either way."""
    _in_graph(monkeypatch, in_graph)
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 1, 0, 0, 2, 0, 5], dtype=torch.int32)
    loud = 1 + 100 * torch.rand(EXPERTS, CAP, 1, generator=gen)
    x = (torch.randn(EXPERTS, CAP, INTER, generator=gen) * loud).bfloat16()
    x[5, 1] = 0.0
    x[5, 0] = 0.0  # an expert whose received rows are all zero: zeros, not NaN
    received = _received(counts, CAP)
    x[~received] = float("nan")
    listed, _, _ = expert_blocks(counts, CAP, 16, max_blocks(11, EXPERTS, CAP, 16))
    _, _, qc = _layer("tensor-dynamic", 0)
    q, s = compact_experts_fp8.quantize_listed_rows_per_tensor(
        x.view(-1, INTER), listed, CAP, qc, None
    )
    assert q.shape == (EXPERTS * CAP, INTER) and s.shape == (EXPERTS * CAP, 1)
    q, s = q.view(EXPERTS, CAP, INTER), s.view(EXPERTS, CAP)
    assert torch.equal(q[5, :2].float(), torch.zeros(2, INTER))
    if in_graph:
        whole = torch.where(received[..., None], x, torch.zeros_like(x))
        vq, vs = moe_kernel_quantize_input(whole.view(-1, INTER), None, FP8, False, None)
        vq = vq.view(EXPERTS, CAP, INTER)
        assert s.stride(0) == 0 and torch.equal(s[received], vs.expand(int(counts.sum())))
        assert torch.equal(q.view(torch.uint8)[received], vq.view(torch.uint8)[received])
        return
    for e in torch.nonzero(counts).flatten().tolist():
        n = int(counts[e])
        vq, vs = moe_kernel_quantize_input(x[e, :n].contiguous(), None, FP8, False, None)
        if e == 5:  # vLLM divides by a zero scale there; the path floors it
            assert float(vs) == 0 and bool((s[e, :n] > 0).all())
            continue
        assert torch.equal(q[e, :n].view(torch.uint8), vq.view(torch.uint8)), e
        assert torch.equal(s[e, :n], vs.expand(n)), e


def test_bf16_arrival_of_a_per_token_layer_quantized_as_vllm_s_prepare_would():
    q1, q2, qc = _layer("token-channel", seed=4)
    x, c = _buffer([3, 0, 1, 0, 0, 2, 0, 2], seed=4)
    xq, xs = receive_quant.quantize_expert_buffer(x, c, qc, False)
    want = _call(_experts(qc, compact=False), xq, xs, q1, q2, c, 4)
    rec.quantized.clear()
    got = _call(_experts(qc, compact=True), x, None, q1, q2, c, 4)
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])
    # Two per-token quantizations, each of the listed rows only.
    assert [(r["kind"], r["rows"]) for r in rec.quantized] == [
        ("dynamic-token", _listed_rows(4))
    ] * 2
    assert _listed_rows(4) < EXPERTS * CAP


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in-graph"])
@pytest.mark.parametrize("kind", ["tensor-static", "tensor-dynamic"])
def test_bf16_arrival_of_a_per_tensor_layer_quantized_as_vllm_s_prepare_would(
    monkeypatch, kind, in_graph
):
    """BF16 arrives (the LL prepare leaves a per-tensor layer's input to this path): the
    listed rows get the prepare's one scale (the static one, or max |x| / 448 over the
    received rows), the bytes it would have given them, and vLLM's output."""
    _in_graph(monkeypatch, in_graph)
    q1, q2, qc = _layer(kind, seed=8)
    x, c = _buffer([3, 0, 1, 0, 0, 2, 0, 2], seed=8)
    xq, xs = receive_quant.quantize_expert_buffer(x, c, qc, False)
    want = _call(_experts(qc, compact=False), xq, xs, q1, q2, c, 4)
    rec.quantized.clear()
    rec.fused.clear()
    got = _call(_experts(qc, compact=True), x, None, q1, q2, c, 4)
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])
    assert torch.isnan(got[~received].float()).all()
    # The input: one static quantization of the listed rows only, with the prepare's scale.
    assert rec.quantized[0] == {"kind": "static-tensor", "rows": _listed_rows(4)}
    g1 = rec.fused[0]
    flat = received.flatten()
    assert torch.equal(g1["A"].view(torch.uint8)[flat], xq.view(-1, HIDDEN).view(torch.uint8)[flat])
    assert g1["A_scale"].stride(0) == 0 and float(g1["A_scale"][0, 0]) == float(xs.flatten()[0])


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "in-graph"])
@pytest.mark.parametrize("kind", ["tensor-static", "tensor-dynamic"])
def test_per_tensor_layers_reach_the_two_launch_kernels_when_taken(monkeypatch, kind, in_graph):
    """With listed_quant's per-tensor kernels taken (TENSOR_ENABLED on a GPU), a dynamic
    layer's BF16 input goes to them with one scale over the listed rows, its intermediate
    with a scale per expert when eager and one in a graph, as vLLM's batched experts take
    it; a layer with static scales keeps vLLM's static quantization. A stand-in returning
    the gathered path's bytes keeps vLLM's output."""
    from vllm_flashinfer_ep.vllm import listed_quant

    _in_graph(monkeypatch, in_graph)
    q1, q2, qc = _layer(kind, seed=8)
    x, c = _buffer([3, 0, 1, 0, 0, 2, 0, 2], seed=8)
    want = _call(_experts(qc, compact=True), x, None, q1, q2, c, 4)
    seen = []

    def kernels(rows, blocks, rows_per_expert, per_expert, act):
        seen.append((per_expert, act, tuple(rows.shape)))
        if act:
            d = rows.shape[1] // 2
            y = torch.nn.functional.silu(rows[:, :d].float()) * rows[:, d:].float()
            rows = y.to(rows.dtype)
        one = not per_expert or not act
        return compact_experts_fp8.quantize_listed_rows_per_tensor(
            rows, blocks[0], rows_per_expert, qc, None, one_scale=one
        )

    asked = []

    def takes_tensor(x, act, fused_experts=None, activation=None):
        asked.append((act, fused_experts is not None, activation))
        return True

    monkeypatch.setattr(listed_quant, "takes_tensor", takes_tensor)
    monkeypatch.setattr(listed_quant, "tensor_quant", kernels)
    got = _call(_experts(qc, compact=True), x, None, q1, q2, c, 4)
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])
    if kind == "tensor-static":
        assert seen == []
        return
    # asked with what the real check reads: the input without, the intermediate with the
    # layer's activation (a non-SiLU layer must not get the kernel's SiLU)
    assert asked == [(False, False, None), (True, True, MoEActivation.SILU)]
    assert seen == [
        (False, False, (EXPERTS * CAP, HIDDEN)),
        (not in_graph, True, (EXPERTS * CAP, 2 * INTER)),
    ]


def test_only_installed_fp8_experts_that_take_quantized_inputs_quantize_their_input():
    _, _, qc = _layer("token-channel", 0)
    assert compact_experts.quantizes_input(_experts(qc, compact=True))
    unquantized = _experts(FusedMoEQuantConfig.make(), compact=True)
    assert not compact_experts.quantizes_input(unquantized)  # BF16 layers: nothing to defer

    class Deferring(VllmExperts):  # experts vLLM already hands unquantized inputs
        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

    deferring = Deferring(_moe_config(2), qc, max_num_tokens=CAP, num_dispatchers=1)
    assert not compact_experts.quantizes_input(deferring)


def test_switched_off_dynamic_per_tensor_layers_are_quantized_by_the_fallback(monkeypatch):
    """FP8_DYNAMIC_TENSOR off keeps dynamic per-tensor intermediates on vLLM's kernel;
    through the LL prepare/finalize such a layer still arrives in BF16 and the wrapper
    quantizes the whole buffer as the prepare would have: vLLM's output, bit for bit."""
    monkeypatch.setattr(compact_experts, "FP8_DYNAMIC_TENSOR", False)
    q1, q2, qc = _layer("tensor-dynamic", seed=6)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, HIDDEN, generator=gen) * 0.5).bfloat16()
    ids, weights = random_routing(5, EXPERTS, 2, CPU, gen)
    outs = []
    for compact in (False, True):
        kernel = _ll_kernel(qc, 2, compact, monkeypatch)
        rec.quantized.clear()
        rec.fused.clear()
        rec.batched = 0
        outs.append(_apply(kernel, x, q1, q2, ids, weights))
        assert rec.batched == 2 and not rec.fused  # vLLM's kernel both times
        assert rec.quantized[0]["rows"] == EXPERTS * CAP  # the whole buffer
    assert torch.equal(outs[1], outs[0])


def test_the_prepare_and_the_listed_rows_take_one_dynamic_per_tensor_scale():
    """A per-tensor layer's BF16 input gets its dynamic scale from the prepare (a call the
    path does not take) or from the listed rows (one it takes): the same scale either way,
    a row holding NaN counting as zero and an infinity kept, as vLLM's kernel keeps it."""
    _, _, qc = _layer("tensor-dynamic", 0)
    counts = torch.tensor([3, 0, 1, 0, 0, 2, 0, 2], dtype=torch.int32)
    listed, _, _ = expert_blocks(counts, CAP, 16, max_blocks(8, EXPERTS, CAP, 16))
    for poison in (None, float("nan"), float("inf"), -float("inf")):
        x, _ = _buffer(counts.tolist(), seed=11)
        if poison is not None:
            x[5, 1, 7] = poison
        _, prepared = receive_quant.quantize_expert_buffer(x, counts, qc, False)
        _, listed_scale = compact_experts_fp8.quantize_listed_rows_per_tensor(
            x.view(-1, HIDDEN), listed, CAP, qc, None, one_scale=True
        )
        want, got = prepared.flatten()[0], listed_scale[0, 0]
        assert torch.equal(got, want), (poison, got, want)
        assert bool(torch.isinf(want)) == (poison is not None and abs(poison) == float("inf"))


@pytest.mark.parametrize("kind", SCHEMES)
def test_a_bf16_call_the_path_does_not_take_gets_the_prepare_s_quantization(monkeypatch, kind):
    """The prepare leaves BF16 to the experts once this path is installed; a call the path
    then does not take (here: its FP8 switch off) reaches vLLM's batched kernel with the
    whole buffer quantized as the prepare would have, and vLLM's output."""
    q1, q2, qc = _layer(kind, seed=9)
    x, c = _buffer([3, 0, 1, 0, 0, 2, 0, 2], seed=9)
    xq, xs = receive_quant.quantize_expert_buffer(x, c, qc, False)
    want = _call(_experts(qc, compact=False), xq, xs, q1, q2, c, 4)
    experts = _experts(qc, compact=True)
    monkeypatch.setattr(compact_experts, "FP8_ENABLED", False)
    rec.quantized.clear()
    rec.fused.clear()
    rec.batched = 0
    got = _call(experts, x, None, q1, q2, c, 4)
    assert rec.batched == 2 and not rec.fused  # vLLM's kernel
    assert rec.quantized[0]["rows"] == EXPERTS * CAP  # the whole buffer, as the prepare's
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])


@pytest.mark.parametrize(("tokens", "counts"), COUNTS[2:])
def test_per_expert_activation_scales_are_read_per_expert(tokens, counts):
    """The LL prepare hands one dynamic scale for every expert; vLLM's own batched
    quantization (`batched_moe_kernel_quantize_input`, eager) one per expert, [E, 1, 1].
    Each row must be read with its own expert's."""
    q1, q2, qc = _layer("tensor-dynamic", seed=tokens + 7)
    x, c = _buffer(counts, seed=tokens + 7)
    xq, xs = fused_batched_moe.batched_moe_kernel_quantize_input(
        x, None, CAP, EXPERTS, N, c, FP8, False, None
    )
    assert xs.shape == (EXPERTS, 1, 1) and len(set(xs[c > 0].flatten().tolist())) > 1
    want = _call(_experts(qc, compact=False), xq, xs, q1, q2, c, tokens)
    got = _call(_experts(qc, compact=True), xq, xs, q1, q2, c, tokens)
    received = _received(c, CAP)
    assert torch.equal(got[received], want[received])


def test_a_static_intermediate_scale_is_vllm_s_static_quantization():
    q1, q2, qc = _layer("tensor-static", seed=5)
    x, c = _buffer([2, 0, 0, 1, 0, 0, 0, 1], seed=5)
    xq, xs = receive_quant.quantize_expert_buffer(x, c, qc, False)
    rec.quantized.clear()
    _call(_experts(qc, compact=True), xq, xs, q1, q2, c, 2)
    assert [(r["kind"], r["rows"]) for r in rec.quantized] == [("static-tensor", _listed_rows(2))]
    a2_scale = rec.fused[1]["A_scale"]
    assert a2_scale.stride(0) == 0 and float(a2_scale[0, 0]) == float(qc.a2_scale)


# --------------------------------------------- through vLLM's modular kernel and the LL P/F
def _ll_kernel(qc, top_k: int, compact: bool, monkeypatch):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=top_k,
        sizes=[1, 5, 12],
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    experts = VllmExperts(
        _moe_config(top_k),
        qc,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    with monkeypatch.context() as m:
        m.setattr(compact_experts, "ENABLED", compact)
        kernel = mk.FusedMoEKernel(pf, experts)  # vLLM's setup hook installs the path (or not)
    return kernel


def _apply(kernel, x, q1, q2, ids, weights) -> torch.Tensor:
    """One SiLU MoE layer through vLLM's modular kernel, as the model calls it."""
    return kernel.apply(
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


@pytest.mark.parametrize("kind", SCHEMES)
@pytest.mark.parametrize("num_tokens", [1, 5, 12])
def test_layer_through_the_ll_prepare_finalize(monkeypatch, kind, num_tokens):
    top_k = 2
    q1, q2, qc = _layer(kind, seed=6)
    gen = torch.Generator().manual_seed(num_tokens)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 0.5).bfloat16()
    ids, weights = random_routing(num_tokens, EXPERTS, top_k, CPU, gen)
    outs = []
    for compact in (False, True):
        kernel = _ll_kernel(qc, top_k, compact, monkeypatch)
        rec.fused.clear()
        rec.batched = 0
        outs.append(_apply(kernel, x, q1, q2, ids, weights))
        assert (len(rec.fused), rec.batched) == ((2, 0) if compact else (0, 2))
        # BF16 over the wire: quantized here, the listed rows only (a decode step's few
        # blocks); without the path, the prepare quantizes the whole buffer
        want_rows = _listed_rows(num_tokens, top_k) if compact else EXPERTS * CAP
        assert rec.quantized[0]["rows"] == want_rows
        rec.quantized.clear()
    vllm_out, got = outs
    assert torch.equal(got, vllm_out)
    # The path undone after set-up (the patch table's undo): vLLM's apply is back, and the
    # prepare quantizes again (it must not hand BF16 to vLLM's FP8 kernel).
    from vllm_flashinfer_ep.vllm.patches._helper import undo_instance

    assert undo_instance(compact_experts.PATCH, kernel.fused_experts)
    rec.quantized.clear()
    undone = _apply(kernel, x, q1, q2, ids, weights)
    assert rec.quantized[0]["rows"] == EXPERTS * CAP and torch.equal(undone, vllm_out)
    # And both an FP8 MoE of these weights (E4M3 activations twice: a few percent).
    deq1 = q1.float() * (qc.w1_scale if qc.w1_scale.dim() == 3 else qc.w1_scale[:, None, None])
    deq2 = q2.float() * (qc.w2_scale if qc.w2_scale.dim() == 3 else qc.w2_scale[:, None, None])
    want = reference_moe(x, deq1, deq2, ids, weights, False)
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert torch.isfinite(got.float()).all() and rel < 8e-2, rel
