"""Fixtures shared by the CPU unit tests."""

from __future__ import annotations

import pytest

from tests.fakes.runtime import hide_cuda, installed_fake
from tests.helpers import patch_row
from vllm_flashinfer_ep.runtime import transport


@pytest.fixture()
def fake(monkeypatch):
    """The fake flashinfer.moe_ep installed for one test, CUDA hidden, always removed."""
    hide_cuda(monkeypatch)
    with installed_fake() as module:
        yield module
    assert transport._override is None


@pytest.fixture()
def round_split_row():
    """The `round_split` row: kernels whose prepare/finalize carries a RoundSplit split."""
    with patch_row("round_split") as patch:
        yield patch
