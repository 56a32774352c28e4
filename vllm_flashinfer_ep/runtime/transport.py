"""The one seam between the package and `flashinfer.moe_ep`'s public API.

Everything the runtime needs from FlashInfer's public API is looked up here, by name,
from one module object; what it reads of FlashInfer's internals is listed in
runtime/flashinfer_internals.py. Unit tests install a fake module
(tests/fakes/fake_moe_ep.py) through `use_transport_module`; production always uses the
real `flashinfer.moe_ep`.
"""

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
    """Whether the installed FlashInfer's NCCL-EP handle has `update()`.

    `update` (FlashInfer >= 0.7.2) is what lets one handle be created at warmup and
    re-targeted inside captured forwards; without it every forward needs a fresh handle,
    which cannot be captured.
    """
    if _override is not None:
        return hasattr(getattr(_override, "Handle", object), "update")
    # FlashInfer's handle class is internal (runtime/flashinfer_internals.py).
    return callable(getattr(flashinfer_internals.handle_class(), "update", None))
