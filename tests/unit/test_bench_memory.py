"""bench-memory: the sizes it pools, its arguments, and one run on the fake transport."""

from __future__ import annotations

import argparse
from unittest import mock

import pytest
import torch

from tests.fakes.runtime import installed_fake
from vllm_flashinfer_ep.bench import memory
from vllm_flashinfer_ep.cli import build_parser
from vllm_flashinfer_ep.runtime.fleet import FleetCache
from vllm_flashinfer_ep.runtime.pool_sizes import bucket_sizes


def test_default_capture_sizes_are_vllm_s():
    sizes = memory.vllm_default_capture_sizes()
    assert len(sizes) == 51 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [496, 512]
    assert memory.vllm_default_capture_sizes(max_num_seqs=8) == [1, 2, 4, 8, 16]


def test_served_pool_sizes_are_capture_sizes_then_buckets():
    assert memory.served_pool_sizes(512) == memory.vllm_default_capture_sizes()
    big = memory.served_pool_sizes(4096)
    assert big == memory.vllm_default_capture_sizes() + bucket_sizes(512, 4096)
    assert memory.served_pool_sizes(100)[-3:] == [88, 96, 100]


def _args(*argv):
    return build_parser().parse_args(["bench-memory", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hidden", "3072"], "not NCCL-EP LL sizes"),
        (["--capacity", "0"], "positive"),
        (["--top-k", "99"], "--top-k must be in"),
    ],
)
def test_bad_arguments_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        memory.validate_arguments(_args(*argv))


def test_refuses_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert memory.main(_args()) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_measure_runs_every_pooled_handle_once_on_the_fake(fake):
    with installed_fake(), mock.patch.object(torch.cuda, "current_device", return_value=0):
        fleets = FleetCache(0, 1, None)
        sizes = [1, 2, 4, 8, 12, 16]
        row = memory.measure(2048, 16, 8, 2, sizes, fleets, torch.device("cpu"))
    assert row.handles == len(sizes) and row.capacity == 16
    table = memory.format_table([row], argparse.Namespace(num_experts=8, top_k=2))
    assert "| 2048 | 16 | 6 |" in table
