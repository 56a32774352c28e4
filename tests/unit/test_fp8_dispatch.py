"""FP8 on the LL wire (runtime/fp8_wire.py) on CPU: NCCL-EP's DS_FP8E3M4 dispatch on
FlashInfer's handle, the layers that take it, and the prepare result vLLM's experts get.

The fake nccl.ep (tests/fakes/fake_nccl_ep.py) refuses what nccl_ep.h refuses for the
recipe and quantizes as the H200 measured; the real library runs in
tests/kernels/test_transport_gpu.py::test_fp8_dispatch_*.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    fp8_w8a8_moe_quant_config,
)

from tests.fakes import fake_nccl_ep
from tests.fakes.runtime import build_fake_runtime
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, HandlePoolError
from vllm_flashinfer_ep.runtime import fp8_wire
from vllm_flashinfer_ep.runtime.fp8_wire import Fp8Wire
from vllm_flashinfer_ep.runtime.rounds import LowLatencyRound
from vllm_flashinfer_ep.vllm import receive_quant
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN, EXPERTS, TOP_K, CAP = 2048, 8, 2, 16
FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")


def _layer(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    loud = 1 + 20 * torch.rand(num_tokens, 1, generator=gen)  # rows of very different size
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * loud).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, CPU, gen)
    return x, ids, weights


def _block_qc():
    one = torch.ones(EXPERTS, dtype=torch.float32)
    return fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows = q.shape[:-1]
    return (q.float().view(*rows, -1, 128) * s[..., None]).view(*rows, q.shape[-1])


def _runtime(sizes=(4, 8)):
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, top_k=TOP_K, sizes=sizes
    )
    rt.enable_fp8_wire()
    return rt, fleet


@pytest.mark.parametrize("num_tokens", [1, 5, 8])
def test_fp8_dispatch_carries_every_received_row_within_fp8_error_and_combines(num_tokens):
    rt, _ = _runtime(sizes=(1, 5, 8))  # every count pooled exactly: no padded rows arrive
    x, ids, weights = _layer(num_tokens, seed=num_tokens)
    rnd = LowLatencyRound(rt)
    d = rnd.dispatch(x, ids, weights, fp8=True)
    assert d.expert_x.dtype == FP8 and d.expert_x.shape == (EXPERTS, CAP, HIDDEN)
    assert d.expert_x_scale.shape == (EXPERTS, CAP, HIDDEN // 128)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS).to(torch.int32)
    assert torch.equal(d.expert_num_tokens, counts)
    deq = _dequantized(d.expert_x, d.expert_x_scale)
    for e in torch.nonzero(counts).flatten().tolist():
        got = deq[e, : counts[e]]
        want = x[(ids == e).any(dim=1)].float()
        # rows arrive in any order: compare each arrived row with its nearest sent row
        err = (got[:, None, :] - want[None, :, :]).abs().amax(-1).amin(1)
        assert bool((err <= want.abs().amax(-1).max() * 2 ** -3).all()), e
    # BF16 expert outputs combine as usual after an FP8 dispatch
    scales = torch.rand(EXPERTS, generator=torch.Generator().manual_seed(1)) + 0.5
    out = torch.full_like(x, float("nan"))
    rnd.combine(scale_expert_rows(deq.to(torch.bfloat16), scales), out)
    want = reference_moe(x, ids, weights, scales).float()
    torch.testing.assert_close(out.float(), want, rtol=0.1, atol=0.1 * float(want.abs().max()))
    assert rt.fp8_wire.dispatches == 1


def test_a_padded_fp8_round_pads_with_zeros_and_stays_on_the_pooled_handle():
    rt, fleet = _runtime(sizes=(8,))
    x, ids, weights = _layer(5, seed=3)
    d = LowLatencyRound(rt).dispatch(x, ids, weights, fp8=True)
    assert rt.pool.sent_per_rank == 8 and rt.pool.counters.padded_rounds == 1
    assert int(d.expert_num_tokens.sum()) == 8 * TOP_K  # padded rows arrive too, as zeros
    assert fleet.handles_created == 1


def test_fp8_dispatch_needs_the_runtime_s_wire():
    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, top_k=TOP_K)
    x, ids, weights = _layer(2, seed=1)
    with pytest.raises(FlashInferEPConfigError, match="without an FP8 wire"):
        LowLatencyRound(rt).dispatch(x, ids, weights, fp8=True)


def test_the_recipe_s_hidden_rule_is_refused_before_nccl_ep():
    assert fp8_wire.hidden_reason(7168) is None and fp8_wire.hidden_reason(4096) is None
    with pytest.raises(ValueError, match="multiple of 512"):
        Fp8Wire(2, 16, 3200, CPU)


def test_a_handle_without_flashinfer_s_attributes_is_refused_with_the_version():
    wire = Fp8Wire(2, 16, HIDDEN, CPU)
    with pytest.raises(HandlePoolError, match="0.7.2.post1"):
        wire.dispatch(SimpleNamespace(), torch.zeros(1, HIDDEN, dtype=torch.bfloat16))


def test_the_fake_refuses_what_nccl_ep_refuses():
    """The fake's rules are the header's (a fake that accepted these would hide bugs)."""
    rt, _ = _runtime()
    x, ids, weights = _layer(4, seed=2)
    rt.pool.begin(ids, weights)
    handle, ep, wire = rt.pool._current, fake_nccl_ep, rt.fp8_wire
    counters = ep.LayoutInfo(expert_counters=ep.Tensor(handle._recv_count_t))
    config = ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.DS_FP8E3M4)
    good = ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(wire.scales))
    cases = {
        "inputs.scales must be absent": (ep.DispatchInputs(tokens=ep.Tensor(x), scales=ep.Tensor(wire.scales)), good, counters),
        "outputs.scales is required": (ep.DispatchInputs(tokens=ep.Tensor(x)), ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens)), counters),
        "BF16 tokens": (ep.DispatchInputs(tokens=ep.Tensor(x.float())), good, counters),
        "expert_counters": (ep.DispatchInputs(tokens=ep.Tensor(x)), good, None),
        "outputs.scales must be FP32": (
            ep.DispatchInputs(tokens=ep.Tensor(x)),
            ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(wire.scales[:, :8].contiguous())),
            counters,
        ),
    }
    for message, (inputs, outputs, layout) in cases.items():
        with pytest.raises(fake_nccl_ep.NcclInvalid, match=message):
            handle._handle.dispatch(inputs, outputs, layout_info=layout, config=config, stream=0)
    rt.pool.end()


# --------------------------------------------------------------- which layers
def test_only_block_fp8_layers_with_a_recipe_hidden_take_the_fp8_dispatch(monkeypatch):
    one = torch.ones(EXPERTS, dtype=torch.float32)
    assert receive_quant.fp8_dispatch_reason(_block_qc(), 7168) is None
    assert receive_quant.fp8_dispatch_reason(_block_qc(), 2560) is None  # every LL size is
    assert "multiple of 512" in receive_quant.fp8_dispatch_reason(_block_qc(), 3200)
    assert "block" in receive_quant.fp8_dispatch_reason(fp8_w8a8_moe_quant_config(one, one), 7168)
    per_token = fp8_w8a8_moe_quant_config(one, one, per_act_token_quant=True, per_out_ch_quant=True)
    assert "block" in receive_quant.fp8_dispatch_reason(per_token, 7168)
    assert receive_quant.fp8_dispatch_reason(FUSED_MOE_UNQUANTIZED_CONFIG, 7168) is not None
    assert receive_quant.fp8_dispatch_reason(None, 7168) is not None
    monkeypatch.setenv(envs.FP8_DISPATCH, "0")
    assert envs.FP8_DISPATCH in receive_quant.fp8_dispatch_reason(_block_qc(), 7168)


def test_ll_prepare_hands_the_experts_the_wire_s_fp8_and_scales_without_quantizing(monkeypatch):
    rt, _ = _runtime()
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=True)
    monkeypatch.setattr(receive_quant, "_vllm_quantize", lambda *a: pytest.fail("quantized after receive"))
    x, ids, weights = _layer(5, seed=4)
    a1q, scales, meta, _, _ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc())
    assert a1q is rt.fp8_wire.tokens and scales is rt.fp8_wire.scales
    assert torch.equal(meta.expert_num_tokens, rt.pool._current._recv_count_t)
    out = torch.empty_like(x)
    pf.finalize(out, torch.zeros(EXPERTS, CAP, HIDDEN, dtype=torch.bfloat16), weights, ids, False, None)
    assert rt.fp8_wire.dispatches == 1


def test_experts_that_quantize_themselves_get_bf16(monkeypatch):
    rt, _ = _runtime()
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=True)
    x, ids, weights = _layer(3, seed=5)
    a1, scales, *_ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc(), defer_input_quant=True)
    assert a1.dtype == torch.bfloat16 and scales is None and rt.fp8_wire.dispatches == 0
    pf.finalize(torch.empty_like(x), torch.zeros_like(a1), weights, ids, False, None)


def test_bench_fp8_counts_the_bytes_each_dispatch_moves():
    from vllm_flashinfer_ep.bench.fp8_run import dispatch_bytes

    # hidden 7168: BF16 rows of 14336 bytes; E4M3 rows of 7168 bytes + 56 FP32 scales
    assert dispatch_bytes(1, 8, 7168) == {"bf16": 8 * 14336, "fp8": 8 * (7168 + 224)}
    assert dispatch_bytes(256, 8, 2048)["fp8"] == 256 * 8 * (2048 + 64)


@pytest.mark.parametrize("hidden", [3000, 3072])
def test_bench_fp8_refuses_a_hidden_size_naming_the_flag(hidden):
    from vllm_flashinfer_ep.bench.fp8_run import add_arguments, validate_arguments

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--hidden"):
        validate_arguments(parser.parse_args(["--hidden", str(hidden)]))


def test_a_captured_fp8_round_issues_on_the_capturing_stream(monkeypatch):
    """Under capture FlashInfer's op stream is the capturing one; the FP8 dispatch must use
    it too (issued elsewhere, the graph would replay without dispatching)."""
    from tests.fakes.runtime import install_capture_switch

    switch = install_capture_switch(monkeypatch)
    rt, _ = _runtime(sizes=(4,))
    x, ids, weights = _layer(4, seed=6)
    rnd = LowLatencyRound(rt)
    with switch.capturing():
        d = rnd.dispatch(x, ids, weights, fp8=True)
        rnd.combine(torch.zeros(EXPERTS, CAP, HIDDEN, dtype=torch.bfloat16), torch.empty_like(x))
    assert d.expert_x_scale is not None and rt.fp8_wire.dispatches == 1
