"""HT runs on pooled handles (runtime/handle_pool.py bucket_sizes with HT_MAX_PAD, the HT
manager's _pool_sizes); `bench-ht --help`, the HT benchmark's sources and docs/benchmarks.md
say so and no longer say that HT does not pool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_flashinfer_ep import cli
from vllm_flashinfer_ep.bench import ht_harness, ht_results
from vllm_flashinfer_ep.runtime import pool_sizes

ROOT = Path(__file__).resolve().parents[2]
STALE = re.compile(
    r"warms no pool|does not pool|not pool yet|(?<!\w)no pool sizes \(HT is never captured\)", re.I
)


def _help(command: str) -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[command].format_help()


def test_ht_pools_buckets_at_most_ht_max_pad_apart():
    sizes = pool_sizes.bucket_sizes(0, 8192, max_pad=pool_sizes.HT_MAX_PAD)
    assert sizes[0] == 1 and sizes[-1] == 8192
    assert max(b - a for a, b in zip(sizes, sizes[1:])) <= pool_sizes.HT_MAX_PAD


@pytest.mark.parametrize(
    "text",
    [
        _help("bench-ht"),
        (ROOT / "docs" / "benchmarks.md").read_text(),
        Path(ht_harness.__file__).read_text(),
        Path(ht_results.__file__).read_text(),
    ],
    ids=["bench-ht --help", "benchmarks.md", "ht_harness.py", "ht_results.py"],
)
def test_no_text_says_ht_does_not_pool(text):
    assert not STALE.search(text), STALE.search(text)


def test_help_says_what_each_ht_mode_is():
    text = " ".join(_help("bench-ht").split())
    assert (
        "what a served HT engine runs" in text and f"HT_MAX_PAD = {pool_sizes.HT_MAX_PAD}" in text
    )
    assert "the served HT path only where no pooled size fits" in text


def test_benchmarks_md_describes_the_served_pool():
    text = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert "served HT runs on pooled handles (`ht_pooled`)" in text
    assert (
        "the HT manager pools buckets from 1 to its capacity at most `HT_MAX_PAD` (256) rows apart"
        in text
    )
