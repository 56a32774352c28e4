"""Skip or fail a test whose environment (GPU, NCCL-EP, vLLM runtime, model) is missing.

By default a missing environment skips with the reason. With FLASHINFER_EP_REQUIRE_GPU=1
(set it on GPU machines, where every test is meant to run) the same tests FAIL with
the reason, so a broken GPU stack cannot pass as a run of skips.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ENV = "FLASHINFER_EP_REQUIRE_GPU"
MARKER = "missing_environment"


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _failure(reason: str) -> str:
    return f"{reason} ({REQUIRE_ENV}=1: a missing environment fails instead of skipping)"


def missing(reason: str) -> NoReturn:
    """Inside a test or fixture: skip, or fail in require mode."""
    if required():
        pytest.fail(_failure(reason), pytrace=False)
    pytest.skip(reason)


def mark_missing(item: pytest.Item, reason: str) -> None:
    """At collection: mark the item to skip, or to fail at setup in require mode."""
    if required():
        item.add_marker(pytest.mark.missing_environment(reason=reason))
    else:
        item.add_marker(pytest.mark.skip(reason=reason))


def fail_if_marked(item: pytest.Item) -> None:
    """pytest_runtest_setup: fail an item marked by `mark_missing` in require mode."""
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        pytest.fail(_failure(marker.kwargs["reason"]), pytrace=False)
