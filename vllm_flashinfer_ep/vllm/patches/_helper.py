"""The one patch mechanism: check a vLLM target, replace it, remember the original, undo.

A `Patch` is both a row of the index (what / why / how / upstream fix / removal) and
the input of `apply`/`undo`. Kinds:

- WRAP: a function or method attribute; `make(original) -> replacement`. `in_place`
  keeps the function object (vLLM's importers hold it by name) and swaps its code.
- PROPERTY: a property on a class; `make(original_fget) -> new fget`.
- GLOBAL: a module-level value; `make(original_value) -> new value`.
- FIELD: a dataclass field's type; `make(original_type) -> new type`; pydantic
  dataclasses are rebuilt.
- INSTANCE: a method of one object of a vLLM class, replaced on that object only (vLLM
  hands the package its objects one by one, e.g. the experts of each MoE kernel), by
  `apply_instance(patch, obj, *args)`: `make(obj, original, *args) -> replacement`, where
  `original` is what `obj.method` was (the class's bound method, or another instance
  patch's replacement). Every object so patched is recorded (weakly) and can be undone
  one by one (`undo_instance`) or all at once (`undo_instances`).

`expect` is checked before anything is replaced: for WRAP and PROPERTY the leading
parameter names of the function (getter), for INSTANCE all of them, exactly (on the
target class by `check`, and on each object's class before its method is replaced), for
GLOBAL and FIELD a predicate on the value. A vLLM release that moved or reshaped a target
gives one PatchTargetError naming the patch.
"""

from __future__ import annotations

import importlib
import inspect
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

WRAP, PROPERTY, GLOBAL, FIELD, INSTANCE = "wrap", "property", "global", "field", "instance"


class PatchTargetError(RuntimeError):
    """The vLLM symbol a patch targets is missing or has another shape."""


@dataclass(frozen=True)
class Patch:
    name: str
    stage: str  # "platform" | "worker"
    target: str  # "module:Attr" or "module:Class.attr"
    kind: str  # WRAP | PROPERTY | GLOBAL | FIELD | INSTANCE
    make: Callable[..., Any]  # INSTANCE: make(obj, original, *args); others: make(original)
    expect: tuple[str, ...] | Callable[[Any], bool]
    what: str
    why: str
    how: str
    upstream: str
    removal: str
    in_place: bool = False
    after: Callable[[], None] | None = None  # run after apply and after undo

    def entry(self) -> str:
        """The index entry of this patch, as text."""
        return (
            f"{self.name} [{self.stage}] {self.kind} {self.target}\n"
            f"  What: {self.what}\n  Why: {self.why}\n  How: {self.how}\n"
            f"  Upstream fix: {self.upstream}\n  Removal: {self.removal}"
        )


@dataclass
class _Record:
    owner: Any
    attr: str
    original: Any
    replacement: Any
    saved_code: types.CodeType | None = None


_applied: dict[str, _Record] = {}
_TRAMPOLINE = "__flashinfer_ep_in_place__"


def _owner(patch: Patch) -> tuple[Any, str]:
    module_name, _, path = patch.target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchTargetError(
            f"patch {patch.name!r}: cannot import {module_name} ({exc})"
        ) from exc
    *parents, attr = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise PatchTargetError(f"patch {patch.name!r}: {module_name} has no {part}")
        owner = getattr(owner, part)
    return owner, attr


def _current(patch: Patch, owner: Any, attr: str) -> Any:
    if patch.kind == PROPERTY:
        return owner.__dict__.get(attr)
    if patch.kind == FIELD:
        fields = getattr(owner, "__dataclass_fields__", {})
        return fields[attr].type if attr in fields else None
    return getattr(owner, attr, None)


def check(patch: Patch) -> tuple[Any, str, Any]:
    """(owner, attribute, original) after checking the target; raises PatchTargetError."""
    owner, attr = _owner(patch)
    value = _current(patch, owner, attr)
    problem = None
    if value is None:
        problem = "does not exist"
    elif patch.kind == PROPERTY and not isinstance(value, property):
        problem = f"is a {type(value).__name__}, not a property"
    elif patch.kind in (WRAP, PROPERTY, INSTANCE):
        fn = value.fget if patch.kind == PROPERTY else value
        problem = _parameter_problem(fn, patch.expect, exact=patch.kind == INSTANCE)
    elif not patch.expect(value):
        problem = f"has an unexpected shape ({value!r:.120})"
    if problem is not None:
        raise PatchTargetError(
            f"patch {patch.name!r}: {patch.target} {problem}; this vLLM moved or changed "
            f"it. The patch cannot apply ({patch.what})"
        )
    return owner, attr, value


def _parameter_problem(fn: Any, expect: tuple[str, ...], exact: bool) -> str | None:
    """What is wrong with `fn`'s parameters (None: nothing): `expect` first, or exactly."""
    if not callable(fn):
        return "is not callable"
    params = tuple(inspect.signature(fn).parameters)
    if exact:
        return None if params == expect else f"has parameters {params}, expected exactly {expect}"
    if params[: len(expect)] != expect:
        return f"has parameters {params}, expected {expect} first"
    return None


def is_applied(patch: Patch) -> bool:
    record = _applied.get(patch.name)
    if record is None:
        return False
    if record.saved_code is not None:
        return record.original.__code__ is not record.saved_code
    return _current(patch, record.owner, record.attr) is record.replacement


def apply(patch: Patch) -> None:
    """Check the target and replace it; idempotent."""
    _not_instance(patch)
    if is_applied(patch):
        return
    owner, attr, original = check(patch)
    saved_code = None
    if patch.kind == PROPERTY:
        replacement: Any = property(patch.make(original.fget))
        setattr(owner, attr, replacement)
    elif patch.kind == FIELD:
        replacement = patch.make(original)
        _set_field_type(owner, attr, replacement)
    elif patch.kind == WRAP and patch.in_place:
        callee = _copy_function(original, original.__code__)  # the original, callable later
        replacement = patch.make(callee)
        _describe(replacement, callee)
        saved_code = _swap_code(original, replacement)
    else:
        replacement = patch.make(original)
        if patch.kind == WRAP:
            _describe(replacement, original)
        setattr(owner, attr, replacement)
    _applied[patch.name] = _Record(owner, attr, original, replacement, saved_code)
    if patch.after is not None:
        patch.after()


def undo(patch: Patch) -> None:
    """Put the original back; a no-op when the patch is not applied."""
    _not_instance(patch)
    record = _applied.pop(patch.name, None)
    if record is None:
        return
    if record.saved_code is not None:
        record.original.__code__ = record.saved_code
        record.original.__dict__.pop("__signature__", None)
        record.original.__globals__.pop(f"{_TRAMPOLINE}{record.original.__name__}", None)
    elif patch.kind == FIELD:
        _set_field_type(record.owner, record.attr, record.original)
    else:
        setattr(record.owner, record.attr, record.original)
    if patch.after is not None:
        patch.after()


def original(patch: Patch) -> Any:
    """What the patch replaced (an applied patch only)."""
    record = _applied[patch.name]
    if record.saved_code is not None:
        return _copy_function(record.original, record.saved_code)
    return record.original


def apply_all(patches: Iterable[Patch]) -> None:
    """Check every target first, so one error lists every moved symbol; then apply."""
    patches = list(patches)
    problems = []
    for patch in patches:
        if is_applied(patch):
            continue
        try:
            check(patch)
        except PatchTargetError as exc:
            problems.append(str(exc))
    if problems:
        raise PatchTargetError(
            "vllm-flashinfer-ep cannot patch this vLLM:\n  " + "\n  ".join(problems)
        )
    for patch in patches:
        apply(patch)


# ------------------------------------------------------------- instance patches
@dataclass(frozen=True)
class _InstanceRecord:
    """Carried by an instance patch's replacement (as `_INSTANCE_RECORD`)."""

    patch: str
    attr: str
    replaced: Any  # the object's own attribute it replaced; None: the class's method


_INSTANCE_RECORD = "__flashinfer_ep_instance_patch__"
# id(object) -> (a weak reference to it, the attributes instance patches replaced on it)
_instances: dict[int, tuple[weakref.ref, set[str]]] = {}


def _instance_target(patch: Patch) -> tuple[type, str]:
    if patch.kind != INSTANCE:
        raise ValueError(f"patch {patch.name!r} is a {patch.kind} patch, not an instance one")
    return _owner(patch)


def _not_instance(patch: Patch) -> None:
    if patch.kind == INSTANCE:
        raise ValueError(
            f"patch {patch.name!r} replaces a method per object: use apply_instance / "
            "undo_instance / undo_instances"
        )


def _chain(obj: Any, attr: str) -> list[_InstanceRecord]:
    """The instance patches on `obj.attr`, the latest first."""
    records = []
    fn = getattr(obj, "__dict__", {}).get(attr)
    while fn is not None:
        record = getattr(fn, _INSTANCE_RECORD, None)
        if record is None:
            break
        records.append(record)
        fn = record.replaced
    return records


def instance_applied(patch: Patch, obj: Any) -> bool:
    """Whether `patch` is among the instance patches on `obj`."""
    attr = _instance_target(patch)[1]
    return any(record.patch == patch.name for record in _chain(obj, attr))


def apply_instance(patch: Patch, obj: Any, *args: Any) -> bool:
    """Replace `obj`'s method with `patch.make(obj, original, *args)`.

    Returns False, changing nothing, when `obj` is not an instance of the target class;
    True when the method is replaced now or was already. Raises PatchTargetError,
    changing nothing, when the target is gone or `obj`'s class has another method shape.
    """
    cls, attr = _instance_target(patch)
    if not isinstance(cls, type):
        raise PatchTargetError(f"patch {patch.name!r}: {patch.target} is not a method of a class")
    if not isinstance(obj, cls):
        return False
    if instance_applied(patch, obj):
        return True
    kind = type(obj)
    problem = _parameter_problem(getattr(kind, attr, None), patch.expect, exact=True)
    if problem is not None:
        raise PatchTargetError(
            f"patch {patch.name!r}: {kind.__qualname__}.{attr} {problem}; this vLLM moved "
            f"or changed it. The patch cannot apply ({patch.what})"
        )
    replaced = getattr(obj, "__dict__", {}).get(attr)
    replacement = patch.make(obj, getattr(obj, attr), *args)
    setattr(replacement, _INSTANCE_RECORD, _InstanceRecord(patch.name, attr, replaced))
    setattr(obj, attr, replacement)
    key = id(obj)
    entry = _instances.get(key)
    if entry is None or entry[0]() is not obj:
        entry = _instances[key] = (weakref.ref(obj, lambda _, key=key: _forget(key)), set())
    entry[1].add(attr)
    return True


def _forget(key: int) -> None:
    entry = _instances.get(key)
    if entry is not None and entry[0]() is None:
        del _instances[key]


def undo_instance(patch: Patch, obj: Any) -> bool:
    """Put back what `patch` replaced on `obj`; False when it is not on `obj`. Raises
    PatchTargetError, changing nothing, when another instance patch wraps it there."""
    attr = _instance_target(patch)[1]
    chain = _chain(obj, attr)
    names = [record.patch for record in chain]
    if patch.name not in names:
        return False
    if names[0] != patch.name:
        raise PatchTargetError(
            f"patch {patch.name!r}: {names[0]!r} wraps it on this {type(obj).__name__}; "
            f"undo {names[0]!r} first"
        )
    _restore(obj, chain[0])
    return True


def _restore(obj: Any, record: _InstanceRecord) -> None:
    if record.replaced is None:
        delattr(obj, record.attr)  # the class's method again
    else:
        setattr(obj, record.attr, record.replaced)
    if not any(_chain(obj, attr) for attr in _instances.get(id(obj), (None, ()))[1]):
        _instances.pop(id(obj), None)


def instances(patch: Patch | None = None) -> list[Any]:
    """The live objects `patch` (any instance patch, when None) is applied to."""
    found = []
    for ref, attrs in list(_instances.values()):
        obj = ref()
        if obj is None:
            continue
        names = {record.patch for attr in attrs for record in _chain(obj, attr)}
        if names and (patch is None or patch.name in names):
            found.append(obj)
    return found


def undo_instances(patch: Patch | None = None) -> int:
    """Undo `patch` on every object it is applied to, or with None every instance patch
    on every object (the latest first); returns how many replacements were undone.
    Raises PatchTargetError, changing nothing, where another patch wraps `patch`."""
    objects = instances(patch)
    if patch is not None:
        attr = _instance_target(patch)[1]
        for obj in objects:
            top = _chain(obj, attr)[0].patch
            if top != patch.name:
                raise PatchTargetError(
                    f"patch {patch.name!r}: {top!r} wraps it on this {type(obj).__name__}; "
                    f"undo {top!r} first"
                )
        for obj in objects:
            undo_instance(patch, obj)
        return len(objects)
    undone = 0
    for obj in objects:
        for attr in sorted(_instances.get(id(obj), (None, set()))[1]):
            for record in _chain(obj, attr):
                _restore(obj, record)
                undone += 1
    return undone


# ------------------------------------------------------------------ internals
def _describe(fn: Any, original: Any) -> None:
    for name in ("__name__", "__qualname__", "__doc__"):
        if hasattr(original, name):
            setattr(fn, name, getattr(original, name))
    fn.__wrapped__ = original


def _set_field_type(cls: type, attr: str, new_type: Any) -> None:
    cls.__dataclass_fields__[attr].type = new_type
    cls.__annotations__[attr] = new_type
    if hasattr(cls, "__pydantic_fields__"):
        import pydantic.dataclasses

        pydantic.dataclasses.rebuild_dataclass(cls, force=True)


def _copy_function(fn: types.FunctionType, code: types.CodeType) -> types.FunctionType:
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    return copy


def _swap_code(fn: types.FunctionType, replacement: Callable) -> types.CodeType:
    """Make `fn` itself run `replacement`, so every module holding `fn` sees the patch.

    `fn`'s code becomes a call through a name in its own module; `make` got a copy of
    the original function to call. Returns the original code, for undo.
    """
    if not isinstance(fn, types.FunctionType) or fn.__code__.co_freevars:
        raise PatchTargetError(f"{fn!r} cannot be patched in place")
    saved = fn.__code__
    fn.__signature__ = inspect.signature(fn)  # callers that inspect it see vLLM's parameters
    slot = f"{_TRAMPOLINE}{fn.__name__}"
    fn.__globals__[slot] = replacement
    namespace: dict[str, Any] = {}
    source = f"def {fn.__name__}(*args, **kwargs):\n    return {slot}(*args, **kwargs)\n"
    exec(compile(source, f"<vllm-flashinfer-ep patch of {fn.__qualname__}>", "exec"), namespace)
    fn.__code__ = namespace[fn.__name__].__code__
    return saved
