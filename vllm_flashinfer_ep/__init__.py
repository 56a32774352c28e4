"""vllm-flashinfer-ep: FlashInfer NCCL-EP all2all backends for vLLM. `register()` is the
`vllm.general_plugins` entry point, which vLLM calls in every process; subprocesses
spawned by torch.multiprocessing must call it themselves."""

from __future__ import annotations

from vllm_flashinfer_ep.log import get_logger

__version__ = "0.1.0"
SUPPORTED_VLLM = "0.33"

logger = get_logger(__name__)
_registered = False


def vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def is_supported_vllm(version: str | None) -> bool:
    if not version:
        return False
    parts = version.split(".")
    return len(parts) >= 2 and f"{parts[0]}.{parts[1]}" == SUPPORTED_VLLM


def register() -> bool:
    """Make both backend names work in this process. Idempotent. Returns True if active."""
    global _registered
    if _registered:
        return True
    version = vllm_version()
    if not is_supported_vllm(version):
        logger.warning(
            "vllm-flashinfer-ep %s supports vLLM %s.x only, found %s; the "
            "flashinfer_ep_* all2all backends are NOT registered.",
            __version__,
            SUPPORTED_VLLM,
            version,
        )
        return False
    from vllm_flashinfer_ep.vllm.patches import apply_all

    apply_all()
    _registered = True
    return True
