"""What an eval config needs from the host, and why it cannot run when it cannot.

A run that lacks GPUs, model weights or the NIXL-EP transport should be reported as
skipped with the precise reason, not started and left to fail deep inside vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.evals.config import Gsm8kConfig

NIXL_EP = "nixl_ep"


def visible_gpu_count() -> int:
    """CUDA devices visible to this process (0 when torch has no CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def model_is_local(model: str) -> bool:
    """True if the model's config and every weight shard are on disk.

    A local directory counts as is; a hub id counts when the Hugging Face cache holds
    config.json and all safetensors shards (checked without network access).
    """
    path = Path(model)
    if path.is_dir():
        return (path / "config.json").is_file()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False

    def cached(filename: str) -> str | None:
        hit = try_to_load_from_cache(model, filename)
        return hit if isinstance(hit, str) else None

    if cached("config.json") is None:
        return False
    index = cached("model.safetensors.index.json")
    if index is not None:
        shards = set(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"].values())
        return all(cached(shard) is not None for shard in shards)
    return cached("model.safetensors") is not None


def nixl_ep_transport_available() -> bool:
    """FlashInfer's NIXL-EP transport (absent from the PyPI flashinfer wheel)."""
    try:
        from flashinfer.moe_ep import have_nixl_ep
    except Exception:
        return False
    try:
        return bool(have_nixl_ep())
    except Exception:
        return False


def uses_nixl_ep_transport(config: Gsm8kConfig) -> bool:
    return config.env.get(envs.TRANSPORT, "").strip() == NIXL_EP


def unmet_requirement(
    config: Gsm8kConfig,
    *,
    check_gpus: bool = True,
    check_model: bool = True,
    allow_download: bool = False,
) -> str | None:
    """Why this host cannot run the config, or None if it can."""
    if uses_nixl_ep_transport(config) and not nixl_ep_transport_available():
        return (
            f"{envs.TRANSPORT}={NIXL_EP} needs a FlashInfer built with NIXL-EP; "
            "flashinfer.moe_ep.have_nixl_ep() is False (the PyPI wheel ships no NIXL-EP library)"
        )
    if check_gpus:
        have = visible_gpu_count()
        need = config.gpus_needed
        if have < need:
            return f"needs {need} GPU(s) (dp x tp), {have} visible"
    if check_model and not allow_download and not model_is_local(config.model_name):
        return (
            f"model {config.model_name} is neither a local directory nor fully "
            f"in the Hugging Face cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}); "
            "downloads are not allowed for this run"
        )
    return None
