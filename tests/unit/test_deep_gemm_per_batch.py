"""Block-FP8 LL layers on DeepGEMM choosing per forward (vllm/deep_gemm_per_batch.py), on CPU.

vLLM 0.33.0's own `BatchedDeepGemmExperts` (its apply, DeepGEMM, absent here, replaced by
a recorder) gets the instance patch the LL setup hook applies. A forward whose rows per
expert (tokens over all ranks x top_k / experts) are at most the bound runs
the received-rows experts, with vLLM's fused-MoE kernel and group quantization replaced
by the stand-ins of test_compact_experts_fp8.py, and must compute what each received
row's expert computes; any other reaches vLLM's apply with the scales MN-major. The bound
is VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS (4 by default), read at install. On the
GPU: tests/kernels/test_deep_gemm_experts_gpu.py compares the choice's two sides with
vLLM's batched experts on one receive buffer.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.unit import test_deep_gemm_experts
from tests.unit.test_compact_experts_fp8 import (  # noqa: F401 - fixtures
    CAP,
    EXPERTS,
    G,
    VllmBatchedExperts,
    _block_weights,
    _call,
    _expert_outputs,
    _fp8_path_on,
    _moe_config,
    _qc,
    _received_buffer,
    _rel,
    rec,
    standins,
)
from vllm_flashinfer_ep.vllm import deep_gemm_experts, deep_gemm_per_batch
from vllm_flashinfer_ep.vllm.patches import _helper

TOP_K = 2  # _call's routing width


class RecordingDeepGemm(test_deep_gemm_experts.RecordingDeepGemm):
    """vLLM's BatchedDeepGemmExperts whose own apply (DeepGEMM) records what it got; the
    activation is a torch SiLU-and-mul (vllm._C is absent here)."""

    activation = VllmBatchedExperts.activation


@pytest.fixture
def experts(monkeypatch):
    """A DeepGEMM experts object with the patch installed at `bound` (None: the package
    variable's); undone after."""

    def build(bound: float | None, dispatchers: int = 1, sent=None, seed: int = 0):
        monkeypatch.setattr(deep_gemm_per_batch, "RECEIVED_ROWS_UP_TO", bound)
        (q1, s1, d1), (q2, s2, d2) = _block_weights(seed)
        e = RecordingDeepGemm(
            _moe_config(TOP_K),
            _qc("block", s1, s2),
            max_num_tokens=CAP // dispatchers,
            num_dispatchers=dispatchers,
        )
        assert deep_gemm_per_batch.install(e, (lambda: sent) if sent is not None else None)
        return e, (q1, q2, d1, d2)

    yield build
    _helper.undo_instances()


def _is_mn_major(s: torch.Tensor) -> bool:
    experts, rows, groups = s.shape
    return s.stride() == (rows * groups, 1, rows)


def _counts(tokens: int) -> list[int]:
    """tokens x top_k rows over the experts, none of them more than the buffer holds."""
    counts = [0] * EXPERTS
    for r in range(tokens * TOP_K):
        counts[(r * 3) % EXPERTS] += 1
    return counts


# Bound 1 row per expert: 8 experts x 1 / top_k 2 = 4 tokens at most take the received rows.
@pytest.mark.parametrize(
    ("bound", "tokens", "received_rows"),
    [
        pytest.param(1.0, 1, True, id="one-token"),
        pytest.param(1.0, 4, True, id="at-the-bound"),
        pytest.param(1.0, 5, False, id="one-token-above"),
        pytest.param(0.0, 1, False, id="off"),
        pytest.param(0.0, 0, False, id="off-for-an-empty-forward-too"),
        pytest.param(float("inf"), 32, True, id="every-forward"),
    ],
)
def test_small_forwards_run_the_received_rows_and_the_others_deep_gemm(
    experts, bound, tokens, received_rows
):
    e, (q1, q2, d1, d2) = experts(bound)
    x, q, s, c, received = _received_buffer(_counts(tokens), CAP, seed=tokens)
    out = _call(e, q, s, q1, q2, c, tokens)
    if received_rows:
        assert not e.calls and len(rec.gemms) == 2  # vLLM's fused-MoE kernel, twice
        want = _expert_outputs(q.float() * s.repeat_interleave(G, -1), received, d1, d2)
        assert _rel(out[received], want[received].bfloat16()) < 1e-3
        assert torch.isnan(out[~received].float()).all()  # nothing else written
        return
    assert not rec.gemms and len(e.calls) == 1
    got = e.calls[0]
    assert got["hidden"] is q and _is_mn_major(got["scales"]) and not _is_mn_major(s)
    filled = tokens  # one sender: the rows it can fill
    same = got["scales"][:, :filled].nan_to_num(7.0) == s[:, :filled].nan_to_num(7.0)
    assert bool(same.all())


def test_the_forward_s_size_is_every_sender_s_not_this_rank_s(experts, monkeypatch):
    """Two senders, a pooled round of 8 tokens each: 16 tokens x 2 = 32 rows over 8 experts,
    4 per expert, whatever this rank's own count (1 token here)."""
    copied = []
    real = deep_gemm_experts.mn_major
    monkeypatch.setattr(
        deep_gemm_experts, "mn_major", lambda t, rows=None: copied.append(rows) or real(t, rows)
    )
    for bound, received_rows in ((4.0, True), (3.9, False)):
        rec.gemms.clear()
        e, (q1, q2, *_) = experts(bound, dispatchers=2, sent=8)
        _, q, s, c, _ = _received_buffer([4] * EXPERTS, CAP, seed=3)
        _call(e, q, s, q1, q2, c, 1)
        assert bool(rec.gemms) is received_rows and bool(e.calls) is not received_rows
    assert copied == [16]  # the DeepGEMM call: the rows 8 tokens from each of 2 senders fill


def test_a_call_the_received_rows_do_not_read_goes_to_deep_gemm_as_it_is(experts):
    """Scales already MN-major (not viewable as rows): DeepGEMM's, with the same values."""
    e, (q1, q2, *_) = experts(float("inf"))
    _, q, s, c, _ = _received_buffer(_counts(2), CAP, seed=5)
    mn = deep_gemm_experts.mn_major(s)
    _call(e, q, mn, q1, q2, c, 2)
    assert not rec.gemms and len(e.calls) == 1
    seen = e.calls[0]["scales"]
    assert _is_mn_major(seen) and bool((seen.nan_to_num(7.0) == s.nan_to_num(7.0)).all())


def test_with_the_wire_off_the_prepare_s_quantized_rows_take_the_received_rows(experts):
    """A block layer whose wire is off: the LL prepare quantizes what arrived over the
    whole buffer (DeepGEMM experts never defer it, compact_experts.quantizes_input), and
    those E4M3 rows with their row-major scales take the received rows under the bound."""
    from vllm_flashinfer_ep.vllm import receive_quant

    e, (q1, q2, d1, d2) = experts(1.0)
    x, _, _, c, received = _received_buffer(_counts(2), CAP, seed=6)
    xq, xs = receive_quant.quantize_expert_buffer(x.nan_to_num(), c, e.quant_config, False)
    out = _call(e, xq, xs, q1, q2, c, 2)
    assert not e.calls and rec.gemms[0]["A"].data_ptr() == xq.data_ptr()  # read in place
    want = _expert_outputs(xq.float() * xs.repeat_interleave(G, -1), received, d1, d2)
    assert _rel(out[received], want[received].bfloat16()) < 1e-3


def test_a_pooled_round_s_rows_are_all_computed_whatever_this_rank_sent(experts):
    """World 1, a pooled round of 8 tokens carrying 1 real one: every row the 8 tokens
    put in the buffer is computed (the block list sized from the round, not the batch)."""
    e, (q1, q2, d1, d2) = experts(float("inf"), sent=8)
    _, q, s, c, received = _received_buffer(_counts(8), CAP, seed=7)
    out = _call(e, q, s, q1, q2, c, 1)
    assert not e.calls
    want = _expert_outputs(q.float() * s.repeat_interleave(G, -1), received, d1, d2)
    assert _rel(out[received], want[received].bfloat16()) < 1e-3


def test_rows_per_expert_count_every_rank_s_experts(experts):
    """EP world 2, 8 experts here of 16: 2 senders x 4 tokens x top_k 2 = 16 rows over 16
    experts, 1 per expert: at a bound of 1 the received rows, not the 2 per local expert."""
    e, (q1, q2, *_) = experts(1.0, dispatchers=2, sent=4)
    _, q, s, c, _ = _received_buffer(_counts(4), CAP, seed=8)
    _call(e, q, s, q1, q2, c, 4, experts_all=2 * EXPERTS)
    assert not e.calls and len(rec.gemms) == 2


def test_the_bound_is_the_package_variable_read_when_a_layer_is_set_up(experts, monkeypatch):
    """Unset, the measured default (4 rows per expert); set, its value, read at install:
    the forwards of a layer set up before a change keep the bound they were set up with."""
    from vllm_flashinfer_ep import envs

    monkeypatch.delenv(envs.DEEP_GEMM_RECEIVED_ROWS, raising=False)
    monkeypatch.setattr(deep_gemm_per_batch, "RECEIVED_ROWS_UP_TO", None)
    assert deep_gemm_per_batch.bound() == 4.0
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "0.5")
    e, (q1, q2, *_) = experts(None)
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "inf")
    _, q, s, c, _ = _received_buffer(_counts(4), CAP, seed=4)  # 1 row per expert
    _call(e, q, s, q1, q2, c, 4)
    assert len(e.calls) == 1 and not rec.gemms  # above 0.5: DeepGEMM


def test_a_bad_bound_fails_the_set_up_naming_the_variable(monkeypatch):
    from vllm_flashinfer_ep import envs
    from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

    monkeypatch.setattr(deep_gemm_per_batch, "RECEIVED_ROWS_UP_TO", None)
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "-1")
    with pytest.raises(FlashInferEPEnvVarError, match=envs.DEEP_GEMM_RECEIVED_ROWS):
        deep_gemm_per_batch.bound()


def test_the_choice_is_logged_once(experts, caplog, monkeypatch):
    monkeypatch.setattr(deep_gemm_per_batch, "_logged", False)
    with caplog.at_level(logging.INFO):
        experts(2.0)
        experts(2.0)
        experts(0.0)
    assert caplog.text.count("at most 2 rows per expert run the package's received-rows") == 1
    assert "DEEP_GEMM_RECEIVED_ROWS=0: DeepGEMM for every forward" in caplog.text
    assert "every forward on DeepGEMM" not in caplog.text


@pytest.mark.parametrize(
    ("bound", "says"),
    [
        (0.5, "at most 0.5 rows per expert run the package's received-rows"),
        (0.0625, "at most 0.0625 rows per expert run the package's received-rows"),
        (float("inf"), "every forward on the package's received-rows Triton experts"),
    ],
)
def test_fractional_and_infinite_bounds_are_logged_as_they_route(
    experts, caplog, monkeypatch, bound, says
):
    monkeypatch.setattr(deep_gemm_per_batch, "_logged", False)
    with caplog.at_level(logging.INFO):
        experts(bound)
    assert says in caplog.text and "every forward on DeepGEMM" not in caplog.text


def test_off_the_log_says_deep_gemm_for_every_forward(experts, caplog, monkeypatch):
    monkeypatch.setattr(deep_gemm_per_batch, "_logged", False)
    with caplog.at_level(logging.INFO):
        experts(0.0)
    assert "block-FP8 layers on DeepGEMM: every forward on DeepGEMM" in caplog.text
    assert "received-rows Triton experts" not in caplog.text


def test_undone_the_object_is_vllm_s_again(experts):
    e, _ = experts(1.0)
    assert [r.patch for r in _helper._chain(e, "apply")] == ["deep_gemm_per_batch"]
    _helper.undo_instances()
    assert "apply" not in vars(e)


def test_the_kill_switch_and_the_off_bound_send_every_forward_to_deep_gemm(experts, monkeypatch):
    """compact_experts.ENABLED off (vLLM's own experts path, to measure): DeepGEMM at any
    bound. Bound 0: DeepGEMM, without looking the forward's token count up per layer."""
    from vllm_flashinfer_ep.vllm import compact_experts

    e, (q1, q2, *_) = experts(float("inf"))
    _, q, s, c, _ = _received_buffer(_counts(1), CAP, seed=9)
    monkeypatch.setattr(compact_experts, "ENABLED", False)
    _call(e, q, s, q1, q2, c, 1)
    assert len(e.calls) == 1 and not rec.gemms
    monkeypatch.setattr(compact_experts, "ENABLED", True)

    def no_lookup(*args):
        raise AssertionError("the token count was looked up with the bound off")

    monkeypatch.setattr(compact_experts, "senders_tokens", no_lookup)
    e, (q1, q2, *_) = experts(0.0)
    _call(e, q, s, q1, q2, c, 1)
    assert len(e.calls) == 1 and not rec.gemms
