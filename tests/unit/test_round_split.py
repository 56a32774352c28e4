"""The `round_split` row (vllm/patches/worker.py `make_kernel_apply`) and RoundSplit's
cut of one forward (vllm/round_chunks.py), on CPU with recorded calls. Whole LL forwards
through the row, against the torch MoE: tests/unit/test_prepare_finalize_cpu.py and
tests/unit/test_dp_agreement.py."""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk

from vllm_flashinfer_ep.vllm import patches
from vllm_flashinfer_ep.vllm.patches import worker
from vllm_flashinfer_ep.vllm.round_chunks import RoundSplit

HIDDEN, TOP_K = 8, 2
ROW = patches.BY_NAME["round_split"]


class Recorder:
    """vLLM's `apply` stand-in with its parameters (and one it may add later): each call's
    arguments by name, returning its input."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(
        self,
        kernel,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        apply_router_weight_on_input,
        shared_experts=None,
        shared_experts_input=None,
        added_later=None,
    ):
        call = dict(locals())
        del call["self"]
        self.calls.append(call)
        return hidden_states.clone()


class PrepareFinalize:
    """What the split reads of a prepare/finalize: its RoundSplit and `agreed_as`."""

    def __init__(self, round_split=None) -> None:
        self.round_split = round_split
        self.counts: list[int] = []

    @contextlib.contextmanager
    def agreed_as(self, count: int):
        self.counts.append(count)
        yield


def _forward(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.randint(0, 4, (tokens, TOP_K), generator=gen)
    return x, torch.rand(tokens, TOP_K, generator=gen), ids


def test_the_row_s_target_is_vllm_s_apply_with_its_parameters():
    expect = tuple(inspect.signature(mk.FusedMoEKernel.apply).parameters)
    assert ROW.target.endswith("modular_kernel:FusedMoEKernel.apply") and ROW.expect == expect
    assert ROW.entry() in patches.index()


def test_a_kernel_without_rounds_gets_every_argument_by_vllm_s_name():
    """vLLM's quantization methods call `apply` by keyword; positional calls reach the
    same parameters, and nothing is split or renamed."""
    vllm_s = Recorder()
    apply = worker.make_kernel_apply(vllm_s)
    kernel = SimpleNamespace(prepare_finalize=PrepareFinalize())
    x, weights, ids = _forward(5)
    w1, w2, shared, shared_in = object(), object(), object(), torch.zeros(5, HIDDEN)
    out = apply(kernel, x, w1, w2, weights, ids, "silu", 4, None, True, shared, shared_in)
    assert torch.equal(out, x) and len(vllm_s.calls) == 1
    call = vllm_s.calls[0]
    assert call["kernel"] is kernel and call["hidden_states"] is x
    assert call["topk_weights"] is weights and call["topk_ids"] is ids
    assert (call["w1"], call["w2"]) == (w1, w2)
    rest = dict(
        activation="silu",
        global_num_experts=4,
        expert_map=None,
        apply_router_weight_on_input=True,
        shared_experts=shared,
    )
    assert {name: call[name] for name in rest} == rest
    assert call["shared_experts_input"] is shared_in
    assert kernel.prepare_finalize.counts == []


def test_an_argument_this_package_does_not_know_reaches_vllm_on_both_paths():
    """A later vLLM 0.33.x may add a parameter to `apply`: a kernel without rounds passes
    it as called, a split one to every round."""
    x, weights, ids = _forward(20, seed=3)
    args = (None, None, weights, ids, "silu", 4, None, False)
    for rounds, calls in ((None, 1), (RoundSplit(16, 1, lambda n: "local"), 2)):
        vllm_s = Recorder()
        kernel = SimpleNamespace(prepare_finalize=PrepareFinalize(rounds))
        worker.make_kernel_apply(vllm_s)(kernel, x, *args, added_later="kept")
        assert [c["added_later"] for c in vllm_s.calls] == ["kept"] * calls


def test_a_split_forward_gives_each_round_its_rows_and_its_agreed_count():
    """40 tokens, rounds of 16: three calls of 16, 16 and 8 rows, each under its count,
    with the shared experts' input cut like the hidden states; the outputs join in order."""
    vllm_s = Recorder()
    pf = PrepareFinalize(RoundSplit(16, 1, lambda n: "local"))
    kernel = SimpleNamespace(prepare_finalize=pf)
    x, weights, ids = _forward(40, seed=1)
    shared_in = x * 2
    out = worker.make_kernel_apply(vllm_s)(
        kernel, x, None, None, weights, ids, "silu", 4, None, False, None, shared_in
    )
    assert torch.equal(out, x) and pf.counts == [16, 16, 8]
    for call, start in zip(vllm_s.calls, (0, 16, 32), strict=True):
        rows = slice(start, start + 16)
        assert torch.equal(call["hidden_states"], x[rows])
        assert torch.equal(call["topk_ids"], ids[rows])
        assert torch.equal(call["topk_weights"], weights[rows])
        assert torch.equal(call["shared_experts_input"], shared_in[rows])


def test_a_rank_past_its_tokens_sends_a_zero_weight_row_with_a_matching_shared_input():
    """The largest rank has 40 tokens, this one 10: its second and third rounds carry one
    zero row with weight 0, and the shared experts see that row too; only its own 10
    outputs come back."""
    vllm_s = Recorder()
    pf = PrepareFinalize(RoundSplit(16, 2, lambda n: 40))
    x, weights, ids = _forward(10, seed=2)
    out = worker.make_kernel_apply(vllm_s)(
        SimpleNamespace(prepare_finalize=pf), x, None, None, weights, ids, "silu", 4, None,
        False, None, x + 1,
    )  # fmt: skip
    assert torch.equal(out, x) and pf.counts == [16, 16, 8]
    for call in vllm_s.calls[1:]:
        assert call["hidden_states"].shape == (1, HIDDEN) and not call["hidden_states"].any()
        assert not call["topk_weights"].any()
        assert call["shared_experts_input"] is call["hidden_states"]
