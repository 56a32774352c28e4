"""FP8 on the wire (runtime/fp8_wire.py) on CPU: NCCL-EP's DS_FP8E3M4 dispatch (LL) and
its forward recipe (HT) on FlashInfer's handle, the layers that take them, and the prepare
result vLLM's experts get.

The fake nccl.ep (tests/fakes/fake_nccl_ep.py) refuses what nccl_ep.h refuses for the
recipe and quantizes as the H200 measured; the real library runs in
tests/kernels/test_transport_gpu.py::test_fp8_dispatch_*.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

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
from vllm_flashinfer_ep.runtime.fp8_wire import Fp8Wire, HtFp8Wire
from vllm_flashinfer_ep.vllm import receive_quant
from vllm_flashinfer_ep.vllm.prepare_finalize import (
    FlashInferEPHighThroughputPrepareAndFinalize,
    FlashInferEPLowLatencyPrepareAndFinalize,
)

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
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=sizes,
    )
    rt.enable_fp8_wire()
    return rt, fleet


@pytest.mark.parametrize("num_tokens", [1, 5, 8])
def test_fp8_dispatch_carries_every_received_row_within_fp8_error_and_combines(num_tokens):
    rt, _ = _runtime(sizes=(1, 5, 8))  # every count pooled exactly: no padded rows arrive
    x, ids, weights = _layer(num_tokens, seed=num_tokens)
    rnd = rt.round
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
        assert bool((err <= want.abs().amax(-1).max() * 2**-3).all()), e
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
    d = rt.round.dispatch(x, ids, weights, fp8=True)
    assert rt.round.sent_per_rank == 8 and rt.pool.counters.padded_rounds == 1
    assert int(d.expert_num_tokens.sum()) == 8 * TOP_K  # padded rows arrive too, as zeros
    assert fleet.handles_created == 1


def test_fp8_dispatch_needs_the_runtime_s_wire():
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, top_k=TOP_K
    )
    x, ids, weights = _layer(2, seed=1)
    with pytest.raises(FlashInferEPConfigError, match="without an FP8 wire"):
        rt.round.dispatch(x, ids, weights, fp8=True)


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
    handle, ep, wire = rt.round.planner.plan(x, ids, weights).handle, fake_nccl_ep, rt.fp8_wire
    counters = ep.LayoutInfo(expert_counters=ep.Tensor(handle._recv_count_t))
    config = ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.DS_FP8E3M4)
    good = ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(wire.scales))
    cases = {
        "inputs.scales must be absent": (
            ep.DispatchInputs(tokens=ep.Tensor(x), scales=ep.Tensor(wire.scales)),
            good,
            counters,
        ),
        "outputs.scales is required": (
            ep.DispatchInputs(tokens=ep.Tensor(x)),
            ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens)),
            counters,
        ),
        "BF16 tokens": (ep.DispatchInputs(tokens=ep.Tensor(x.float())), good, counters),
        "expert_counters": (ep.DispatchInputs(tokens=ep.Tensor(x)), good, None),
        "outputs.scales must be FP32": (
            ep.DispatchInputs(tokens=ep.Tensor(x)),
            ep.DispatchOutputs(
                tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(wire.scales[:, :8].contiguous())
            ),
            counters,
        ),
    }
    for message, (inputs, outputs, layout) in cases.items():
        with pytest.raises(fake_nccl_ep.NcclInvalid, match=message):
            handle._handle.dispatch(inputs, outputs, layout_info=layout, config=config, stream=0)


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
    monkeypatch.setattr(
        receive_quant, "_vllm_quantize", lambda *a: pytest.fail("quantized after receive")
    )
    x, ids, weights = _layer(5, seed=4)
    a1q, scales, meta, _, _ = pf.prepare(x, weights, ids, EXPERTS, None, False, _block_qc())
    assert a1q is rt.fp8_wire.tokens and scales is rt.fp8_wire.scales
    assert torch.equal(meta.expert_num_tokens, rt.round.in_flight.handle._recv_count_t)
    out = torch.empty_like(x)
    pf.finalize(
        out, torch.zeros(EXPERTS, CAP, HIDDEN, dtype=torch.bfloat16), weights, ids, False, None
    )
    assert rt.fp8_wire.dispatches == 1


def test_experts_that_quantize_themselves_get_bf16(monkeypatch):
    rt, _ = _runtime()
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=True)
    x, ids, weights = _layer(3, seed=5)
    a1, scales, *_ = pf.prepare(
        x, weights, ids, EXPERTS, None, False, _block_qc(), defer_input_quant=True
    )
    assert a1.dtype == torch.bfloat16 and scales is None and rt.fp8_wire.dispatches == 0
    pf.finalize(torch.empty_like(x), torch.zeros_like(a1), weights, ids, False, None)


def test_bench_fp8_counts_the_bytes_each_dispatch_moves():
    from vllm_flashinfer_ep.bench.fp8_run import dispatch_bytes

    # hidden 7168: BF16 rows of 14336 bytes; E4M3 rows of 7168 bytes + 56 FP32 scales
    assert dispatch_bytes(1, 8, 7168) == {"bf16": 8 * 14336, "fp8": 8 * (7168 + 224)}
    assert dispatch_bytes(256, 8, 2048)["fp8"] == 256 * 8 * (2048 + 64)
    # HT sends a token once per rank holding one of its experts: one row at world 1, at
    # most top_k rows however many ranks
    assert dispatch_bytes(4, 8, 7168, ht_world=1) == {"bf16": 4 * 14336, "fp8": 4 * (7168 + 224)}
    assert dispatch_bytes(4, 8, 7168, ht_world=4)["bf16"] == 4 * 4 * 14336
    assert dispatch_bytes(4, 8, 7168, ht_world=16)["bf16"] == 4 * 8 * 14336


@pytest.mark.parametrize("hidden", [3000, 3072])
def test_bench_fp8_refuses_a_hidden_size_naming_the_flag(hidden):
    from vllm_flashinfer_ep.bench.fp8_run import add_arguments, validate_arguments

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--hidden"):
        validate_arguments(parser.parse_args(["--hidden", str(hidden)]))


def test_bench_fp8_ht_takes_hidden_sizes_outside_the_ll_set_and_prefill_token_counts():
    """HT's forward recipe needs only 16-byte scale rows (hidden % 512), not an LL size."""
    from vllm_flashinfer_ep.bench.fp8_run import add_arguments, modes, validate_arguments

    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "ht", "--hidden", "3072"])
    validate_arguments(args)
    assert args.tokens == [256, 1024, 4096] and modes("ht") == (
        "bf16_quant_eager",
        "fp8_wire_eager",
    )
    with pytest.raises(SystemExit, match="--hidden"):
        validate_arguments(parser.parse_args(["--backend", "ht", "--hidden", "3000"]))
    ll = parser.parse_args([])
    validate_arguments(ll)
    assert ll.tokens == [1, 8, 32, 128, 256] and "fp8_wire" in modes("ll")


def test_a_captured_fp8_round_issues_on_the_capturing_stream(monkeypatch):
    """Under capture FlashInfer's op stream is the capturing one; the FP8 dispatch must use
    it too (issued elsewhere, the graph would replay without dispatching)."""
    from tests.fakes.runtime import install_capture_switch

    switch = install_capture_switch(monkeypatch)
    rt, _ = _runtime(sizes=(4,))
    x, ids, weights = _layer(4, seed=6)
    rnd = rt.round
    with switch.capturing():
        d = rnd.dispatch(x, ids, weights, fp8=True)
        rnd.combine(torch.zeros(EXPERTS, CAP, HIDDEN, dtype=torch.bfloat16), torch.empty_like(x))
    assert d.expert_x_scale is not None and rt.fp8_wire.dispatches == 1


# ------------------------------------------------------------ high throughput
def _ht_runtime(sizes: tuple[int, ...] = ()) -> tuple[Any, Any]:
    rt, fleet = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=sizes,
    )
    rt.enable_fp8_wire()
    return rt, fleet


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("num_tokens,sizes", [(1, ()), (6, ()), (5, (8,)), (16, (4, 16))])
def test_ht_fp8_dispatch_forwards_each_token_s_rows_and_scales_unchanged(num_tokens, sizes):
    """World 1: every token arrives once, its E4M3 row and scales byte for byte as the
    sender quantized them (the forward recipe converts nothing); padded rows (a pooled
    handle above the count) arrive as zeros with weight 0; combine after it matches."""
    rt, _ = _ht_runtime(sizes)
    x, ids, weights = _layer(num_tokens, seed=10 + num_tokens)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, fp8=True)
    sent_q, sent_s = fp8_wire.group_quantize(x)
    size = rt.round.sent_per_rank or num_tokens  # None on a per-forward handle
    assert (
        d.x.dtype == FP8
        and d.x.shape == (size, HIDDEN)
        and d.x_scale.shape == (size, HIDDEN // 128)
    )
    real = d.topk_weights.sum(1) > 0  # padded rows carry weight 0 only
    assert int(real.sum()) == num_tokens
    for row in torch.nonzero(real).flatten().tolist():
        [j] = torch.nonzero((d.x_scale[row] == sent_s).all(1)).flatten().tolist()
        assert torch.equal(_bytes(d.x[row]), _bytes(sent_q[j]))
        assert torch.equal(d.topk_ids[row].sort().values, ids[j].sort().values)
    assert not bool(d.x[~real].float().any()) and not bool(d.x_scale[~real].any())
    scales = torch.rand(EXPERTS, generator=torch.Generator().manual_seed(2)) + 0.5
    from tests.helpers import reduce_received_rows

    deq = _dequantized(d.x, d.x_scale).to(torch.bfloat16)
    reduce_received_rows(deq, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(size))
    out = torch.full_like(x, float("nan"))
    rnd.combine(out)
    want = reference_moe(x, ids, weights, scales).float()
    torch.testing.assert_close(out.float(), want, rtol=0.1, atol=0.1 * float(want.abs().max()))
    assert rt.fp8_wire.dispatches == 1 and rt.pool.counters.padded_rounds == int(size != num_tokens)


def test_ht_fp8_dispatch_crosses_ranks():
    """Two fake ranks: each receives exactly the tokens routed to its experts, with the
    sender's bytes and the routing weights HT's forward pass carries."""
    from tests.fakes.world import run_ranks

    def rank_fn(rank, group):
        rt, _ = build_fake_runtime(
            Algorithm.HIGH_THROUGHPUT,
            hidden=HIDDEN,
            num_experts=EXPERTS,
            capacity=CAP,
            top_k=TOP_K,
            sizes=(),
            rank=rank,
            world_size=2,
            process_group=group,
        )
        rt.enable_fp8_wire()
        everyone = [_layer(4 + r, seed=40 + r) for r in range(2)]
        x, ids, weights = everyone[rank]
        d = rt.round.dispatch(x, ids, weights, fp8=True)
        mine = rank * (EXPERTS // 2)
        want = sum(
            int(((i >= mine) & (i < mine + EXPERTS // 2)).any(1).sum()) for _, i, _ in everyone
        )
        matched = 0
        for row in range(d.x.shape[0]):
            for xs, _, ws in everyone:
                q, s = fp8_wire.group_quantize(xs)
                hits = torch.nonzero((s == d.x_scale[row]).all(1)).flatten().tolist()
                if hits:
                    assert torch.equal(_bytes(q[hits[0]]), _bytes(d.x[row]))
                    here = ~d.remote_slot[row]
                    assert bool(here.any()) and torch.equal(
                        d.topk_weights[row][here], ws[hits[0]][here]
                    )
                    matched += 1
        rt.round.end()
        return d.x.shape[0] == want == matched

    assert run_ranks(2, rank_fn, timeout_s=60) == [True, True]


def test_ht_prepare_hands_the_experts_the_forwarded_fp8_without_quantizing_after_receive(
    monkeypatch,
):
    """The HT prepare quantizes before dispatch with the layer's group quantization
    (vLLM's; its Triton kernel needs a GPU, so the torch one stands in here) and hands the
    experts what arrived; nothing is quantized after receive."""
    monkeypatch.setattr(receive_quant, "group_quantize", fp8_wire.group_quantize)
    monkeypatch.setattr(
        receive_quant, "_vllm_quantize", lambda *a: pytest.fail("quantized after receive")
    )
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=(),
    )
    pf = FlashInferEPHighThroughputPrepareAndFinalize(rt, fp8_dispatch=True)
    assert isinstance(rt.fp8_wire, HtFp8Wire) and rt.fp8_wire.quantize is fp8_wire.group_quantize
    x, ids, weights = _layer(5, seed=8)
    a1q, scales, meta, recv_ids, recv_w = pf.prepare(
        x, weights, ids, EXPERTS, None, False, _block_qc()
    )
    assert meta is None and a1q.dtype == FP8 and a1q.shape == (5, HIDDEN)
    assert scales.shape == (5, HIDDEN // 128) and scales.data_ptr() == rt.fp8_wire.scales.data_ptr()
    assert recv_ids.shape == recv_w.shape == (5, TOP_K)
    assert rt.fp8_wire.dispatches == 1
    rt.round.end()


def test_ht_router_weight_on_input_is_applied_before_quantizing():
    x, ids, _ = _layer(3, seed=9)
    ids = ids[:, :1].contiguous()  # one expert per token (what apply_router_weight_on_input allows)
    w = torch.full((3, 1), 0.5)
    rt2, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=1,
        sizes=(),
    )
    rt2.enable_fp8_wire()
    d = rt2.round.dispatch(x, ids, w, fp8=True, apply_router_weight_on_input=True)
    q, s = fp8_wire.group_quantize(x * 0.5)
    for row in range(3):
        [j] = torch.nonzero((d.x_scale[row] == s).all(1)).flatten().tolist()
        assert torch.equal(_bytes(d.x[row]), _bytes(q[j]))
    assert bool((d.topk_weights == 1).all())
    rt2.round.end()


def test_ht_fp8_wire_refuses_rows_it_cannot_forward():
    rt, _ = _ht_runtime()
    x, ids, weights = _layer(4, seed=3)
    q, s = fp8_wire.group_quantize(x)
    wire = rt.fp8_wire
    groups = HIDDEN // 128
    for bad_x, bad_s, message in [
        (
            x,
            s,
            "rows must be torch.float8_e4m3fn .*got torch.bfloat16",
        ),  # the recipe converts nothing
        (q[:3], s[:3], rf"routes 4 tokens\): rows must be \(4, {HIDDEN}\), got \(3, {HIDDEN}\)"),
        (q, None, "no scales were given"),
        (q, s.to(torch.bfloat16), "scales must be torch.float32, got torch.bfloat16"),
        (q, s[:, :4].contiguous(), rf"scales must be \(4, {groups}\) .*got \(4, 4\)"),
    ]:
        plan = rt.round.planner.plan(bad_x, ids, weights, wire=wire)
        with pytest.raises(HandlePoolError, match=message) as err:
            plan.dispatch(bad_x, bad_s)
        assert "VLLM_FLASHINFER_EP_FP8_DISPATCH=0" in str(err.value)  # how to turn the wire off
        plan.end()
    with pytest.raises(ValueError, match="multiple of 512"):
        HtFp8Wire(16, 3200, torch.zeros(16, 2))
    with pytest.raises(HandlePoolError, match="pass no scales"):
        Fp8Wire(2, 16, HIDDEN, CPU).dispatch(
            SimpleNamespace(), torch.zeros(1, HIDDEN), torch.zeros(1, 16)
        )


def test_the_fake_refuses_what_nccl_ep_refuses_for_forwarded_rows():
    rt, _ = _ht_runtime()
    x, ids, weights = _layer(4, seed=2)
    q, s = fp8_wire.group_quantize(x)
    handle, ep, wire = rt.round.planner.plan(q, ids, weights).handle, fake_nccl_ep, rt.fp8_wire
    fwd = ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.FWD)
    w = ep.Tensor(rt.pool.topk_weights[:4])
    good_in = ep.DispatchInputs(tokens=ep.Tensor(q), scales=ep.Tensor(s), topk_weights=w)
    good_out = ep.DispatchOutputs(tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(wire.scales))
    odd = torch.zeros(4, 3)  # 12-byte scale rows
    cases = {
        "inputs.scales and outputs.scales are required": (
            ep.DispatchInputs(tokens=ep.Tensor(q), topk_weights=w),
            good_out,
            fwd,
        ),
        "requires inputs.topk_weights": (
            ep.DispatchInputs(tokens=ep.Tensor(q), scales=ep.Tensor(s)),
            good_out,
            fwd,
        ),
        "round_scales must be 0": (
            good_in,
            good_out,
            ep.DispatchConfig(
                round_scales=1, quantization_recipe=ep.DispatchQuantizationRecipe.FWD
            ),
        ),
        "like the inputs": (
            good_in,
            ep.DispatchOutputs(
                tokens=ep.Tensor(wire.tokens.view(torch.uint8)), scales=ep.Tensor(wire.scales)
            ),
            fwd,
        ),
        "16-byte aligned": (
            ep.DispatchInputs(tokens=ep.Tensor(q), scales=ep.Tensor(odd), topk_weights=w),
            ep.DispatchOutputs(
                tokens=ep.Tensor(wire.tokens), scales=ep.Tensor(torch.zeros(CAP, 3))
            ),
            fwd,
        ),
        "token / 4 scale rows": (
            ep.DispatchInputs(
                tokens=ep.Tensor(torch.cat([q, q])), scales=ep.Tensor(s), topk_weights=w
            ),
            good_out,
            fwd,
        ),
    }
    for message, (inputs, outputs, config) in cases.items():
        with pytest.raises(fake_nccl_ep.NcclInvalid, match=message):
            handle._handle.dispatch(inputs, outputs, config=config, stream=0)
    with pytest.raises(fake_nccl_ep.NcclInvalid, match="LL-only"):
        handle._handle.dispatch(
            ep.DispatchInputs(tokens=ep.Tensor(x)),
            good_out,
            config=ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.DS_FP8E3M4),
            stream=0,
        )
    rt.round.end()


def test_ht_fp8_padding_is_staged_when_the_wire_is_enabled():
    """At model load (before vLLM sizes the KV cache), not in the first padded round:
    the E4M3 rows and FP32 scales of padded rounds go through buffers made then."""
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=(4, 8),
    )
    pool = rt.pool
    before = set(pool.staged)
    rt.enable_fp8_wire()
    staged = {k: v.data_ptr() for k, v in pool.staged.items()}
    assert set(staged) - before == {"x:torch.float8_e4m3fn", "scales:torch.float32"}
    rnd = rt.round
    for n in (3, 5, 7):  # each pads to a pooled size
        x, ids, weights = _layer(n, seed=n)
        d = rnd.dispatch(x, ids, weights, fp8=True)
        assert d.x.shape[0] == (4 if n <= 4 else 8)
        rnd.combine(torch.empty_like(x))
    assert {k: v.data_ptr() for k, v in pool.staged.items()} == staged
