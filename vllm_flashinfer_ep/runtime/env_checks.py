"""Host checks for NCCL-EP, each a `Check` with a one-line fix: the worker runs them before
model load (`require_runtime_environment`), `doctor` prints them. No vLLM import."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vllm_flashinfer_ep.errors import FlashInferEPEnvironmentError
from vllm_flashinfer_ep.runtime.limits import (
    MIN_COMPUTE_CAPABILITY,
    MIN_CUDA_MAJOR,
    MIN_NCCL_VERSION,
    format_version,
)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # ok, but the engine would change something or cannot check it

    def line(self) -> str:
        mark = "FAIL" if not self.ok else ("warn" if self.warn else "ok  ")
        tail = f"  -> {self.fix}" if (self.fix and (self.warn or not self.ok)) else ""
        return f"[{mark}] {self.name}: {self.detail}{tail}"


def check_cuda_driver() -> Check:
    """The NVIDIA driver library; every GPU check below depends on it."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return Check(
            "CUDA driver",
            False,
            f"libcuda.so.1 cannot be loaded ({exc})",
            "run on a host with the NVIDIA driver (containers: --gpus all)",
        )
    return Check("CUDA driver", True, "libcuda.so.1 loads")


def check_torch_cuda() -> Check:
    import torch

    cuda = torch.version.cuda
    if not cuda:
        return Check(
            "torch CUDA",
            False,
            f"torch {torch.__version__} is a CPU build",
            f"install a CUDA >= {MIN_CUDA_MAJOR} build of torch (vLLM 0.33.0 pins torch 2.14.0+cu130)",
        )
    major = int(cuda.split(".")[0])
    return Check(
        "torch CUDA",
        major >= MIN_CUDA_MAJOR,
        f"torch {torch.__version__} built for CUDA {cuda}",
        f"NCCL-EP needs torch built for CUDA >= {MIN_CUDA_MAJOR}; reinstall torch 2.14.0+cu130",
    )


def check_gpus() -> Check:
    import torch

    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001
        return Check("GPUs", False, f"CUDA unavailable ({exc})", "run on a host with NVIDIA GPUs")
    if count == 0:
        return Check(
            "GPUs", False, "no CUDA device visible", "run on a host with sm_90+ NVIDIA GPUs"
        )
    caps = [torch.cuda.get_device_capability(i) for i in range(count)]
    names = [torch.cuda.get_device_name(i) for i in range(count)]
    low = [i for i, cc in enumerate(caps) if tuple(cc) < MIN_COMPUTE_CAPABILITY]
    detail = ", ".join(f"{i}: {n} (sm_{c[0]}{c[1]})" for i, (n, c) in enumerate(zip(names, caps)))
    return Check(
        "GPUs",
        not low,
        detail,
        f"NCCL-EP needs compute capability >= {MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} "
        f"(Hopper or newer); GPUs {low} are older",
    )


def check_nccl_ep_installed() -> Check:
    if importlib.util.find_spec("nccl") is None or importlib.util.find_spec("nccl.ep") is None:
        return Check(
            "nccl.ep",
            False,
            "module nccl.ep not found",
            "pip install 'nccl-extensions>=0.1.0' (it provides nccl.ep; FlashInfer's hint to "
            "rebuild FlashInfer does not apply to wheel installs)",
        )
    return Check("nccl.ep", True, "module nccl.ep importable")


def check_nccl_ep_loads() -> Check:
    """Load libnccl_ep (needs a GPU driver) and report its version."""
    installed = check_nccl_ep_installed()
    if not installed.ok:
        return installed
    try:
        import nccl.ep as ep

        version = ep.get_lib_version()
    except Exception as exc:  # noqa: BLE001 - report any loader failure verbatim
        return Check(
            "libnccl_ep",
            False,
            f"cannot load: {exc}",
            "reinstall 'nccl-extensions>=0.1.0' for your CUDA major, make sure the NVIDIA "
            f"driver is present, and load NCCL >= {format_version(MIN_NCCL_VERSION)} first",
        )
    return Check("libnccl_ep", True, f"version {version}")


def parse_nccl_version_code(code: int) -> tuple[int, int, int]:
    """NCCL's ncclGetVersion code: major*10000 + minor*100 + patch (>= 2.9)."""
    if code >= 10000:
        return code // 10000, (code % 10000) // 100, code % 100
    return code // 1000, (code % 1000) // 100, code % 100


def loaded_nccl_version() -> tuple[tuple[int, int, int], str] | None:
    """Version and path of the libnccl.so.2 this process uses: the first loaded wins."""
    try:
        lib = ctypes.CDLL("libnccl.so.2")
    except OSError:
        candidate = _pip_nccl_library()
        if candidate is None:
            return None
        try:
            lib = ctypes.CDLL(str(candidate))
        except OSError:
            return None
    code = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None
    return parse_nccl_version_code(code.value), _loaded_path("libnccl.so.2") or "?"


NCCL_IN_WHEEL = Path("nccl/lib/libnccl.so.2")  # nvidia-nccl-cu13
NVCC_IN_WHEEL = (Path("cu13/bin/nvcc"), Path("cuda_nvcc/bin/nvcc"))  # nvidia-cuda-nvcc


def nvidia_wheel_file(*relative: Path) -> Path | None:
    """The first of `relative` under a pip-installed `nvidia` namespace package."""
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for rel in relative:
            if (Path(root) / rel).is_file():
                return (Path(root) / rel).resolve()
    return None


def _pip_nccl_library() -> Path | None:
    return nvidia_wheel_file(NCCL_IN_WHEEL)


def _loaded_path(soname: str) -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                if line.rstrip().endswith(soname) or f"/{soname}" in line:
                    return line.split()[-1]
    except OSError:
        return None
    return None


def check_nccl_version(found: tuple[tuple[int, int, int], str] | None = None) -> Check:
    found = found if found is not None else loaded_nccl_version()
    need = format_version(MIN_NCCL_VERSION)
    fix = (
        f"load NCCL >= {need} before anything else: pip install 'nvidia-nccl-cu13>={need}' and "
        "export LD_PRELOAD=$(python -c 'import nvidia.nccl, os; "
        'print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))\')'
    )
    if found is None:
        return Check("libnccl", False, "no libnccl.so.2 could be loaded", fix)
    version, path = found
    return Check("libnccl", version >= MIN_NCCL_VERSION, f"{format_version(version)} ({path})", fix)


def nvcc_candidates() -> list[tuple[str, str]]:
    """nvcc paths in NCCL-EP's JIT search order, then the pip `nvidia-cuda-nvcc` one."""
    out: list[tuple[str, str]] = []
    for var in ("NCCL_EP_JIT_NVCC", "NVCC"):
        if os.environ.get(var):
            out.append((var, os.environ[var]))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((var, str(Path(os.environ[var]) / "bin" / "nvcc")))
    on_path = shutil.which("nvcc")
    if on_path:
        out.append(("PATH", on_path))
    pip_nvcc = pip_nvcc_path()
    if pip_nvcc:
        out.append(("nvidia-cuda-nvcc wheel", pip_nvcc))
    return out


def pip_nvcc_path() -> str | None:
    found = nvidia_wheel_file(*NVCC_IN_WHEEL)
    return str(found) if found is not None else None


def nvcc_cuda_version(path: str) -> tuple[int, int] | None:
    try:
        text = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_nvcc(candidates: list[tuple[str, str]] | None = None) -> Check:
    """NCCL-EP compiles its dispatch/combine kernels at first use with nvcc (CUDA 13)."""
    candidates = nvcc_candidates() if candidates is None else candidates
    fix = (
        f"install a CUDA {MIN_CUDA_MAJOR} nvcc (pip install nvidia-cuda-nvcc, or the CUDA "
        "toolkit) and export NCCL_EP_JIT_NVCC=/path/to/nvcc"
    )
    if not candidates:
        return Check("nvcc (NCCL-EP JIT)", False, "no nvcc found", fix)
    source, path = candidates[0]
    version = nvcc_cuda_version(path)
    if version is None:
        return Check("nvcc (NCCL-EP JIT)", False, f"{path} (from {source}) does not run", fix)
    return Check(
        "nvcc (NCCL-EP JIT)",
        version[0] == MIN_CUDA_MAJOR,
        f"{path} (from {source}), CUDA {version[0]}.{version[1]}",
        fix,
    )


def ensure_nvcc_for_jit(log) -> None:
    """Point NCCL-EP's JIT at the `nvidia-cuda-nvcc` wheel's nvcc, which it does not search."""
    candidates = nvcc_candidates()
    if candidates and candidates[0][0] != "nvidia-cuda-nvcc wheel":
        return
    if candidates:
        os.environ["NCCL_EP_JIT_NVCC"] = candidates[0][1]
        log(
            f"flashinfer_ep: set NCCL_EP_JIT_NVCC={candidates[0][1]} (nvcc of the nvidia-cuda-nvcc wheel)"
        )


def runtime_checks() -> list[Check]:
    """Everything a worker needs before the first NCCL-EP call, the driver first."""
    return [
        check_cuda_driver(),
        check_torch_cuda(),
        check_gpus(),
        check_nccl_ep_loads(),
        check_nccl_version(),
        check_nvcc(),
    ]


def image_checks() -> list[Check]:
    """What an image can check at build time, without a GPU or driver."""
    return [check_torch_cuda(), check_nccl_ep_installed(), check_nccl_version(), check_nvcc()]


def link_runtime_paths(prefix: Path) -> list[str]:
    """Stable paths for an image's ENV (nvcc wrapped: a symlinked one misses its toolchain)."""
    nccl, nvcc = _pip_nccl_library(), pip_nvcc_path()
    if nccl is None or nvcc is None:
        missing = [
            n for n, p in (("nvidia-nccl-cu13", nccl), ("nvidia-cuda-nvcc", nvcc)) if p is None
        ]
        raise FlashInferEPEnvironmentError(f"pip packages not installed: {', '.join(missing)}")
    (prefix / "lib").mkdir(parents=True, exist_ok=True)
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    lib = prefix / "lib" / "libnccl.so.2"
    if lib.is_symlink() or lib.exists():
        lib.unlink()
    lib.symlink_to(nccl)
    wrapper = prefix / "bin" / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec "{nvcc}" "$@"\n', encoding="utf-8")
    wrapper.chmod(0o755)
    return [f"{lib} -> {nccl}", f"{wrapper} -> {nvcc}"]


def require_runtime_environment(checks: list[Check] | None = None) -> None:
    checks = runtime_checks() if checks is None else checks
    failed = [c for c in checks if not c.ok]
    if failed:
        lines = "\n".join("  " + c.line() for c in failed)
        raise FlashInferEPEnvironmentError(
            "the flashinfer_ep all2all backends cannot run on this host:\n" + lines
        )
