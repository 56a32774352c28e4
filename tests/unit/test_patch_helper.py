"""The one patch mechanism: target checks, replacement, undo, and the error naming the patch."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from vllm_flashinfer_ep.vllm import patches
from vllm_flashinfer_ep.vllm.patches import _helper
from vllm_flashinfer_ep.vllm.patches._helper import (
    FIELD,
    GLOBAL,
    PROPERTY,
    WRAP,
    Patch,
    PatchTargetError,
)

MOD = "fake_vllm_target"


@pytest.fixture()
def target(monkeypatch):
    """A stand-in vLLM module: a function imported by name elsewhere, a class, a global."""
    module = types.ModuleType(MOD)
    exec(
        "def select(moe, quant_config=None):\n"
        "    return ('vllm', moe)\n"
        "class Config:\n"
        "    @property\n"
        "    def batched(self):\n"
        "        return False\n"
        "    def forward(self, x):\n"
        "        return x\n"
        "SET = frozenset({'a'})\n",
        module.__dict__,
    )

    @dataclasses.dataclass
    class Fields:
        backend: int = 0

    module.Fields = Fields
    monkeypatch.setitem(sys.modules, MOD, module)
    yield module
    for name in [n for n in _helper._applied if n.startswith("test_")]:
        del _helper._applied[name]  # a failed test must not leave records behind


def _patch(kind, attr, make, expect, **kw):
    return Patch(
        f"test_{attr}",
        "worker",
        f"{MOD}:{attr}",
        kind,
        make,
        expect,
        what="w",
        why="y",
        how="h",
        upstream="u",
        removal="r",
        **kw,
    )


def _wrap_select(original):
    def select(moe, quant_config=None):
        return ("ours", moe) if moe == "ours" else original(moe, quant_config)

    return select


def test_wrap_applies_and_undo_restores(target):
    original = target.select
    patch = _patch(WRAP, "select", _wrap_select, ("moe", "quant_config"))
    _helper.apply(patch)
    try:
        assert target.select("ours") == ("ours", "ours")
        assert target.select("x") == ("vllm", "x")
        assert _helper.is_applied(patch) and _helper.original(patch) is original
        _helper.apply(patch)  # idempotent
        assert target.select.__wrapped__ is original
    finally:
        _helper.undo(patch)
    assert target.select is original and not _helper.is_applied(patch)
    _helper.undo(patch)  # undoing twice is a no-op


def test_in_place_wrap_reaches_holders_of_the_function(target):
    held = target.select  # what `from module import select` leaves in another module
    patch = _patch(WRAP, "select", _wrap_select, ("moe",), in_place=True)
    _helper.apply(patch)
    try:
        assert target.select is held
        assert held("ours") == ("ours", "ours") and held("x") == ("vllm", "x")
        assert _helper.original(patch)("ours") == ("vllm", "ours")
    finally:
        _helper.undo(patch)
    assert held("ours") == ("vllm", "ours")
    assert not any(k.startswith(_helper._TRAMPOLINE) for k in vars(target))


def test_property_global_and_field_undo(target):
    prop = _patch(PROPERTY, "Config.batched", lambda fget: lambda self: True, ("self",))
    glob = _patch(GLOBAL, "SET", lambda s: s | {"b"}, lambda v: isinstance(v, frozenset))
    declared = target.Fields.__dataclass_fields__["backend"].type  # 'int' (future annotations)
    field = _patch(FIELD, "Fields.backend", lambda t: str, lambda t: t == declared)
    for patch in (prop, glob, field):
        _helper.apply(patch)
    assert target.Config().batched is True
    assert target.SET == {"a", "b"}
    assert target.Fields.__dataclass_fields__["backend"].type is str
    for patch in (prop, glob, field):
        _helper.undo(patch)
    assert target.Config().batched is False
    assert target.SET == {"a"}
    assert target.Fields.__dataclass_fields__["backend"].type == declared
    assert target.Fields.__annotations__["backend"] == declared


@pytest.mark.parametrize(
    "kind,attr,expect,message",
    [
        (WRAP, "gone", ("moe",), "does not exist"),
        (WRAP, "select", ("moe", "routing_tables"), "expected ('moe', 'routing_tables') first"),
        (WRAP, "Config.forward", ("self", "hidden"), "has parameters ('self', 'x')"),
        (PROPERTY, "Config.forward", ("self",), "not a property"),
        (GLOBAL, "SET", lambda v: isinstance(v, dict), "unexpected shape"),
        (FIELD, "Fields.missing", lambda t: True, "does not exist"),
    ],
)
def test_target_checked_before_patching(target, kind, attr, expect, message):
    before = dict(vars(target))
    patch = _patch(kind, attr, lambda o: o, expect)
    with pytest.raises(PatchTargetError, match=f"patch 'test_{attr}'") as info:
        _helper.apply(patch)
    assert message in str(info.value)
    assert dict(vars(target)) == before and not _helper.is_applied(patch)


def test_apply_all_lists_every_moved_target_and_applies_none(target):
    good = _patch(WRAP, "select", _wrap_select, ("moe",))
    bad1 = _patch(WRAP, "moved_a", lambda o: o, ())
    bad2 = _patch(GLOBAL, "moved_b", lambda o: o, lambda v: True)
    with pytest.raises(PatchTargetError) as info:
        _helper.apply_all([good, bad1, bad2])
    assert "test_moved_a" in str(info.value) and "test_moved_b" in str(info.value)
    assert not _helper.is_applied(good)


def test_missing_module_names_the_patch():
    patch = Patch(
        "p",
        "worker",
        "vllm.no_such_module:f",
        WRAP,
        lambda o: o,
        (),
        what="w",
        why="y",
        how="h",
        upstream="u",
        removal="r",
    )
    with pytest.raises(PatchTargetError, match="patch 'p': cannot import vllm.no_such_module"):
        _helper.apply(patch)


def test_every_real_patch_undoes_and_reapplies():
    """Against vLLM 0.33.0 itself: each row's target passes its check, undo restores it."""
    import vllm_flashinfer_ep

    vllm_flashinfer_ep.register()
    for patch in patches.PATCHES:
        assert _helper.is_applied(patch), patch.name
        replaced = _helper.original(patch)
        _helper.undo(patch)
        try:
            _, _, current = _helper.check(patch)
            if not patch.in_place:
                assert current is replaced, patch.name
        finally:
            _helper.apply(patch)
        assert _helper.is_applied(patch), patch.name
    assert all(patches.status().values())


def test_index_has_every_entry():
    text = patches.index()
    for patch in patches.PATCHES:
        assert patch.name in text and patch.upstream in text
    assert "router_gate_width" in text
