"""The one seam between the package and `flashinfer.moe_ep`'s public API (its internals:
flashinfer_internals.py); unit tests install a fake through `use_transport_module`."""

from __future__ import annotations

import importlib
from types import ModuleType

from vllm_flashinfer_ep.runtime import flashinfer_internals

_override: ModuleType | None = None


def moe_ep() -> ModuleType:
    """The transport module: `flashinfer.moe_ep`, or the fake a test installed."""
    if _override is not None:
        return _override
    return importlib.import_module("flashinfer.moe_ep")


def use_transport_module(module: ModuleType | None) -> None:
    """Install (or with None remove) a stand-in for `flashinfer.moe_ep`. Tests only."""
    global _override
    _override = module


def handle_supports_update() -> bool:
    """Whether FlashInfer's handle has `update()` (>= 0.7.2: re-targeted under capture)."""
    if _override is not None:
        return hasattr(getattr(_override, "Handle", object), "update")
    return callable(getattr(flashinfer_internals.handle_class(), "update", None))
