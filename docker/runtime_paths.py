"""Image build helper: stable paths to pip-installed NCCL and nvcc, and a GPU-free check.

`install` links site-packages' libnccl.so.2 (nvidia-nccl-cu13) to PREFIX/lib and writes
a PREFIX/bin/nvcc wrapper for the nvidia-cuda-nvcc wheel's CUDA-13 nvcc (a symlink
does not work: nvcc locates its toolchain from its real directory). The Dockerfile's
ENV then names those fixed paths. `check` verifies, in the final environment, that the
libnccl.so.2 actually loaded is >= 2.30.7 (what libnccl_ep needs), that nvcc is
CUDA 13, and that the plugin and NCCL-EP import.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

MIN_NCCL = (2, 30, 7)
NCCL_REL = Path("nccl/lib/libnccl.so.2")
NVCC_REL = Path("cu13/bin/nvcc")


def nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no 'nvidia' wheels in site-packages: is nvidia-nccl-cu13 installed?")
    return [Path(p) for p in spec.submodule_search_locations]


def find(rel: Path) -> Path:
    for base in nvidia_dirs():
        if (base / rel).is_file():
            return (base / rel).resolve()
    sys.exit(f"nvidia/{rel} not found under {[str(d) for d in nvidia_dirs()]}")


def install(prefix: Path) -> None:
    (prefix / "lib").mkdir(parents=True, exist_ok=True)
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    lib = prefix / "lib" / "libnccl.so.2"
    if lib.is_symlink() or lib.exists():
        lib.unlink()
    lib.symlink_to(find(NCCL_REL))
    nvcc = prefix / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\nexec "{find(NVCC_REL)}" "$@"\n', encoding="utf-8")
    nvcc.chmod(0o755)
    print(f"{lib} -> {lib.resolve()}\n{nvcc} -> {find(NVCC_REL)}")


def loaded_nccl_version() -> tuple[tuple[int, int, int], str]:
    try:
        lib = ctypes.CDLL("libnccl.so.2")  # the preloaded one, if LD_PRELOAD names it
    except OSError as exc:
        sys.exit(f"libnccl.so.2 cannot be loaded ({exc}); LD_PRELOAD should name it")
    raw = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(raw)) != 0:
        sys.exit("ncclGetVersion failed")
    v = raw.value  # e.g. 23007 for 2.30.7
    version = (v // 10000, (v // 100) % 100, v % 100)
    maps = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
    paths = sorted({line.split()[-1] for line in maps if "libnccl.so" in line})
    return version, ", ".join(paths)


def check() -> None:
    version, paths = loaded_nccl_version()
    if version < MIN_NCCL:
        sys.exit(f"loaded libnccl {version} < {MIN_NCCL} ({paths}); check LD_PRELOAD")
    print(f"libnccl {'.'.join(map(str, version))} loaded from {paths}")

    nvcc = os.environ.get("NCCL_EP_JIT_NVCC", "")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    if "release 13." not in out:
        sys.exit(f"NCCL_EP_JIT_NVCC={nvcc} is not a CUDA 13 nvcc:\n{out}")
    print(f"nvcc: {out.strip().splitlines()[-2]}")

    import nccl.ep  # noqa: F401  (lazy dlopen: importable without a GPU)

    import vllm_flashinfer_ep  # noqa: F401

    plugins = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if "flashinfer_ep" not in plugins:
        sys.exit(f"vllm.general_plugins lacks flashinfer_ep: {sorted(plugins)}")
    print("vllm_flashinfer_ep and nccl.ep import; vLLM plugin entry point present")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install").add_argument("--prefix", type=Path, required=True)
    sub.add_parser("check")
    args = parser.parse_args()
    if args.cmd == "install":
        install(args.prefix)
    else:
        check()


if __name__ == "__main__":
    main()
