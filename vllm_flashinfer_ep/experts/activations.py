"""Which gated activation a layer's received rows run, decided once at construction.

- `SILU`: SiLU(gate) x up with vLLM's defaults (no clamp, alpha 1, beta 0): the wing's
  kernel, fused with the intermediate's quantization in FP8 layers.
- `SWIGLU_OAI`: gpt-oss's clamped SwiGLU, vLLM's `swigluoai` (gate and up interleaved,
  gate = x[2j], up = x[2j + 1]): the wing's kernel over the received rows. vLLM 0.33.0's
  batched experts run it through the masked activation with alpha 1.702 and limit 7.0
  fixed, whatever the activation config says (`fused_moe/activation.py` l.267-269), as its
  unmasked op does (`swigluoai_and_mul`'s defaults, `layers/activation.py` l.481); so do
  these experts.
- `VLLM_MASKED`: anything else: vLLM's masked activation over every expert's slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

SWIGLU_OAI_ALPHA = 1.702  # vLLM 0.33.0's masked "swigluoai" (fused_moe/activation.py l.269)
SWIGLU_OAI_LIMIT = 7.0  # (l.268)


class Kind(enum.Enum):
    SILU = "silu"
    SWIGLU_OAI = "swigluoai"
    VLLM_MASKED = "vLLM's masked activation"


@dataclass(frozen=True)
class RowActivation:
    kind: Kind
    alpha: float = 1.0  # SWIGLU_OAI: sigmoid(alpha * gate)
    limit: float = 0.0  # SWIGLU_OAI: gate <= limit, |up| <= limit


def plain_silu_and_mul(activation: Any, config: Any) -> bool:
    """SiLU(gate) x up with vLLM's defaults: what the fused activation kernels compute."""
    return (
        _name(activation) == "silu"
        and config is not None
        and config.clamp_limit is None
        and config.alpha == 1.0
        and config.beta == 0.0
    )


def for_layer(activation: Any, config: Any) -> RowActivation:
    """The layer's activation (vLLM's MoEActivation or its name, and its
    ApplyMoEActivationConfig) as the received rows run it."""
    if plain_silu_and_mul(activation, config):
        return RowActivation(Kind.SILU)
    if _name(activation) == "swigluoai":
        return RowActivation(Kind.SWIGLU_OAI, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
    return RowActivation(Kind.VLLM_MASKED)


def _name(activation: Any) -> Any:
    return getattr(activation, "value", activation)
