"""FP8 MoE layers: BF16 on the wire, quantized after receive (vllm/receive_quant.py), on CPU.

vLLM's quantization kernels (`moe_kernel_quantize_input` -> vllm._C) do not run on this
host; `emulated_quantize` computes the same FP8 values in torch and refuses the inputs
vLLM's kernels refuse (non-2D or non-contiguous input, a static scale that is not one
number, rows not a multiple of the group). The GPU tests run vLLM's own kernels
(tests/kernels/test_vllm_join_gpu.py::test_ll_fp8_*, test_ht_fp8_*). The quant configs
are vLLM's (`fp8_w8a8_moe_quant_config`, `int8_w8a8_moe_quant_config`).
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    fp8_w8a8_moe_quant_config,
    int8_w8a8_moe_quant_config,
)

from tests.fakes.runtime import build_fake_runtime
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm import receive_quant
from vllm_flashinfer_ep.vllm.prepare_finalize import (
    FlashInferEPHighThroughputPrepareAndFinalize,
    FlashInferEPLowLatencyPrepareAndFinalize,
)

FP8 = torch.float8_e4m3fn
FMAX = torch.finfo(FP8).max
HIDDEN, EXPERTS, ROWS = 2048, 4, 16
FLAG = "--all2all-backend flashinfer_ep_low_latency"


def emulated_quantize(x, scale, quant_config):
    """What vLLM's FP8 activation quantization computes, in torch (see module doc)."""
    assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16, (x.shape, x.dtype)
    assert x.shape[0] > 0, "vLLM's per-tensor FP8 kernels launch an empty grid on zero rows"
    xf = x.float()
    if quant_config.block_shape is not None:
        group = quant_config.block_shape[1]
        assert x.shape[1] % group == 0
        xg = xf.view(x.shape[0], -1, group)
        s = (xg.abs().amax(-1) / FMAX).clamp_min(1e-10)
        return (xg / s[..., None]).clamp(-FMAX, FMAX).to(FP8).view_as(x), s
    if scale is not None:
        assert scale.numel() == 1, "a static scale is one number"
        return (xf / scale).clamp(-FMAX, FMAX).to(FP8), scale
    if quant_config.per_act_token_quant:
        s = (xf.abs().amax(-1, keepdim=True) / FMAX).clamp_min(1e-10)
        return (xf / s).clamp(-FMAX, FMAX).to(FP8), s
    s = (xf.abs().amax() / FMAX).reshape(1)
    return (xf / s).clamp(-FMAX, FMAX).to(FP8), s


@pytest.fixture(autouse=True)
def torch_quantize(monkeypatch):
    monkeypatch.setattr(receive_quant, "_vllm_quantize", emulated_quantize)


def _qc(kind: str, a1_scale: float | None = None):
    one = torch.ones(EXPERTS, dtype=torch.float32)
    static = None if a1_scale is None else torch.tensor([a1_scale])
    if kind == "tensor":
        return fp8_w8a8_moe_quant_config(one, one, a1_scale=static)
    if kind == "token":
        return fp8_w8a8_moe_quant_config(one, one, per_act_token_quant=True, per_out_ch_quant=True)
    if kind == "block":
        return fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])
    raise ValueError(kind)


def _buffer(counts: list[int], seed: int, garbage: float | None):
    """An LL receive buffer: rows past each count hold `garbage` (NaN or a large value),
    or leftovers of an earlier batch (random) when None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(EXPERTS, ROWS, HIDDEN, generator=gen).bfloat16()
    received = torch.arange(ROWS)[None, :] < torch.tensor(counts)[:, None]
    if garbage is not None:
        x[~received] = garbage
    return x, torch.tensor(counts, dtype=torch.int32), received


def _received(t: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    return t[received].float()


@pytest.mark.parametrize("garbage", [float("nan"), 1e4, None], ids=["nan", "large", "stale"])
def test_dynamic_tensor_scale_is_taken_over_received_rows_only(garbage):
    x, counts, received = _buffer([3, 0, 16, 1], seed=1, garbage=garbage)
    xq, scales = receive_quant.quantize_expert_buffer(x, counts, _qc("tensor"), defer=False)
    want = x[received].float().abs().max() / FMAX
    assert scales.shape == (EXPERTS, 1, 1)  # what vLLM's batched experts read per expert
    torch.testing.assert_close(scales.flatten(), want.expand(EXPERTS), rtol=0, atol=0)
    alone, _ = emulated_quantize(x[received].contiguous(), None, _qc("tensor"))
    assert torch.equal(_received(xq, received), alone.float())
    assert xq.dtype == FP8 and xq.shape == x.shape


def test_quantized_rows_do_not_depend_on_what_earlier_batches_left():
    counts = [5, 2, 0, 9]
    a, c, received = _buffer(counts, seed=2, garbage=None)
    b = a.clone()
    b[~received] = 300.0  # an earlier, louder batch's rows
    for kind in ("tensor", "token", "block"):
        qa, sa = receive_quant.quantize_expert_buffer(a, c, _qc(kind), defer=False)
        qb, sb = receive_quant.quantize_expert_buffer(b, c, _qc(kind), defer=False)
        assert torch.equal(_received(qa, received), _received(qb, received)), kind
        if kind == "tensor":
            assert torch.equal(sa, sb)
        else:
            assert torch.equal(sa[received], sb[received]), kind


def test_a_checkpoint_s_static_scale_is_used_as_is():
    x, counts, received = _buffer([4, 4, 4, 4], seed=3, garbage=None)
    xq, scales = receive_quant.quantize_expert_buffer(x, counts, _qc("tensor", 0.05), defer=False)
    assert torch.equal(scales.flatten(), torch.full((EXPERTS,), 0.05))
    assert torch.equal(xq.float(), (x.float() / 0.05).clamp(-FMAX, FMAX).to(FP8).float())


@pytest.mark.parametrize("kind,width", [("token", 1), ("block", HIDDEN // 128)])
def test_per_row_scales_keep_the_buffer_layout(kind, width):
    x, counts, received = _buffer([1, 7, 16, 0], seed=4, garbage=float("nan"))
    xq, scales = receive_quant.quantize_expert_buffer(x, counts, _qc(kind), defer=False)
    assert scales.shape == (EXPERTS, ROWS, width)
    alone_q, alone_s = emulated_quantize(x[received].contiguous(), None, _qc(kind))
    assert torch.equal(_received(xq, received), alone_q.float())
    assert torch.equal(scales[received], alone_s)


def test_unquantized_and_deferred_layers_get_bf16():
    x, counts, _ = _buffer([2, 2, 2, 2], seed=5, garbage=None)
    for qc, defer in ((FUSED_MOE_UNQUANTIZED_CONFIG, False), (_qc("tensor"), True)):
        got, scales = receive_quant.quantize_expert_buffer(x, counts, qc, defer)
        assert got is x and scales is None
        got, scales = receive_quant.quantize_received_rows(x[0], qc, defer)
        assert got is x[0] or torch.equal(got, x[0])
        assert scales is None


def test_high_throughput_quantizes_exactly_the_received_rows():
    x = torch.randn(7, HIDDEN).bfloat16()
    xq, scale = receive_quant.quantize_received_rows(x, _qc("tensor"), defer=False)
    assert torch.equal(scale, (x.float().abs().max() / FMAX).reshape(1))
    assert xq.shape == x.shape and xq.dtype == FP8


def test_high_throughput_with_no_rows_received_skips_quantization():
    x = torch.empty(0, HIDDEN, dtype=torch.bfloat16)
    for kind in ("tensor", "token", "block"):
        got, scales = receive_quant.quantize_received_rows(x, _qc(kind), defer=False)
        assert got is x and scales is None  # vLLM's kernel returns before the experts


def test_a_nan_in_one_received_row_leaves_the_others_a_finite_scale():
    x, counts, received = _buffer([4, 4, 0, 2], seed=8, garbage=None)
    x[0, 1, 5] = float("nan")
    _, scales = receive_quant.quantize_expert_buffer(x, counts, _qc("tensor"), defer=False)
    finite = x[received].float().nan_to_num(0.0).abs().max() / FMAX
    torch.testing.assert_close(scales.flatten(), finite.expand(EXPERTS), rtol=0, atol=0)


def test_refusal_names_the_flag_for_what_cannot_be_carried():
    one = torch.ones(EXPERTS)
    assert receive_quant.refusal(None, FLAG) is None
    assert receive_quant.refusal(FUSED_MOE_UNQUANTIZED_CONFIG, FLAG) is None
    for kind in ("tensor", "token", "block"):
        assert receive_quant.refusal(_qc(kind), FLAG) is None
    int8 = receive_quant.refusal(int8_w8a8_moe_quant_config(one, one, None, None), FLAG)
    assert int8 is not None and FLAG in int8 and "int8" in int8
    odd = receive_quant.refusal(fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 64]), FLAG)
    assert odd is not None and "[128, 64]" in odd and "--all2all-backend" in odd


# ------------------------------------------------ through the prepare/finalize
def test_ll_prepare_hands_the_experts_fp8_and_scales(fake):
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=8, top_k=2, sizes=[5])
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, HIDDEN, generator=gen).bfloat16()
    ids, weights = random_routing(5, rt.num_local_experts, 2, torch.device("cpu"), gen)
    a1q, scales, meta, _, _ = pf.prepare(
        x, weights, ids, rt.num_local_experts, None, False, _qc("tensor"), defer_input_quant=False
    )
    assert a1q.dtype == FP8 and a1q.dim() == 3
    torch.testing.assert_close(scales.flatten()[0], x.float().abs().max() / FMAX, rtol=0, atol=0)
    assert int(meta.expert_num_tokens.sum()) == 5 * 2
    pf.finalize(
        torch.empty_like(x), torch.zeros(a1q.shape, dtype=torch.bfloat16), weights, ids, False, None
    )


def test_ht_prepare_hands_the_experts_fp8_and_scales(fake):
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=8, top_k=2, sizes=[]
    )
    pf = FlashInferEPHighThroughputPrepareAndFinalize(rt)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, HIDDEN, generator=gen).bfloat16()
    ids, weights = random_routing(6, rt.num_local_experts, 2, torch.device("cpu"), gen)
    a1q, scales, meta, recv_ids, _ = pf.prepare(
        x, weights, ids, rt.num_local_experts, None, False, _qc("block"), defer_input_quant=False
    )
    assert meta is None and a1q.dtype == FP8 and a1q.shape == (6, HIDDEN)
    assert scales.shape == (6, HIDDEN // 128) and recv_ids.shape == (6, 2)
    rt.round.end()


class _NotTriton:
    def __init__(self, qc):
        self.quant_config = qc


def test_ht_fp8_layers_refuse_experts_other_than_vllm_s_triton():
    with pytest.raises(FlashInferEPConfigError, match="--moe-backend triton"):
        receive_quant.check_ht_experts(_NotTriton(_qc("block")), FLAG)
    receive_quant.check_ht_experts(_NotTriton(FUSED_MOE_UNQUANTIZED_CONFIG), FLAG)
