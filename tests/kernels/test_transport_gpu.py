"""Real NCCL-EP on one GPU: LL/HT round trips and the handle pool under CUDA graphs.

Runs the package's engine-agnostic runtime (fleet cache, handle pool, rounds) on
flashinfer.moe_ep + nccl.ep. World size 1 (the multi-rank variant lives in
test_transport_multigpu.py). Skipped with a reason without a GPU and NCCL-EP.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.fakes.matrix import backend_hidden_params
from tests.helpers import reduce_received_rows, scale_expert_rows
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import DispatchCapacityError, HandlePoolError
from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_HT, MAX_TOPK_LL, SUPPORTED_HIDDEN_SIZES
from vllm_flashinfer_ep.runtime.pool_sizes import bucket_sizes
from vllm_flashinfer_ep.runtime.rounds import LowLatencyRound

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 128
TOP_K = 8
CAPACITY = 256
HIDDEN_SIZES = [2048, 4096, 7168]
TOKEN_COUNTS = [1, 8, 128, 256]
NUM_LAYERS = 8
# bf16 activations and outputs: relative tolerance of a few bf16 ulps.
ATOL, RTOL = 2e-2, 2e-2

_fleet_caches: dict[tuple, FleetCache] = {}
_runtimes: list = []  # destroyed before their fleets (a handle outliving its fleet crashes)


def _runtime(group, algorithm: str, hidden: int, sizes=(), top_k: int = TOP_K):
    cache = _fleet_caches.setdefault((algorithm, hidden), FleetCache(0, 1, group))
    spec = FleetSpec(algorithm, NUM_EXPERTS, CAPACITY, hidden)
    rt = build_runtime(cache, spec, top_k, torch.device("cuda", 0), list(sizes))
    _runtimes.append(rt)
    return rt


def _inputs(num_tokens: int, hidden: int, seed: int, top_k: int = TOP_K):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda", 0)
    x = torch.randn(num_tokens, hidden, device=dev, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, top_k, dev, gen)
    scales = torch.rand(NUM_EXPERTS, device=dev, generator=gen) + 0.5
    return x, ids, weights, scales


def _ll_step(rnd: LowLatencyRound, x, ids, weights, scales, out):
    d = rnd.dispatch(x, ids, weights)
    return rnd.combine(scale_expert_rows(d.expert_x, scales), out)


def _ll_round_trip(group, hidden, num_tokens):
    rt = _runtime(group, Algorithm.LOW_LATENCY, hidden)
    x, ids, weights, scales = _inputs(num_tokens, hidden, seed=num_tokens + hidden)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights)
    counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS).to(torch.int32)
    torch.testing.assert_close(d.expert_num_tokens, counts)
    # every expert's first `count` rows are exactly the tokens routed to it
    for e in torch.nonzero(counts).flatten().tolist()[:16]:
        rows = d.expert_x[e, : counts[e]].float()
        want = x[(ids == e).any(dim=1)].float()
        torch.testing.assert_close(rows.sum(0), want.sum(0), atol=1e-1, rtol=1e-2)
    out = torch.empty_like(x)
    got = rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    assert got.data_ptr() == out.data_ptr(), "combine must write into the caller's output"
    torch.testing.assert_close(out, reference_moe(x, ids, weights, scales), atol=ATOL, rtol=RTOL)
    assert rt.pool.counters.fresh_created >= 1 and not rt.pool.sizes


def _ht_round_trip(group, hidden, num_tokens):
    rt = _runtime(group, Algorithm.HIGH_THROUGHPUT, hidden)
    x, ids, weights, scales = _inputs(num_tokens, hidden, seed=7 * num_tokens + hidden)
    rnd = rt.round
    d = rnd.dispatch(x, ids, weights)
    assert d.x.shape[0] == num_tokens  # world 1: every token received once
    assert not bool(d.remote_slot.any())
    reduce_received_rows(d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(d.x.shape[0]))
    out = torch.empty_like(x)
    rnd.combine(out)
    torch.testing.assert_close(out, reference_moe(x, ids, weights, scales), atol=ATOL, rtol=RTOL)


# 3072 is in the matrix on purpose: HT runs it, LL skips it through the shared constant.
@pytest.mark.parametrize(
    ("backend", "hidden"), backend_hidden_params(hidden_sizes=(2048, 3072, 4096, 7168))
)
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_round_trip(ep_group_world1, backend, hidden, num_tokens):
    if backend == LL_BACKEND:
        _ll_round_trip(ep_group_world1, hidden, num_tokens)
    else:
        _ht_round_trip(ep_group_world1, hidden, num_tokens)


@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_pool_cuda_graph_many_layers(ep_group_world1, hidden):
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=TOKEN_COUNTS)
    pool = rt.pool
    assert pool.sizes == TOKEN_COUNTS
    rnd = rt.round
    print(
        f"POOL_MEMORY hidden={hidden} per_handle_bytes={pool.per_handle_bytes} first={pool.first_handle_bytes}"
    )
    _record(
        {
            "hidden": hidden,
            "handle_bytes": pool.handle_bytes,
            "per_handle_bytes": pool.per_handle_bytes,
        }
    )
    for num_tokens in TOKEN_COUNTS:
        layers = [
            _inputs(num_tokens, hidden, seed=1000 * i + num_tokens) for i in range(NUM_LAYERS)
        ]
        outs = [torch.empty_like(layer[0]) for layer in layers]

        def step(layers=layers, outs=outs):
            for (x, ids, w, s), out in zip(layers, outs):
                _ll_step(rnd, x, ids, w, s, out)

        step()  # eager, pooled
        torch.cuda.synchronize()
        eager = [o.clone() for o in outs]
        for (x, ids, w, s), got in zip(layers, eager):
            torch.testing.assert_close(got, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)

        fresh_before = pool.counters.fresh_created
        graph = capture_graph(step)  # warmup on a side stream, as vLLM does
        assert pool.counters.fresh_created == fresh_before, "no handle may be created in capture"
        assert pool.counters.created_during_capture == 0
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, eager):
            torch.testing.assert_close(got, want, atol=0, rtol=0)

        # change routing, weights, activations and scales in place; replay again
        for i, (x, ids, w, s) in enumerate(layers):
            nx, nids, nw, ns = _inputs(num_tokens, hidden, seed=77 + i + num_tokens)
            x.copy_(nx), ids.copy_(nids), w.copy_(nw), s.copy_(ns)
        graph.replay()
        torch.cuda.synchronize()
        for (x, ids, w, s), got in zip(layers, outs):
            torch.testing.assert_close(got, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)
        step()  # eager after replay agrees too
        torch.cuda.synchronize()
        for (x, ids, w, s), got in zip(layers, outs):
            torch.testing.assert_close(got, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)
        assert pool.counters.fresh_created == fresh_before
        del graph


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_eager_rounds_pad_to_pooled_handles(ep_group_world1, hidden):
    """Eager counts between pooled sizes run on the next pooled handle (capture sizes
    1..8, then the buckets up to the capacity), on torch's default stream and on a side
    stream as vLLM's warm-ups do; outputs match the reference, nothing is created, and a
    captured size still replays exactly afterwards."""
    sizes = [1, 2, 4, 8, *bucket_sizes(8, CAPACITY)]
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=sizes)
    pool, rnd = rt.pool, rt.round
    assert pool.sizes == sizes
    print(f"POOL_MEMORY hidden={hidden} {pool.memory_summary()}")
    created = pool.counters.pooled_created
    for num_tokens in (3, 5, 13, 100, 200, 255):
        for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
            with torch.cuda.stream(stream):
                layers = [_inputs(num_tokens, hidden, seed=num_tokens * 10 + i) for i in range(3)]
                for x, ids, w, s in layers:
                    out = torch.full_like(x, float("nan"))
                    _ll_step(rnd, x, ids, w, s, out)
                    torch.testing.assert_close(
                        out, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL
                    )
            torch.cuda.synchronize()
    c = pool.counters
    assert c.fresh_created == 0 and c.pooled_created == created
    assert c.padded_rounds == 6 * 2 * 3
    x, ids, w, s = _inputs(8, hidden, seed=99)
    out = torch.empty_like(x)
    graph = capture_graph(lambda: _ll_step(rnd, x, ids, w, s, out))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)
    assert pool.counters.fresh_created == 0
    del graph


@pytest.mark.parametrize("hidden", [4096, 7168])
def test_ht_eager_rounds_pad_to_pooled_handles(ep_group_world1, hidden):
    """HT rounds between pooled sizes run on the next pooled handle (the buckets from 1
    up to the capacity): each padded row arrives once at world 1 (zero activations,
    weight 0), the real rows' outputs match the reference, nothing is created."""
    sizes = bucket_sizes(0, CAPACITY)
    rt = _runtime(ep_group_world1, Algorithm.HIGH_THROUGHPUT, hidden, sizes=sizes)
    pool, rnd = rt.pool, rt.round
    assert pool.sizes == sizes
    print(f"POOL_MEMORY ht hidden={hidden} {pool.memory_summary()}")
    created = pool.counters.pooled_created
    counts = (5, 13, 100, 200, 255)
    for num_tokens in counts:
        for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
            with torch.cuda.stream(stream):
                for i in range(2):
                    x, ids, w, s = _inputs(num_tokens, hidden, seed=num_tokens * 10 + i)
                    d = rnd.dispatch(x, ids, w)
                    assert d.x.shape[0] == rt.round.sent_per_rank == pool.pooled_size(num_tokens)
                    assert not bool(d.remote_slot.any())
                    reduce_received_rows(
                        d.x, d.topk_ids, d.topk_weights, s, rnd.combine_buffer(d.x.shape[0])
                    )
                    out = torch.full_like(x, float("nan"))
                    rnd.combine(out)
                    torch.testing.assert_close(
                        out, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL
                    )
            torch.cuda.synchronize()
    c = pool.counters
    assert c.fresh_created == 0 and c.pooled_created == created
    assert c.padded_rounds == len(counts) * 2 * 2


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_direct_eager_rounds_match_flashinfer_methods(ep_group_world1, hidden, monkeypatch):
    """Eager pooled LL rounds issued directly on the nccl.ep handle (runtime/
    native_handle.py; the first round records FlashInfer's receive buffer) against the
    same rounds through FlashInfer's handle methods and the reference: captured rounds
    (FlashInfer's, same receive buffer) replay exactly in between, and a second pass
    over the same tensors (the experts' output at one address, as vLLM's workspace)
    builds no descriptor."""
    sizes = [1, 8, 128, 256]
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=sizes)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_NATIVE_EAGER", "0")
    rt_fi = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=sizes)
    monkeypatch.delenv("VLLM_FLASHINFER_EP_NATIVE_EAGER")
    assert rt.round.planner.native is not None and rt_fi.round.planner.native is None
    rnd, rnd_fi = rt.round, rt_fi.round
    xg, idsg, wg, sg = _inputs(8, hidden, seed=4242)
    outg = torch.empty_like(xg)
    graph = capture_graph(lambda: _ll_step(rnd, xg, idsg, wg, sg, outg))
    want_g = reference_moe(xg, idsg, wg, sg)
    layers = {n: [_inputs(n, hidden, seed=100 * n + i) for i in range(3)] for n in sizes}
    outs = {n: [torch.empty_like(layer[0]) for layer in layers[n]] for n in sizes}
    # the experts' output at one address, as vLLM's workspace
    expert_out = torch.empty(NUM_EXPERTS, CAPACITY, hidden, dtype=torch.bfloat16, device="cuda")
    x0, ids0, w0, s0 = _inputs(1, hidden, seed=4243)  # the first round, through FlashInfer's
    _ll_step(rnd, x0, ids0, w0, s0, torch.empty_like(x0))  # methods, records its buffer
    assert rt.round.planner.native.rounds == 0 and rt.round.planner.native.recv is not None
    worst = 0.0
    for sweep in range(2):
        built = rt.round.planner.native.memo.built
        for n in sizes:
            for (x, ids, w, s), out in zip(layers[n], outs[n]):
                out.fill_(float("nan"))
                d = rnd.dispatch(x, ids, w)
                rnd.combine(scale_expert_rows(d.expert_x, s, out=expert_out), out)
                out_fi = _ll_step(rnd_fi, x, ids, w, s, torch.empty_like(x))
                torch.cuda.synchronize()
                torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)
                worst = max(worst, (out.float() - out_fi.float()).abs().max().item())
            outg.zero_()
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(outg, want_g, atol=ATOL, rtol=RTOL)
        if sweep == 1:
            assert rt.round.planner.native.memo.built == built, (
                "the same tensors again built descriptors"
            )
    print(
        f"DIRECT_EAGER hidden={hidden} rounds={rt.round.planner.native.rounds} max|direct-flashinfer|={worst:.3g} "
        f"descriptors={rt.round.planner.native.memo.built}"
    )
    assert rt.round.planner.native.rounds == 2 * 3 * len(sizes)
    assert worst <= ATOL
    assert rt.pool.counters.fresh_created == 0
    del graph


def _fp8_rows_match(d, x, ids, num_experts: int = NUM_EXPERTS) -> float:
    """Every expert's received E4M3 rows dequantize to the BF16 rows routed to it (rows
    arrive in any order: each is matched with its nearest sent row), with scales amax/448
    per 128 elements (vLLM's group quantization). Returns the worst relative error."""
    counts = torch.bincount(ids.flatten(), minlength=num_experts).to(torch.int32)
    torch.testing.assert_close(d.expert_num_tokens, counts)
    worst = 0.0
    for e in torch.nonzero(counts).flatten().tolist():
        n = int(counts[e])
        q, s = d.expert_x[e, :n].float(), d.expert_x_scale[e, :n]
        deq = (q.view(n, -1, 128) * s[..., None]).view(n, -1)
        sent = x[(ids == e).any(dim=1)].float()
        err = (deq[:, None, :] - sent[None, :, :]).abs().amax(-1)  # [received, sent]
        nearest = err.argmin(1)
        assert sorted(nearest.tolist()) == list(range(n)), f"expert {e}: rows lost or doubled"
        rel = err.amin(1) / sent[nearest].abs().amax(-1)
        worst = max(worst, float(rel.max()))
        amax = sent[nearest].view(n, -1, 128).abs().amax(-1)
        torch.testing.assert_close(s, amax / 448.0, rtol=1e-5, atol=1e-12)
    assert worst <= 2**-4, worst  # E4M3 keeps 3 mantissa bits
    return worst


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_fp8_dispatch_carries_rows_within_fp8_error(ep_group_world1, hidden):
    """NCCL-EP's DS_FP8E3M4 dispatch on the pool's FlashInfer handles (runtime/fp8_wire.py):
    pooled and padded counts, on the default and a side stream; combine (BF16) after it
    matches the reference; a captured FP8 round replays exactly."""
    sizes = [1, 8, *bucket_sizes(8, CAPACITY)]
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=sizes)
    wire = rt.enable_fp8_wire()
    rnd = rt.round
    worst = 0.0
    for num_tokens in (1, 5, 8, 64, 200, 256):
        for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
            with torch.cuda.stream(stream):
                x, ids, w, s = _inputs(num_tokens, hidden, seed=num_tokens + hidden)
                x = x * (1 + 20 * torch.rand(num_tokens, 1, device=x.device)).to(x.dtype)
                d = rnd.dispatch(x, ids, w, fp8=True)
                size = rt.round.sent_per_rank
                if size == num_tokens:
                    worst = max(worst, _fp8_rows_match(d, x, ids))
                else:  # padded rows (zeros) arrive at this rank's experts too
                    assert int(d.expert_num_tokens.sum()) == size * TOP_K
                    rows = torch.arange(d.expert_x.shape[1], device=x.device)
                    valid = rows[None, :] < d.expert_num_tokens[:, None]
                    finite = bool(torch.isfinite(d.expert_x_scale[valid]).all())
                    print(
                        f"FP8_WIRE hidden={hidden} T={num_tokens} padded to {size}: scales finite {finite}"
                    )
                deq = (
                    d.expert_x.float().view(*d.expert_x.shape[:2], -1, 128)
                    * d.expert_x_scale[..., None]
                )
                deq = torch.nan_to_num(deq.view_as(d.expert_x.float())).to(torch.bfloat16)
                out = torch.full_like(x, float("nan"))
                rnd.combine(scale_expert_rows(deq, s), out)
                want = reference_moe(x, ids, w, s).float()
                torch.testing.assert_close(
                    out.float(), want, rtol=0.1, atol=0.1 * float(want.abs().max())
                )
            torch.cuda.synchronize()
    assert rt.pool.counters.fresh_created == 0 and wire.dispatches == 12
    x, ids, w, s = _inputs(8, hidden, seed=5)
    box = {}
    graph = capture_graph(
        lambda: (
            box.update(d=rnd.dispatch(x, ids, w, fp8=True))
            or rnd.combine(
                torch.zeros(*wire.tokens.shape, dtype=torch.bfloat16, device=x.device),
                torch.empty_like(x),
            )
        )
    )
    wire.tokens.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _fp8_rows_match(box["d"], x, ids)
    print(
        f"FP8_WIRE hidden={hidden} worst relative row error {worst:.4f}; "
        f"receive buffers {wire.memory_bytes / 1e6:.1f} MB"
    )
    del graph


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_ht_fp8_dispatch_forwards_rows_and_scales_unchanged(ep_group_world1, hidden):
    """NCCL-EP's forward recipe on HT handles (runtime/fp8_wire.py HtFp8Wire): at world 1
    every token arrives once with its E4M3 row and FP32 scales byte for byte as quantized
    before dispatch, on pooled, padded and per-forward handles, on the default and a side
    stream; padded rows arrive as zeros; combine (BF16) after it matches the reference."""
    from vllm_flashinfer_ep.runtime.fp8_wire import group_quantize
    from vllm_flashinfer_ep.runtime.pool_sizes import HT_MAX_PAD

    pooled = _runtime(
        ep_group_world1,
        Algorithm.HIGH_THROUGHPUT,
        hidden,
        sizes=bucket_sizes(0, CAPACITY, max_pad=HT_MAX_PAD),
    )
    fresh = _runtime(ep_group_world1, Algorithm.HIGH_THROUGHPUT, hidden)
    rounds = 0
    for rt in (pooled, fresh):
        wire = rt.enable_fp8_wire()
        rnd = rt.round
        for num_tokens in (1, 5, 64, 200, 256):
            for stream in (torch.cuda.current_stream(), torch.cuda.Stream()):
                with torch.cuda.stream(stream):
                    x, ids, w, s = _inputs(num_tokens, hidden, seed=3 * num_tokens + hidden)
                    x = x * (1 + 20 * torch.rand(num_tokens, 1, device=x.device)).to(x.dtype)
                    d = rnd.dispatch(x, ids, w, fp8=True)
                    q, qs = group_quantize(x)
                    same = (d.x_scale[:, None, :] == qs[None, :, :]).all(-1)  # [received, sent]
                    real = same.any(1)
                    assert int(real.sum()) == num_tokens and bool((same.sum(0) == 1).all())
                    assert not bool(d.remote_slot.any())
                    src = same.float().argmax(1)[real]
                    assert torch.equal(d.x[real].view(torch.uint8), q[src].view(torch.uint8))
                    assert not bool(d.x[~real].float().any()) and not bool(d.x_scale[~real].any())
                    deq = d.x.float().view(d.x.shape[0], -1, 128) * d.x_scale[..., None]
                    deq = deq.view(d.x.shape).to(torch.bfloat16)
                    reduce_received_rows(
                        deq, d.topk_ids, d.topk_weights, s, rnd.combine_buffer(d.x.shape[0])
                    )
                    out = torch.full_like(x, float("nan"))
                    rnd.combine(out)
                    want = reference_moe(x, ids, w, s).float()
                    torch.testing.assert_close(
                        out.float(), want, rtol=0.1, atol=0.1 * float(want.abs().max())
                    )
                torch.cuda.synchronize()
                rounds += 1
        assert wire.dispatches == 10
        print(
            f"HT_FP8_WIRE hidden={hidden} {'pooled' if rt is pooled else 'per-forward'}: "
            f"padded rounds {rt.pool.counters.padded_rounds}, fresh {rt.pool.counters.fresh_created}; "
            f"receive buffers {wire.memory_bytes / 1e6:.1f} MB"
        )
    assert pooled.pool.counters.fresh_created == 0 and pooled.pool.counters.padded_rounds > 0
    assert fresh.pool.counters.fresh_created == rounds // 2


@pytest.mark.parametrize(
    "algorithm,top_k",
    [(Algorithm.LOW_LATENCY, k) for k in (8, 9, 10, MAX_TOPK_LL)]
    + [(Algorithm.HIGH_THROUGHPUT, k) for k in (8, 9, 10, 16, MAX_TOPK_HT)],
)
def test_top_k_limit(ep_group_world1, algorithm, top_k):
    """Re-measures the top_k range behind runtime.limits.MAX_TOPK_LL/HT on this GPU."""
    hidden = SUPPORTED_HIDDEN_SIZES[0]
    cache = FleetCache(0, 1, ep_group_world1)
    rt = build_runtime(
        cache, FleetSpec(algorithm, NUM_EXPERTS, 64, hidden), top_k, torch.device("cuda", 0), []
    )
    x, ids, weights, scales = _inputs(16, hidden, seed=top_k, top_k=top_k)
    out = torch.empty_like(x)
    if algorithm == Algorithm.LOW_LATENCY:
        _ll_step(rt.round, x, ids, weights, scales, out)
    else:
        rnd = rt.round
        d = rnd.dispatch(x, ids, weights)
        reduce_received_rows(
            d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(d.x.shape[0])
        )
        rnd.combine(out)
    torch.testing.assert_close(out, reference_moe(x, ids, weights, scales), atol=ATOL, rtol=RTOL)
    rt.destroy()
    cache.destroy()


def test_ll_top_k_above_limit_is_refused_before_nccl_ep(ep_group_world1):
    cache = FleetCache(0, 1, ep_group_world1)
    with pytest.raises(ValueError, match="top_k must be in"):
        build_runtime(
            cache,
            FleetSpec(Algorithm.LOW_LATENCY, NUM_EXPERTS, 64, 2048),
            MAX_TOPK_LL + 1,
            torch.device("cuda", 0),
            [],
        )
    cache.destroy()


def test_over_dispatch_is_a_clear_error(ep_group_world1):
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, 2048)
    x, ids, weights, _ = _inputs(CAPACITY + 1, 2048, seed=3)
    with pytest.raises(DispatchCapacityError, match="max-num-batched-tokens"):
        rt.round.dispatch(x, ids, weights)


def test_unwarmed_size_under_capture_raises(ep_group_world1):
    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, 2048, sizes=[8])
    x, ids, weights, _ = _inputs(5, 2048, seed=5)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(HandlePoolError, match="cannot be created inside CUDA-graph capture"):
        with torch.cuda.graph(graph):
            rt.round.dispatch(x, ids, weights)
    rt.round.end()
    torch.cuda.synchronize()


@pytest.mark.parametrize("hidden", [2048, 7168])
def test_capture_phase_learns_the_counts_the_engine_captures(ep_group_world1, hidden):
    """Counts the configured sizes lack (speculative decoding's 3, 9, 18) are learned from
    the eager warm-up vLLM runs on a side stream inside its capture phase, then captured
    and replayed for new routing on real NCCL-EP; no handle is created in a capture."""
    from vllm_flashinfer_ep.runtime.capture import capture_phase

    rt = _runtime(ep_group_world1, Algorithm.LOW_LATENCY, hidden, sizes=[8, 16])
    pool, rnd = rt.pool, rt.round
    for num_tokens in (18, 9, 3):  # vLLM captures the largest first
        layers = [_inputs(num_tokens, hidden, seed=500 * i + num_tokens) for i in range(NUM_LAYERS)]
        outs = [torch.empty_like(layer[0]) for layer in layers]

        def step(layers=layers, outs=outs):
            for (x, ids, w, s), out in zip(layers, outs):
                _ll_step(rnd, x, ids, w, s, out)

        with capture_phase():
            graph = capture_graph(step)
        assert num_tokens in pool.sizes and pool.learned[-1] == num_tokens
        assert pool.counters.created_during_capture == 0 and pool.counters.fresh_created == 0
        for i, (x, ids, w, s) in enumerate(layers):
            nx, nids, nw, ns = _inputs(num_tokens, hidden, seed=91 + i + num_tokens)
            x.copy_(nx), ids.copy_(nids), w.copy_(nw), s.copy_(ns)
        created = pool.counters.pooled_created
        graph.replay()
        torch.cuda.synchronize()
        for (x, ids, w, s), got in zip(layers, outs):
            torch.testing.assert_close(got, reference_moe(x, ids, w, s), atol=ATOL, rtol=RTOL)
        assert pool.counters.pooled_created == created
        del graph
    assert pool.learned == [18, 9, 3] and pool.sizes == [3, 8, 9, 16, 18]


@pytest.fixture(scope="module", autouse=True)
def _destroy_fleets():
    yield
    torch.cuda.synchronize()
    for rt in _runtimes:
        rt.destroy()
    _runtimes.clear()
    for cache in _fleet_caches.values():
        cache.destroy()
    _fleet_caches.clear()


def _record(entry: dict) -> None:
    path = os.environ.get("FLASHINFER_EP_TEST_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def test_bench_expert_kernel_touches_valid_rows_only():
    from vllm_flashinfer_ep.bench.expert_kernel import scale_valid_rows_

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(6, 40, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    counts = torch.tensor([0, 1, 17, 40, 5, 39], dtype=torch.int32, device="cuda")
    scales = torch.rand(6, device="cuda", generator=gen) + 0.5
    want = x.clone()
    for e, n in enumerate(counts.tolist()):
        want[e, :n] = (want[e, :n].float() * scales[e]).to(torch.bfloat16)
    scale_valid_rows_(x, counts, scales)
    torch.testing.assert_close(x, want, atol=0, rtol=0)
