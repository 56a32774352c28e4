"""Instance patches (kind INSTANCE, vllm/patches/_helper.py) on real vLLM objects.

Two rows replace `apply` on vLLM 0.33.0's BatchedTritonExperts objects, one object at a
time (vllm/batched_tiles.py, vllm/compact_experts.py); two more on its BatchedDeepGemmExperts
(vllm/deep_gemm_warmup.py and vllm/deep_gemm_per_batch.py, tested in test_deep_gemm_warmup.py
and test_deep_gemm_per_batch.py). Here they are applied, checked and
undone on BatchedTritonExperts objects built on CPU (nothing is computed: the wrappers'
results are tested in test_batched_tiles.py and test_compact_experts.py).
"""

from __future__ import annotations

import dataclasses
import gc

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

from tests.unit.test_prepare_finalize_cpu import _moe_config
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.vllm import (
    batched_tiles,
    compact_experts,
    deep_gemm_per_batch,
    deep_gemm_warmup,
    patches,
)
from vllm_flashinfer_ep.vllm.patches import _helper
from vllm_flashinfer_ep.vllm.patches._helper import INSTANCE, PatchTargetError

TILES, COMPACT = batched_tiles.PATCH, compact_experts.PATCH


@pytest.fixture()
def made():
    """Experts objects a test builds; whatever it left on them is undone afterwards."""
    objects: list = []

    def build(cls=BatchedTritonExperts):
        experts = cls(
            _moe_config(2, LOW_LATENCY),
            FUSED_MOE_UNQUANTIZED_CONFIG,
            max_num_tokens=256,
            num_dispatchers=1,
        )
        objects.append(experts)
        return experts

    yield build
    for experts in objects:
        for record in _helper._chain(experts, "apply"):
            _helper._restore(experts, record)


def _is_vllm_s(experts) -> bool:
    """`experts.apply` is its class's own method again, nothing of ours on the object."""
    return "apply" not in vars(experts) and experts.apply.__func__ is type(experts).apply


def test_the_rows_are_instance_patches_that_check_against_this_vllm():
    text = patches.index()
    deep_gemm = (deep_gemm_warmup.PATCH, deep_gemm_per_batch.PATCH)
    assert patches.instance_patches() == (TILES, COMPACT, *deep_gemm)
    for patch in patches.instance_patches():
        assert patch.kind == INSTANCE and patch not in patches.PATCHES
        owner, attr, method = _helper.check(patch)
        cls = BatchedDeepGemmExperts if patch in deep_gemm else BatchedTritonExperts
        assert (owner, attr, method) == (cls, "apply", cls.apply)
        assert patch.expect == batched_tiles.APPLY_PARAMS
        assert patch.entry() in text
        for field in (patch.what, patch.why, patch.how, patch.upstream, patch.removal):
            assert field and field in text


def test_apply_check_and_undo_on_one_object(made):
    experts = made()
    assert _is_vllm_s(experts)
    assert batched_tiles.install(experts)
    tiles = vars(experts)["apply"]
    assert _helper.instance_applied(TILES, experts)
    assert not _helper.instance_applied(COMPACT, experts)
    assert compact_experts.install(experts, lambda: None)
    compact = vars(experts)["apply"]
    assert compact is not tiles and compact._flashinfer_ep_compact
    assert [r.patch for r in _helper._chain(experts, "apply")] == [
        "compact_experts",
        "batched_tiles",
    ]
    assert experts in _helper.instances(TILES) and experts in _helper.instances(COMPACT)
    # applying again changes nothing
    assert batched_tiles.install(experts) and compact_experts.install(experts)
    assert vars(experts)["apply"] is compact

    # the lower patch cannot be undone under the upper one: refused, nothing changed
    with pytest.raises(PatchTargetError, match="'compact_experts' wraps it"):
        _helper.undo_instance(TILES, experts)
    assert vars(experts)["apply"] is compact

    assert _helper.undo_instance(COMPACT, experts)
    assert vars(experts)["apply"] is tiles and not _helper.instance_applied(COMPACT, experts)
    assert _helper.undo_instance(TILES, experts)
    assert _is_vllm_s(experts)
    assert experts not in _helper.instances()
    assert not _helper.undo_instance(TILES, experts)  # not on it: a no-op


def test_undo_every_instance_at_once(made):
    gc.collect()  # experts objects of earlier tests, patched, may still await collection
    _helper.undo_instances()
    first, second = made(), made()
    for experts in (first, second):
        assert batched_tiles.install(experts) and compact_experts.install(experts)
    untouched = made()
    assert batched_tiles.install(untouched)

    with pytest.raises(PatchTargetError, match="undo 'compact_experts' first"):
        _helper.undo_instances(TILES)  # compact wraps it on two objects: nothing is undone
    assert all(_helper.instance_applied(TILES, e) for e in (first, second, untouched))

    assert _helper.undo_instances(COMPACT) == 2
    assert not _helper.instances(COMPACT)
    assert set(map(id, _helper.instances(TILES))) >= {id(first), id(second), id(untouched)}
    assert _helper.undo_instances() >= 3  # every instance patch on every object
    assert all(_is_vllm_s(e) for e in (first, second, untouched))
    assert not _helper.instances()


def test_another_apply_shape_is_refused_with_patch_target_error(made, caplog):
    class Moved(BatchedTritonExperts):
        def apply(self, output, hidden_states, w1, w2, **kwargs):  # not 0.33.0's parameters
            raise AssertionError

    moved = made(Moved)
    for patch in (TILES, COMPACT):
        with pytest.raises(PatchTargetError, match=f"patch '{patch.name}': .*Moved.apply") as info:
            _helper.apply_instance(patch, moved)
        assert "expected exactly" in str(info.value)
        assert _is_vllm_s(moved) and moved not in _helper.instances()
    # the setup hook's install leaves such experts to vLLM, logged
    assert not batched_tiles.install(moved) and not compact_experts.install(moved)
    assert "leaving its tile choice to vLLM" in caplog.text
    assert "leaving the experts computation to vLLM" in caplog.text
    assert _is_vllm_s(moved)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(expect=batched_tiles.APPLY_PARAMS[:-1]), "expected exactly"),
        (dict(target=batched_tiles.TARGET.replace(".apply", ".gone")), "does not exist"),
        (dict(target="vllm.no_such_module:BatchedTritonExperts.apply"), "cannot import"),
    ],
)
def test_a_moved_target_is_refused_before_any_object_changes(made, change, message):
    moved = dataclasses.replace(TILES, **change)
    with pytest.raises(PatchTargetError, match=message):
        _helper.check(moved)
    experts = made()
    with pytest.raises(PatchTargetError):
        _helper.apply_instance(moved, experts)
    assert _is_vllm_s(experts)


def test_objects_of_other_classes_are_not_touched(made):
    naive = made(NaiveBatchedExperts)
    assert _helper.apply_instance(TILES, naive) is False
    assert "apply" not in vars(naive) and naive not in _helper.instances()


def test_an_instance_patch_is_not_a_class_patch():
    with pytest.raises(ValueError, match="apply_instance"):
        _helper.apply(TILES)
    with pytest.raises(ValueError, match="apply_instance"):
        _helper.undo(COMPACT)


def test_the_record_holds_no_object_alive():
    experts = BatchedTritonExperts(
        _moe_config(2, LOW_LATENCY),
        FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=256,
        num_dispatchers=1,
    )
    assert batched_tiles.install(experts) and compact_experts.install(experts)
    key = id(experts)
    assert key in _helper._instances
    del experts
    gc.collect()
    assert key not in _helper._instances


@pytest.mark.usefixtures("fake")
def test_the_ll_setup_hook_applies_both_rows(made):
    from tests.fakes.runtime import build_fake_runtime
    from tests.unit.test_prepare_finalize_cpu import HIDDEN
    from vllm_flashinfer_ep.backends import Algorithm
    from vllm_flashinfer_ep.vllm.prepare_finalize import FlashInferEPLowLatencyPrepareAndFinalize

    rt, _ = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, capacity=256, sizes=[1])
    experts = made()
    mk.FusedMoEKernel(FlashInferEPLowLatencyPrepareAndFinalize(rt), experts)  # post_init_setup
    assert [r.patch for r in _helper._chain(experts, "apply")] == [
        "compact_experts",
        "batched_tiles",
    ]
    assert _helper.undo_instances() >= 2 and _is_vllm_s(experts)
