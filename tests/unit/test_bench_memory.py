"""bench-memory: the sizes it pools, its arguments, and one run on the fake transport."""

from __future__ import annotations

import argparse
import sys
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


def test_each_row_is_measured_in_a_process_of_its_own(monkeypatch, capsys):
    """NCCL-EP's first fleet of a process costs more than later ones (it loads its group
    and kernels), and an engine worker builds its first: every row gets a fresh process."""
    import json as json_mod
    import subprocess

    monkeypatch.setattr(memory, "refuse_without_gpu", lambda *a: False)
    children = []

    def child(command, check):
        children.append(command)
        args = build_parser().parse_args(["bench-memory", *command[3:]])
        row = memory.MemoryRow(
            args.hidden[0], args.capacity[0], 3, 1.0, 0.0, 0.0, 1.0, 2.0, 1.0, 2.0, 2.0
        )
        with open(args.one_row, "w") as fh:
            json_mod.dump(memory.asdict(row), fh)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(memory.subprocess, "run", child)
    assert memory.main(_args("--hidden", "2048,7168", "--capacity", "256,4096")) == 0
    measured = [(c[c.index("--hidden") + 1], c[c.index("--capacity") + 1]) for c in children]
    assert measured == [("2048", "256"), ("7168", "256"), ("2048", "4096"), ("7168", "4096")]
    assert all(c[:3] == [sys.executable, "-m", "vllm_flashinfer_ep.bench.memory"] for c in children)
    table = capsys.readouterr().out
    assert "| 7168 | 4096 | 3 |" in table and "log / total" in table and "estimate / total" in table


def test_one_row_takes_one_shape():
    with pytest.raises(SystemExit, match="one --hidden and one --capacity"):
        memory.validate_arguments(_args("--hidden", "2048,7168", "--one-row", "x.json"))
