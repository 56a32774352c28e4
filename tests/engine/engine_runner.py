"""Start engine configurations in subprocesses with the world-1 harness plugin visible.

Shared by the engine tests, the serve test and the engine benchmark.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import world1_harness  # the harness this module installs in every engine process

from tests.helpers import NO_MULTICAST
from vllm_flashinfer_ep import envs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HARNESS_DIST = "vllm_flashinfer_ep_world1_harness-0.0.0.dist-info"
LOG_DIR_ENV = "FLASHINFER_EP_TEST_ENGINE_LOG_DIR"
# Harness switches read by the engine processes: they change what an engine computes, so
# a kept result is keyed by them too, as by the package's variables.
ENGINE_SWITCHES = world1_harness.SWITCHES


def write_plugin_dist(root: Path) -> Path:
    """A test-only distribution whose `vllm.general_plugins` entry point installs the harness.

    vLLM loads general plugins in every process it starts (API server, engine core,
    workers), so an entry point is how the harness reaches all of them.
    """
    dist = root / HARNESS_DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-flashinfer-ep-world1-harness\nVersion: 0.0.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nflashinfer_ep_world1_harness = world1_harness:install\n"
    )
    return root


def engine_env(plugin_root: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: harness plugin (None: a real multi-rank engine,
    no harness), tests/engine and the repo first."""
    env = dict(os.environ)
    paths = [str(p) for p in (plugin_root, HERE, REPO) if p is not None]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.pop("VLLM_TARGET_DEVICE", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["VLLM_CONFIGURE_LOGGING"] = "1"  # the test process turns it off; engines print INFO
    env.update(extra or {})
    env.update(NO_MULTICAST)
    return env


def _log_dir(work: Path) -> Path:
    path = Path(os.environ.get(LOG_DIR_ENV) or work)
    path.mkdir(parents=True, exist_ok=True)
    return path


# A folder that keeps engine results across device calls on one machine (the multi-GPU
# steps each need the same reference engines): keyed by spec, environment and the code.
CACHE_ENV = "FLASHINFER_EP_TEST_ENGINE_CACHE"


def _code_digest() -> str:
    """The package's and the engine tests' sources: a changed tree never reads old results."""
    digest = hashlib.sha1()
    for path in sorted([*(REPO / "vllm_flashinfer_ep").rglob("*.py"), *HERE.glob("*.py")]):
        digest.update(str(path.relative_to(REPO)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


class EngineRunner:
    """Runs each engine spec once (by content) and keeps its result for the session, and
    across sessions in CACHE_ENV's folder where that is set."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.plugin_root = write_plugin_dist(work / "plugin")
        self._results: dict[str, dict[str, Any]] = {}
        folder = os.environ.get(CACHE_ENV)
        self.cache = Path(folder) if folder else None
        self._code = _code_digest() if self.cache else ""

    def log_path(self, name: str) -> Path:
        return _log_dir(self.work) / f"engine-{name}.log"

    def run(
        self,
        name: str,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        timeout: float = 540,  # within one 600 s device call
    ) -> dict[str, Any]:
        switches = {
            name: value
            for name, value in os.environ.items()
            if name in ENGINE_SWITCHES or name.startswith(envs.PREFIX)
        }
        key = hashlib.sha1(
            json.dumps([spec, env, switches, self._code], sort_keys=True).encode()
        ).hexdigest()[:12]
        if key in self._results:
            return self._results[key]
        kept = self.cache / f"{name}-{key}.json" if self.cache else None
        if kept is not None and kept.exists():
            try:
                self._results[key] = json.loads(kept.read_text())
            except (OSError, ValueError):  # unreadable: run the engine again
                kept.unlink(missing_ok=True)
            else:
                print(f"engine {name}: result kept from an earlier run ({kept})", flush=True)
                return self._results[key]
        spec_path = self.work / f"{name}-{key}.spec.json"
        out_path = self.work / f"{name}-{key}.result.json"
        log_path = self.log_path(name)
        spec_path.write_text(json.dumps(spec))
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [sys.executable, str(HERE / "engine_run.py"), str(spec_path), str(out_path)],
                env=engine_env(self.plugin_root, env),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                cwd=self.work,
            )
        if proc.returncode != 0 or not out_path.exists():
            tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-60:])
            raise RuntimeError(f"engine {name} exited {proc.returncode}; log tail:\n{tail}")
        result = json.loads(out_path.read_text())
        result["log"] = str(log_path)
        self._results[key] = result
        if kept is not None:  # whole or not at all: a call killed mid-write leaves no entry
            kept.parent.mkdir(parents=True, exist_ok=True)
            partial = kept.with_suffix(".partial")
            partial.write_text(json.dumps(result))
            os.replace(partial, kept)
        return result
