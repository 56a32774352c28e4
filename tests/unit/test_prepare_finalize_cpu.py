"""The prepare/finalize classes inside vLLM 0.33.0's real modular kernel, on CPU.

`mk.FusedMoEKernel` (0.33.0's name for the modular kernel) runs prepare -> experts ->
finalize over the fake NCCL-EP transport and is compared with a plain torch MoE
(SiLU-gated MLP per expert, BF16).

Experts on this host. vLLM 0.33.0 cannot run any of its experts on a CPU-only host
with this wheel as they are:
- `NaiveBatchedExperts` (the torch batched reference, experts/fused_batched_moe.py)
  calls `torch.ops._C.silu_and_mul` through `apply_moe_activation` (vllm._C is not
  importable here) and `_is_capturing_or_compiling()`, which asks
  `torch.accelerator.current_stream()` and raises "Found no NVIDIA driver".
- The Standard-format CPU experts (`CPUUnquantizedExperts`, experts/cpu_moe.py) need
  vllm._C's `cpu_fused_moe`; `TritonExperts` needs Triton on a GPU; and the
  weight-and-reduce that our HT finalize picks for delegating experts,
  `TopKWeightAndReduceContiguous`, calls `ops.moe_sum` (torch.ops._moe_C).
So LL runs vLLM's own `NaiveBatchedExperts` loop with two shims (a torch SiLU-and-mul,
and the capture probe answered by the test), and HT runs a minimal torch
Standard-format `FusedMoEExpertsModular` written here, with `ops.moe_sum` replaced by
its torch equivalent where the Contiguous reduce is exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import vllm._custom_ops as vllm_ops
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceDelegate,
    TopKWeightAndReduceNoOP,
)

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import moe_config, patch_row
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT as HT_BACKEND
from vllm_flashinfer_ep.backends import LOW_LATENCY as LL_BACKEND
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm.prepare_finalize import (
    FlashInferEPHighThroughputPrepareAndFinalize,
    FlashInferEPLowLatencyPrepareAndFinalize,
)

HIDDEN = 2048  # smallest NCCL-EP LL hidden size
INTER = 64  # intermediate size per partition (w1 is [E, 2 * INTER, HIDDEN])
NUM_EXPERTS = 8
CAPACITY = 16
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_capture_probe(monkeypatch, fake):
    # No driver: answer NaiveBatchedExperts' capture probe (it would raise).
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: False)
    return fake


def _moe_config(top_k: int, backend: str) -> FusedMoEConfig:
    return moe_config(
        experts=NUM_EXPERTS,
        top_k=top_k,
        hidden=HIDDEN,
        inter=INTER,
        max_num_tokens=CAPACITY,
        backend=backend,
    )


def _silu_and_mul(output: torch.Tensor, input: torch.Tensor) -> None:
    d = input.shape[-1] // 2
    output.copy_(F.silu(input[..., :d]) * input[..., d:])


class TorchActNaiveBatchedExperts(fused_batched_moe.NaiveBatchedExperts):
    """vLLM's NaiveBatchedExperts with a torch SiLU-and-mul (vllm._C is absent here)."""

    def activation(self, activation, output, input, **kwargs) -> None:
        assert activation == MoEActivation.SILU
        _silu_and_mul(output, input)


class NoOpReduceBatchedExperts(TorchActNaiveBatchedExperts):
    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()


class TorchStandardExperts(mk.FusedMoEExpertsModular):
    """Minimal Standard-format experts: rows [M, K] with per-row global topk ids.

    `reduce_here=False`: writes unweighted per-(row, k) outputs [M, topk, K] and leaves
    weighting to the P/F (TopKWeightAndReduceDelegate), like TritonExperts.
    `reduce_here=True`: weighs and reduces itself into [M, K] (TopKWeightAndReduceNoOP),
    like the CPU experts.
    """

    reduce_here = False

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True

    def workspace_shapes(
        self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation
    ):
        out = (M, K) if self.reduce_here else (M, topk, K)
        return (0,), (0,), out

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP() if self.reduce_here else TopKWeightAndReduceDelegate()

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ) -> None:
        assert activation == MoEActivation.SILU
        local_ids = expert_map[topk_ids] if expert_map is not None else topk_ids
        per_slot = torch.zeros(*topk_ids.shape, hidden_states.shape[1], dtype=torch.float32)
        for e in range(w1.shape[0]):
            rows, slots = (local_ids == e).nonzero(as_tuple=True)
            if rows.numel():
                per_slot[rows, slots] = _expert_mlp(hidden_states[rows], w1[e], w2[e])
        if self.reduce_here:
            if not apply_router_weight_on_input:
                per_slot = per_slot * topk_weights.float().unsqueeze(-1)
            output.copy_(per_slot.sum(dim=1).to(output.dtype))
        else:
            output.copy_(per_slot.to(output.dtype))


class ReducingStandardExperts(TorchStandardExperts):
    reduce_here = True


def _expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP of one expert in fp32 (vLLM layout: gate = first half of w1)."""
    h = x.float() @ w1.float().t()
    d = h.shape[-1] // 2
    return (F.silu(h[:, :d]) * h[:, d:]) @ w2.float().t()


def reference_moe(x, w1, w2, ids, weights, apply_router_weight_on_input):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            w = float(weights[t, k])
            if apply_router_weight_on_input:
                xin = (x[t : t + 1].float() * w).to(x.dtype)
                out[t] += _expert_mlp(xin, w1[e], w2[e])[0]
            else:
                out[t] += w * _expert_mlp(x[t : t + 1], w1[e], w2[e])[0]
    return out


def _problem(num_tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    w1 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(
        torch.bfloat16
    )
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, top_k, CPU, gen)
    return x, w1, w2, ids, weights


def _assert_bf16_close(out, expected):
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * scale)


def _ll_kernel(rt, top_k, experts_cls=TorchActNaiveBatchedExperts, uniform=True, rounds=None):
    pf = FlashInferEPLowLatencyPrepareAndFinalize(
        rt, agreement_fn=lambda n: "local" if uniform else None, round_split=rounds
    )
    # Built the way vLLM's oracle builds batched experts (oracle/unquantized.py).
    experts = experts_cls(
        _moe_config(top_k, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    return mk.FusedMoEKernel(pf, experts)


def _apply(kernel, x, w1, w2, ids, weights, on_input):
    return kernel.apply(
        hidden_states=x,
        w1=w1,
        w2=w2,
        topk_weights=weights,
        topk_ids=ids,
        activation=MoEActivation.SILU,
        global_num_experts=NUM_EXPERTS,
        expert_map=None,
        apply_router_weight_on_input=on_input,
    )


CASES = [
    pytest.param(1, False, id="top1"),
    pytest.param(1, True, id="top1-weight-on-input"),
    pytest.param(2, False, id="top2"),
    pytest.param(4, False, id="top4"),
]


# ------------------------------------------------------------------------- LL
@pytest.mark.parametrize(("top_k", "on_input"), CASES)
@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("uniform", [True, False], ids=["pooled", "fresh"])
def test_ll_modular_kernel_matches_torch_moe(top_k, on_input, num_tokens, uniform):
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[1, 13]
    )
    kernel = _ll_kernel(rt, top_k, uniform=uniform)
    x, w1, w2, ids, weights = _problem(num_tokens, top_k, seed=num_tokens * 7 + top_k)
    out = _apply(kernel, x, w1, w2, ids, weights, on_input)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, on_input))
    tail = (
        ["dispatch", "combine"] if uniform else ["create_handle", "dispatch", "combine", "destroy"]
    )
    assert [c.op for c in fleet.log[-len(tail) :]] == tail
    assert {c.tokens for c in fleet.log[-len(tail) :]} == {num_tokens}
    assert rt.round.in_flight is None  # round ended
    assert fleet.handles_alive == 2  # the two pooled sizes; a fresh handle is gone


def test_ll_modular_kernel_on_a_padded_pooled_handle_matches_torch_moe():
    """An eager step of 5 tokens whose ranks agreed on 7 runs on the pooled 8-token handle;
    the padded rows reach the experts (as zeros) and leave vLLM's output untouched."""
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[4, 8]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt, agreement_fn=lambda n: 7)
    experts = TorchActNaiveBatchedExperts(
        _moe_config(2, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    kernel = mk.FusedMoEKernel(pf, experts)
    x, w1, w2, ids, weights = _problem(5, 2, seed=3)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    assert out.shape == x.shape
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))
    assert [(c.op, c.tokens) for c in fleet.log[-3:]] == [
        ("update", 8),
        ("dispatch", 8),
        ("combine", 8),
    ]
    assert rt.pool.counters.padded_rounds == 1 and rt.pool.counters.fresh_created == 0


def _split_kernel(rt, top_k, step_agreement, world_size=1):
    """An LL kernel whose forwards above the fleet capacity run as several rounds (its
    prepare/finalize carries a RoundSplit; the test applies the `round_split` row)."""
    from vllm_flashinfer_ep.vllm.round_chunks import RoundSplit

    return _ll_kernel(rt, top_k, rounds=RoundSplit(rt.capacity, world_size, step_agreement))


@pytest.mark.parametrize("on_input", [False, True], ids=["weight-after", "weight-on-input"])
@pytest.mark.usefixtures("round_split_row")
def test_ll_forward_above_the_capacity_runs_as_rounds_and_matches_torch_moe(on_input):
    """40 tokens through a 16-token fleet: rounds of 16, 16 and 8 on pooled handles."""
    top_k = 1 if on_input else 2
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[8, 16]
    )
    kernel = _split_kernel(rt, top_k, lambda n: "local")
    x, w1, w2, ids, weights = _problem(40, top_k, seed=5)
    out = _apply(kernel, x, w1, w2, ids, weights, on_input)
    assert out.shape == x.shape
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, on_input))
    rounds = [c.tokens for c in fleet.log if c.op == "dispatch"]
    assert rounds == [16, 16, 8] and rt.pool.counters.fresh_created == 0


@pytest.mark.usefixtures("round_split_row")
def test_a_rank_whose_tokens_end_early_joins_every_round_of_the_largest_rank():
    """The largest EP rank runs 50 tokens, this one 20: both run four rounds (16, 16, 16,
    2); this rank's last two carry padding and one zero-weight row, and its 20 outputs
    are the torch MoE's."""
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[2, 8, 16]
    )
    kernel = _split_kernel(rt, 2, lambda n: 50)
    x, w1, w2, ids, weights = _problem(20, 2, seed=9)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    assert out.shape == x.shape
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))
    assert [c.tokens for c in fleet.log if c.op == "dispatch"] == [16, 16, 16, 2]
    assert rt.round.in_flight is None


@pytest.mark.usefixtures("round_split_row")
def test_without_an_agreed_count_several_ranks_refuse_to_split_before_any_round():
    """No count agreed (no DP metadata) and two EP ranks: each would cut its own rounds
    and mis-pair the collectives, so a forward above the capacity is refused; one rank
    alone splits."""
    from vllm_flashinfer_ep.errors import DispatchCapacityError

    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[16]
    )
    kernel = _split_kernel(rt, 2, lambda n: "local", world_size=2)
    x, w1, w2, ids, weights = _problem(40, 2, seed=4)
    with pytest.raises(DispatchCapacityError, match="no count agreed"):
        _apply(kernel, x, w1, w2, ids, weights, False)
    assert not [c for c in fleet.log if c.op == "dispatch"]


@pytest.mark.usefixtures("round_split_row")
def test_a_rank_with_no_token_in_a_split_forward_returns_an_empty_output():
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[1, 16]
    )
    kernel = _split_kernel(rt, 2, lambda n: 20)
    x, w1, w2, ids, weights = _problem(1, 2, seed=4)
    out = _apply(kernel, x[:0], w1, w2, ids[:0], weights[:0], False)
    assert out.shape == (0, HIDDEN)
    assert [c.tokens for c in fleet.log if c.op == "dispatch"] == [16, 16]


@pytest.mark.usefixtures("round_split_row")
def test_a_kernel_whose_implementation_vllm_swaps_still_splits():
    """vLLM may rebuild the kernel's implementation after load (LoRA): the round's count
    goes to the prepare/finalize the kernel holds at the call."""
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[8, 16]
    )
    kernel = _split_kernel(rt, 2, lambda n: 40)
    # a new prepare/finalize whose own agreement is the forward's count (40, above the
    # capacity), as vLLM's DP metadata would give it, with the manager's RoundSplit
    pf = FlashInferEPLowLatencyPrepareAndFinalize(
        rt, agreement_fn=lambda n: 40, round_split=kernel.prepare_finalize.round_split
    )
    experts = TorchActNaiveBatchedExperts(
        _moe_config(2, LL_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=pf.max_num_tokens_per_rank(),
        num_dispatchers=pf.num_dispatchers(),
    )
    kernel.impl = mk.FusedMoEKernel(pf, experts).impl
    x, w1, w2, ids, weights = _problem(40, 2, seed=6)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))


def test_the_round_split_row_wraps_vllm_s_apply_on_the_class_and_undo_restores_it():
    """Rounds reach a kernel through the patch table only: applied, vLLM's class carries
    the split and no kernel object is changed; undone, the same kernel runs a 40-token
    forward whole, which its 16-token fleet refuses before any round."""
    from vllm_flashinfer_ep.errors import DispatchCapacityError
    from vllm_flashinfer_ep.vllm.patches import _helper

    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[8, 16]
    )
    kernel = _split_kernel(rt, 2, lambda n: "local")
    x, w1, w2, ids, weights = _problem(40, 2, seed=7)
    with patch_row("round_split") as row:
        vllm_s = _helper.original(row)
        assert mk.FusedMoEKernel.apply is not vllm_s and "apply" not in vars(kernel)
        _assert_bf16_close(
            _apply(kernel, x, w1, w2, ids, weights, False),
            reference_moe(x, w1, w2, ids, weights, False),
        )
        assert [c.tokens for c in fleet.log if c.op == "dispatch"] == [16, 16, 8]
        _helper.undo(row)
        assert mk.FusedMoEKernel.apply is vllm_s
        before = len(fleet.log)
        with pytest.raises(DispatchCapacityError):
            _apply(kernel, x, w1, w2, ids, weights, False)
        assert not [c for c in fleet.log[before:] if c.op == "dispatch"]


@pytest.mark.usefixtures("round_split_row")
def test_a_forward_within_the_capacity_is_one_round():
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[16]
    )
    kernel = _split_kernel(rt, 2, lambda n: 16)
    x, w1, w2, ids, weights = _problem(13, 2, seed=2)
    _assert_bf16_close(
        _apply(kernel, x, w1, w2, ids, weights, False),
        reference_moe(x, w1, w2, ids, weights, False),
    )
    assert [c.tokens for c in fleet.log if c.op == "dispatch"] == [16]


def test_ll_combine_ignores_padding_rows_the_experts_compute(monkeypatch):
    # Under graphs NaiveBatchedExperts computes every row of the batched buffer,
    # including the padding past each expert's count (garbage; NaN in the fake).
    monkeypatch.setattr(fused_batched_moe, "_is_capturing_or_compiling", lambda: True)
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[5]
    )
    kernel = _ll_kernel(rt, 2)
    x, w1, w2, ids, weights = _problem(5, 2, seed=11)
    out = _apply(kernel, x, w1, w2, ids, weights, False)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, False))


def test_ll_declared_properties_fit_vllm_s_batched_experts():
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2, sizes=[4]
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    assert pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts
    assert pf.topk_indices_dtype() == torch.int64
    assert pf.max_num_tokens_per_rank() == CAPACITY
    assert pf.num_dispatchers() == 1
    assert pf.output_is_reduced() is True
    assert pf.supports_async() is False
    kernel = _ll_kernel(rt, 2)
    experts = kernel.fused_experts
    assert experts.activation_format() == pf.activation_format
    assert isinstance(experts.finalize_weight_and_reduce_impl(), TopKWeightAndReduceDelegate)
    # The experts' batched output (from max_num_tokens x num_dispatchers) has exactly
    # the shape of the buffer the LL dispatch hands them.
    x, _, _, ids, weights = _problem(4, 2, seed=12)
    a1q, scale, meta, topk_ids, topk_w = pf.prepare(
        x, weights, ids, NUM_EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG
    )
    rt.round.end()
    assert scale is None and topk_ids is None and topk_w is None
    assert meta.expert_num_tokens.dtype == torch.int32
    shapes = experts.workspace_shapes(
        4, 2 * INTER, HIDDEN, 2, NUM_EXPERTS, NUM_EXPERTS, meta, MoEActivation.SILU
    )
    assert shapes[2] == tuple(a1q.shape) == (NUM_EXPERTS, CAPACITY * pf.num_dispatchers(), HIDDEN)


def test_ll_num_dispatchers_is_the_ep_world():
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, world_size=2, rank=1
    )
    pf = FlashInferEPLowLatencyPrepareAndFinalize(rt)
    assert pf.num_dispatchers() == 2 and pf.max_num_tokens_per_rank() == CAPACITY


def test_ll_refuses_experts_that_weigh_themselves():
    """Checked once, when vLLM builds the kernel (post_init_setup), before any round."""
    rt, fleet = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=CAPACITY, top_k=2)
    with pytest.raises(FlashInferEPConfigError, match="applies routing weights in its combine"):
        _ll_kernel(rt, 2, experts_cls=NoOpReduceBatchedExperts)
    assert fleet.handles_created == 0 and fleet.calls("dispatch") == []


# ------------------------------------------------------------------------- HT
@pytest.fixture
def torch_moe_sum(monkeypatch):
    def moe_sum(input, output, topk_ids=None, expert_map=None):
        output.copy_(input.sum(dim=1))

    monkeypatch.setattr(vllm_ops, "moe_sum", moe_sum)


def _ht_kernel(rt, experts_cls):
    pf = FlashInferEPHighThroughputPrepareAndFinalize(rt)
    experts = experts_cls(_moe_config(rt.pool.top_k, HT_BACKEND), FUSED_MOE_UNQUANTIZED_CONFIG)
    return mk.FusedMoEKernel(pf, experts)


@pytest.mark.usefixtures("torch_moe_sum")
@pytest.mark.parametrize("experts_cls", [TorchStandardExperts, ReducingStandardExperts])
@pytest.mark.parametrize(("top_k", "on_input"), CASES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_ht_modular_kernel_matches_torch_moe(experts_cls, top_k, on_input, num_tokens):
    rt, fleet = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=CAPACITY, top_k=top_k, sizes=[1, 13]
    )
    kernel = _ht_kernel(rt, experts_cls)
    x, w1, w2, ids, weights = _problem(num_tokens, top_k, seed=num_tokens * 5 + top_k)
    out = _apply(kernel, x, w1, w2, ids, weights, on_input)
    _assert_bf16_close(out, reference_moe(x, w1, w2, ids, weights, on_input))
    assert [c.op for c in fleet.log[-2:]] == ["dispatch", "combine"]
    assert rt.round.in_flight is None


def test_ht_declared_properties():
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=CAPACITY, world_size=2
    )
    pf = FlashInferEPHighThroughputPrepareAndFinalize(rt)
    assert pf.activation_format == mk.FusedMoEActivationFormat.Standard
    assert pf.topk_indices_dtype() == torch.int64
    assert pf.max_num_tokens_per_rank() is None
    assert pf.num_dispatchers() == 2
    assert pf.output_is_reduced() is True
    assert pf.supports_async() is False


def test_formats_must_match_the_experts():
    rt, _ = build_fake_runtime(Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, capacity=CAPACITY)
    batched = TorchActNaiveBatchedExperts(
        _moe_config(2, HT_BACKEND),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=CAPACITY,
        num_dispatchers=1,
    )
    with pytest.raises(AssertionError):
        mk.FusedMoEKernel(FlashInferEPHighThroughputPrepareAndFinalize(rt), batched)
