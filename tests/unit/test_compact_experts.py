"""LL experts over the received rows only (vllm/compact_experts.py), on CPU.

The block list is plain tensor code and is checked here against every routing property
that matters (each received row once, in a block of its own expert, within the bound).
The GEMM is vLLM's Triton fused-MoE kernel, absent on CPU: `fused_moe_kernel_standin`
takes its launcher's place (its signature; it refuses quantization flags and scales for
16-bit weights) and `emulate_fused_moe_kernel` computes what the kernel's documented
contract says (and refuses the layouts its launcher refuses), so that
the wiring (views, activation, which rows reach the output) runs through the real LL
prepare/finalize and vLLM's FusedMoEKernel. The kernel itself is compared with vLLM's
batched kernel on the GPU (tests/kernels/test_compact_experts_gpu.py).
"""

from __future__ import annotations

import types

import pytest
import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    biased_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

from tests.fakes.runtime import build_fake_runtime
from tests.unit.test_batched_tiles import RecordingTritonExperts
from tests.unit.test_batched_tiles import _kernel as batched_tiles_kernel
from tests.unit.test_prepare_finalize_cpu import (
    HIDDEN,
    INTER,
    NUM_EXPERTS,
    _apply,
    _assert_bf16_close,
    _moe_config,
    _problem,
    reference_moe,
)
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm import compact_experts
from vllm_flashinfer_ep.vllm.compact_experts import expert_blocks, max_blocks, senders_tokens
from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

CAPACITY = 256


def _routing_counts(tokens: int, experts: int, top_k: int, gen) -> torch.Tensor:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=experts).to(torch.int32)


def _listed_rows(counts, rows, block_m, num_blocks):
    sorted_ids, expert_ids, blocks_rows = expert_blocks(counts, rows, block_m, num_blocks)
    assert sorted_ids.dtype == expert_ids.dtype == blocks_rows.dtype == torch.int32
    assert sorted_ids.shape == (num_blocks * block_m,) and expert_ids.shape == (num_blocks,)
    used = int(blocks_rows) // block_m
    listed = []
    for b in range(used):
        ids = sorted_ids[b * block_m : (b + 1) * block_m]
        real = ids[ids < counts.numel() * rows]
        e = int(expert_ids[b])
        assert e >= 0 and bool(((real // rows) == e).all()), "a block mixes experts"
        listed += real.tolist()
    assert bool((sorted_ids[used * block_m :] == counts.numel() * rows).all())
    return listed


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens", [1, 7, 64, 256])
def test_every_received_row_is_listed_once_in_its_experts_block(block_m, tokens):
    gen = torch.Generator().manual_seed(tokens * block_m)
    experts, rows, top_k = 32, CAPACITY, 4
    counts = _routing_counts(tokens, experts, top_k, gen)
    bound = max_blocks(tokens * top_k, experts, rows, block_m)
    listed = _listed_rows(counts, rows, block_m, bound)
    expected = [e * rows + r for e in range(experts) for r in range(int(counts[e]))]
    assert sorted(listed) == expected


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_the_bound_holds_for_extreme_routings(block_m):
    experts, rows, top_k = 64, CAPACITY, 8
    for tokens in (1, 2, 3, 9, 31, 32, 100, 256):
        bound = max_blocks(tokens * top_k, experts, rows, block_m)
        spread = torch.zeros(experts, dtype=torch.int32)  # rows spread over most experts
        for i in range(tokens * top_k):
            spread[i % experts] += 1
        packed = torch.zeros(experts, dtype=torch.int32)  # every token on the same top_k
        packed[:top_k] = tokens
        for counts in (spread, packed):
            need = int(((counts + block_m - 1) // block_m).sum())
            assert need <= bound, (tokens, block_m, need, bound)
            assert sorted(_listed_rows(counts, rows, block_m, bound)) == sorted(
                e * rows + r for e in range(experts) for r in range(int(counts[e]))
            )


def test_the_launch_follows_the_batch_not_the_buffer():
    # The point: a decode token of a 128-expert model lists 8 blocks, not 128 x 16.
    assert max_blocks(1 * 8, 128, CAPACITY, 16) == 8
    # 2048 rows: 128 full blocks plus at most one partial block per expert.
    assert max_blocks(256 * 8, 128, CAPACITY, 16) == 256 < 128 * CAPACITY // 16
    assert max_blocks(10**6, 128, CAPACITY, 16) == 128 * CAPACITY // 16  # the buffer's own


def test_a_short_list_leaves_rows_out():
    # What the bound guards against (a planted undersized list drops received rows).
    counts = torch.tensor([3, 0, 5], dtype=torch.int32)
    assert len(_listed_rows(counts, 8, 2, 3)) < 8


def test_senders_tokens_reads_the_dp_metadata_for_several_senders(monkeypatch):
    import vllm.forward_context as fc

    assert senders_tokens(5, 1, CAPACITY) == 5
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: False)
    assert senders_tokens(5, 4, CAPACITY) == CAPACITY  # unknown: the buffer's bound
    dp = types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor([3, 9, 2, 5]))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: types.SimpleNamespace(dp_metadata=dp))
    assert senders_tokens(5, 4, CAPACITY) == 9
    assert senders_tokens(5, 4, 8) == 8
    # A pooled round knows what every rank sent (its handle size, padding included).
    assert senders_tokens(5, 4, CAPACITY, sent_per_rank=16) == 16
    assert senders_tokens(5, 1, CAPACITY, sent_per_rank=8) == 8


# ------------------------------------------------------------ wiring, through the kernel
calls: list[dict] = []


def emulate_fused_moe_kernel(a, w, c, blocks, config, compute_type) -> None:
    """vLLM's fused_moe_kernel with top_k=1 and a block list: for each used block,
    c[row, 0] = a[row] @ w[expert].T over its listed rows; sentinel rows are masked."""
    sorted_ids, expert_ids, blocks_rows = blocks
    bm = config["BLOCK_SIZE_M"]
    assert sorted_ids.dtype == torch.int32 and sorted_ids.stride(0) == 1
    assert a.dim() == 2 and c.dim() == 3 and c.shape[1] == 1 and a.shape[0] == c.shape[0]
    assert w.shape[2] == a.shape[1] and w.shape[1] == c.shape[2]
    assert sorted_ids.numel() % bm == 0
    calls.append({"blocks": sorted_ids.numel() // bm, "block_m": bm})
    for b in range(sorted_ids.numel() // bm):
        if b * bm >= int(blocks_rows):
            break
        ids = sorted_ids[b * bm : (b + 1) * bm].long()
        ids = ids[ids < a.shape[0]]
        e = int(expert_ids[b])
        c[ids, 0] = (a[ids].float() @ w[e].float().T).to(c.dtype)


def _kernel(top_k: int, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[1, 13]
    )
    # Calls that reach vLLM's own apply (its batched kernel) are recorded in `tiles`.
    return batched_tiles_kernel(rt, top_k, quant_config=quant_config)


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
    """vLLM 0.33.0's `invoke_fused_moe_triton_kernel` (its signature) for 16-bit weights,
    top_k 1 and no routing weights: refuses any quantization flag or scale, then computes
    as `emulate_fused_moe_kernel`."""
    import triton.language as tl

    assert A.dtype == B.dtype == C.dtype and A.dtype in (torch.bfloat16, torch.float16)
    assert compute_type == (tl.bfloat16 if A.dtype == torch.bfloat16 else tl.float16)
    assert A_scale is None and B_scale is None and topk_weights is None and B_bias is None
    assert not (use_fp8_w8a8 or use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16)
    assert not per_channel_quant and block_shape is None
    assert top_k == 1 and not mul_routed_weight
    blocks = (sorted_token_ids, expert_ids, num_tokens_post_padded)
    emulate_fused_moe_kernel(A, B, C, blocks, config, compute_type)


@pytest.fixture
def emulated(monkeypatch, fake):
    from vllm.model_executor.layers.fused_moe import fused_moe as vllm_fused_moe

    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    monkeypatch.setattr(vllm_fused_moe, "invoke_fused_moe_triton_kernel", fused_moe_kernel_standin)
    calls.clear()
    return fake


@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_received_rows_experts_match_the_reference(emulated, top_k, num_tokens):
    kernel, experts = _kernel(top_k)
    x, w1, w2, ids, weights = _problem(num_tokens, top_k, seed=num_tokens + top_k)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))
    assert experts.tiles == []
    # Both GEMMs launched over at most the rows this batch can bring, not the buffer.
    assert len(calls) == 2 and all(c["blocks"] <= num_tokens * top_k for c in calls)


def test_a_disabled_switch_keeps_vllm_s_batched_kernel(emulated, monkeypatch):
    monkeypatch.setattr(compact_experts, "ENABLED", False)
    kernel, experts = _kernel(2)
    x, w1, w2, ids, weights = _problem(3, 2, seed=1)
    _assert_bf16_close(
        _apply(kernel, x, w1, w2, ids, weights, False),
        reference_moe(x, w1, w2, ids, weights, False),
    )
    assert len(experts.tiles) == 1 and not calls


def test_biased_experts_are_refused_at_load(emulated):
    # Neither vLLM's batched kernel nor the received-rows path applies expert biases:
    # building the kernel (vLLM's post_init_setup) refuses instead of dropping them.
    bias1 = torch.zeros(NUM_EXPERTS, 2 * INTER, dtype=torch.bfloat16)
    bias2 = torch.zeros(NUM_EXPERTS, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(FlashInferEPConfigError, match="--all2all-backend"):
        _kernel(2, biased_moe_quant_config(bias1, bias2))


def test_several_senders_without_dp_metadata_bound_by_the_per_rank_capacity(emulated):
    # Two senders, no forward context: each may send the LL capacity per rank, so the
    # list covers 2 x capacity x top_k rows (not the buffer's 2 x capacity rows per
    # expert taken as a per-sender count).
    top_k, senders = 2, 2
    experts = RecordingTritonExperts(
        _moe_config(top_k, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=CAPACITY,
        num_dispatchers=senders,
    )
    experts.tiles, experts.fail = [], False
    assert compact_experts.install(experts)
    rows = CAPACITY * senders
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int32)
    counts[:top_k] = 3
    hidden = torch.randn(NUM_EXPERTS, rows, HIDDEN).to(torch.bfloat16)
    out = torch.empty(NUM_EXPERTS, rows, HIDDEN, dtype=torch.bfloat16)
    _, w1, w2, _, _ = _problem(1, top_k, seed=9)
    experts.apply(
        output=out,
        hidden_states=hidden,
        w1=w1,
        w2=w2,
        topk_weights=None,
        topk_ids=torch.zeros(3, top_k, dtype=torch.int64),
        activation=MoEActivation.SILU,
        global_num_experts=NUM_EXPERTS,
        expert_map=None,
        a1q_scale=None,
        a2_scale=None,
        workspace13=torch.empty(NUM_EXPERTS * rows * 2 * INTER, dtype=torch.bfloat16),
        workspace2=torch.empty(NUM_EXPERTS * rows * INTER, dtype=torch.bfloat16),
        expert_tokens_meta=mk.ExpertTokensMetadata(
            expert_num_tokens=counts, expert_num_tokens_cpu=None
        ),
        apply_router_weight_on_input=False,
    )
    bm = calls[0]["block_m"]
    assert calls[0]["blocks"] == max_blocks(CAPACITY * senders * top_k, NUM_EXPERTS, rows, bm)
    expected = hidden[0, :3].float() @ w1[0].float().T
    d = INTER
    act = (torch.nn.functional.silu(expected[:, :d]) * expected[:, d:]).to(torch.bfloat16)
    torch.testing.assert_close(
        out[0, :3].float(),
        (act.float() @ w2[0].float().T),
        rtol=3e-2,
        atol=3e-2 * float(out[0, :3].abs().max()),
    )


def test_installing_twice_wraps_once(emulated):
    kernel, experts = _kernel(2)
    x, w1, w2, ids, weights = _problem(1, 2, seed=4)
    _apply(kernel, x, w1, w2, ids, weights, False)
    wrapped = experts.apply
    assert compact_experts.install(experts) and experts.apply is wrapped


def test_a_padded_round_lists_the_padded_rows_too(emulated):
    """One real token padded onto a 64-token handle: 128 rows arrive (the pad rows go to
    every local expert), far more than one token's top_k. The block list must cover them
    all, or the real token's rows, listed after the pad rows of lower experts, are dropped."""
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[64]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, agreement_fn=lambda n: 64)
    experts = RecordingTritonExperts(
        _moe_config(2, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    experts.tiles, experts.fail = [], False
    kernel = mk.FusedMoEKernel(pf, experts)
    x, w1, w2, _, weights = _problem(1, 2, seed=21)
    ids = torch.tensor([[NUM_EXPERTS - 1, NUM_EXPERTS - 2]])  # the last experts: listed last
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))
    assert rt.pool.counters.padded_rounds == 1 and experts.tiles == []
    assert rt.round.sent_per_rank is None  # the round ended
