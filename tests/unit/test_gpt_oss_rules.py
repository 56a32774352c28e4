"""gpt-oss under the two backends: what config time refuses, with the same words from the
engine (VllmConfig, built by real vLLM 0.33.0) and from `doctor`.

- MXFP4 expert weights (the checkpoints' quant_method mxfp4): refused with the reason
  (vLLM 0.33.0's only batched MXFP4 experts, BatchedMarlinExperts, are not validated here)
  and what to serve instead.
- A BF16 gpt-oss at hidden 2880 under LL: LL pads the MoE weights to 4096, and vLLM
  0.33.0's gpt-oss loader copies whole unquantized expert tensors into them
  (`_load_weights_other`), which fails: refused, HT named. HT does not pad; a gpt-oss
  shape at an LL size is not refused.
The received-rows experts' biases and clamped SwiGLU: test_received_rows_experts.py.
"""

from __future__ import annotations

import inspect

import pytest

from tests.unit.test_doctor_engine_agree import _doctor, _engine_refusal
from tests.unit.tiny_models import engine_config, write_model
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.model_shape import read_shape
from vllm_flashinfer_ep.vllm import config_rules as rules

GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 1000,
    "num_local_experts": 8,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "swiglu_limit": 7.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
LL_FLAG = f"--all2all-backend {LOW_LATENCY}"


def test_the_shape_reads_the_model_type():
    assert read_shape(GPT_OSS).model_type == "gpt_oss"
    assert read_shape({"hidden_size": 8}).model_type is None


@pytest.mark.parametrize("method", rules.MXFP4_METHODS)
def test_mxfp4_weights_are_refused_with_the_reason_and_what_to_serve(method):
    reason = rules.quantization_reason(LL_FLAG, method, None)
    assert "expert weights are MXFP4" in reason and "BatchedMarlinExperts" in reason
    assert "Serve a BF16 checkpoint" in reason and "--all2all-backend" in reason
    assert "\n" not in reason and method not in reason.replace("mxfp4, as", "")
    ht = rules.quantization_reason("--all2all-backend flashinfer_ep_high_throughput", method, None)
    assert "expert weights are MXFP4" in ht and "expert-major" not in ht  # LL's layout only


def test_gpt_oss_at_a_padded_hidden_size_is_refused_under_ll_only():
    reason = rules.hidden_reason(LL_FLAG, LOW_LATENCY, 2880, "gpt_oss")
    assert "padded to 4096" in reason and "_load_weights_other" in reason
    assert "--all2all-backend flashinfer_ep_high_throughput" in reason
    assert rules.hidden_reason("x", HIGH_THROUGHPUT, 2880, "gpt_oss") is None
    assert rules.hidden_reason(LL_FLAG, LOW_LATENCY, 2880, "qwen3_moe") is None  # narrows
    assert rules.hidden_reason(LL_FLAG, LOW_LATENCY, 4096, "gpt_oss") is None  # no padding
    assert rules.hidden_reason(LL_FLAG, LOW_LATENCY, 2880) is None


def test_vllm_s_gpt_oss_loader_still_copies_whole_expert_tensors():
    """The rule's premise, read from vLLM 0.33.0: the unquantized loader copies the
    checkpoint's expert tensors with `param.copy_` (no narrowing into padded weights), and
    the MoE weights are created at the rounded hidden size."""
    from vllm.model_executor.layers.fused_moe import routed_experts
    from vllm.model_executor.models.gpt_oss import GptOssModel

    loader = inspect.getsource(GptOssModel._load_weights_other)
    assert "param.copy_(narrow_weight)" in loader and "param.copy_(weight)" in loader
    init = inspect.getsource(routed_experts)
    assert '"hidden_size": self.hidden_size' in init and "maybe_roundup_sizes" in init


def test_bf16_gpt_oss_fails_in_both_under_ll(tmp_path, monkeypatch):
    model = write_model(tmp_path / "gpt-oss", base=GPT_OSS)
    reason = _engine_refusal(model, LOW_LATENCY)
    assert "padded to 4096" in reason
    rc, checks = _doctor(monkeypatch, model, "--all2all-backend", LOW_LATENCY, "-dp", "2", "-ep")
    assert rc == 1 and checks["LL hidden size"].fix == reason
    engine_config(model, HIGH_THROUGHPUT)  # HT does not pad


def test_mxfp4_gpt_oss_fails_in_both(tmp_path, monkeypatch):
    model = write_model(tmp_path / "gpt-oss-mxfp4", base=GPT_OSS, quantization_config=MXFP4)
    reason = _engine_refusal(model, LOW_LATENCY)
    assert "expert weights are MXFP4" in reason
    rc, checks = _doctor(monkeypatch, model, "--all2all-backend", LOW_LATENCY, "-dp", "2", "-ep")
    assert rc == 1 and checks["checkpoint precision"].fix == reason
