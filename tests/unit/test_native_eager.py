"""Eager LL rounds issued directly on the nccl.ep handle (runtime/native_handle.py), on CPU.

The fake nccl.ep (tests/fakes/fake_nccl_ep.py) takes the direct update / BF16 dispatch /
combine, refuses what nccl_ep.h refuses there (LL update with a layout_info, a combine
without weights, any call off FlashInfer's op stream) and resolves descriptors made from
a raw address through CPU memory. The real library runs in
tests/kernels/test_transport_gpu.py::test_direct_eager_rounds_*.
"""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from tests.fakes import fake_moe_ep, fake_nccl_ep
from tests.fakes.runtime import build_fake_runtime, install_capture_switch
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.log import ROOT
from vllm_flashinfer_ep.runtime.native_handle import DescriptorMemo

pytestmark = pytest.mark.usefixtures("fake")

HIDDEN, EXPERTS, TOP_K, CAP = 2048, 8, 2, 16
CPU = torch.device("cpu")


def _layer(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, CPU, gen)
    scales = torch.rand(EXPERTS, generator=gen) + 0.5
    return x, ids, weights, scales


def _runtime(sizes=(4, 8)):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=sizes,
    )
    return rt


def _step(rnd, x, ids, w, s):
    out = torch.full_like(x, float("nan"))
    d = rnd.dispatch(x, ids, w)
    return rnd.combine(scale_expert_rows(d.expert_x, s), out)


def _native_calls(rt) -> tuple[int, int, int]:
    """(updates, BF16 dispatches, combines) issued on the nccl.ep handles directly."""
    natives = [h._handle for h in rt.pool.handles.values()]
    return (
        sum(n.updates for n in natives),
        sum(n.bf16_dispatches for n in natives),
        sum(n.combines for n in natives),
    )


def test_eager_rounds_run_direct_after_the_first_and_match_the_reference():
    """The first pooled round goes through FlashInfer's methods (its receive buffer is
    recorded); every later one issues update, dispatch and combine directly, with the
    same results as the reference MoE."""
    rt = _runtime()
    rnd = rt.round
    for i, n in enumerate((4, 8, 4, 8, 8)):
        x, ids, w, s = _layer(n, seed=i)
        out = _step(rnd, x, ids, w, s)
        torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2)
    assert rt.round.planner.native.rounds == 4
    assert _native_calls(rt) == (4, 4, 4)
    assert rt.pool.counters.pooled_rounds == 5 and rt.round.sent_per_rank is None


def test_direct_and_flashinfer_methods_give_identical_rows(monkeypatch):
    """The same rounds with the direct calls and with FlashInfer's methods
    (VLLM_FLASHINFER_EP_NATIVE_EAGER=0): the same received rows, counts and outputs."""
    layers = [_layer(8, seed=10 + i) for i in range(4)]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(envs.NATIVE_EAGER, setting)
        rt = _runtime()
        rnd = rt.round
        got = []
        for x, ids, w, s in layers:
            d = rnd.dispatch(x, ids, w)
            counts = d.expert_num_tokens.clone()
            rows = [d.expert_x[e, : counts[e]].float().sum(0) for e in range(EXPERTS)]
            out = rnd.combine(scale_expert_rows(d.expert_x, s), torch.empty_like(x))
            got.append((counts, torch.stack(rows), out.clone()))
        results[setting] = (got, _native_calls(rt))
    assert results["1"][1] == (3, 3, 3) and results["0"][1] == (0, 0, 0)
    for (c1, r1, o1), (c0, r0, o0) in zip(results["1"][0], results["0"][0]):
        assert torch.equal(c1, c0)
        torch.testing.assert_close(r1, r0, atol=1e-3, rtol=1e-3)  # row order may differ
        assert torch.equal(o1, o0)


def test_padded_captured_and_non_int64_rounds_use_flashinfer_methods(monkeypatch):
    """Only pooled rounds of exactly their size, ids the handle can bind, outside
    capture, go direct; the others keep FlashInfer's methods and stay correct."""
    switch = install_capture_switch(monkeypatch)
    rt = _runtime(sizes=(4, 8))
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=1)
    _step(rnd, x, ids, w, s)  # records the receive buffer
    before = _native_calls(rt)
    x5, ids5, w5, s5 = _layer(5, seed=2)  # padded to 8
    torch.testing.assert_close(
        _step(rnd, x5, ids5, w5, s5), reference_moe(x5, ids5, w5, s5), atol=2e-2, rtol=2e-2
    )
    x4, ids4, w4, s4 = _layer(4, seed=3)
    torch.testing.assert_close(  # int32 ids: copied into the static buffer
        _step(rnd, x4, ids4.to(torch.int32), w4, s4),
        reference_moe(x4, ids4, w4, s4),
        atol=2e-2,
        rtol=2e-2,
    )
    switch.active = True  # the fake refuses a direct call under capture: it would escape it
    try:
        _step(rnd, x4, ids4, w4, s4)
    finally:
        switch.active = False
    assert _native_calls(rt) == before
    _step(rnd, x4, ids4, w4, s4)
    assert _native_calls(rt)[0] == before[0] + 1


def test_a_failed_direct_dispatch_ends_the_round(monkeypatch):
    """A direct dispatch that raises leaves no round behind: the next round runs."""
    rt = _runtime()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=4)
    _step(rnd, x, ids, w, s)

    def refuse(*args, **kwargs):
        raise fake_nccl_ep.NcclInvalid("injected")

    with monkeypatch.context() as m:
        m.setattr(fake_nccl_ep.NativeHandle, "dispatch", refuse)
        with pytest.raises(fake_nccl_ep.NcclInvalid, match="injected"):
            rnd.dispatch(x, ids, w)
    assert rt.round.in_flight is None
    torch.testing.assert_close(
        _step(rnd, x, ids, w, s), reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2
    )


def test_a_flashinfer_without_the_attributes_keeps_its_methods_logged_once(monkeypatch, caplog):
    monkeypatch.delattr(fake_moe_ep.Handle, "_op_stream")
    rt = _runtime()
    rnd = rt.round
    ours = logging.getLogger(ROOT)  # under vLLM's logger, which does not propagate
    ours.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=ROOT):
            for i in range(3):
                x, ids, w, s = _layer(8, seed=20 + i)
                out = _step(rnd, x, ids, w, s)
                torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2)
    finally:
        ours.removeHandler(caplog.handler)
    assert _native_calls(rt) == (0, 0, 0)
    # one record (seen once per handler it reached), naming what is missing
    records = {id(r): r for r in caplog.records if "handle methods" in r.getMessage()}
    assert len(records) == 1 and "_op_stream" in next(iter(records.values())).getMessage()


def test_the_descriptor_memo_holds_no_tensor_alive():
    """FlashInfer's memo keeps its tensors alive; descriptors from raw addresses do not,
    so a caller's per-step output is freed when the caller drops it."""
    rt = _runtime()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=5)
    _step(rnd, x, ids, w, s)
    out = torch.empty_like(x)
    d = rnd.dispatch(x, ids, w)
    rnd.combine(scale_expert_rows(d.expert_x, s), out)
    assert len(rt.round.planner.native.memo) > 0
    ref = weakref.ref(out)
    del out, d
    gc.collect()
    assert ref() is None


def test_the_memo_keys_by_address_dtype_and_shape():
    """One descriptor per (address, dtype, shape): the same memory seen with another
    shape or dtype gets its own, the same key the same object."""
    memo = DescriptorMemo()
    buf = torch.zeros(64)
    a, b = buf[:32].view(4, 8), buf[:32].view(8, 4)
    da, db = memo.tensor(fake_nccl_ep, a), memo.tensor(fake_nccl_ep, b)
    assert da is not db and da.sizes == (4, 8) and db.sizes == (8, 4)
    assert memo.tensor(fake_nccl_ep, buf[:32].view(4, 8)) is da
    dc = memo.tensor(fake_nccl_ep, buf[:32].view(torch.int32).view(4, 8))
    assert dc is not da and dc.datatype == torch.int32
    # a descriptor reads whatever lives at its address now
    a.fill_(3.0)
    assert torch.equal(da.buffer, torch.full((4, 8), 3.0))
    small = DescriptorMemo(max_entries=2)
    for n in range(1, 6):
        small.tensor(fake_nccl_ep, buf[:n])
    assert len(small) <= 2 and small.built == 5


def test_fp8_rounds_update_and_combine_directly_and_match_flashinfer_methods(monkeypatch):
    """An FP8-wire round (runtime/fp8_wire.py) re-targets its handle and combines with
    the direct calls from its first round on (it needs no BF16 receive buffer); the same
    rounds through FlashInfer's methods give the same outputs."""
    layers = [_layer(8, seed=30 + i) for i in range(3)]
    results = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(envs.NATIVE_EAGER, setting)
        rt = _runtime()
        rt.enable_fp8_wire()
        rnd = rt.round
        outs = []
        for x, ids, w, s in layers:
            d = rnd.dispatch(x, ids, w, fp8=True)
            rows = (
                d.expert_x.float().view(*d.expert_x.shape[:-1], -1, 128)
                * d.expert_x_scale[..., None]
            )
            expert_out = scale_expert_rows(rows.view(d.expert_x.shape).to(torch.bfloat16), s)
            outs.append(rnd.combine(expert_out, torch.empty_like(x)).clone())
        results[setting] = (outs, _native_calls(rt), rt.fp8_wire.dispatches)
    assert results["1"][1] == (3, 0, 3) and results["0"][1] == (0, 0, 0)
    assert results["1"][2] == results["0"][2] == 3
    for o1, o0 in zip(results["1"][0], results["0"][0]):
        assert torch.equal(o1, o0)


def test_a_row_count_mismatch_is_refused_before_any_direct_call():
    """NCCL-EP does not compare the activation rows with the routing's (FlashInfer's
    dispatch does): a mismatch must never reach the direct dispatch."""
    rt = _runtime()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=6)
    _step(rnd, x, ids, w, s)
    before = _native_calls(rt)
    with pytest.raises(fake_moe_ep.MoEEpConfigError, match="7 activation rows"):
        rnd.dispatch(x[:7], ids, w)
    assert _native_calls(rt) == before and rt.round.in_flight is None


def test_a_handle_on_another_stream_keeps_flashinfer_methods(caplog):
    rt = _runtime()
    for handle in rt.pool.handles.values():
        handle._stream = 5  # not the pool's handle stream (0)
    rnd = rt.round
    for i in range(2):
        x, ids, w, s = _layer(8, seed=40 + i)
        torch.testing.assert_close(
            _step(rnd, x, ids, w, s), reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2
        )
    assert _native_calls(rt) == (0, 0, 0)
    assert not rt.round.planner.native.usable(rt.pool.handles[8])


def test_a_round_left_without_its_combine_does_not_make_the_next_one_direct(monkeypatch):
    """A layer that failed between a direct dispatch and its combine leaves the round
    open; the next round (here captured, with int32 ids: FlashInfer's methods) must
    combine through FlashInfer's methods, not directly (which would escape the capture)."""
    switch = install_capture_switch(monkeypatch)
    rt = _runtime()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=7)
    _step(rnd, x, ids, w, s)
    rnd.dispatch(x, ids, w)  # direct; its combine never comes
    assert rnd.in_flight.issuer is rnd.planner.native
    x4, ids4, w4, s4 = _layer(4, seed=8)
    switch.active = True
    try:
        out = _step(rnd, x4, ids4.to(torch.int32), w4, s4)
    finally:
        switch.active = False
    torch.testing.assert_close(out, reference_moe(x4, ids4, w4, s4), atol=2e-2, rtol=2e-2)


def test_strided_ids_and_expert_outputs_are_made_contiguous_before_a_descriptor():
    """Descriptors carry no strides and the memo's key none either: strided routing
    takes the static buffer, a strided expert output is copied, and both still match."""
    rt = _runtime()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=9)
    _step(rnd, x, ids, w, s)
    strided_ids = torch.empty(TOP_K, 8, dtype=torch.int64).t()
    strided_ids.copy_(ids)
    assert not strided_ids.is_contiguous()
    torch.testing.assert_close(
        _step(rnd, x, strided_ids, w, s), reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2
    )
    before = _native_calls(rt)
    d = rnd.dispatch(x, ids, w)  # direct
    expert_out = scale_expert_rows(d.expert_x, s)
    strided_out = torch.empty(
        expert_out.shape[0], expert_out.shape[2], expert_out.shape[1], dtype=expert_out.dtype
    )
    strided_out = strided_out.transpose(1, 2)
    strided_out.copy_(expert_out)
    assert not strided_out.is_contiguous()
    out = rnd.combine(strided_out, torch.empty_like(x))
    torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2)
    assert _native_calls(rt) == tuple(n + 1 for n in before)
    with pytest.raises(ValueError, match="no strides"):
        DescriptorMemo().tensor(fake_nccl_ep, strided_ids)
