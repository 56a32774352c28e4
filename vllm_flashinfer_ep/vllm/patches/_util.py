"""Small helpers shared by the patch modules: marking wrappers, rebinding names."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

MARK = "__flashinfer_ep_patch__"


def mark(fn: Callable, original: Callable) -> Callable:
    """Tag a wrapper so re-applying a patch is a no-op and tests can see it took."""
    setattr(fn, MARK, True)
    fn.__wrapped_original__ = original  # type: ignore[attr-defined]
    fn.__name__ = getattr(original, "__name__", fn.__name__)
    fn.__qualname__ = getattr(original, "__qualname__", fn.__qualname__)
    fn.__doc__ = getattr(original, "__doc__", None)
    return fn


def is_marked(obj: Any) -> bool:
    fn = obj.fget if isinstance(obj, property) else obj
    return bool(getattr(fn, MARK, False))


def original_of(obj: Any) -> Any:
    fn = obj.fget if isinstance(obj, property) else obj
    return getattr(fn, "__wrapped_original__", fn)


def rebind_everywhere(name: str, original: Any, replacement: Any) -> list[str]:
    """Point every loaded module's `name` that is `original` at `replacement`.

    vLLM imports some functions by name (`from x import f`), so replacing the
    defining module's attribute is not enough for modules loaded earlier.
    """
    rebound = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith("vllm"):
            continue
        try:
            if getattr(module, name, None) is original:
                setattr(module, name, replacement)
                rebound.append(mod_name)
        except Exception:  # noqa: BLE001 - lazy modules may refuse getattr
            continue
    return rebound
