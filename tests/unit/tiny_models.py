"""Locally generated tiny Hugging Face configs (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "mlp_only_layers": [],
}


# DeepSeek-V3's layout in miniature, with one MTP layer (vLLM's `mtp` speculative method
# builds its draft from the same checkpoint, under the target's parallel config).
DEEPSEEK_V3_MTP: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


def write_model(root: Path, **overrides: Any) -> str:
    base = overrides.pop("base", QWEN3_MOE)
    cfg = dict(base, **overrides)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return str(root)


def engine_config(model: str, backend: str, **kwargs):
    """A dp=2 EP engine config of `model` with `backend`, built by real vLLM."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(
        model=model,
        skip_tokenizer_init=True,
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend=backend,
    )
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()
