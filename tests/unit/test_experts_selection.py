"""Which experts an LL MoE kernel runs: `experts.for_low_latency` and the patch table's
`experts_selection` row (vllm/patches/worker.py `make_kernel_init`), on CPU.

vLLM's oracles pick an experts class from fixed tables and build it; every one of them
builds its kernel through `FusedMoEKernel.__init__`, which the row wraps: for the LL
prepare/finalize, vLLM's batched Triton experts become `ReceivedRowsExperts` and its
batched DeepGEMM experts `ReceivedRowsOrDeepGemmExperts`, built with the same arguments,
the layer's FP8-wire decision and the user's bound. Nothing of vLLM's objects changes;
every other prepare/finalize keeps vLLM's experts; undone, vLLM's constructor is back.
"""

from __future__ import annotations

import logging
import math

import pytest
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
    BatchedTritonExperts,
    NaiveBatchedExperts,
)
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import (
    BatchedPrepareAndFinalize,
)

from tests.fakes.runtime import build_fake_runtime
from tests.unit.test_prepare_finalize_cpu import TorchStandardExperts
from tests.unit.test_received_rows_experts import (  # noqa: F401 - fixtures
    EXPERTS,
    HIDDEN,
    make_layer,
    moe_cfg,
    selection,
    standins,
)
from vllm_flashinfer_ep import envs, experts
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvVarError
from vllm_flashinfer_ep.experts import ExpertsOptions, for_low_latency
from vllm_flashinfer_ep.experts.deep_gemm import ReceivedRowsOrDeepGemmExperts
from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts
from vllm_flashinfer_ep.vllm import patches
from vllm_flashinfer_ep.vllm.patches import _helper
from vllm_flashinfer_ep.vllm.prepare_finalize import (
    FlashInferEPHighThroughputPrepareAndFinalize,
    FlashInferEPLowLatencyPrepareAndFinalize,
)

ROWS = 128  # DeepGEMM's whole row tiles at one dispatcher
ROW = patches.BY_NAME["experts_selection"]


def sent() -> int | None:
    return None


def vllm_experts(cls, kind: str = "bf16", capacity: int = ROWS, dispatchers: int = 1):
    """What vLLM's oracle builds for an LL layer: its class, the layer's configs, the
    prepare/finalize's capacity and dispatchers."""
    layer = make_layer(kind, 0)
    return cls(moe_cfg(2, capacity), layer.qc, capacity, dispatchers)


# ------------------------------------------------------------------ for_low_latency
@pytest.mark.parametrize("kind", ["bf16", "block", "channel", "tensor_dynamic"])
@pytest.mark.parametrize("wire", [True, False], ids=["fp8-wire", "bf16-wire"])
def test_vllm_s_batched_triton_experts_become_the_received_rows_with_its_arguments(kind, wire):
    theirs = vllm_experts(BatchedTritonExperts, kind, capacity=64, dispatchers=2)
    ours = for_low_latency(
        theirs, fp8_wire=wire, sent_per_rank=sent, options=ExpertsOptions(deep_gemm_received_rows=2)
    )
    assert type(ours) is ReceivedRowsExperts
    assert ours.moe_config is theirs.moe_config and ours.quant_config is theirs.quant_config
    assert (ours.max_num_tokens, ours.num_dispatchers) == (64, 2)
    assert ours._sent_per_rank is sent
    assert ours.expects_unquantized_inputs is (kind != "bf16" and not wire)


@pytest.mark.parametrize("wire", [True, False], ids=["fp8-wire", "bf16-wire"])
@pytest.mark.parametrize("bound", [0.0, 2.5, math.inf])
def test_vllm_s_batched_deep_gemm_experts_become_the_pair_with_the_user_s_bound(wire, bound):
    theirs = vllm_experts(BatchedDeepGemmExperts, "block", capacity=64, dispatchers=2)
    ours = for_low_latency(
        theirs,
        fp8_wire=wire,
        sent_per_rank=sent,
        options=ExpertsOptions(deep_gemm_received_rows=bound),
    )
    assert type(ours) is ReceivedRowsOrDeepGemmExperts
    assert ours.received_rows_up_to == bound
    assert ours.moe_config is theirs.moe_config and ours.quant_config is theirs.quant_config
    for built in (ours, ours.experts, ours.fallback_experts):
        assert (built.max_num_tokens, built.num_dispatchers) == (64, 2)
    assert ours.experts._sent_per_rank is sent and ours.fallback_experts._sent_per_rank is sent
    assert ours.expects_unquantized_inputs is False  # DeepGEMM reads FP8: the prepare quantizes


def test_bf16_layers_keep_other_experts_and_say_so_once(caplog):
    """Weights the wing has no class for (MXFP4's BatchedMarlinExperts; vLLM's activations
    stay BF16, quant_dtype None) keep vLLM's pick, logged once."""
    experts._log_kept.cache_clear()
    theirs = vllm_experts(NaiveBatchedExperts, "bf16")
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            kept = for_low_latency(theirs, fp8_wire=False, sent_per_rank=sent, options=None)
            assert kept is theirs
    assert caplog.text.count("MoE layers run vLLM's NaiveBatchedExperts") == 1


@pytest.mark.parametrize("cls", [NaiveBatchedExperts, type("Sub", (BatchedTritonExperts,), {})])
def test_fp8_layers_with_other_experts_are_refused_naming_the_flag(cls):
    theirs = vllm_experts(cls, "block")
    with pytest.raises(FlashInferEPConfigError, match="Pass --moe-backend triton") as info:
        for_low_latency(theirs, fp8_wire=True, sent_per_rank=sent, options=ExpertsOptions())
    assert cls.__name__ in str(info.value)


@pytest.mark.parametrize("cls", [BatchedTritonExperts, BatchedDeepGemmExperts])
def test_experts_already_the_wing_s_are_returned_as_they_are(cls):
    """vLLM may build a kernel again on experts it got from one (a second kernel)."""
    options = ExpertsOptions()
    once = for_low_latency(
        vllm_experts(cls, "block"), fp8_wire=True, sent_per_rank=sent, options=options
    )
    assert for_low_latency(once, fp8_wire=False, sent_per_rank=sent, options=options) is once


def test_the_replacement_is_logged_once_per_case(caplog):
    experts._log_replacement.cache_clear()
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            for_low_latency(
                vllm_experts(BatchedTritonExperts), fp8_wire=False, sent_per_rank=sent, options=None
            )
    line = "MoE layers run ReceivedRowsExperts in place of vLLM's BatchedTritonExperts"
    assert caplog.text.count(line) == 1


def test_the_table_maps_vllm_s_two_batched_classes():
    assert experts.replacements() == {
        BatchedTritonExperts: ReceivedRowsExperts,
        BatchedDeepGemmExperts: ReceivedRowsOrDeepGemmExperts,
    }


# ------------------------------------------------------------------ the options
def test_the_options_read_the_package_variable(monkeypatch):
    name = envs.DEEP_GEMM_RECEIVED_ROWS
    assert name == "VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS"
    monkeypatch.delenv(name, raising=False)
    assert ExpertsOptions.from_env() == ExpertsOptions(deep_gemm_received_rows=4.0)
    for raw, value in (("0", 0.0), ("0.5", 0.5), ("inf", math.inf), ("12", 12.0)):
        monkeypatch.setenv(name, raw)
        assert ExpertsOptions.from_env().deep_gemm_received_rows == value
    monkeypatch.setenv(name, "-1")
    with pytest.raises(FlashInferEPEnvVarError, match=name):
        ExpertsOptions.from_env()
    with pytest.raises(AttributeError):
        ExpertsOptions().deep_gemm_received_rows = 1.0  # frozen: one value per kernel


# ------------------------------------------------------------------ the patch row
def ll_pf(capacity: int = ROWS, wire: bool = False):
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, num_experts=EXPERTS, capacity=capacity, sizes=[1]
    )
    return FlashInferEPLowLatencyPrepareAndFinalize(rt, fp8_dispatch=wire)


@pytest.mark.usefixtures("selection")
@pytest.mark.parametrize(
    ("cls", "kind", "want"),
    [
        (BatchedTritonExperts, "bf16", ReceivedRowsExperts),
        (BatchedTritonExperts, "block", ReceivedRowsExperts),
        (BatchedTritonExperts, "tensor_static", ReceivedRowsExperts),
        (BatchedDeepGemmExperts, "block", ReceivedRowsOrDeepGemmExperts),
    ],
)
@pytest.mark.parametrize("wire", [True, False], ids=["fp8-wire", "bf16-wire"])
def test_vllm_s_kernel_over_the_ll_prepare_holds_the_wing_s_experts(cls, kind, want, wire):
    wire = wire and kind == "block"
    pf = ll_pf(wire=wire)
    theirs = vllm_experts(cls, kind)
    before = dict(vars(theirs))
    kernel = mk.FusedMoEKernel(pf, theirs)
    ours = kernel.fused_experts
    assert type(ours) is want and ours is not theirs
    assert ours.max_num_tokens == pf.max_num_tokens_per_rank()
    assert ours.num_dispatchers == pf.num_dispatchers()
    assert ours.quant_config is theirs.quant_config
    # the layer's wire decision: deferred quantization exactly off the FP8 wire
    expected_defer = want is ReceivedRowsExperts and kind != "bf16" and not wire
    assert ours.expects_unquantized_inputs is expected_defer
    # the kernel asks the prepare/finalize's own round for the tokens sent
    inner = ours.experts if want is ReceivedRowsOrDeepGemmExperts else ours
    assert inner._sent_per_rank == pf.sent_per_rank
    # vLLM's object is left as vLLM built it: no attribute added, replaced or removed
    assert vars(theirs).keys() == before.keys()
    assert all(vars(theirs)[k] is v for k, v in before.items())
    assert "apply" not in vars(theirs) and type(theirs) is cls


@pytest.mark.usefixtures("selection")
def test_the_bound_is_the_variable_s_when_the_kernel_is_built(monkeypatch):
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "0.5")
    kernel = mk.FusedMoEKernel(ll_pf(wire=True), vllm_experts(BatchedDeepGemmExperts, "block"))
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "inf")  # later changes: not this layer's
    assert kernel.fused_experts.received_rows_up_to == 0.5


@pytest.mark.usefixtures("selection")
def test_the_wing_s_experts_are_left_as_built_by_the_kernel():
    """The prepare/finalize's setup hook asks its experts questions only."""
    pf = ll_pf()
    ours = ReceivedRowsExperts(moe_cfg(2, ROWS), FUSED_MOE_UNQUANTIZED_CONFIG, ROWS, 1)
    before = dict(vars(ours))
    kernel = mk.FusedMoEKernel(pf, ours)
    assert kernel.fused_experts is ours
    assert vars(ours).keys() == before.keys()
    assert all(vars(ours)[k] is v for k, v in before.items())


@pytest.mark.usefixtures("selection")
def test_other_prepare_finalizes_keep_vllm_s_experts():
    """HT (Standard format) and vLLM's own batched prepare/finalize are not LL rounds."""
    rt, _ = build_fake_runtime(
        Algorithm.HIGH_THROUGHPUT, hidden=HIDDEN, num_experts=EXPERTS, capacity=ROWS
    )
    standard = TorchStandardExperts(moe_cfg(2, ROWS), FUSED_MOE_UNQUANTIZED_CONFIG)
    ht = mk.FusedMoEKernel(FlashInferEPHighThroughputPrepareAndFinalize(rt), standard)
    assert ht.fused_experts is standard
    for cls, kind in ((BatchedTritonExperts, "block"), (BatchedDeepGemmExperts, "block")):
        theirs = vllm_experts(cls, kind)
        pf = BatchedPrepareAndFinalize(ROWS, EXPERTS, num_dispatchers=1, rank=0)
        assert mk.FusedMoEKernel(pf, theirs).fused_experts is theirs


@pytest.mark.usefixtures("selection")
def test_undone_vllm_s_constructor_is_back():
    assert _helper.is_applied(ROW) and patches.status()["experts_selection"]
    vllm_s = _helper.original(ROW)
    assert mk.FusedMoEKernel.__init__ is not vllm_s
    assert mk.FusedMoEKernel.__init__.__wrapped__ is vllm_s
    _helper.undo(ROW)
    assert not _helper.is_applied(ROW) and not patches.status()["experts_selection"]
    assert mk.FusedMoEKernel.__init__ is vllm_s
    theirs = vllm_experts(BatchedTritonExperts)
    assert mk.FusedMoEKernel(ll_pf(), theirs).fused_experts is theirs
    _helper.apply(ROW)  # and back again
    assert type(mk.FusedMoEKernel(ll_pf(), theirs).fused_experts) is ReceivedRowsExperts


def test_the_row_checks_against_this_vllm_and_is_in_the_index():
    owner, attr, original = _helper.check(ROW)
    assert (owner, attr) == (mk.FusedMoEKernel, "__init__") and ROW.stage == "worker"
    assert ROW.expect == ("self", "prepare_finalize", "fused_experts")
    text = patches.index()
    assert ROW.entry() in text
    for field in (ROW.what, ROW.why, ROW.how, ROW.upstream, ROW.removal):
        assert field and field in text
    # one class-level mechanism: no patch kind replaces anything on one object
    assert {p.kind for p in patches.PATCHES} <= {"wrap", "property", "global", "field"}
