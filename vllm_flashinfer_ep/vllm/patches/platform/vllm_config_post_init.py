"""Validate flashinfer_ep settings when the engine config is built.

Patches: `vllm.config.vllm.VllmConfig.__post_init__` (vllm/config/vllm.py l.1510).
Why: vLLM has no hook for backend-specific config checks; its DBO check is a bare
assert later in the same method (l.2180-2204). Checks must fail before any worker
starts, with one actionable message.
How: wrap `__post_init__`; run `config_validation.validate` first, then the original.
`FlashInferEPConfigError` is not a ValueError, so pydantic does not fold it into a
ValidationError.
"""

from __future__ import annotations

from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = "vllm.config.vllm.VllmConfig.__post_init__"


def is_applied() -> bool:
    from vllm.config.vllm import VllmConfig

    return is_marked(VllmConfig.__post_init__)


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    from vllm_flashinfer_ep.vllm import config_validation

    if is_applied():
        return
    original = VllmConfig.__post_init__

    def __post_init__(self) -> None:
        config_validation.validate(self)
        original(self)

    VllmConfig.__post_init__ = mark(__post_init__, original)
