"""The received-rows experts (experts/received_rows.py), on CPU, as vLLM runs them.

`ReceivedRowsExperts` is vLLM 0.33.0's `BatchedTritonExperts` computing only the rows
that arrived. Here it runs inside vLLM's own `FusedMoEKernel` with the package's LL
prepare/finalize over the fake transport (the `experts_selection` patch in place, so the
kernel vLLM builds holds the wing's class), and by direct calls on receive buffers whose
rows past each count hold NaN. What needs a GPU is replaced by stand-ins that compute the
documented contract of the real thing and refuse what it refuses:
- vLLM's `invoke_fused_moe_triton_kernel` (its signature): top_k 1 over a block list, the
  sentinel rows masked by A's row count, C written through the strides the launcher hands
  the kernel; FP8 A and B scales read as the kernel reads them (128x128 blocks per K group,
  `per_channel_quant` one A scale per row and B per output channel, else tensor-wise).
- the wing's Triton kernels (kernels/quantize.py, kernels/activation.py): the listed rows
  only, with the rounding their docstrings state; rows not listed come back NaN, so a
  GEMM that reads one shows it.
- vLLM's masked activation (`apply_moe_activation`, vllm._C): torch, the counts' rows.
The kernels themselves run in Triton's interpreter (test_row_blocks.py and the kernel
tests) and on the GPU (tests/kernels/test_received_rows_experts_gpu.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
import vllm.forward_context as fc
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
    biased_moe_quant_config,
    fp8_w8a8_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import moe_config, patch_row
from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.backends import LOW_LATENCY, Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.experts import received_rows
from vllm_flashinfer_ep.experts.kernels import activation as act_kernel
from vllm_flashinfer_ep.experts.kernels import quantize
from vllm_flashinfer_ep.experts.kernels.row_blocks import max_blocks
from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts, senders_tokens
from vllm_flashinfer_ep.vllm import receive_quant
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

HIDDEN, INTER, EXPERTS, CAP = 2048, 128, 8, 64  # w1 [E, 2 * INTER, HIDDEN], w2 [E, HIDDEN, INTER]
N = 2 * INTER
FP8 = num.FP8
G = num.GROUP
CPU = torch.device("cpu")
FP8_SCHEMES = [
    "block",
    "channel",
    "tensor_weights_token_activations",
    "tensor_static",
    "tensor_dynamic",
]
STATIC_A1, STATIC_A2 = 0.01, 0.02  # about max |x| / 448 of the rows and intermediates here
E4M3_NAN = 0x7F


# ------------------------------------------------------------------ stand-ins
class Recorder:
    def __init__(self) -> None:
        self.gemms: list[dict] = []
        self.quants: list[dict] = []
        self.fused_acts = 0
        self.swiglu_oai: list[dict] = []
        self.masked: list[dict] = []

    def clear(self) -> None:
        self.__init__()


rec = Recorder()
_rows_reason = quantize.rows_reason  # the real checks, kept by the stand-ins


def _listed(blocks, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat rows, their experts) the used blocks list, as the kernels read the list."""
    bm = blocks.block_m
    used = min(int(blocks.blocks_rows) // bm, blocks.expert_ids.numel())
    ids = blocks.sorted_ids[: used * bm].long().view(used, bm)
    owners = blocks.expert_ids[:used].long()[:, None].expand(used, bm)
    keep = ids < rows
    return ids[keep], owners[keep]


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up of 16-bit rows [n, 2d], rounded as kernels/activation.py states (the
    SiLU to the 16-bit type, then the product), FP32 holding those 16-bit values."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d].float(), x[..., d:].float()
    act = (gate / (1.0 + torch.exp(-gate))).to(x.dtype).float()
    return (act * up).to(x.dtype).float()


def _garbage_fp8(rows: int, d: int) -> torch.Tensor:
    return torch.full((rows, d), E4M3_NAN, dtype=torch.uint8).view(FP8)


def group_scales(y: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """vLLM's per-128 scales of FP32 rows [n, d]: max(amax, 1e-10) / 448 (a power of two
    above it under E8M0)."""
    amax = y.view(y.shape[0], y.shape[1] // G, G).abs().amax(-1).clamp_min(num.GROUP_AMAX_FLOOR)
    s = num.over_fp8_max(amax)
    return torch.exp2(torch.ceil(torch.log2(s))) if ue8m0 else s


def token_scales(y: torch.Tensor) -> torch.Tensor:
    """vLLM's per-token scales of FP32 rows [n, d]: max(amax / 448, 1 / (448 * 512))."""
    return num.over_fp8_max(y.abs().amax(-1, keepdim=True)).clamp_min(num.TOKEN_SCALE_FLOOR)


def divided(y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 of y / scale (true division; scales per row, or per row and 128-group)."""
    if scales.shape[-1] > 1:
        scales = scales.repeat_interleave(G, -1)
    return (y / scales).clamp(-num.FP8_MAX, num.FP8_MAX).to(FP8)


def times_inverse(y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 of y x (1 / scale): vLLM's static per-tensor quantization."""
    inverse = torch.ones_like(scales) / scales
    return (y * inverse).clamp(-num.FP8_MAX, num.FP8_MAX).to(FP8)


def quantize_rows_standin(x, blocks, group, ue8m0, act):
    """kernels/quantize.py `quantize_rows`: the listed rows, per group or per token."""
    reason = _rows_reason(x, group, act)
    if reason is not None:
        raise ValueError(f"quantize_rows: {reason}")
    d = x.shape[1] // 2 if act else x.shape[1]
    q = _garbage_fp8(x.shape[0], d)
    scales = torch.full((x.shape[0], 1 if group is None else d // group), float("nan"))
    ids, _ = _listed(blocks, x.shape[0])
    y = silu_mul(x[ids]) if act else x[ids].float()
    s = token_scales(y) if group is None else group_scales(y, ue8m0)
    q[ids], scales[ids] = divided(y, s), s
    kind = "token" if group is None else "group"
    rec.quants.append(
        {"kind": kind, "group": group, "ue8m0": ue8m0, "act": act, "x": x, "rows": ids.numel()}
    )
    return q, scales


def tensor_quant_standin(x, blocks, rows_per_expert, per_expert, act, static_scale=None):
    """kernels/quantize.py `tensor_quant`: one scale per expert or over every listed row
    (NaN counting as zero, an infinity kept), or the static one."""
    reason = _rows_reason(x, None, act)
    if reason is not None:
        raise ValueError(f"tensor_quant: {reason}")
    d = x.shape[1] // 2 if act else x.shape[1]
    q = _garbage_fp8(x.shape[0], d)
    scales = torch.full((x.shape[0], 1), float("nan"))
    ids, owners = _listed(blocks, x.shape[0])
    y = silu_mul(x[ids]) if act else x[ids].float()
    if static_scale is not None:
        assert static_scale.numel() == 1 and static_scale.dtype == torch.float32
        s = static_scale.reshape(1, 1).expand(ids.numel(), 1)
        kind = "static"
    else:
        slots = owners if per_expert else torch.zeros_like(owners)
        row_max = y.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax(-1)
        amax = torch.zeros(x.shape[0] // rows_per_expert)
        amax = amax.scatter_reduce(0, slots, row_max, "amax")
        s = num.tensor_scale(amax)[slots][:, None]
        kind = "per-expert" if per_expert else "one"
    q[ids], scales[ids] = times_inverse(y, s), s
    rec.quants.append(
        {"kind": kind, "act": act, "x": x, "rows": ids.numel(), "static": static_scale}
    )
    return q, scales


def silu_and_mul_standin(out, x, blocks):
    """kernels/activation.py `silu_and_mul`: the listed rows; the others come back NaN."""
    reason = act_kernel.buffers_reason(out, x)
    if reason is not None:
        raise ValueError(f"silu_and_mul: {reason}")
    ids, _ = _listed(blocks, x.shape[0])
    y = silu_mul(x[ids]).to(out.dtype)
    out.fill_(float("nan"))
    out[ids] = y
    rec.fused_acts += 1


def swiglu_oai(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """vLLM's `swigluoai` of rows [n, 2d] in FP32: gate x[2j], up x[2j + 1] (interleaved),
    gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha *
    gate); vLLM's masked batched activation fixes alpha 1.702 and limit 7.0."""
    x = x if x.dtype == torch.float64 else x.float()
    gate, up = x[..., ::2].clamp(max=limit), x[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def swiglu_oai_standin(out, x, blocks, alpha, limit):
    """kernels/activation.py `swiglu_oai`: the listed rows, FP32, rounded once; the others
    come back NaN."""
    reason = act_kernel.buffers_reason(out, x)
    if reason is not None:
        raise ValueError(f"swiglu_oai: {reason}")
    ids, _ = _listed(blocks, x.shape[0])
    y = swiglu_oai(x[ids], alpha, limit).to(out.dtype)
    out.fill_(float("nan"))
    out[ids] = y
    rec.swiglu_oai.append({"alpha": alpha, "limit": limit, "rows": ids.numel()})


def masked_activation(activation, x: torch.Tensor, config) -> torch.Tensor:
    """What vLLM's masked activation computes for rows [n, 2d] (FP32 in, FP32 out)."""
    if activation == MoEActivation.SWIGLUOAI:  # whatever the config (activation.py l.267)
        return swiglu_oai(x)
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if activation == MoEActivation.SILU:
        if config.clamp_limit is not None:
            gate = gate.clamp(max=config.clamp_limit)
            up = up.clamp(-config.clamp_limit, config.clamp_limit)
        return F.silu(gate) * up
    assert activation == MoEActivation.GELU, activation
    return F.gelu(gate) * up


def apply_moe_activation_standin(
    activation,
    output,
    input,
    *,
    activation_config=None,
    topk_ids=None,
    expert_map=None,
    valid_token_counts=None,
):
    """vLLM's `apply_moe_activation` as the batched experts call it: per expert, the rows
    below its count ([E, T, 2d] -> [E, T, d]); the other rows come back NaN."""
    assert valid_token_counts is not None and valid_token_counts.dtype == torch.int32
    assert input.dim() == output.dim() == 3 and input.is_contiguous() and output.is_contiguous()
    assert input.shape[:-1] == output.shape[:-1] and output.shape[-1] * 2 == input.shape[-1]
    assert valid_token_counts.numel() == input.shape[0] and input.dtype == output.dtype
    rec.masked.append({"activation": activation, "config": activation_config})
    output.fill_(float("nan"))
    for e, n in enumerate(valid_token_counts.tolist()):
        output[e, :n] = masked_activation(activation, input[e, :n].float(), activation_config).to(
            output.dtype
        )
    return output


def _strided(t: torch.Tensor, shape: tuple, strides: tuple) -> torch.Tensor:
    return t.as_strided(shape, strides)


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
    """vLLM 0.33.0's `invoke_fused_moe_triton_kernel` over a block list, top_k 1."""
    # What the launcher asserts.
    assert topk_weights is not None or not mul_routed_weight
    assert topk_weights is None or topk_weights.stride(1) == 1
    assert sorted_token_ids is None or sorted_token_ids.stride(0) == 1
    if use_fp8_w8a8 or use_int8_w8a8:
        assert B_scale is not None
        assert block_shape is None or -(-B.size(-2) // block_shape[0]) == B_scale.size(-2)
        assert block_shape is None or -(-B.size(-1) // block_shape[1]) == B_scale.size(-1)
    elif use_int8_w8a16 or use_int4_w4a16:
        assert B_scale is not None
        assert block_shape is None or block_shape[0] == 0
    else:
        assert A_scale is None and B_scale is None
    # What this stand-in emulates (the received rows' calls), and tl.dot's operand rule.
    assert sorted_token_ids is not None and sorted_token_ids.dtype == torch.int32
    assert top_k == 1 and not mul_routed_weight
    assert B_bias is None or (B_bias.dim() == 2 and tuple(B_bias.shape) == (B.shape[0], B.shape[1]))
    assert not (use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16)
    assert A.dim() == 2 and B.dim() == 3 and C.dim() == 3 and A.shape[1] == B.shape[2]
    assert A.dtype == B.dtype, (A.dtype, B.dtype)
    assert A.dtype in (FP8, torch.bfloat16, torch.float16) and (A.dtype == FP8) == use_fp8_w8a8
    # The accumulator is cast to compute_type, then stored as C's type: the 16-bit GEMMs
    # compute in A's type; E4M3 ones in BF16 (vLLM's batched experts' choice for FP8).
    compute = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}[compute_type]
    assert compute == (torch.bfloat16 if A.dtype == FP8 else A.dtype)
    if A_scale is not None and A_scale.ndim == 0:
        A_scale = A_scale.reshape(1)
    e, n, k = B.shape
    m = A.size(0)
    bm = config["BLOCK_SIZE_M"]
    em = sorted_token_ids.size(0)
    if m < bm:
        em = min(em, m * top_k * bm)
    launched = -(-em // bm)
    out = _strided(C, (m, n), (C.stride(1), C.stride(2)))  # stride_cm, stride_cn
    if use_fp8_w8a8:
        assert A_scale is not None and A_scale.dtype == B_scale.dtype == torch.float32
        s_am = A_scale.stride(0) if A_scale.ndim == 2 else 0
        s_ak = A_scale.stride(1) if A_scale.ndim == 2 else 0
        s_be = B_scale.stride(0)
        s_bk = B_scale.stride(2) if B_scale.ndim == 3 else 0
        s_bn = B_scale.stride(1) if B_scale.ndim >= 2 and B_scale.size(1) > 1 else 0
    weights: dict[int, torch.Tensor] = {}  # each expert's B as the kernel scales it, FP64
    listed = []
    for b in range(launched):
        if b * bm >= int(num_tokens_post_padded):
            break
        ids = sorted_token_ids[b * bm : (b + 1) * bm].long()
        ids = ids[ids < m * top_k]
        ex = int(expert_ids[b])
        if ex == -1:
            out[ids] = 0
            continue
        listed.append(ids)
        if ids.numel() == 0:
            continue
        a = A[ids].double()
        if ex not in weights:
            w = B[ex].double()
            if use_fp8_w8a8 and block_shape is not None:
                gn, gk = block_shape
                b_s = _strided(B_scale, (e, -(-n // gn), -(-k // gk)), (s_be, s_bn, s_bk))[ex]
                w = w * b_s.double().repeat_interleave(gn, 0)[:n].repeat_interleave(gk, 1)[:, :k]
            elif use_fp8_w8a8 and per_channel_quant:
                w = w * _strided(B_scale, (e, n), (s_be, s_bn))[ex].double()[:, None]
            elif use_fp8_w8a8:  # tensor-wise: B's scale at the expert's element offset
                w = w * _strided(B_scale, (e,), (1,))[ex].double()
            weights[ex] = w
        if not use_fp8_w8a8:
            pass
        elif block_shape is not None:  # A's scale per row and K group
            gk = block_shape[1]
            a_s = _strided(A_scale, (m, -(-k // gk)), (s_am, s_ak))[ids].double()
            a = a * a_s.repeat_interleave(gk, 1)[:, :k]
        elif per_channel_quant:  # per row
            a = a * _strided(A_scale, (m,), (s_am,))[ids].double()[:, None]
        else:  # tensor-wise: A's first scale
            a = a * A_scale.reshape(-1)[0].double()
        acc = a @ weights[ex].T
        if B_bias is not None:  # after the dequantization, before the cast
            acc = acc + B_bias[ex].double()
        out[ids] = acc.to(compute).to(C.dtype)
    rec.gemms.append(
        {
            "A": A,
            "A_scale": A_scale,
            "B_scale": B_scale,
            "C": C,
            "config": dict(config),
            "blocks": sorted_token_ids.numel() // bm,
            "block_m": bm,
            "per_channel": per_channel_quant,
            "block_shape": block_shape,
            "listed": torch.cat(listed) if listed else torch.zeros(0, dtype=torch.long),
            "bias": B_bias,
        }
    )


class CaptureSwitch:
    """What `_is_capturing_or_compiling` answers (inside a CUDA graph or torch.compile)."""

    def __init__(self) -> None:
        self.on = False

    def __call__(self) -> bool:
        return self.on


@pytest.fixture(autouse=True)
def standins(monkeypatch, fake):
    """The stand-ins above in place of what needs a GPU; the fake transport installed."""
    switch = CaptureSwitch()
    monkeypatch.setattr(received_rows, "invoke_fused_moe_triton_kernel", fused_moe_kernel_standin)
    monkeypatch.setattr(received_rows, "_is_capturing_or_compiling", switch)
    monkeypatch.setattr(quantize, "quantize_rows", quantize_rows_standin)
    monkeypatch.setattr(quantize, "tensor_quant", tensor_quant_standin)
    monkeypatch.setattr(act_kernel, "silu_and_mul", silu_and_mul_standin)
    monkeypatch.setattr(act_kernel, "swiglu_oai", swiglu_oai_standin)
    monkeypatch.setattr(mk, "apply_moe_activation", apply_moe_activation_standin)
    rec.clear()
    return switch


@pytest.fixture
def selection():
    """The patch table's `experts_selection` row applied for the test."""
    with patch_row("experts_selection") as patch:
        yield patch


# ------------------------------------------------------------------ layers and buffers
class Layer(NamedTuple):
    kind: str
    w1: torch.Tensor  # E4M3 (FP8 layers) or BF16
    w2: torch.Tensor
    qc: FusedMoEQuantConfig
    d1: torch.Tensor  # what the weights stand for, FP64
    d2: torch.Tensor
    b1: torch.Tensor | None = None  # expert biases [E, N], [E, H] (gpt-oss), FP64
    b2: torch.Tensor | None = None


def _quantize_weight(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [E, n, k] -> (E4M3, FP32 scales as vLLM's quant config holds them, FP64 dequant)."""
    e, n, k = w.shape
    if kind == "block":
        blocks = w.view(e, n // G, G, k // G, G)
        s = blocks.abs().amax(dim=(2, 4)) / num.FP8_MAX
        q = (blocks / s[:, :, None, :, None]).clamp(-num.FP8_MAX, num.FP8_MAX).to(FP8)
        deq = q.double() * s.double()[:, :, None, :, None]
        return q.view(e, n, k), s.contiguous(), deq.view(e, n, k)
    if kind == "channel":
        s = w.abs().amax(dim=2, keepdim=True) / num.FP8_MAX  # [E, n, 1]
        q = (w / s).clamp(-num.FP8_MAX, num.FP8_MAX).to(FP8)
        return q, s.contiguous(), q.double() * s.double()
    s = w.abs().amax(dim=(1, 2)) / num.FP8_MAX  # [E]
    q = (w / s[:, None, None]).clamp(-num.FP8_MAX, num.FP8_MAX).to(FP8)
    return q, s.contiguous(), q.double() * s.double()[:, None, None]


def make_layer(kind: str, seed: int, biased: bool = False) -> Layer:
    """The weights of one MoE layer and vLLM's quant config for `kind` ("bf16" or one of
    FP8_SCHEMES, the received-rows scheme table's rows); `biased`: with expert biases as
    gpt-oss has them (BF16), GEMM1's loud enough that SwiGLU-OAI's clamp at 7 bites."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(EXPERTS, N, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    bias = {}
    if biased:
        bias1 = (torch.randn(EXPERTS, N, generator=gen) * 6).bfloat16()
        bias2 = torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16()
        bias = {"w1_bias": bias1, "w2_bias": bias2}
    deq = {f"b{i}": b.double() for i, b in enumerate(bias.values(), 1)}
    if kind == "bf16":
        b1, b2 = w1.bfloat16(), w2.bfloat16()
        qc = biased_moe_quant_config(**bias) if biased else FUSED_MOE_UNQUANTIZED_CONFIG
        return Layer(kind, b1, b2, qc, b1.double(), b2.double(), **deq)
    weights = {"block": "block", "channel": "channel"}.get(kind, "tensor")
    (q1, s1, d1), (q2, s2, d2) = _quantize_weight(w1, weights), _quantize_weight(w2, weights)
    static = kind == "tensor_static"
    qc = fp8_w8a8_moe_quant_config(
        s1,
        s2,
        a1_scale=torch.tensor([STATIC_A1]) if static else None,
        a2_scale=torch.tensor([STATIC_A2]) if static else None,
        per_act_token_quant=kind in ("channel", "tensor_weights_token_activations"),
        per_out_ch_quant=kind == "channel",
        block_shape=[G, G] if kind == "block" else None,
        **bias,
    )
    return Layer(kind, q1, q2, qc, d1, d2, **deq)


def moe_cfg(top_k: int = 2, capacity: int = CAP, **changes):
    cfg = moe_config(
        experts=EXPERTS,
        top_k=top_k,
        hidden=HIDDEN,
        inter=INTER,
        max_num_tokens=capacity,
        backend=LOW_LATENCY,
    )
    return dataclasses.replace(cfg, **changes) if changes else cfg


def received_mask(counts: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.arange(rows)[None, :] < counts[:, None]


def bf16_buffer(counts: list[int], seed: int, rows: int = CAP):
    """An LL receive buffer [E, rows, H] in BF16, rows of very different loudness; rows
    past each count hold NaN (never to be read)."""
    gen = torch.Generator().manual_seed(20_000 + seed)  # not a layer's weights' stream
    loud = 0.25 + 0.75 * torch.rand(EXPERTS, rows, 1, generator=gen)
    x = (torch.randn(EXPERTS, rows, HIDDEN, generator=gen) * loud).bfloat16()
    c = torch.tensor(counts, dtype=torch.int32)
    x[~received_mask(c, rows)] = float("nan")
    return x, c


def fp8_arrivals(kind: str, x: torch.Tensor, counts: torch.Tensor, layout: str = "rows"):
    """E4M3 rows and scales as they arrive: the FP8 wire's (block: [E, rows, H / 128]),
    the LL prepare's after receive (per token [E, rows, 1]; static per tensor: the
    layer's scale), or vLLM's batched prepare's per-expert dynamic scales [E, 1, 1]
    (`layout` "one": a single one). Rows past each count hold NaN."""
    e, rows, h = x.shape
    received = received_mask(counts, rows)
    flat = x.view(-1, h).float().nan_to_num()
    if kind == "block":
        s = group_scales(flat)
        q = divided(flat, s)
    elif kind in ("channel", "tensor_weights_token_activations"):
        s = token_scales(flat)
        q = divided(flat, s)
    elif kind == "tensor_static":
        s = torch.tensor([STATIC_A1])
        q = times_inverse(flat, s.view(1, 1))
    else:
        masked = torch.where(received.view(-1, 1), flat.abs(), torch.zeros_like(flat))
        amax = masked.view(e, rows * h).amax(-1)
        if layout == "one":
            s = num.tensor_scale(amax.amax()).reshape(1)
            per_row = s.view(1, 1).expand(e * rows, 1)
        else:
            s = num.tensor_scale(amax).view(e, 1, 1)
            per_row = s.view(e, 1).expand(e, rows).reshape(-1, 1)
        q = times_inverse(flat, per_row)
    q = q.view(e, rows, h)
    q.view(torch.uint8)[~received] = E4M3_NAN
    if s.dim() == 2 and s.shape[0] == e * rows:  # per row: [E, rows, groups]
        s = s.view(e, rows, -1).clone()
        s[~received] = float("nan")
    return q, s


# ------------------------------------------------------------------ the reference
def vllm_rows(
    layer: Layer,
    hidden: torch.Tensor,
    scales: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    captured: bool = False,
    activation=MoEActivation.SILU,
    config=None,
) -> torch.Tensor:
    """What vLLM's batched experts compute for each received row ([E, rows, H] FP32, NaN
    elsewhere): the arrivals (quantized per the layer's scheme when BF16 arrives) times
    the weights, GEMM1 in BF16, the activation, the intermediate quantized per the scheme
    (a dynamic per-tensor one per expert eagerly, one for all when captured), GEMM2."""
    e, rows, h = hidden.shape
    received = received_mask(counts, rows)
    flat = received.view(-1).nonzero().flatten()
    owner = flat // rows
    kind = layer.kind
    out = torch.full((e, rows, h), float("nan"))
    if flat.numel() == 0:
        return out
    x = hidden.view(-1, h)[flat]
    if kind == "bf16":
        a1 = x.double()
    else:
        if x.dtype == FP8:  # as they arrived
            if scales.dim() == 3 and scales.shape[1] == rows:  # per row
                s = scales.reshape(e * rows, -1)[flat]
            else:  # per expert, or one for all
                s = scales.reshape(-1).float().expand(e).reshape(e)[owner][:, None]
            q = x
        else:
            q, s = _quantize_rows(kind, x.float(), owner, layer.qc.a1_scale, "input", captured)
        a1 = q.double() * (s.double().repeat_interleave(G, 1) if s.shape[1] > 1 else s.double())
    dtype = hidden.dtype if hidden.dtype != FP8 else torch.bfloat16  # the 16-bit type
    h1 = _per_expert(a1, layer.d1, owner, layer.b1).to(dtype)
    if activation == MoEActivation.SILU and (config is None or config.clamp_limit is None):
        y = silu_mul(h1)
    else:
        y = masked_activation(activation, h1.float(), config).to(dtype).float()
    if kind == "bf16":
        a2 = y.to(dtype).double()
    else:
        q2, s2 = _quantize_rows(kind, y, owner, layer.qc.a2_scale, "intermediate", captured)
        a2 = q2.double() * (s2.double().repeat_interleave(G, 1) if s2.shape[1] > 1 else s2.double())
    out.view(-1, h)[flat] = _per_expert(a2, layer.d2, owner, layer.b2).to(dtype).float()
    return out


def _per_expert(a: torch.Tensor, w: torch.Tensor, owner: torch.Tensor, bias=None) -> torch.Tensor:
    """a[r] @ w[owner[r]].T (+ bias[owner[r]]) for each row, FP64."""
    out = torch.empty(a.shape[0], w.shape[1], dtype=torch.float64)
    for e in owner.unique().tolist():
        rows = owner == e
        out[rows] = a[rows] @ w[e].T + (0 if bias is None else bias[e])
    return out


def _quantize_rows(kind, y: torch.Tensor, owner: torch.Tensor, static, which: str, captured):
    """vLLM's quantization of one GEMM's input rows for the layer's scheme: per tensor, the
    layer's static scale, else a dynamic one (over every row for the input; for the
    intermediate per expert in the eager loop, one over the buffer when captured)."""
    if kind == "block":
        s = group_scales(y)
        return divided(y, s), s
    if kind in ("channel", "tensor_weights_token_activations"):
        s = token_scales(y)
        return divided(y, s), s
    if static is not None:
        s = static.float().view(1, 1)
        return times_inverse(y, s), s.expand(y.shape[0], 1)
    row_max = y.abs().nan_to_num(nan=0.0).amax(-1)
    if which == "input" or captured:
        s = num.tensor_scale(row_max.amax()).view(1, 1).expand(y.shape[0], 1)
    else:  # vLLM's eager loop over experts: each expert's own
        amax = torch.zeros(EXPERTS).scatter_reduce(0, owner, row_max, "amax")
        s = num.tensor_scale(amax)[owner][:, None]
    return times_inverse(y, s), s


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def call(experts, hidden, scales, layer: Layer, counts, tokens, *, top_k=2, activation=None):
    """One experts call as vLLM's modular kernel makes it; the output starts NaN (only
    received rows may be written), the workspaces hold loud leftovers."""
    e, rows, h = hidden.shape
    out = torch.full((e, rows, h), float("nan"), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    experts.apply(
        output=out,
        hidden_states=hidden,
        w1=layer.w1,
        w2=layer.w2,
        topk_weights=None,
        topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64),
        activation=activation or experts.moe_config.activation,
        global_num_experts=EXPERTS,
        expert_map=None,
        a1q_scale=scales,
        a2_scale=experts.a2_scale,
        workspace13=(torch.randn(e * rows * max(N, h), generator=gen) * 1e3).bfloat16(),
        workspace2=(torch.randn(e * rows * INTER, generator=gen) * 1e3).bfloat16(),
        expert_tokens_meta=mk.ExpertTokensMetadata(
            expert_num_tokens=counts, expert_num_tokens_cpu=None
        ),
        apply_router_weight_on_input=False,
    )
    return out


def experts_for(layer: Layer, *, quantizes_input=False, sent=None, dispatchers=1, **cfg):
    capacity = cfg.pop("capacity", CAP)
    return ReceivedRowsExperts(
        moe_cfg(capacity=capacity, **cfg),
        layer.qc,
        capacity,
        dispatchers,
        quantizes_input=quantizes_input,
        sent_per_rank=(lambda: sent) if sent is not None else None,
    )


def tile(layer: Layer, received: int, top_k: int = 2) -> dict:
    """vLLM's tile for its fused-MoE kernel at the forward's received tokens."""
    dtype = "fp8_w8a8" if layer.kind != "bf16" else None
    block = [G, G] if layer.kind == "block" else None
    return try_get_optimal_moe_config(
        tuple(layer.w1.shape), tuple(layer.w2.shape), top_k, dtype, received, block_shape=block
    )


# ------------------------------------------------------------------ numerics, direct calls
COUNTS = [
    # (tokens of the forward, received counts)
    pytest.param(1, [0] * EXPERTS, id="no-rows"),
    pytest.param(1, [0, 0, 0, 1, 0, 0, 0, 1], id="decode-1"),
    pytest.param(3, [1, 0, 2, 0, 0, 2, 0, 1], id="decode-3"),
    pytest.param(CAP, [CAP, 0, 1, 7, 0, CAP - 1, 3, 5], id="full-expert-and-empty-ones"),
    pytest.param(4 * CAP, [CAP] * EXPERTS, id="every-row-of-the-buffer"),
]


CASES = [
    pytest.param(kind, arrival, *count.values, id=f"{kind}-{arrival}-{count.id}")
    for kind, arrival in [("bf16", "bf16")] + [(k, a) for a in ("bf16", "fp8") for k in FP8_SCHEMES]
    for count in COUNTS
    if arrival == "bf16" or count.id in ("decode-1", "full-expert-and-empty-ones")
]


@pytest.mark.parametrize(("kind", "arrival", "tokens", "counts"), CASES)
def test_received_rows_compute_what_vllm_s_batched_experts_compute(kind, arrival, tokens, counts):
    """Every scheme row, arriving as BF16 (quantized by the experts) or as E4M3 with the
    scales of its arrival: each received row is what its expert computes, nothing else is
    written, and both GEMMs launch over the blocks the forward's rows can need."""
    layer = make_layer(kind, seed=tokens)
    x, c = bf16_buffer(counts, seed=tokens + 1)
    hidden, scales = (x, None) if arrival == "bf16" else fp8_arrivals(kind, x, c)
    experts = experts_for(layer, quantizes_input=arrival == "bf16" and kind != "bf16")
    out = call(experts, hidden, scales, layer, c, tokens)
    received = received_mask(c, CAP)
    want = vllm_rows(layer, hidden, scales, c)
    assert torch.isnan(out[~received].float()).all()  # nothing else written
    if received.any():
        assert torch.isfinite(out[received].float()).all()
        assert rel(out[received], want[received]) < 1e-3
    # Both GEMMs: vLLM's tile at the forward's size, the blocks its rows can need.
    assert len(rec.gemms) == 2
    forward = min(tokens, EXPERTS * CAP)
    want_tile = tile(layer, forward)
    bm = want_tile["BLOCK_SIZE_M"]
    for gemm in rec.gemms:
        assert gemm["config"] == want_tile
        assert gemm["blocks"] == max_blocks(forward * 2, EXPERTS, CAP, bm)
        assert sorted(gemm["listed"].tolist()) == received.view(-1).nonzero().flatten().tolist()
    if tokens <= 3:  # a decode step: a few blocks, far from the buffer's
        blocks = rec.gemms[0]["blocks"]
        assert blocks <= tokens * 2 and blocks * bm <= EXPERTS * CAP // 4
    # Only received rows were quantized, and only where the arrivals are BF16.
    quantized_input = arrival == "bf16" and kind != "bf16"
    assert [q["x"].shape[1] == HIDDEN for q in rec.quants] == (
        [True] * quantized_input + [False] * (kind != "bf16")
    )


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_a_dynamic_per_tensor_intermediate_scale_is_per_expert_eagerly_and_one_captured(
    standins, captured
):
    """vLLM's batched experts quantize a dynamic per-tensor intermediate with one scale
    per expert in their eager loop and with one over the buffer when captured or
    compiled; the experts ask vLLM's `_is_capturing_or_compiling` on each call. The input
    takes one scale over every received row either way."""
    standins.on = captured
    layer = make_layer("tensor_dynamic", seed=3)
    counts = [3, 0, 1, 0, 0, 2, 0, 5]
    x, c = bf16_buffer(counts, seed=3)
    x[5] *= 8  # one loud expert: its scale differs from the others'
    out = call(experts_for(layer, quantizes_input=True), x, None, layer, c, 4)
    received = received_mask(c, CAP)
    want = vllm_rows(layer, x, None, c, captured=captured)
    assert rel(out[received], want[received]) < 1e-3
    assert [(q["kind"], q["act"]) for q in rec.quants] == [
        ("one", False),
        ("one" if captured else "per-expert", True),
    ]
    a2_scale = rec.gemms[1]["A_scale"].view(EXPERTS, CAP)
    per_expert = {e: set(a2_scale[e, : counts[e]].tolist()) for e in range(EXPERTS) if counts[e]}
    assert all(len(s) == 1 for s in per_expert.values())
    assert len(set().union(*per_expert.values())) == (1 if captured else len(per_expert))
    # and the input's one scale over every received row, whatever the capture
    a1_scale = rec.gemms[0]["A_scale"].view(EXPERTS, CAP)[received]
    assert len(set(a1_scale.tolist())) == 1


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("static", ["a1", "a2"])
def test_a_per_tensor_layer_with_one_static_scale_takes_the_other_dynamic(
    standins, static, captured
):
    """A checkpoint with a static scale for one GEMM only: that GEMM's input gets it, the
    other's a dynamic scale, as vLLM's batched experts give them."""
    standins.on = captured
    base = make_layer("tensor_static", seed=18)
    scale = torch.tensor([STATIC_A1 if static == "a1" else STATIC_A2])
    qc = fp8_w8a8_moe_quant_config(
        base.qc.w1_scale,
        base.qc.w2_scale,
        a1_scale=scale if static == "a1" else None,
        a2_scale=scale if static == "a2" else None,
    )
    layer = base._replace(qc=qc)
    counts = [3, 0, 1, 0, 0, 2, 0, 5]
    x, c = bf16_buffer(counts, seed=18)
    x[5] *= 4
    out = call(experts_for(layer, quantizes_input=True), x, None, layer, c, 4)
    received = received_mask(c, CAP)
    want = vllm_rows(layer, x, None, c, captured=captured)
    assert rel(out[received], want[received]) < 1e-3
    dynamic = "one" if captured else "per-expert"
    assert [q["kind"] for q in rec.quants] == (
        ["static", dynamic] if static == "a1" else ["one", "static"]
    )


@pytest.mark.parametrize("layout", ["per-expert", "one"])
def test_per_tensor_fp8_arrivals_are_read_with_their_expert_s_scale(layout):
    """vLLM's batched prepare hands a dynamic per-tensor layer one scale per expert
    ([E, 1, 1]) or one for all: each row is read with its own expert's."""
    layer = make_layer("tensor_dynamic", seed=7)
    counts = [2, 0, 3, 1, 0, 0, 4, 1]
    x, c = bf16_buffer(counts, seed=7)
    x[2] *= 8
    q, s = fp8_arrivals("tensor_dynamic", x, c, layout)
    if layout == "per-expert":
        assert len(set(s.flatten()[c > 0].tolist())) > 1
    out = call(experts_for(layer), q, s, layer, c, 6)
    received = received_mask(c, CAP)
    assert rel(out[received], vllm_rows(layer, q, s, c)[received]) < 1e-3
    assert rec.quants[0]["kind"] == "per-expert"  # the intermediate only


def test_fp8_wire_arrivals_are_read_in_place():
    """The FP8 wire's E4M3 rows and row-major scales reach GEMM1 as they are: no copy,
    [E * rows, H / 128] views."""
    layer = make_layer("block", seed=4)
    counts = [3, 0, 1, 0, 0, 2, 0, 2]
    x, c = bf16_buffer(counts, seed=4)
    q, s = fp8_arrivals("block", x, c)
    call(experts_for(layer), q, s, layer, c, 4)
    g1, g2 = rec.gemms
    assert g1["A"].data_ptr() == q.data_ptr() and g1["A_scale"].data_ptr() == s.data_ptr()
    assert g1["A_scale"].shape == (EXPERTS * CAP, HIDDEN // G)
    assert g1["B_scale"] is layer.qc.w1_scale and g2["B_scale"] is layer.qc.w2_scale
    assert g1["block_shape"] == g2["block_shape"] == [G, G] and not g1["per_channel"]
    assert [(r["kind"], r["act"], r["ue8m0"]) for r in rec.quants] == [("group", True, False)]


@pytest.mark.parametrize("kind", ["block", "channel"])
def test_vllm_s_e8m0_setting_rounds_group_scales_only(monkeypatch, kind):
    """Where vLLM's DeepGEMM E8M0 setting is on, the group quantizer rounds block
    layers' scales to powers of two (as vLLM's would); per-token scales never."""
    monkeypatch.setattr(received_rows, "_e8m0_scales", lambda: True)
    layer = make_layer(kind, seed=5)
    x, c = bf16_buffer([1, 0, 0, 2, 0, 0, 0, 0], seed=5)
    call(experts_for(layer, quantizes_input=True), x, None, layer, c, 2)
    assert [q["ue8m0"] for q in rec.quants] == [kind == "block"] * 2


@pytest.mark.parametrize(
    ("name", "changes", "activation"),
    [
        ("silu-with-clamp", {"swiglu_limit": 1.5}, MoEActivation.SILU),
        ("gelu", {"activation": MoEActivation.GELU}, MoEActivation.GELU),
    ],
)
@pytest.mark.parametrize("kind", ["bf16", "block", "tensor_dynamic"])
def test_other_activations_run_vllm_s_masked_activation_then_the_quantizer(
    kind, name, changes, activation
):
    """Only plain SiLU-and-mul fuses with the quantization (or runs the wing's
    activation kernel); a clamp from the activation config, or GELU, runs vLLM's masked
    activation over the counts, then the quantizer without `act`."""
    layer = make_layer(kind, seed=6)
    counts = [2, 0, 1, 0, 3, 0, 0, 1]
    x, c = bf16_buffer(counts, seed=6)
    experts = experts_for(layer, quantizes_input=kind != "bf16", **changes)
    out = call(experts, x, None, layer, c, 4, activation=activation)
    received = received_mask(c, CAP)
    want = vllm_rows(layer, x, None, c, activation=activation, config=experts.activation_config)
    assert rel(out[received], want[received]) < 1e-3
    assert [m["activation"] for m in rec.masked] == [activation] and rec.fused_acts == 0
    assert [q["act"] for q in rec.quants] == [False] * (2 if kind != "bf16" else 0)
    if name == "silu-with-clamp":
        assert rec.masked[0]["config"].clamp_limit == 1.5
        plain = vllm_rows(layer, x, None, c)  # the clamp bites here
        assert rel(out[received], plain[received]) > 1e-2


@pytest.mark.parametrize("kind", ["bf16", "block"])
def test_plain_silu_runs_the_wing_s_activation(kind):
    layer = make_layer(kind, seed=8)
    x, c = bf16_buffer([1, 1, 0, 0, 0, 0, 0, 0], seed=8)
    call(experts_for(layer, quantizes_input=kind != "bf16"), x, None, layer, c, 1)
    assert rec.masked == []
    if kind == "bf16":
        assert rec.fused_acts == 1
    else:  # fused with the intermediate's quantization
        assert rec.fused_acts == 0 and rec.quants[-1]["act"] is True


# ------------------------------------------------------------------ gpt-oss: biases, SwiGLU-OAI
SWIGLU = MoEActivation.SWIGLUOAI
SWIGLUOAI_UNINTERLEAVE = MoEActivation.SWIGLUOAI_UNINTERLEAVE
GPT_OSS_CASES = [
    pytest.param(kind, act, arrival, id=f"{kind}-{arrival}-{act.value}")
    for kind, arrival in [("bf16", "bf16"), ("block", "bf16"), ("block", "fp8")]
    + [(k, "bf16") for k in FP8_SCHEMES[1:]]
    for act in (SWIGLU, MoEActivation.SILU)
]


@pytest.mark.parametrize(("kind", "activation", "arrival"), GPT_OSS_CASES)
def test_expert_biases_and_swiglu_oai_compute_what_vllm_computes(
    monkeypatch, kind, activation, arrival
):
    """A gpt-oss layer (expert biases; vLLM's `swigluoai`: interleaved gate/up, clamped at
    7, alpha 1.702) in every scheme row: each received row is its expert's (x @ w1.T + b1,
    the activation, @ w2.T + b2), nothing else is written, the wing's kernel runs the
    SwiGLU over the received rows only, and biases and clamp both change the numbers."""
    layer = make_layer(kind, seed=31, biased=True)
    counts = [2, 0, 1, 0, 3, 0, CAP, 1]
    x, c = bf16_buffer(counts, seed=31)
    hidden, scales = (x, None) if arrival == "bf16" else fp8_arrivals(kind, x, c)
    experts = experts_for(
        layer, quantizes_input=kind != "bf16" and arrival == "bf16", activation=activation
    )
    out = call(experts, hidden, scales, layer, c, CAP + 7, activation=activation)
    received = received_mask(c, CAP)
    config = experts.activation_config
    want = vllm_rows(layer, hidden, scales, c, activation=activation, config=config)
    assert torch.isnan(out[~received].float()).all()  # nothing else written
    assert torch.isfinite(out[received].float()).all()
    assert rel(out[received], want[received]) < 1e-3
    assert [g["bias"] is layer.qc.w1_bias for g in rec.gemms[:1]] == [True]
    assert [g["bias"] is layer.qc.w2_bias for g in rec.gemms[1:]] == [True]
    assert rec.masked == []
    if activation == SWIGLU:
        assert [(a["alpha"], a["limit"], a["rows"]) for a in rec.swiglu_oai] == [
            (1.702, 7.0, int(c.sum()))
        ]
        quantized = (kind != "bf16") * (1 + (arrival == "bf16"))  # the input, the intermediate
        assert [q["act"] for q in rec.quants] == [False] * quantized
    # Each piece bites here: without either bias, or without the clamp, the rows differ.
    for name, other in (
        ("no w1 bias", layer._replace(b1=None)),
        ("no w2 bias", layer._replace(b2=None)),
    ):
        unbiased = vllm_rows(other, hidden, scales, c, activation=activation, config=config)
        assert rel(out[received], unbiased[received]) > 1e-2, name
    if activation == SWIGLU:  # vLLM's SwiGLU without its clamp: other rows
        clamped = swiglu_oai
        monkeypatch.setitem(globals(), "swiglu_oai", lambda y: clamped(y, limit=float("inf")))
        unclamped = vllm_rows(layer, hidden, scales, c, activation=activation, config=config)
        assert rel(out[received], unclamped[received]) > 1e-2


@pytest.mark.parametrize("activation", [SWIGLU, MoEActivation.SILU])
def test_padding_rows_with_biases_stay_finite_and_unlisted_rows_are_untouched(activation):
    """Zero rows (a padded round's) map to the biases' outputs, finite: the combine's zero
    weight drops them; experts without rows write nothing."""
    layer = make_layer("bf16", seed=33, biased=True)
    x, c = bf16_buffer([3, 0, 0, 0, 0, 0, 0, 1], seed=33)
    x[0, :3] = 0
    experts = experts_for(layer, activation=activation)
    out = call(experts, x, None, layer, c, 4, activation=activation)
    received = received_mask(c, CAP)
    want = vllm_rows(layer, x, None, c, activation=activation, config=experts.activation_config)
    assert torch.isfinite(out[received].float()).all() and out[0, :3].abs().amax() > 0
    assert rel(out[received], want[received]) < 1e-3
    assert torch.isnan(out[~received].float()).all()


def test_swiglu_oai_is_decided_once_with_vllm_s_constants():
    """vLLM 0.33.0's batched experts run `swigluoai` at alpha 1.702, limit 7.0 whatever the
    activation config holds (its masked activation fixes them); the layer decides the
    kernel at construction."""
    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig

    from vllm_flashinfer_ep.experts import activations

    for config in (ApplyMoEActivationConfig(), ApplyMoEActivationConfig(clamp_limit=3.0)):
        row = activations.for_layer(SWIGLU, config)
        assert (row.kind, row.alpha, row.limit) == (activations.Kind.SWIGLU_OAI, 1.702, 7.0)
    assert activations.for_layer("swigluoai", None).kind is activations.Kind.SWIGLU_OAI
    assert activations.for_layer(MoEActivation.SILU, ApplyMoEActivationConfig()).kind is (
        activations.Kind.SILU
    )
    # the unmasked op's defaults are the same constants
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    defaults = inspect.signature(SwigluOAIAndMul.__init__).parameters
    assert (defaults["alpha"].default, defaults["limit"].default) == (1.702, 7.0)
    for act in (SWIGLUOAI_UNINTERLEAVE, MoEActivation.GELU):
        assert activations.for_layer(act, ApplyMoEActivationConfig(clamp_limit=7.0)).kind is (
            activations.Kind.VLLM_MASKED
        )
    experts = experts_for(make_layer("bf16", 0, biased=True), activation=SWIGLU)
    assert experts._row_activation.kind is activations.Kind.SWIGLU_OAI
    assert not experts._fused_activation


def test_a_float16_layer_computes_in_float16():
    """16-bit GEMMs run in the activations' type (--dtype float16 models too)."""
    bf16 = make_layer("bf16", seed=16)
    layer = bf16._replace(w1=bf16.w1.half(), w2=bf16.w2.half())
    layer = layer._replace(d1=layer.w1.double(), d2=layer.w2.double())
    x, c = bf16_buffer([2, 0, 1, 0, 0, 0, 3, 0], seed=16)
    x = x.half()
    experts = experts_for(layer, in_dtype=torch.float16)
    out = torch.full_like(x, float("nan"))
    ws13 = torch.empty(EXPERTS * CAP * max(N, HIDDEN), dtype=torch.float16)
    ws2 = torch.empty(EXPERTS * CAP * INTER, dtype=torch.float16)
    experts.apply(
        out,
        x,
        layer.w1,
        layer.w2,
        None,
        torch.zeros(3, 2, dtype=torch.int64),
        MoEActivation.SILU,
        EXPERTS,
        None,
        None,
        None,
        ws13,
        ws2,
        mk.ExpertTokensMetadata(expert_num_tokens=c, expert_num_tokens_cpu=None),
        False,
    )  # positionally, as vLLM's FallbackExperts calls it
    received = received_mask(c, CAP)
    assert rel(out[received], vllm_rows(layer, x, None, c)[received]) < 1e-3
    assert all(g["C"].dtype == torch.float16 for g in rec.gemms)


# ------------------------------------------------------------------ how many rows
def test_several_senders_without_dp_metadata_are_bounded_by_the_per_rank_capacity(monkeypatch):
    """Two senders, no forward context: each may send the LL capacity, so the list covers
    2 x capacity x top_k rows; the received rows are computed."""
    monkeypatch.setattr(fc, "_forward_context", None)
    layer = make_layer("bf16", seed=9)
    rows = 2 * CAP
    counts = [3, 0, 0, 0, 0, 0, 0, rows]
    x, c = bf16_buffer(counts, seed=9, rows=rows)
    out = call(experts_for(layer, dispatchers=2), x, None, layer, c, 3)
    received = received_mask(c, rows)
    assert rel(out[received], vllm_rows(layer, x, None, c)[received]) < 1e-3
    g1 = rec.gemms[0]
    forward = 2 * CAP  # both senders at capacity
    assert g1["config"] == tile(layer, forward)
    bm = g1["block_m"]
    assert g1["blocks"] == max_blocks(forward * 2, EXPERTS, rows, bm)


@pytest.mark.parametrize(
    ("sent", "dp", "want_forward"),
    [
        pytest.param(None, [3, 9, 2, 5], 4 * 9, id="dp-metadata-largest"),
        pytest.param(None, [3, 900, 2, 5], 4 * CAP, id="dp-metadata-capped"),
        pytest.param(16, [3, 9, 2, 5], 4 * 16, id="the-round-knows"),
    ],
)
def test_several_senders_read_the_round_or_vllm_s_dp_metadata(monkeypatch, sent, dp, want_forward):
    across = torch.tensor(dp)
    ctx = types.SimpleNamespace(dp_metadata=types.SimpleNamespace(num_tokens_across_dp_cpu=across))
    monkeypatch.setattr(fc, "_forward_context", ctx)
    layer = make_layer("bf16", seed=10)
    rows = 4 * CAP
    x, c = bf16_buffer([5, 0, 0, 1, 0, 0, 0, 2], seed=10, rows=rows)
    call(experts_for(layer, dispatchers=4, sent=sent), x, None, layer, c, 5)
    g1 = rec.gemms[0]
    assert g1["config"] == tile(layer, want_forward)
    assert g1["blocks"] == max_blocks(want_forward * 2, EXPERTS, rows, g1["block_m"])


def test_senders_tokens_reads_the_round_then_this_rank_then_the_dp_metadata(monkeypatch):
    monkeypatch.setattr(fc, "_forward_context", None)
    assert senders_tokens(5, 1, CAP, None) == 5  # one sender: this rank's count
    assert senders_tokens(5, 4, CAP, None) == CAP  # unknown: the capacity per rank
    assert senders_tokens(5, 4, CAP, 16) == 16  # a pooled round: every rank sent 16
    assert senders_tokens(5, 1, CAP, 8) == 8  # padding included, at one sender too
    dp = types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([3, 9, 2, 5]))
    monkeypatch.setattr(fc, "_forward_context", types.SimpleNamespace(dp_metadata=dp))
    assert senders_tokens(5, 4, CAP, None) == 9
    assert senders_tokens(5, 4, 8, None) == 8  # at most the capacity
    assert senders_tokens(5, 4, CAP, 2) == 2
    monkeypatch.setattr(fc, "_forward_context", types.SimpleNamespace(dp_metadata=None))
    assert senders_tokens(5, 4, CAP, None) == CAP


def test_the_launch_follows_the_batch_not_the_buffer():
    """A decode token at the default capacity (256 rows per expert) lists a few blocks of
    the buffer's hundreds."""
    layer = make_layer("bf16", seed=11)
    rows = 256
    x, c = bf16_buffer([1, 0, 0, 0, 0, 0, 1, 0], seed=11, rows=rows)
    call(experts_for(layer, capacity=rows), x, None, layer, c, 1)
    g1 = rec.gemms[0]
    assert g1["blocks"] == 2 and g1["blocks"] * g1["block_m"] < EXPERTS * rows // 16


def test_vllm_s_override_config_sets_the_tile():
    """The tile is vLLM's own lookup: its `override_config` (and tuned tables) win."""
    from vllm.model_executor.layers.fused_moe import override_config

    layer = make_layer("bf16", seed=17)
    x, c = bf16_buffer([1, 0, 0, 0, 0, 0, 1, 0], seed=17)
    mine = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 1}
    with override_config(mine):
        out = call(experts_for(layer), x, None, layer, c, 1)
    assert all(g["config"] == mine and g["block_m"] == 32 for g in rec.gemms)
    received = received_mask(c, CAP)
    assert rel(out[received], vllm_rows(layer, x, None, c)[received]) < 1e-3


# ------------------------------------------------------------------ through vLLM's kernel
def torch_moe(
    x, d1, d2, ids, weights, activation=MoEActivation.SILU, config=None, b1=None, b2=None
):
    """A plain MoE of the dequantized weights (FP64) and expert biases, routing weights
    applied after."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = x[t].double() @ d1[e].T + (0 if b1 is None else b1[e])
            if activation == MoEActivation.SILU and (config is None or config.clamp_limit is None):
                y = F.silu(h[:INTER]) * h[INTER:]
            else:
                y = masked_activation(activation, h, config)
            out[t] += float(weights[t, k]) * (y @ d2[e].T + (0 if b2 is None else b2[e]))
    return out


def ll_kernel(layer: Layer, top_k=2, *, wire=False, sizes=(1, 5, 12), agreed=None, **cfg):
    """vLLM's FusedMoEKernel over the LL prepare/finalize with the experts vLLM's oracle
    builds (its BatchedTritonExperts): the selection makes them the wing's."""
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=top_k,
        sizes=list(sizes),
    )
    agreement = (lambda n: agreed) if agreed is not None else None
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, agreement_fn=agreement, fp8_dispatch=wire)
    vllm_experts = BatchedTritonExperts(
        moe_cfg(top_k, **cfg),
        layer.qc,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    kernel = mk.FusedMoEKernel(pf, vllm_experts)
    assert type(kernel.fused_experts) is ReceivedRowsExperts
    return rt, fleet, kernel


def kernel_apply(kernel, layer, x, ids, weights, activation=MoEActivation.SILU, on_input=False):
    return kernel.apply(
        hidden_states=x,
        w1=layer.w1,
        w2=layer.w2,
        topk_weights=weights,
        topk_ids=ids,
        activation=activation,
        global_num_experts=EXPERTS,
        expert_map=None,
        apply_router_weight_on_input=on_input,
    )


def tokens_for(num_tokens: int, top_k: int, seed: int, scale: float = 0.5):
    gen = torch.Generator().manual_seed(10_000 + seed)  # not a layer's weights' stream
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * scale).bfloat16()
    ids, weights = random_routing(num_tokens, EXPERTS, top_k, CPU, gen)
    return x, ids, weights


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("num_tokens", [1, 12])
def test_a_bf16_layer_through_the_ll_kernel_matches_a_torch_moe(top_k, num_tokens):
    layer = make_layer("bf16", seed=num_tokens + top_k)
    _, _, kernel = ll_kernel(layer, top_k, sizes=[1, 12])
    x, ids, weights = tokens_for(num_tokens, top_k, seed=num_tokens * 3 + top_k)
    out = kernel_apply(kernel, layer, x, ids, weights)
    want = torch_moe(x, layer.d1, layer.d2, ids, weights)
    assert out.dtype == torch.bfloat16 and rel(out, want) < 1e-2
    # both GEMMs over at most the rows this batch can bring, not the buffer
    assert len(rec.gemms) == 2 and rec.fused_acts == 1 and not rec.quants
    for gemm in rec.gemms:
        bm = gemm["block_m"]
        assert gemm["blocks"] == max_blocks(num_tokens * top_k, EXPERTS, CAP, bm)
        assert gemm["blocks"] <= num_tokens * top_k


@pytest.mark.usefixtures("selection")
def test_router_weights_on_the_input_go_through_the_kernel():
    layer = make_layer("bf16", seed=21)
    _, _, kernel = ll_kernel(layer, 1, sizes=[5])
    x, ids, weights = tokens_for(5, 1, seed=21)
    out = kernel_apply(kernel, layer, x, ids, weights, on_input=True)
    scaled = (x.float() * weights.float()).bfloat16()
    want = torch_moe(scaled, layer.d1, layer.d2, ids, torch.ones_like(weights))
    assert rel(out, want) < 1e-2


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("num_tokens", [1, 5, 12])
@pytest.mark.parametrize(
    ("kind", "wire"),
    [("block", True), ("block", False)] + [(k, False) for k in FP8_SCHEMES[1:]],
    ids=lambda v: {True: "fp8-wire", False: "bf16-wire"}.get(v, v) if isinstance(v, bool) else v,
)
def test_an_fp8_layer_through_the_ll_kernel_matches_a_torch_moe(
    monkeypatch, kind, wire, num_tokens
):
    """Each FP8 scheme through vLLM's kernel and the LL prepare/finalize: arriving as
    E4M3 from the FP8 wire (block layers), or in BF16, which the prepare hands over
    unquantized (it never runs the buffer's quantization) and the experts quantize."""

    def no_buffer_quantization(*args):
        raise AssertionError("the prepare quantized a layer whose experts quantize")

    monkeypatch.setattr(receive_quant, "_vllm_quantize", no_buffer_quantization)
    layer = make_layer(kind, seed=num_tokens)
    rt, _, kernel = ll_kernel(layer, wire=wire)
    assert kernel.fused_experts.expects_unquantized_inputs is (not wire)
    x, ids, weights = tokens_for(num_tokens, 2, seed=num_tokens)
    out = kernel_apply(kernel, layer, x, ids, weights)
    want = torch_moe(x, layer.d1, layer.d2, ids, weights)
    # E4M3 activations twice against a BF16 MoE of the same weights (a wrong scale or
    # row is off by O(1)).
    assert torch.isfinite(out.float()).all() and rel(out, want) < 8e-2
    g1 = rec.gemms[0]
    assert g1["A"].dtype == FP8
    if wire:
        assert rt.fp8_wire.dispatches == 1 and len(rec.quants) == 1  # the intermediate
        assert g1["A"].data_ptr() == rt.fp8_wire.tokens.data_ptr()
        assert g1["A_scale"].data_ptr() == rt.fp8_wire.scales.data_ptr()
    else:
        assert rt.fp8_wire is None or rt.fp8_wire.dispatches == 0
        first = rec.quants[0]
        assert first["x"].dtype == torch.bfloat16 and first["x"].shape[1] == HIDDEN
        assert first["rows"] == int((ids >= 0).sum())  # the received rows, not the buffer


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("kind", ["bf16", "block"])
def test_a_padded_round_lists_the_padded_rows_too(kind):
    """One real token padded onto a 64-token pooled handle: 128 rows arrive (the pad rows
    too), far more than one token's top_k. The list covers the round's rows (its
    sent_per_rank), or the real token's rows, listed after the pad rows of lower experts,
    would be dropped."""
    layer = make_layer(kind, seed=12)
    rt, _, kernel = ll_kernel(layer, 2, sizes=[64], agreed=64)
    x, _, weights = tokens_for(1, 2, seed=12)
    ids = torch.tensor([[EXPERTS - 1, EXPERTS - 2]])  # the last experts: listed last
    out = kernel_apply(kernel, layer, x, ids, weights)
    want = torch_moe(x, layer.d1, layer.d2, ids, weights)
    assert rel(out, want) < (1e-2 if kind == "bf16" else 8e-2)
    assert rt.pool.counters.padded_rounds == 1 and rt.round.sent_per_rank is None  # ended
    g1 = rec.gemms[0]
    assert g1["config"] == tile(layer, 64)
    assert g1["blocks"] == max_blocks(64 * 2, EXPERTS, CAP, g1["block_m"])


@pytest.mark.usefixtures("selection")
def test_gelu_through_the_ll_kernel_matches_a_torch_moe():
    layer = make_layer("bf16", seed=13)
    _, _, kernel = ll_kernel(layer, 2, sizes=[5], activation=MoEActivation.GELU)
    x, ids, weights = tokens_for(5, 2, seed=13)
    out = kernel_apply(kernel, layer, x, ids, weights, activation=MoEActivation.GELU)
    want = torch_moe(x, layer.d1, layer.d2, ids, weights, MoEActivation.GELU)
    assert rel(out, want) < 1e-2 and len(rec.masked) == 1 and rec.fused_acts == 0


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize("agreed", [None, 64], ids=["exact", "padded-round"])
def test_a_gpt_oss_layer_through_the_ll_kernel_matches_a_torch_moe(agreed):
    """Expert biases and SwiGLU-OAI through vLLM's kernel and the LL prepare/finalize, as
    vLLM builds it for a BF16 gpt-oss layer (its BatchedTritonExperts, made the wing's);
    a padded round's zero rows get the biases and are dropped by the combine."""
    layer = make_layer("bf16", seed=41, biased=True)
    sizes = [5] if agreed is None else [64]
    rt, _, kernel = ll_kernel(layer, 2, sizes=sizes, agreed=agreed, activation=SWIGLU)
    x, ids, weights = tokens_for(5, 2, seed=41)
    out = kernel_apply(kernel, layer, x, ids, weights, activation=SWIGLU)
    want = torch_moe(x, layer.d1, layer.d2, ids, weights, SWIGLU, b1=layer.b1, b2=layer.b2)
    assert rel(out, want) < 1e-2
    assert len(rec.swiglu_oai) == 1 and rec.masked == [] and rec.fused_acts == 0
    assert all(g["bias"] is not None for g in rec.gemms)
    if agreed is not None:
        assert rt.pool.counters.padded_rounds == 1 and rec.swiglu_oai[0]["rows"] == 64 * 2
    unbiased = torch_moe(x, layer.d1, layer.d2, ids, weights, SWIGLU)
    assert rel(out, unbiased) > 1e-2


# ------------------------------------------------------------------ what the prepare asks
@pytest.mark.parametrize("kind", ["bf16", *FP8_SCHEMES])
@pytest.mark.parametrize("wire", [True, False], ids=["fp8-wire", "bf16-wire"])
def test_expects_unquantized_inputs_exactly_for_fp8_layers_off_the_fp8_wire(kind, wire):
    """vLLM's modular kernel hands `expects_unquantized_inputs` to the prepare as
    `defer_input_quant`: True makes the LL prepare send BF16 and skip its quantization.
    Only FP8 layers whose activations do not come in FP8 take it."""
    layer = make_layer(kind, seed=0)

    class VllmPick:  # what for_low_latency is handed: vLLM's experts
        moe_config = moe_cfg()
        quant_config = layer.qc
        max_num_tokens = CAP
        num_dispatchers = 1

    experts = ReceivedRowsExperts.in_place_of(
        VllmPick, fp8_wire=wire, sent_per_rank=lambda: None, options=None
    )
    assert experts.expects_unquantized_inputs is (kind != "bf16" and not wire)
    # a BF16 layer never quantizes, whatever it is told
    bf16 = experts_for(make_layer("bf16", 0), quantizes_input=True)
    assert bf16.expects_unquantized_inputs is False


@pytest.mark.usefixtures("selection")
def test_the_prepare_of_an_fp8_layer_off_the_wire_hands_bf16_and_never_quantizes(monkeypatch):
    def no_buffer_quantization(*args):
        raise AssertionError("the prepare quantized")

    monkeypatch.setattr(receive_quant, "_vllm_quantize", no_buffer_quantization)
    layer = make_layer("channel", seed=14)
    rt, _, kernel = ll_kernel(layer)
    pf = kernel.prepare_finalize
    x, ids, weights = tokens_for(5, 2, seed=14)
    defer = kernel.fused_experts.expects_unquantized_inputs
    a1, scales, meta, _, _ = pf.prepare(x, weights, ids, EXPERTS, None, False, layer.qc, defer)
    rt.round.end()
    assert defer and a1.dtype == torch.bfloat16 and scales is None
    assert int(meta.expert_num_tokens.sum()) == 10


# ------------------------------------------------------------------ refused at construction
def _refused(case: str):
    """(moe config changes, quant config) of a layer the received rows cannot run."""
    block = make_layer("block", 0).qc
    tensor = make_layer("tensor_dynamic", 0).qc
    channel = make_layer("channel", 0).qc
    if case == "bias-of-every-expert":  # a global [E, N] bias on an EP rank of 4 experts
        bias1, bias2 = torch.zeros(EXPERTS, N), torch.zeros(EXPERTS, HIDDEN)
        return {"num_local_experts": EXPERTS // 2}, biased_moe_quant_config(
            bias1.bfloat16(), bias2.bfloat16()
        )
    if case == "fp8-bias-one-row":
        return {}, fp8_w8a8_moe_quant_config(
            block.w1_scale,
            block.w2_scale,
            block_shape=[G, G],
            w1_bias=torch.zeros(EXPERTS, N),
            w2_bias=torch.zeros(HIDDEN),
        )
    if case == "static-scale-per-expert":
        per_expert = torch.full((EXPERTS,), STATIC_A1)
        return {}, fp8_w8a8_moe_quant_config(
            tensor.w1_scale, tensor.w2_scale, a1_scale=per_expert, a2_scale=per_expert
        )
    if case == "fp32-activations":
        return {"in_dtype": torch.float32}, FUSED_MOE_UNQUANTIZED_CONFIG
    if case == "channel-weights-tensor-activations":
        return {}, fp8_w8a8_moe_quant_config(
            channel.w1_scale, channel.w2_scale, per_out_ch_quant=True
        )
    if case == "block-128x64":
        return {}, fp8_w8a8_moe_quant_config(
            torch.ones(EXPERTS, N // G, HIDDEN // 64),
            torch.ones(EXPERTS, HIDDEN // G, INTER // 64),
            block_shape=[G, 64],
        )
    raise ValueError(case)


REFUSALS = [
    ("bias-of-every-expert", "w1_bias as [local experts (4), N]"),
    ("fp8-bias-one-row", "w2_bias as [local experts (8), N]"),
    ("static-scale-per-expert", "one static activation scale per layer"),
    ("fp32-activations", "--dtype bfloat16"),
    ("channel-weights-tensor-activations", "--all2all-backend"),
    ("block-128x64", "--all2all-backend"),
]


@pytest.mark.parametrize(("case", "says"), REFUSALS, ids=[c for c, _ in REFUSALS])
def test_what_the_received_rows_cannot_run_is_refused_at_construction(case, says):
    changes, qc = _refused(case)
    with pytest.raises(FlashInferEPConfigError) as info:
        ReceivedRowsExperts(moe_cfg(**changes), qc, CAP, 1)
    assert type(info.value) is FlashInferEPConfigError and says in str(info.value)
    assert "\n" not in str(info.value)  # one error, one line


@pytest.mark.parametrize("case", [c for c, _ in REFUSALS])
def test_each_refusal_names_what_to_change(case):
    """A refusal at load is the user's to act on: it names the flag that avoids it."""
    changes, qc = _refused(case)
    with pytest.raises(FlashInferEPConfigError) as info:
        ReceivedRowsExperts(moe_cfg(**changes), qc, CAP, 1)
    assert re.search(r"--[a-z][a-z0-9-]+", str(info.value)), str(info.value)


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize(
    "case", ["bias-of-every-expert", "static-scale-per-expert", "fp32-activations"]
)
def test_vllm_s_kernel_build_raises_the_same_error(case):
    """vLLM builds the kernel at load: the refusal surfaces there, before any round."""
    changes, qc = _refused(case)
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, sizes=[1]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    vllm_experts = BatchedTritonExperts(moe_cfg(**changes), qc, CAP, 1)
    with pytest.raises(FlashInferEPConfigError, match=re.escape(dict(REFUSALS)[case])):
        mk.FusedMoEKernel(pf, vllm_experts)
    assert fleet.calls("dispatch") == []
