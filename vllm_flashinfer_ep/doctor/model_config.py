"""The model's config.json for doctor: from a local directory or a Hugging Face id (the
cache offline), with an error that names the file and what to do about it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.count("/") != 1


class ModelConfigError(Exception):
    """The model's config.json cannot be read; `fix` says what to do about it."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _read_config_json(path: Path, fix: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path} is not valid JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(data).__name__}, not an object", fix)
    return data


def load_model_config(model: str) -> dict[str, Any]:
    path = Path(model).expanduser()
    if path.is_file():
        raise FileNotFoundError(f"{model} is a file; pass the model directory (with config.json)")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{cfg} does not exist")
        return _read_config_json(
            cfg, f"repair {cfg}: it must be the model's Hugging Face config (a JSON object)"
        )
    if _looks_like_path(model):
        raise FileNotFoundError(f"no such directory: {model} (nor a Hugging Face id: org/name)")
    cached = _hub_config_json(model)
    return _read_config_json(
        cached, f"the cached download is damaged: delete {cached} and run again to fetch it anew"
    )


OFFLINE_FIX = (
    "pass a local model dir (--model /path/to/model), or fetch the model on a host with "
    "network; once it is in the Hugging Face cache, HF_HUB_OFFLINE=1 reads it from there "
    "without trying the network"
)


def _hub_config_json(model: str) -> Path:
    """config.json of a Hugging Face id, as `hf_hub_download` gets it, but without its
    retries where the Hub cannot be reached at all: one HEAD without retries first
    (`get_hf_file_metadata`); where that cannot connect, the cached copy or an error."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def cached(why: str, fix: str) -> Path:
        try:
            return Path(hf_hub_download(model, "config.json", local_files_only=True))
        except LocalEntryNotFoundError:
            raise ModelConfigError(f"{model}: {why}", fix) from None

    if constants.is_offline_mode():
        return cached(
            "config.json is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids "
            "downloading it",
            "pass a local model dir (--model /path/to/model), or unset HF_HUB_OFFLINE "
            "on a host with network to fetch it",
        )
    if _hub_unreachable(model):
        return cached(
            f"cannot connect to {constants.ENDPOINT} (no network?) and its config.json is "
            "not in the Hugging Face cache",
            OFFLINE_FIX,
        )
    try:
        return Path(hf_hub_download(model, "config.json"))
    except LocalEntryNotFoundError as exc:  # the Hub stayed unreachable through the retries
        raise ModelConfigError(f"{model}: {exc}", OFFLINE_FIX) from None


def _hub_unreachable(model: str) -> bool:
    """True when no connection to the Hub can be made (what huggingface_hub takes for "the
    connection is down" before it retries); any answer or other error: False."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json"))
    except Exception as exc:  # noqa: BLE001 - only a failed connection counts
        names = {cls.__name__ for cls in type(exc).__mro__}
        return "ProxyError" not in names and bool(
            names & {"ConnectError", "ConnectTimeout", "ConnectionError"}
        )
    return False
