"""Every benchmark refuses a host without a GPU the same way: one line on stderr, exit 2,
nothing built (bench-fp8 used to end in a traceback from its harness)."""

from __future__ import annotations

import pytest
import torch

from vllm_flashinfer_ep import cli
from vllm_flashinfer_ep.bench import fp8_harness, harness, ht_harness

BENCHMARKS = [
    ("bench", "vllm_flashinfer_ep.bench.run"),
    ("bench-ht", "vllm_flashinfer_ep.bench.ht_run"),
    ("bench-fp8", "vllm_flashinfer_ep.bench.fp8_run"),
    ("bench-memory", "vllm_flashinfer_ep.bench.memory"),
]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def built(*args, **kwargs):
        raise AssertionError("a benchmark harness was built on a host without a GPU")

    for cls in (harness.Harness, ht_harness.HtHarness, fp8_harness.Fp8Harness):
        monkeypatch.setattr(cls, "__init__", built)


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize(("command", "module"), BENCHMARKS)
def test_refuses_in_one_line(capsys, command, module):
    assert cli.main([command]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"{command}: needs a CUDA GPU (sm_90+) with NCCL-EP; none is visible here."
    )
    assert f"`vllm-flashinfer-ep {command}`" in err and f"-m {module}`" in err


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("backend", ["ll", "ht"])
def test_bench_fp8_refuses_for_both_backends(capsys, backend):
    assert cli.main(["bench-fp8", "--backend", backend]) == 2
    assert capsys.readouterr().err.startswith("bench-fp8: needs a CUDA GPU")


def test_bench_fp8_still_validates_its_arguments_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="bench-fp8: .*pass --hidden"):
        cli.main(["bench-fp8", "--hidden", "1000"])
