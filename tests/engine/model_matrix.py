"""The issue-48 model matrix: five published MoE architectures, config only.

One writer per architecture returns the model's published config.json with only the layer
count reduced (to fit one GPU with `--load-format dummy`); per-layer lists are cut to the
kept layers. Everything else is as published, vocabulary included, so the plugin's rules
see the real hidden size, experts, top_k, dtype and quantization. `auto_map` entries
(pointers to remote code files that are not written here) are left out: vLLM serves these
architectures natively, without --trust-remote-code.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from engine_models import write_config_only


def deepseek_v3(layers: int = 4) -> dict[str, Any]:
    """deepseek-ai/DeepSeek-V3 (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json):
    block FP8 as published. Its first 3 layers are dense (first_k_dense_replace), so 4
    layers keep one MoE layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "ep_size": 1,
        "first_k_dense_replace": 3,
        "hidden_act": "silu",
        "hidden_size": 7168,
        "initializer_range": 0.02,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "moe_layer_freq": 1,
        "n_group": 8,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
        },
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 129280,
    }


def qwen3_235b_a22b(layers: int = 2) -> dict[str, Any]:
    """Qwen/Qwen3-235B-A22B (huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json):
    BF16, every layer MoE (decoder_sparse_step 1, mlp_only_layers empty)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 94,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 1536,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def gpt_oss_120b(layers: int = 2) -> dict[str, Any]:
    """openai/gpt-oss-120b (huggingface.co/openai/gpt-oss-120b/blob/main/config.json): MXFP4
    experts as published, expert biases (its checkpoint's `*_proj_bias`), layer_types
    alternating sliding and full attention (cut to the kept layers)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
        + ["sliding_attention"] * (layers % 2),
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    }


def gpt_oss_120b_bf16(layers: int = 2) -> dict[str, Any]:
    """gpt-oss-120b's config with BF16 experts (a dequantized checkpoint: no
    quantization_config): the expert biases and clamped SwiGLU through the package's
    experts, hidden 2880 padded to 4096 under LL."""
    config = gpt_oss_120b(layers)
    del config["quantization_config"]
    return {**config, "torch_dtype": "bfloat16"}


# Llama-4-Scout's no_rope_layers: every fourth layer has RoPE (0), the rest none (1).
SCOUT_NO_ROPE = [1, 1, 1, 0]


def llama4_scout(layers: int = 4) -> dict[str, Any]:
    """meta-llama/Llama-4-Scout-17B-16E's text_config
    (huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json), served as
    vLLM 0.33.0's text-only Llama4ForCausalLM (model_type llama4_text; the published
    checkpoint is Llama4ForConditionalGeneration, whose language model is this). Every
    layer MoE (interleave_moe_layer_step 1), 16 experts, top-1 with the router weight
    applied to the input; 4 layers keep both RoPE and no-RoPE layers."""
    return {
        "architectures": ["Llama4ForCausalLM"],
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        # 4 in Scout's config as transformers 4.51 saved and loads it; transformers 5
        # (vLLM 0.33.0's) types it bool and refuses the int (test_model_matrix_configs).
        # vLLM's Llama4 attention reads it as a truth value: True is the same model.
        "attn_temperature_tuning": True,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "floor_scale": 8192,
        "for_llm_compressor": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 262144,
        "model_type": "llama4_text",
        "moe_layers": list(range(layers)),
        "no_rope_layers": (SCOUT_NO_ROPE * layers)[:layers],
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 202048,
    }


def mixtral_8x7b(layers: int = 2) -> dict[str, Any]:
    """mistralai/Mixtral-8x7B-v0.1 (huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/
    config.json): BF16, 8 experts, top-2, every layer MoE."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    }


class MatrixModel(NamedTuple):
    writer: Callable[[], dict[str, Any]]
    quantization: str | None  # the published checkpoint's quant_method (None: BF16)


MODELS: dict[str, MatrixModel] = {
    "deepseek-v3": MatrixModel(deepseek_v3, "fp8"),
    "qwen3-235b-a22b": MatrixModel(qwen3_235b_a22b, None),
    "gpt-oss-120b-mxfp4": MatrixModel(gpt_oss_120b, "mxfp4"),
    "gpt-oss-120b-bf16": MatrixModel(gpt_oss_120b_bf16, None),
    "llama-4-scout": MatrixModel(llama4_scout, None),
    "mixtral-8x7b": MatrixModel(mixtral_8x7b, None),
}


def moe_layer_count(config: dict[str, Any]) -> int:
    """MoE layers of a written config: DeepSeek-V3's first `first_k_dense_replace` are
    dense, Llama-4's MoE layers are listed, the others are MoE in every layer."""
    layers = config["num_hidden_layers"]
    if "moe_layers" in config:
        return len(config["moe_layers"])
    return layers - config.get("first_k_dense_replace", 0)


def write_model(root: Path, name: str) -> str:
    """config.json and a word-level tokenizer of the published vocabulary for `name` under
    root/name (serve it with `--load-format dummy`)."""
    return write_config_only(Path(root) / name, MODELS[name].writer())


def config_verdict(make_config: Callable[[], Any]) -> dict[str, Any]:
    """What the config-time matrix records of one engine config `make_config` builds: the
    refusal's words, or what the plugin decided (quantization, budget, experts, graphs)."""
    from vllm_flashinfer_ep.doctor.engine_config import refusal_text
    from vllm_flashinfer_ep.vllm import cudagraph_policy

    cudagraph_policy.LAST_DECISION = None
    try:
        cfg = make_config()
    except Exception as exc:  # noqa: BLE001 - whatever stops the engine config
        return {"accepted": False, "error": type(exc).__name__, "message": refusal_text(exc)}
    return {
        "accepted": True,
        "quantization": cfg.model_config.quantization,
        "load_format": cfg.load_config.load_format,
        "use_all2all": cfg.parallel_config.use_all2all,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "moe_backend": cfg.kernel_config.moe_backend,
        "cudagraphs": getattr(cudagraph_policy.LAST_DECISION, "reason", None),
    }
