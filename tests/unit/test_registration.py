"""The plugin registers both backends in real vLLM 0.33.0 processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_flashinfer_ep
from vllm_flashinfer_ep.backends import BACKENDS
from vllm_flashinfer_ep.vllm import patches


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env.update(extra)
    return env


@pytest.mark.slow
def test_vllm_serve_help_lists_both_backends_via_entry_point():
    # The test never imports the plugin in the child: vLLM loads it through the
    # `vllm.general_plugins` entry point.
    out = subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "serve", "--help=all2all-backend"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for name in BACKENDS:
        assert name in out.stdout
    assert "Added by vllm-flashinfer-ep" in out.stdout


CHILD = (
    "from vllm.plugins import load_general_plugins\n"
    "load_general_plugins()\n"
    "from vllm.config import ParallelConfig\n"
    "ParallelConfig(all2all_backend='flashinfer_ep_low_latency')\n"
    "print('ACCEPTED')\n"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugins,accepted", [("flashinfer_ep", True), ("some_other_plugin", False)]
)
def test_vllm_plugins_filter(plugins, accepted):
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=_env(VLLM_PLUGINS=plugins),
        timeout=300,
        check=False,
    )
    if accepted:
        assert out.returncode == 0 and "ACCEPTED" in out.stdout, out.stderr[-2000:]
    else:
        assert out.returncode != 0 and "ACCEPTED" not in out.stdout
        assert "flashinfer_ep_low_latency" in out.stderr  # pydantic names the rejected value


def test_register_twice_is_harmless():
    assert vllm_flashinfer_ep.register() is True
    import vllm.engine.arg_utils as arg_utils

    get_kwargs = arg_utils.get_kwargs
    assert vllm_flashinfer_ep.register() is True
    assert arg_utils.get_kwargs is get_kwargs  # not wrapped twice
    patches.apply_all()  # direct re-apply is idempotent too
    assert arg_utils.get_kwargs is get_kwargs
    assert all(patches.status().values()), patches.status()
    assert len(patches.PATCHES) == len(patches.BY_NAME) == 18


def test_unsupported_vllm_version_registers_nothing(monkeypatch, caplog):
    monkeypatch.setattr(vllm_flashinfer_ep, "_registered", False)
    monkeypatch.setattr(vllm_flashinfer_ep, "vllm_version", lambda: "0.34.0")
    with caplog.at_level("WARNING"):
        assert vllm_flashinfer_ep.register() is False
    assert "supports vLLM 0.33.x only, found 0.34.0" in caplog.text


@pytest.mark.parametrize(
    "version,ok",
    [("0.33.0", True), ("0.33.1", True), ("0.32.0", False), ("0.330.0", False), (None, False)],
)
def test_version_guard(version, ok):
    assert vllm_flashinfer_ep.is_supported_vllm(version) is ok


def test_bogus_backend_name_is_still_rejected():
    vllm_flashinfer_ep.register()
    from pydantic import ValidationError
    from vllm.config import ParallelConfig

    with pytest.raises(ValidationError, match="flashinfer_ep_bogus"):
        ParallelConfig(all2all_backend="flashinfer_ep_bogus")


def test_cli_parser_accepts_both_backends():
    vllm_flashinfer_ep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    for name in BACKENDS:
        args = parser.parse_args(["--all2all-backend", name])
        assert args.all2all_backend == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--all2all-backend", "flashinfer_ep_bogus"])
