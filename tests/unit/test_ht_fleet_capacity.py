"""HT fleets are sized at most 8192 tokens per rank, and the package's pool agrees.

NCCL-EP's HT kernels are built for MAX_SUPPORTED_TOKENS_PER_RANK = 8192 and FlashInfer
clamps the fleet silently; the package must clamp the same way so its pool capacity,
staging buffers and capacity errors describe the fleet that exists.
"""

from __future__ import annotations

import importlib
import logging

import pytest
import torch

from tests.fakes.runtime import build_fake_runtime
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import DispatchCapacityError
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.limits import HT_MAX_TOKENS_PER_RANK

pytestmark = pytest.mark.usefixtures("fake")


def test_the_limit_is_flashinfer_s():
    assert HT_MAX_TOKENS_PER_RANK == 8192
    try:
        fi_fleet = importlib.import_module("flashinfer.moe_ep.backends.split.comm.nccl_ep.fleet")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"flashinfer not importable here: {exc}")
    assert fi_fleet._HT_MAX_SUPPORTED_TOKENS_PER_RANK == HT_MAX_TOKENS_PER_RANK


@pytest.mark.parametrize(
    ("asked", "expected"), [(100, 100), (8192, 8192), (8193, 8192), (65536, 8192)]
)
def test_spec_capacity(asked, expected):
    assert (
        FleetSpec(Algorithm.HIGH_THROUGHPUT, 8, asked, 2048).effective_max_tokens_per_rank
        == expected
    )
    assert FleetSpec(Algorithm.LOW_LATENCY, 8, asked, 2048).effective_max_tokens_per_rank == asked


def test_ht_runtime_over_the_limit_is_sized_for_the_limit(caplog):
    with caplog.at_level(logging.WARNING):
        rt, fleet = build_fake_runtime(
            Algorithm.HIGH_THROUGHPUT, hidden=2048, capacity=16384, world_size=2
        )
    assert fleet.params.max_tokens_per_rank == 8192
    assert rt.capacity == 8192
    assert rt.round.combine_in.shape == (8192 * 2, 2048) and rt.round.ids.shape[0] == 8192 * 2
    assert "sized for 8192 instead of the requested 16384" in caplog.text


def test_a_step_over_the_limit_is_our_capacity_error_naming_the_flag():
    rt, fleet = build_fake_runtime(Algorithm.HIGH_THROUGHPUT, hidden=2048, capacity=16384)
    ids = torch.zeros(8193, 2, dtype=torch.int64)
    ids[:, 1] = 1
    with pytest.raises(DispatchCapacityError, match="--max-num-batched-tokens"):
        rt.round.dispatch(
            torch.zeros(8193, 2048, dtype=torch.bfloat16), ids, torch.full((8193, 2), 0.5)
        )
    assert fleet.calls() == []
