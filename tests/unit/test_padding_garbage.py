"""Padded rows are zero whatever the allocator left in the pool's staging.

A round whose token count is not pooled is padded to the next pooled size through the
pool's persistent staging (HandlePool.staging, made with torch.empty at warm-up or
when the FP8 wire is enabled, stage_padding). Fresh CPU memory is usually zero, which
would hide a pool that forgot to clear the padded rows; here the staging (and the pad
routing weights) are filled with NaN and huge values first, and what reaches the
transport is inspected: the padded rows must be exactly zero, their weights exactly 0,
and the outputs the same, bit for bit, as on a runtime whose staging was never touched.
"""

from __future__ import annotations

import pytest
import torch

from tests.fakes import fake_moe_ep, fake_nccl_ep
from tests.fakes.runtime import build_fake_runtime
from tests.helpers import reduce_received_rows, scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.runtime import fp8_wire

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN, EXPERTS, TOP_K, CAP = 2048, 8, 2, 32
SIZES = (4, 8, 16)
CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


def _garbage(buf: torch.Tensor) -> None:
    """NaN and huge values where the type has them, else non-zero bytes."""
    if buf.dtype.is_floating_point and buf.dtype.itemsize > 1:
        flat = buf.view(-1)
        flat.fill_(float("nan"))
        flat[1::3] = torch.finfo(buf.dtype).max
        flat[2::3] = -1.0e4
    else:  # FP8 or integer staging: every byte 0x7f (E4M3 NaN), never zero
        buf.view(torch.uint8).fill_(0x7F)


def _poison(rt) -> list[str]:
    pool = rt.pool
    for buf in pool.staged.values():
        _garbage(buf)
    pool.topk_weights.fill_(float("nan"))  # rows past a round's tokens are the pad's
    return sorted(pool.staged)


class Sent:
    """What reached the transport: each dispatch's activation (and scale) rows and the
    weights bound to its handle, recorded where the fake's collective takes them."""

    def __init__(self, monkeypatch) -> None:
        self.rows: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        send = fake_moe_ep.Handle._send
        forwarded = fake_nccl_ep.NativeHandle._dispatch_forwarded

        def record_send(handle, x, weights):
            if x.dtype != torch.float32:  # BF16 rows (HT FP8 rows are recorded below)
                self.rows.append(x.clone())
            self.weights.append(handle.bound_weights.clone())
            return send(handle, x, weights)

        def record_forwarded(native, inputs, outputs, config):
            self.rows.append(inputs.tokens.buffer.clone())
            self.scales.append(inputs.scales.buffer.clone())
            return forwarded(native, inputs, outputs, config)

        monkeypatch.setattr(fake_moe_ep.Handle, "_send", record_send)
        monkeypatch.setattr(fake_nccl_ep.NativeHandle, "_dispatch_forwarded", record_forwarded)


def _layer(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 4).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, CPU, gen)
    scales = torch.rand(EXPERTS, generator=gen) + 0.5
    return x, ids, weights, scales


def _dequantized(q, s):
    rows = q.shape[:-1]
    return (q.float().view(*rows, -1, 128) * s[..., None]).view(q.shape)


def _ll_round(rt, x, ids, weights, scales, fp8):
    d = rt.round.dispatch(x, ids, weights, fp8=fp8)
    seen = _dequantized(d.expert_x, d.expert_x_scale).to(torch.bfloat16) if fp8 else d.expert_x
    out = torch.full_like(x, float("nan"))
    return rt.round.combine(scale_expert_rows(seen, scales), out)


def _ht_round(rt, x, ids, weights, scales, fp8):
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights, fp8=fp8)
    rows = d.x.shape[0]
    seen = _dequantized(d.x, d.x_scale).to(torch.bfloat16) if fp8 else d.x
    reduce_received_rows(seen, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(rows))
    return rnd.combine(torch.full_like(x, float("nan")))


# Each count pads to the next pooled size; 15 then 5 reuses staging a larger round wrote.
COUNTS = (3, 7, 15, 5, 9)
CASES = [
    (Algorithm.LOW_LATENCY, False),
    (Algorithm.LOW_LATENCY, True),
    (Algorithm.HIGH_THROUGHPUT, False),
    (Algorithm.HIGH_THROUGHPUT, True),
]


@pytest.mark.parametrize(("algorithm", "fp8"), CASES)
def test_padded_rows_reach_the_transport_as_zeros_over_garbage_staging(monkeypatch, algorithm, fp8):
    def runtime():
        rt, _ = build_fake_runtime(
            algorithm, hidden=HIDDEN, num_experts=EXPERTS, capacity=CAP, top_k=TOP_K, sizes=SIZES
        )
        if fp8:
            rt.enable_fp8_wire()
        return rt

    run = _ht_round if algorithm == Algorithm.HIGH_THROUGHPUT else _ll_round
    clean = runtime()
    want = [run(clean, *_layer(n, seed=n), fp8=fp8).clone() for n in COUNTS]

    rt = runtime()
    staged = _poison(rt)
    expected = {"x:torch.bfloat16", "out:torch.bfloat16"}
    if fp8 and algorithm == Algorithm.HIGH_THROUGHPUT:
        expected |= {"x:torch.float8_e4m3fn", "scales:torch.float32"}
    assert set(staged) == expected  # every staging buffer was poisoned before its first use
    sent = Sent(monkeypatch)
    for i, n in enumerate(COUNTS):
        x, ids, weights, scales = _layer(n, seed=n)
        out = run(rt, x, ids, weights, scales, fp8=fp8)
        size = min(s for s in SIZES if s >= n)
        rows, bound = sent.rows[-1], sent.weights[-1]
        assert rows.shape[0] == bound.shape[0] == size
        assert rt.pool.counters.padded_rounds == i + 1
        # Padded rows: exactly zero (no NaN, no stale rows of an earlier, larger round) ...
        assert torch.equal(rows[n:].view(torch.uint8), torch.zeros_like(rows[n:]).view(torch.uint8))
        assert torch.equal(bound[n:], torch.zeros(size - n, TOP_K))  # ... with weight 0
        # ... and the real rows exactly what the layer sent.
        if fp8 and algorithm == Algorithm.HIGH_THROUGHPUT:
            q, s = fp8_wire.group_quantize(x)
            assert torch.equal(rows[:n].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(sent.scales[-1][:n], s) and not bool(sent.scales[-1][n:].any())
        else:
            assert torch.equal(rows[:n], x)
        assert torch.equal(bound[:n], weights)
        assert not bool(out.isnan().any())
        assert torch.equal(out, want[i])  # outputs unchanged by what the staging held
        if not fp8:
            torch.testing.assert_close(
                out.float(), reference_moe(x, ids, weights, scales).float(), rtol=2e-2, atol=2e-2
            )
    assert sorted(rt.pool.staged) == staged  # no round staged through fresh memory
