"""The one patch mechanism: check a vLLM target, replace it, remember the original, undo.

Kinds: WRAP (a function; `in_place` swaps its code, since vLLM's importers hold it by
name), PROPERTY (its getter), GLOBAL (a module value), FIELD (a dataclass field's type).
`expect` is checked first, so a moved or reshaped target gives one PatchTargetError.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

WRAP, PROPERTY, GLOBAL, FIELD = "wrap", "property", "global", "field"


class PatchTargetError(RuntimeError):
    """The vLLM symbol a patch targets is missing or has another shape."""


@dataclass(frozen=True)
class Patch:
    name: str
    stage: str  # "platform" | "worker"
    target: str  # "module:Attr" or "module:Class.attr"
    kind: str  # WRAP | PROPERTY | GLOBAL | FIELD
    make: Callable[..., Any]  # make(original) -> replacement
    expect: tuple[str, ...] | Callable[[Any], bool]
    what: str
    why: str
    how: str
    upstream: str
    removal: str
    in_place: bool = False
    after: Callable[[], None] | None = None  # run after apply and after undo

    def entry(self) -> str:
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
    elif patch.kind in (WRAP, PROPERTY):
        fn = value.fget if patch.kind == PROPERTY else value
        problem = _parameter_problem(fn, patch.expect)
    elif not patch.expect(value):
        problem = f"has an unexpected shape ({value!r:.120})"
    if problem is not None:
        raise PatchTargetError(
            f"patch {patch.name!r}: {patch.target} {problem}; this vLLM moved or changed "
            f"it. The patch cannot apply ({patch.what})"
        )
    return owner, attr, value


def _parameter_problem(fn: Any, expect: tuple[str, ...]) -> str | None:
    """What is wrong with `fn`'s parameters (None: nothing): `expect` first."""
    if not callable(fn):
        return "is not callable"
    params = tuple(inspect.signature(fn).parameters)
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
    """Make `fn` itself run `replacement` (through a name in its module), so every module
    holding `fn` sees the patch. Returns the original code, for undo."""
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
