"""The one reader of a model's MoE shape from its Hugging Face config, for config
validation (vLLM's `ModelConfig`) and `doctor` (a config.json) alike. No vLLM import."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_flashinfer_ep.runtime.limits import config_top_k, round_up_ll_hidden_size

# Hugging Face config names (transformers >= 4.56 writes `dtype`).
EXPERT_COUNT_CONFIG_KEYS: tuple[str, ...] = (
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "moe_num_experts",
)
DTYPE_CONFIG_KEYS: tuple[str, ...] = ("dtype", "torch_dtype")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int | None
    routed_experts: int | None  # logical experts of the checkpoint
    top_k: int | None
    redundant_experts: int = 0  # EPLB's extra physical copies (--eplb-config num_redundant_experts)
    dtype: str | None = None  # the checkpoint's dtype name ("bfloat16", "float16", ...)
    quant_method: str | None = None  # quantization_config.quant_method
    weight_block_size: list[int] | None = None
    max_position_embeddings: int | None = None
    unquantized_modules: tuple[str, ...] = ()  # quantization_config's ignore list
    model_type: str | None = None  # config.json's model_type ("gpt_oss", ...)

    @property
    def physical_experts(self) -> int | None:
        """Experts the EP fleet routes over: logical plus EPLB's redundant ones."""
        if self.routed_experts is None:
            return None
        return self.routed_experts + self.redundant_experts

    def ll_fleet_shape(self) -> tuple[int, int, int] | None:
        """(LL hidden size rounded up, physical experts, top_k), or None."""
        if self.hidden_size is None or self.top_k is None or self.physical_experts is None:
            return None
        try:
            hidden = round_up_ll_hidden_size(self.hidden_size)
        except ValueError:
            return None
        return hidden, self.physical_experts, self.top_k


def _getter(config: Any) -> Callable[[str], Any]:
    if isinstance(config, Mapping):
        return config.get
    return lambda name: getattr(config, name, None)


def _text_config(config: Any) -> Any:
    if isinstance(config, Mapping):
        text = config.get("text_config")
        return text if isinstance(text, Mapping) else config
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def dtype_name(value: Any) -> str | None:
    if value is None:
        return None
    return str(value).removeprefix("torch.")


def with_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json with --hf-overrides applied as vLLM's ModelConfig._apply_dict_overrides
    does: nested `*_config`s (not quantization_config) merged, other keys replaced."""
    merged = dict(config)
    for key, value in overrides.items():
        nested = key.endswith("_config") and key != "quantization_config"
        if nested and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def _merged(target: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    out = dict(target)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def read_shape(config: Any, text_config: Any = None, *, redundant_experts: int = 0) -> ModelShape:
    """The MoE shape of a config.json dict or a transformers config (and its text part)."""
    root = _getter(config)
    text = _getter(_text_config(config) if text_config is None else text_config)
    experts = next(
        (v for v in (_positive_int(text(k)) for k in EXPERT_COUNT_CONFIG_KEYS) if v is not None),
        None,
    )
    dtype = next(
        (v for get in (root, text) for k in DTYPE_CONFIG_KEYS if (v := get(k)) is not None), None
    )
    quant = root("quantization_config")
    if not isinstance(quant, Mapping):
        quant = text("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    block = quant.get("weight_block_size") if isinstance(quant, Mapping) else None
    ignored = None
    if isinstance(quant, Mapping):
        ignored = quant.get("ignored_layers") or quant.get("modules_to_not_convert")
    return ModelShape(
        hidden_size=_positive_int(text("hidden_size")),
        routed_experts=experts,
        top_k=config_top_k(text),
        redundant_experts=max(0, int(redundant_experts or 0)),
        dtype=dtype_name(dtype),
        quant_method=method,
        weight_block_size=list(block) if isinstance(block, (list, tuple)) else block,
        max_position_embeddings=_positive_int(text("max_position_embeddings")),
        unquantized_modules=tuple(str(m) for m in ignored)
        if isinstance(ignored, (list, tuple))
        else (),
        model_type=root("model_type") if isinstance(root("model_type"), str) else None,
    )


# vLLM 0.33.0's --dtype choices and their dtypes (vllm/config/model.py _STR_DTYPE_TO_TORCH_DTYPE).
DTYPE_CHOICES: tuple[str, ...] = ("auto", "half", "float16", "bfloat16", "float", "float32")
_DTYPE_NAMES = {"half": "float16", "float": "float32"}  # the other choices are their names


def served_dtype(asked: str, checkpoint: str | None) -> str | None:
    """The dtype vLLM serves with on sm_80+, by name: --dtype, or for `auto` the checkpoint's
    with float32 as bfloat16 (vllm/config/model.py `_resolve_auto_dtype`); None: unknown."""
    asked = asked.lower()
    if asked != "auto":
        return _DTYPE_NAMES.get(asked, asked)
    if checkpoint is None:
        return None
    return "bfloat16" if checkpoint == "float32" else checkpoint


def redundant_experts(enable_eplb: bool, eplb_config: Any) -> int:
    """EPLB's redundant experts, 0 without EPLB (vLLM adds them only when it is on)."""
    if not enable_eplb:
        return 0
    value = _getter(eplb_config)("num_redundant_experts") if eplb_config is not None else None
    return int(value or 0)


def from_vllm_config(vllm_config: Any) -> ModelShape:
    model, par = vllm_config.model_config, vllm_config.parallel_config
    return read_shape(
        model.hf_config,
        model.hf_text_config,
        redundant_experts=redundant_experts(
            bool(getattr(par, "enable_eplb", False)), getattr(par, "eplb_config", None)
        ),
    )
