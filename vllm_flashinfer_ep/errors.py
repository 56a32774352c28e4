"""Errors raised by the package. `FlashInferEPConfigError` is no ValueError: pydantic
folds a ValueError from `__post_init__` into a generic ValidationError."""

from __future__ import annotations


class FlashInferEPConfigError(Exception):
    """A setting cannot work with the flashinfer_ep backends; the message names the fix."""


class FlashInferEPEnvironmentError(FlashInferEPConfigError):
    """The host cannot run NCCL-EP; the message names the fix."""


class HandlePoolError(RuntimeError):
    """Misuse of the persistent handle pool (e.g. an un-warmed size under CUDA-graph capture)."""


class DispatchCapacityError(FlashInferEPConfigError):
    """More tokens were dispatched on one rank than the fleet was sized for."""


class FlashInferEPEnvVarError(FlashInferEPConfigError):
    """A VLLM_FLASHINFER_EP_* variable holds a value the package does not accept."""
