"""One LL runtime with the FP8 wire, shared by an FP8 layer and a BF16 layer in turn.

vLLM hands one runtime (one round, one pool, one FP8 wire) to every MoE layer of a shape,
so a forward can alternate FP8-wire rounds (128x128 block-FP8 layers, runtime/fp8_wire.py)
and BF16 rounds (layers whose wire is off). Each round must be right against its own
reference, and nothing of one may reach the other: a BF16 round must hand its experts
the BF16 receive buffer (never the wire's E4M3 rows or scales), an FP8 round this
layer's quantized rows and counts (never an earlier layer's). Eager (direct nccl.ep calls
on and off) and under the simulated capture switch (tests/fakes/runtime.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.fakes.runtime import build_fake_runtime, install_capture_switch
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.runtime import fp8_wire

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN, EXPERTS, TOP_K, CAP = 2048, 8, 2, 16
FP8 = torch.float8_e4m3fn
CPU = torch.device("cpu")


def _runtime(sizes):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=sizes,
    )
    rt.enable_fp8_wire()
    return rt


def _routing(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, CPU, gen)
    scales = torch.rand(EXPERTS, generator=gen) + 0.5
    return ids, weights, scales


def _input(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    loud = 1 + 10 * torch.rand(num_tokens, 1, generator=gen)
    return (torch.randn(num_tokens, HIDDEN, generator=gen) * loud).to(torch.bfloat16)


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    rows = q.shape[:-1]
    return (q.float().view(*rows, -1, 128) * s[..., None]).view(q.shape)


def _fp8_seen(x: torch.Tensor) -> torch.Tensor:
    """What the experts of an FP8 layer see of x: its E4M3 rows, dequantized, in BF16."""
    return _dequantized(*fp8_wire.group_quantize(x)).to(torch.bfloat16)


def _expected_counts(rt, ids: torch.Tensor) -> torch.Tensor:
    """Rows each expert receives: the layer's slots, and the padded rows' (pad routing)."""
    n, size = ids.shape[0], rt.round.sent_per_rank
    routed = torch.cat([ids, rt.pool.pad_ids[n:size]]).flatten()
    return torch.bincount(routed, minlength=EXPERTS).to(torch.int32)


def _layer(rt, x, kind: str, ids, weights, scales) -> torch.Tensor:
    """One MoE layer on the runtime's shared round; checks what its experts got."""
    wire, rnd = rt.fp8_wire, rt.round
    fp8 = kind == "fp8"
    sent = wire.dispatches
    d = rnd.dispatch(x, ids, weights, fp8=fp8)
    counts = _expected_counts(rt, ids)
    assert torch.equal(d.expert_num_tokens, counts)  # this layer's routing, not the last one's
    if fp8:
        assert wire.dispatches == sent + 1
        assert (
            d.expert_x is wire.tokens
            and d.expert_x_scale is wire.scales
            and d.expert_x.dtype == FP8
        )
        seen = _dequantized(d.expert_x, d.expert_x_scale).to(torch.bfloat16)
        # Each received row is one of this layer's tokens, with its scales, or a padded
        # (zero) row: the wire is rewritten by every FP8 round, never read stale.
        want_scales = fp8_wire.group_quantize(x)[1]
        for e in range(EXPERTS):
            n, routed = int(counts[e]), (ids == e).any(1)
            zero = ~d.expert_x[e, :n].float().abs().bool().any(1)
            assert int(zero.sum()) == n - int(routed.sum()), e
            for row in d.expert_x_scale[e, :n][~zero]:
                assert bool((row == want_scales[routed]).all(1).any()), e
    else:
        assert wire.dispatches == sent  # the wire stays out of a BF16 round
        assert d.expert_x.dtype == torch.bfloat16 and d.expert_x_scale is None
        start = d.expert_x.data_ptr()
        for buf in (wire.tokens, wire.scales):  # not a view into the wire's receive buffers
            end = buf.data_ptr() + buf.numel() * buf.element_size()
            assert not buf.data_ptr() <= start < end
        seen = d.expert_x
    out = torch.full_like(x, float("nan"))
    rnd.combine(scale_expert_rows(seen, scales), out)
    assert rt.round.sent_per_rank is None  # the round ended
    want = reference_moe(_fp8_seen(x) if fp8 else x, ids, weights, scales)
    torch.testing.assert_close(
        out.float(), want.float(), rtol=1e-2, atol=1e-2 * float(want.abs().max())
    )
    return out


def _forward(rt, kinds, num_tokens: int, seed: int) -> torch.Tensor:
    """Layers of `kinds` in turn, each on its own routing, each fed the previous output."""
    x = _input(num_tokens, seed)
    for i, kind in enumerate(kinds):
        x = _layer(rt, x, kind, *_routing(num_tokens, seed * 100 + i))
    return x


ORDERS = [
    ("fp8", "bf16", "fp8", "bf16"),
    ("bf16", "fp8", "bf16", "fp8"),
    ("bf16", "bf16", "fp8", "fp8", "bf16"),
]


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("kinds", ORDERS)
@pytest.mark.parametrize("num_tokens", [4, 5, 8])  # 5: padded to the pooled 8
def test_eager_forward_alternating_fp8_and_bf16_layers(monkeypatch, native, kinds, num_tokens):
    monkeypatch.setenv(envs.NATIVE_EAGER, native)
    rt = _runtime(sizes=(4, 8))
    for step in range(2):  # a second forward finds the state the first one left
        _forward(rt, kinds, num_tokens, seed=10 * step + num_tokens)
    assert rt.fp8_wire.dispatches == 2 * kinds.count("fp8")


@pytest.mark.parametrize("kinds", ORDERS[:2])
def test_captured_forward_alternating_fp8_and_bf16_layers(monkeypatch, kinds):
    """Under the capture switch (no direct calls, the capturing stream), then eager again
    on the same runtime: every round right against its own reference."""
    switch = install_capture_switch(monkeypatch)
    rt = _runtime(sizes=(4, 8))
    _forward(rt, kinds, 8, seed=1)  # eager first, as vLLM's warm-up runs before capture
    with switch.capturing():
        _forward(rt, kinds, 8, seed=2)
        _forward(rt, kinds, 4, seed=3)
    _forward(rt, kinds, 4, seed=4)
    _forward(rt, kinds, 5, seed=5)  # padded, eager
    assert rt.fp8_wire.dispatches == 5 * kinds.count("fp8")


def test_a_bf16_round_after_an_fp8_round_hands_over_what_the_transport_received(monkeypatch):
    """The BF16 layer's experts read the rows of its own dispatch: equal, row for row, to
    the tokens routed to each expert (no E4M3 bytes, no stale rows)."""
    monkeypatch.setenv(envs.NATIVE_EAGER, "1")
    rt = _runtime(sizes=(8,))
    x0 = _input(8, 7)
    _layer(rt, x0, "bf16", *_routing(8, 70))  # records FlashInfer's receive buffer
    _layer(rt, x0, "fp8", *_routing(8, 71))
    x = _input(8, 8)
    ids, weights, _ = _routing(8, 72)
    d = rt.round.dispatch(x, ids, weights)
    for e in range(EXPERTS):
        n = int(d.expert_num_tokens[e])
        got = d.expert_x[e, :n]
        want = x[(ids == e).any(1)]
        assert n == want.shape[0]
        # rows arrive in any order: each received row is one of the tokens routed here
        assert all(bool((row == want).all(1).any()) for row in got), e
    rt.round.end()
