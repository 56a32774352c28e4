"""The FP8 experts probe's reading of its table (tests/engine/fp8_experts_probe.py): the
bound of ReceivedRowsOrDeepGemmExperts (experts/deep_gemm.py) that the measured rows give."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from fp8_experts_probe import received_rows_bound  # noqa: E402


def _rows(*timings):
    """(tokens, received_rows us, deep_gemm_dp us) -> the probe's JSON rows."""
    return [
        {"tokens": t, "us": {"received_rows": ours, "deep_gemm_dp": theirs, "no_ep": 1.0}}
        for t, ours, theirs in timings
    ]


@pytest.mark.parametrize(
    "timings, bound",
    [
        # faster up to 8 tokens: 8 x 8 / 128 = 0.5 rows per expert
        (((1, 30, 48), (2, 40, 50), (4, 60, 70), (8, 110, 120), (16, 170, 160)), 0.5),
        # the order of the rows does not matter
        (((8, 110, 120), (1, 30, 48), (16, 170, 160), (4, 60, 70), (2, 40, 50)), 0.5),
        # a win after a loss does not count: the bound holds for every batch below it
        (((1, 30, 48), (2, 55, 50), (4, 60, 70)), 1 * 8 / 128),
        (((1, 50, 48), (2, 40, 50)), 0.0),  # slower at the first: off
        (((1, 48, 48),), 0.0),  # a tie is not faster
        (((1, 30, 48), (8, 100, None)), 1 * 8 / 128),  # no DeepGEMM timing: stop there
        (((1, 30, 48), (256, 200, 300)), 16.0),  # faster everywhere: the largest batch
    ],
)
def test_the_bound_is_the_largest_batch_below_which_the_received_rows_always_won(timings, bound):
    assert received_rows_bound(_rows(*timings), top_k=8, experts=128) == bound
