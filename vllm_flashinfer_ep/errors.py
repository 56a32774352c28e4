"""Errors raised by the package.

`FlashInferEPConfigError` deliberately does not derive from ValueError: vLLM's config
classes are pydantic dataclasses, and pydantic folds a ValueError raised in
`__post_init__` into a generic ValidationError. Users get our one-line message instead.
"""

from __future__ import annotations


class FlashInferEPConfigError(Exception):
    """A setting cannot work with the flashinfer_ep backends; the message names the fix."""


class FlashInferEPEnvironmentError(FlashInferEPConfigError):
    """The host (GPU, CUDA, NCCL, nvcc, nccl.ep) cannot run NCCL-EP; the message names the fix."""


class HandlePoolError(RuntimeError):
    """Misuse of the persistent handle pool (e.g. an un-warmed size under CUDA-graph capture)."""


class DispatchCapacityError(FlashInferEPConfigError):
    """More tokens were dispatched on one rank than the fleet was sized for."""


class FlashInferEPEnvVarError(FlashInferEPConfigError):
    """A VLLM_FLASHINFER_EP_* variable holds a value the package does not accept."""
