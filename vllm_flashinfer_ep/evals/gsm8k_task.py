"""Offline variant of lm-eval's gsm8k task, read from local JSONL files.

lm-eval's stock task loads `openai/gsm8k` from the Hugging Face hub. For hosts without
hub access we write a renamed copy of that task (same prompt, filters and metrics)
whose dataset is the `json` builder over local `train.jsonl`/`test.jsonl` files, the
format vLLM's own gsm8k harness uses: one `{"question": ..., "answer": "... #### N"}`
object per line.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

STOCK_TASK = "gsm8k"
OFFLINE_TASK = "gsm8k_local_jsonl"
SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class DataDirError(ValueError):
    """The data dir lacks a split file or holds malformed records."""


def stock_task_yaml() -> Path:
    """lm-eval's own gsm8k task definition inside the installed package."""
    import lm_eval.tasks

    path = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"lm-eval's gsm8k task not found at {path}")
    return path


def validate_data_dir(data_dir: Path) -> dict[str, Path]:
    """Absolute split paths after checking each file's first record has the fields."""
    files: dict[str, Path] = {}
    for split, name in SPLIT_FILES.items():
        path = (data_dir / name).resolve()
        if not path.is_file():
            raise DataDirError(f"{data_dir}: missing {name} (gsm8k {split} split as JSONL)")
        with path.open(encoding="utf-8") as fh:
            first = fh.readline()
        try:
            record = json.loads(first)
        except json.JSONDecodeError as exc:
            raise DataDirError(f"{path}: first line is not JSON: {exc}") from exc
        if not isinstance(record, dict) or not {"question", "answer"} <= set(record):
            raise DataDirError(f"{path}: records need 'question' and 'answer' keys")
        if "####" not in str(record["answer"]):
            raise DataDirError(f"{path}: 'answer' must end with '#### <number>'")
        files[split] = path
    return files


def offline_task_config(
    data_files: dict[str, Path], cache_dir: Path | None = None
) -> dict[str, Any]:
    """The stock gsm8k task config, renamed and pointed at local JSONL files."""
    task = yaml.safe_load(stock_task_yaml().read_text(encoding="utf-8"))
    task["task"] = OFFLINE_TASK
    task.pop("tag", None)  # keep the copy out of the stock task groups
    task.pop("dataset_name", None)  # "main" is a hub config name; json has none
    task["dataset_path"] = "json"
    kwargs: dict[str, Any] = {"data_files": {k: str(v) for k, v in data_files.items()}}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    task["dataset_kwargs"] = kwargs
    return task


def write_offline_task(data_dir: Path, include_dir: Path, cache_dir: Path | None = None) -> str:
    """Write the offline task YAML into include_dir; return its task name."""
    files = validate_data_dir(data_dir)
    include_dir.mkdir(parents=True, exist_ok=True)
    config = offline_task_config(files, cache_dir)
    (include_dir / f"{OFFLINE_TASK}.yaml").write_text(
        yaml.safe_dump(config, sort_keys=False), encoding="utf-8"
    )
    return OFFLINE_TASK


_OFFLINE_FLAGS = (
    ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_HUB_OFFLINE"),
    ("datasets.config", "HF_DATASETS_OFFLINE"),
)


@contextlib.contextmanager
def offline_mode() -> Iterator[None]:
    """Keep huggingface_hub/datasets off the network for the block, then restore.

    Both libraries read these variables at import time, so the flags are also set on
    modules that are already imported.
    """
    saved_env = {k: os.environ.get(k) for k in OFFLINE_ENV}
    saved_flags: list[tuple[Any, str, Any]] = []
    os.environ.update(OFFLINE_ENV)
    for module_name, attr in _OFFLINE_FLAGS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attr):
            saved_flags.append((module, attr, getattr(module, attr)))
            setattr(module, attr, True)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for module, attr, value in saved_flags:
            setattr(module, attr, value)
