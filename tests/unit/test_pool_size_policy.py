"""One pool-size policy (pool_sizes.pool_sizes) for the managers, doctor's and the
config's memory estimate and the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.runtime import buffer_sizes
from vllm_flashinfer_ep.runtime import pool_sizes as policy
from vllm_flashinfer_ep.runtime.pool_sizes import HT_MAX_PAD, bucket_sizes, pool_sizes

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_flashinfer_ep"


def test_ll_pools_the_captured_counts_that_fit_then_buckets_above_them():
    sizes = pool_sizes(Algorithm.LOW_LATENCY, 256, [16, 8, 1, 2, 4, 600, 0])
    assert sizes[:5] == [1, 2, 4, 8, 16] and 600 not in sizes and 0 not in sizes
    assert sizes[5:] == bucket_sizes(16, 256) and sizes[-1] == 256
    assert pool_sizes(Algorithm.LOW_LATENCY, 64) == bucket_sizes(0, 64)  # eager engine


def test_ht_pools_buckets_from_one_at_most_ht_max_pad_apart_whatever_is_captured():
    sizes = pool_sizes(Algorithm.HIGH_THROUGHPUT, 4096, [5, 7])
    assert sizes == bucket_sizes(0, 4096, max_pad=HT_MAX_PAD) and not {5, 7} & set(sizes)
    assert max(b - a for a, b in zip(sizes, sizes[1:])) <= HT_MAX_PAD


@pytest.mark.parametrize("capacity", [64, 256, 512, 4096])
def test_the_served_estimate_takes_the_same_policy(capacity):
    want = pool_sizes("low_latency", capacity, buffer_sizes.vllm_default_capture_sizes())
    assert buffer_sizes.served_pool_sizes(capacity) == want


@pytest.mark.parametrize("algorithm", list(Algorithm))
def test_the_manager_takes_the_same_policy(algorithm, monkeypatch):
    from vllm_flashinfer_ep.vllm import managers

    captured = [1, 2, 4, 8, 24, 48]
    monkeypatch.setattr(managers, "pool_sizes_from_config", lambda config: captured)
    monkeypatch.setattr(policy, "unavailable_reason", lambda: None)
    cls = managers.MANAGERS[algorithm.backend]
    manager = cls.__new__(cls)
    manager._vllm_config = None
    assert manager._pool_sizes(512) == pool_sizes(algorithm, 512, captured)


def test_no_module_but_the_policy_builds_sizes_from_buckets():
    """bucket_sizes is the policy's building block: another caller would be a second policy."""
    callers = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "pool_sizes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name == "bucket_sizes":
                    callers.append(str(path.relative_to(PACKAGE)))
    assert callers == []
