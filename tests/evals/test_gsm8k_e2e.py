"""gsm8k accuracy of every listed config on real GPUs (skipped where it cannot run).

Each config in configs/gsm8k/models-dp2-ep.txt (or the list named by
FLASHINFER_EP_TEST_GSM8K_CONFIG_LIST) is served with `vllm serve` and scored with
lm-eval's gsm8k; it must reach accuracy_threshold - tolerance.

Runs only when this host has the GPUs (dp x tp), the model is a local directory or
fully in the Hugging Face cache, and (for nixl_ep-transport configs) FlashInfer has
NIXL-EP. Nothing is downloaded unless FLASHINFER_EP_TEST_ALLOW_DOWNLOADS=1. Data:
FLASHINFER_EP_TEST_GSM8K_DATA_DIR (train.jsonl/test.jsonl), else those files in the
temp dir where vLLM's own harness caches them, else the hub (downloads allowed only).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.helpers import free_port, model_is_local
from vllm_flashinfer_ep.evals.config import load_config, load_config_list
from vllm_flashinfer_ep.evals.gsm8k import (
    SPLIT_FILES,
    RunOptions,
    Status,
    run_eval,
    unmet_requirement,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG_LIST = Path(
    os.environ.get(
        "FLASHINFER_EP_TEST_GSM8K_CONFIG_LIST", REPO / "configs" / "gsm8k" / "models-dp2-ep.txt"
    )
)
ALLOW_DOWNLOADS = os.environ.get("FLASHINFER_EP_TEST_ALLOW_DOWNLOADS") == "1"
DATA_DIR_ENV = "FLASHINFER_EP_TEST_GSM8K_DATA_DIR"

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow]


def _gsm8k_data_dir() -> Path | None:
    """Local gsm8k files, or None when lm-eval may fetch them; skips when neither."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    cached = Path(tempfile.gettempdir())
    if all((cached / name).is_file() for name in SPLIT_FILES.values()):
        return cached
    if ALLOW_DOWNLOADS:
        return None
    pytest.skip(
        f"no local gsm8k data: set {DATA_DIR_ENV} to a dir with train.jsonl/test.jsonl "
        "or FLASHINFER_EP_TEST_ALLOW_DOWNLOADS=1"
    )


@pytest.mark.parametrize("config_path", load_config_list(CONFIG_LIST), ids=lambda p: p.stem)
def test_gsm8k_accuracy(config_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(config_path)
    reason = unmet_requirement(config)
    if reason is None and not ALLOW_DOWNLOADS and not model_is_local(config.model_name):
        reason = f"{config.model_name} is not local and downloads are not allowed"
    if reason is not None:
        pytest.skip(reason)
    data_dir = _gsm8k_data_dir()
    # GPUs are here: the server must not inherit a CPU platform override (set for
    # parser-only tests on GPU-less hosts); vLLM treats VLLM_TARGET_DEVICE=cpu as final.
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    if not ALLOW_DOWNLOADS:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the server must use the cached model
    log = tmp_path / "server.log"
    result = run_eval(
        config,
        RunOptions(
            port=free_port(),
            data_dir=data_dir,
            output=tmp_path / "result.json",
            server_log=log,
        ),
    )
    assert result.status is Status.PASSED, f"{result.status.value}: {result.reason} (log: {log})"
