"""Worker-side environment checks: each failure names its fix; all failures in one error."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from vllm_flashinfer_ep.errors import FlashInferEPConfigError, FlashInferEPEnvironmentError
from vllm_flashinfer_ep.runtime import env_checks
from vllm_flashinfer_ep.runtime.env_checks import Check


@pytest.mark.parametrize("code,want", [(23007, (2, 30, 7)), (22809, (2, 28, 9)), (2708, (2, 7, 8))])
def test_nccl_version_code(code, want):
    assert env_checks.parse_nccl_version_code(code) == want


def test_old_libnccl_fails_with_how_to_load_a_new_one():
    check = env_checks.check_nccl_version(((2, 28, 9), "/x/libnccl.so.2"))
    assert not check.ok and "2.28.9" in check.detail
    assert "LD_PRELOAD" in check.fix and "2.30.7" in check.fix
    assert env_checks.check_nccl_version(((2, 30, 7), "/y")).ok


def _fake_nvcc(tmp_path, release: str) -> str:
    path = tmp_path / "nvcc"
    path.write_text(
        f"#!{sys.executable}\nprint('Cuda compilation tools, release {release}, V{release}.1')\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_nvcc_missing_and_wrong_major(tmp_path):
    missing = env_checks.check_nvcc([])
    assert not missing.ok and "NCCL_EP_JIT_NVCC" in missing.fix
    old = env_checks.check_nvcc([("PATH", _fake_nvcc(tmp_path, "12.8"))])
    assert not old.ok and "CUDA 12.8" in old.detail
    assert env_checks.check_nvcc([("NVCC", _fake_nvcc(tmp_path, "13.0"))]).ok


def test_nvcc_search_order(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_EP_JIT_NVCC", "/a/nvcc")
    monkeypatch.setenv("CUDA_HOME", "/cuda")
    found = env_checks.nvcc_candidates()
    assert found[0] == ("NCCL_EP_JIT_NVCC", "/a/nvcc")
    assert ("CUDA_HOME", os.path.join("/cuda", "bin", "nvcc")) in found


def test_ensure_nvcc_only_fills_an_unset_variable(monkeypatch):
    logs = []
    monkeypatch.setattr(
        env_checks, "nvcc_candidates", lambda: [("nvidia-cuda-nvcc wheel", "/w/nvcc")]
    )
    monkeypatch.delenv("NCCL_EP_JIT_NVCC", raising=False)
    env_checks.ensure_nvcc_for_jit(logs.append)
    assert os.environ["NCCL_EP_JIT_NVCC"] == "/w/nvcc" and "NCCL_EP_JIT_NVCC" in logs[0]
    monkeypatch.setattr(env_checks, "nvcc_candidates", lambda: [("PATH", "/usr/bin/nvcc")])
    monkeypatch.setenv("NCCL_EP_JIT_NVCC", "/user/choice")
    env_checks.ensure_nvcc_for_jit(logs.append)
    assert os.environ["NCCL_EP_JIT_NVCC"] == "/user/choice" and len(logs) == 1


def test_torch_cuda_major(monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", "12.9")
    assert not env_checks.check_torch_cuda().ok
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU build" in env_checks.check_torch_cuda().detail


def test_old_gpu_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0) if i == 0 else (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"gpu{i}")
    check = env_checks.check_gpus()
    assert not check.ok and "[1]" in check.fix and "sm_80" in check.detail


def test_nccl_ep_missing_names_the_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    check = env_checks.check_nccl_ep_installed()
    assert not check.ok and "nccl-extensions>=0.1.0" in check.fix


def test_libnccl_ep_load_failure_is_reported_not_raised():
    # no GPU driver here: the dlopen fails and the check says so
    check = env_checks.check_nccl_ep_loads()
    if check.ok:
        pytest.skip("libnccl_ep loads on this host")
    assert "cannot load" in check.detail and "nccl-extensions" in check.fix


def test_require_runtime_environment_lists_every_failure():
    checks = [
        Check("a", True, "fine"),
        Check("b", False, "bad b", "fix b"),
        Check("c", False, "bad c", "fix c"),
    ]
    with pytest.raises(FlashInferEPEnvironmentError) as info:
        env_checks.require_runtime_environment(checks)
    assert isinstance(info.value, FlashInferEPConfigError)
    text = str(info.value)
    assert "fix b" in text and "fix c" in text and "fine" not in text
    env_checks.require_runtime_environment([Check("a", True, "fine")])
