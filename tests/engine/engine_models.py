"""Tiny random Qwen3-MoE checkpoints (and config-only real shapes) written by the tests.

No downloads: config.json, a word-level tokenizer and, for the tiny models, safetensors
weights from a fixed seed. Weight scales are chosen so the MoE block dominates each layer's
contribution to the residual stream and the logits spread over several nats: a wrong MoE
output then moves prompt logprobs by far more than BF16 rounding does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SPECIAL = ["<unk>", "<|endoftext|>"]
EOS_ID = 1
FIRST_WORD_ID = len(SPECIAL)


def qwen3_moe_config(
    hidden: int,
    *,
    layers: int = 4,
    experts: int = 64,
    top_k: int = 8,
    moe_intermediate: int = 128,
    heads: int | None = None,
    kv_heads: int = 4,
    head_dim: int = 128,
    vocab: int = 4096,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": hidden,
        "intermediate_size": 4 * moe_intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads or hidden // head_dim,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "mlp_only_layers": [],
        "attention_bias": False,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }


# Qwen3-30B-A3B's architecture (its public config.json): used with load_format="dummy".
QWEN3_30B_A3B = qwen3_moe_config(
    2048,
    layers=48,
    experts=128,
    top_k=8,
    moe_intermediate=768,
    heads=32,
    kv_heads=4,
    vocab=151936,
) | {"intermediate_size": 6144, "max_position_embeddings": 40960}


def write_tokenizer(root: Path, vocab: int) -> None:
    """A word-level tokenizer: token i is the word `w{i}` (whitespace separated)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {tok: i for i, tok in enumerate(SPECIAL)}
    words.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def write_config_only(root: Path, config: dict[str, Any]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    write_tokenizer(root, config["vocab_size"])
    return str(root)


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, inter = cfg["num_experts"], cfg["moe_intermediate_size"]

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": randn(v, h, std=1.0),
        "model.norm.weight": ones(h),
        "lm_head.weight": randn(v, h, std=2.0 / h**0.5),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
        w[p + "self_attn.q_proj.weight"] = randn(nh * hd, h, std=0.02)
        w[p + "self_attn.k_proj.weight"] = randn(nkv * hd, h, std=0.02)
        w[p + "self_attn.v_proj.weight"] = randn(nkv * hd, h, std=0.02)
        w[p + "self_attn.o_proj.weight"] = randn(h, nh * hd, std=0.02)
        w[p + "self_attn.q_norm.weight"] = ones(hd)
        w[p + "self_attn.k_norm.weight"] = ones(hd)
        w[p + "mlp.gate.weight"] = randn(e, h, std=1.0 / h**0.5)
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            w[q + "gate_proj.weight"] = randn(inter, h, std=1.0 / h**0.5)
            w[q + "up_proj.weight"] = randn(inter, h, std=1.0 / h**0.5)
            w[q + "down_proj.weight"] = randn(h, inter, std=2.0 / inter**0.5)
    return w


def _save_whole(weights: dict[str, torch.Tensor], root: Path) -> None:
    """model.safetensors whole or not at all: the writers reuse a model whose weights file
    exists, and a run killed mid-write must not leave a truncated one."""
    from safetensors.torch import save_file

    partial = root / "model.safetensors.partial"
    save_file(weights, str(partial))
    os.replace(partial, root / "model.safetensors")


def write_tiny_model(root: Path, hidden: int, seed: int = 0, **arch: Any) -> str:
    """A tiny Qwen3-MoE checkpoint (config, tokenizer, safetensors) under `root`."""

    cfg = qwen3_moe_config(hidden, **arch)
    if (root / "model.safetensors").exists():
        return str(root)
    write_config_only(root, cfg)
    _save_whole(random_weights(cfg, seed), root)
    return str(root)


def token_sequences(
    count: int, vocab: int, seed: int = 1234, lo: int = 16, hi: int = 96
) -> list[list[int]]:
    """`count` fixed random token sequences of lengths in [lo, hi)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [torch.randint(FIRST_WORD_ID, vocab, (n,), generator=g).tolist() for n in lengths]


FP8_MAX = 448.0  # float8_e4m3fn
FP8_INPUT_SCALE = 16.0 / FP8_MAX  # static activation scale of the per-tensor checkpoints


def _quantized_names(cfg: dict[str, Any]) -> list[str]:
    """The expert projections: what an FP8 MoE checkpoint of this package's tests quantizes
    (attention and the router stay BF16, listed in `ignored_layers`)."""
    return [
        f"model.layers.{i}.mlp.experts.{x}.{proj}"
        for i in range(cfg["num_hidden_layers"])
        for x in range(cfg["num_experts"])
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]


def fp8_weights(cfg: dict[str, Any], scheme: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """`random_weights` with the experts in FP8, as vLLM's `fp8` checkpoints store them:
    "block": 128x128 blocks with `weight_scale_inv`; "static": per-tensor `weight_scale`
    and a static `input_scale`."""
    w = random_weights(cfg, seed)
    for name in _quantized_names(cfg):
        weight = w.pop(name + ".weight").float()
        if scheme == "block":
            n, k = weight.shape
            blocks = weight.view(n // 128, 128, k // 128, 128)
            scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
            q = (blocks / scale[:, None, :, None]).view(n, k)
            w[name + ".weight_scale_inv"] = scale.float().contiguous()
        elif scheme == "static":
            scale = weight.abs().amax() / FP8_MAX
            q = weight / scale
            w[name + ".weight_scale"] = scale.float().reshape(())
            w[name + ".input_scale"] = torch.tensor(FP8_INPUT_SCALE, dtype=torch.float32)
        else:
            raise ValueError(scheme)
        w[name + ".weight"] = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w


def write_fp8_model(root: Path, hidden: int, scheme: str, seed: int = 0, **arch: Any) -> str:
    """A tiny Qwen3-MoE checkpoint with FP8 experts (vLLM's `fp8` quantization method)."""

    cfg = qwen3_moe_config(hidden, **arch)
    if (root / "model.safetensors").exists():
        return str(root)
    ignored = [
        f"model.layers.{i}.{name}"
        for i in range(cfg["num_hidden_layers"])
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate",
        )
    ]
    quant: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "ignored_layers": ignored}
    if scheme == "block":
        quant |= {"activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    else:
        quant |= {"activation_scheme": "static"}
    write_config_only(root, cfg | {"quantization_config": quant})
    _save_whole(fp8_weights(cfg, scheme, seed), root)
    return str(root)
