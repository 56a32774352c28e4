"""gpt-oss under the two backends: what config time refuses, with the same words from the
engine (VllmConfig, built by real vLLM 0.33.0) and from `doctor`.

- MXFP4 expert weights (the checkpoints' quant_method mxfp4) run vLLM's own MXFP4 experts:
  under LL its batched ones (BatchedMarlinExperts), which vLLM builds from --moe-backend
  auto only: any other value is refused at config time, in the engine and in `doctor`
  with the same words; HT takes vLLM's pick.
- A BF16 gpt-oss at hidden 2880 is accepted by both: LL pads the MoE weights to 4096,
  and the padded_expert_load patch loads vLLM 0.33.0's whole expert tensors
  (`_load_weights_other`, `param.copy_`) into their leading columns, the padding zeroed;
  checked here through vLLM's own loader.
The received-rows experts' biases and clamped SwiGLU: test_received_rows_experts.py.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

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


def _doctor_ep(monkeypatch, model: str, backend: str, *more: str):
    """doctor on `model` at dp 2 with expert parallelism and `backend`, plus `more`."""
    return _doctor(monkeypatch, model, "--all2all-backend", backend, "-dp", "2", "-ep", *more)


def test_the_shape_reads_the_model_type():
    assert read_shape(GPT_OSS).model_type == "gpt_oss"
    assert read_shape({"hidden_size": 8}).model_type is None


@pytest.mark.parametrize("method", rules.FP8_METHODS)
def test_an_fp8_gpt_oss_is_refused_on_both_backends(method):
    """vLLM 0.33.0's gpt-oss loader copies expert tensors whole: padded FP8 weights (LL's
    hidden, fp8_per_block's 128-rounding: 2880 -> 2944 on any backend) fail, online FP8's
    meta weights are never filled; the padded_expert_load patch covers BF16 only."""
    for flag in (LL_FLAG, "--all2all-backend flashinfer_ep_high_throughput"):
        reason = rules.gpt_oss_fp8_reason(flag, "gpt_oss", method)
        assert f"gpt-oss with FP8 MoE weights ({method})" in reason and flag in reason
        assert "_load_weights_other" in reason and "Serve the BF16 checkpoint" in reason
        assert "\n" not in reason
    assert rules.gpt_oss_fp8_reason(LL_FLAG, "qwen3_moe", method) is None  # loader narrows
    assert rules.gpt_oss_fp8_reason(LL_FLAG, "gpt_oss", None) is None  # the patch's case


@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_online_fp8_gpt_oss_fails_in_both(tmp_path, monkeypatch, backend):
    model = write_model(tmp_path / "gpt-oss", base=GPT_OSS)
    reason = _engine_refusal(model, backend, quantization="fp8_per_block")
    assert "gpt-oss with FP8 MoE weights (fp8_per_block)" in reason
    rc, checks = _doctor_ep(monkeypatch, model, backend, "--quantization", "fp8_per_block")
    assert rc == 1 and checks["checkpoint precision"].fix == reason


@pytest.mark.parametrize("method", rules.MXFP4_METHODS)
def test_mxfp4_weights_run_vllm_s_batched_experts_under_ll(method):
    assert rules.quantization_reason(LL_FLAG, method, None) is None
    for asked in ("auto", "marlin"):  # both build BatchedMarlinExperts under the batched format
        assert rules.mxfp4_experts_reason(LL_FLAG, LOW_LATENCY, method, asked) is None
    reason = rules.mxfp4_experts_reason(LL_FLAG, LOW_LATENCY, method, "triton")
    assert "expert weights are MXFP4" in reason and "BatchedMarlinExperts" in reason
    assert "Pass --moe-backend auto" in reason and "--moe-backend triton" in reason
    assert "\n" not in reason and LL_FLAG in reason
    lora = rules.mxfp4_experts_reason(LL_FLAG, LOW_LATENCY, method, "auto", lora=True)
    assert "do not support LoRA" in lora and "Drop --enable-lora" in lora
    for asked in ("auto", "marlin", "triton"):  # HT: vLLM's pick
        assert rules.mxfp4_experts_reason("x", HIGH_THROUGHPUT, method, asked, lora=True) is None
    assert rules.mxfp4_experts_reason(LL_FLAG, LOW_LATENCY, None, "triton") is None
    assert rules.mxfp4_experts_reason(LL_FLAG, LOW_LATENCY, "fp8", "triton") is None


def test_vllm_turns_marlin_into_its_batched_mxfp4_experts_under_the_batched_format():
    """The rule's premise, read from vLLM 0.33.0's MXFP4 oracle."""
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4

    source = inspect.getsource(mxfp4)
    assert "Mxfp4MoeBackend.BATCHED_MARLIN if b == Mxfp4MoeBackend.MARLIN else b" in source


def test_vllm_s_gpt_oss_loader_still_copies_whole_expert_tensors():
    """The patch's premise, read from vLLM 0.33.0: the unquantized loader copies the
    checkpoint's expert tensors with `param.copy_` (no narrowing into padded weights), and
    the MoE weights are created at the rounded hidden size."""
    from vllm.model_executor.layers.fused_moe import routed_experts
    from vllm.model_executor.models.gpt_oss import GptOssModel

    loader = inspect.getsource(GptOssModel._load_weights_other)
    assert "param.copy_(narrow_weight)" in loader and "param.copy_(weight)" in loader
    init = inspect.getsource(routed_experts)
    assert '"hidden_size": self.hidden_size' in init and "maybe_roundup_sizes" in init


HIDDEN, PADDED, EXPERTS, INTER = 2880, 4096, 4, 32


class _Experts(torch.nn.Module):
    """One gpt-oss MoE layer's expert parameters as vLLM creates them under LL (hidden
    padded to 4096, uninitialized: NaN here), at vLLM's names and layout."""

    def __init__(self, hidden: int):
        super().__init__()
        shapes = {
            "w13_weight": (EXPERTS, 2 * INTER, hidden),
            "w13_bias": (EXPERTS, 2 * INTER),
            "w2_weight": (EXPERTS, hidden, INTER),
            "w2_bias": (EXPERTS, hidden),
        }
        for name, shape in shapes.items():
            nan = torch.full(shape, float("nan"))
            self.register_parameter(name, torch.nn.Parameter(nan, requires_grad=False))


def _gpt_oss_model(hidden: int):
    """The attributes vLLM's GptOssModel._load_weights_other reads, around real
    parameters under vLLM's names (layers.N.mlp.experts.*)."""
    from vllm.model_executor.models.gpt_oss import GptOssModel

    class Model(torch.nn.Module):
        _try_load_streamed_expert = GptOssModel._try_load_streamed_expert

    model = Model()
    model.config = SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER)
    model.parallel_config = SimpleNamespace(
        enable_expert_parallel=True, all2all_backend=LOW_LATENCY
    )
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = _Experts(hidden)
    return model


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """The checkpoint's expert tensors after vLLM's name mapping (gate_up_proj [E, H, 2I],
    down_proj [E, I, H]: the loader transposes them)."""
    g = torch.Generator().manual_seed(seed)
    prefix = "layers.0.mlp.experts."
    return {
        prefix + "w13_weight": torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g),
        prefix + "w13_bias": torch.randn(EXPERTS, 2 * INTER, generator=g),
        prefix + "w2_weight": torch.randn(EXPERTS, INTER, HIDDEN, generator=g),
        prefix + "w2_bias": torch.randn(EXPERTS, HIDDEN, generator=g),
    }


@pytest.fixture
def world_one(monkeypatch):
    """vLLM's group getters for one rank (the loader reads TP, DP and PCP sizes)."""
    from vllm.model_executor.models import gpt_oss

    group = SimpleNamespace(world_size=1, rank_in_group=0)
    monkeypatch.setattr(gpt_oss, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(gpt_oss, "get_dp_group", lambda: group)
    monkeypatch.setattr(gpt_oss, "get_pcp_group", lambda: group)


def _load(model, checkpoint: dict[str, torch.Tensor] | None = None) -> set[str]:
    from vllm.model_executor.models.gpt_oss import GptOssModel

    weights = (checkpoint or _checkpoint()).items()
    return GptOssModel._load_weights_other(model, EXPERTS, 0, weights, [])


def test_an_unquantized_gpt_oss_checkpoint_loads_into_ll_s_padded_experts(world_one):
    from vllm_flashinfer_ep.vllm.patches import BY_NAME, _helper

    assert _helper.is_applied(BY_NAME["padded_expert_load"])
    model = _gpt_oss_model(PADDED)
    experts = model.layers[0].mlp.experts
    pointers = {name: p.data_ptr() for name, p in experts.named_parameters()}
    assert len(_load(model)) == 4
    want = {k.rsplit(".", 1)[-1]: v for k, v in _checkpoint().items()}
    w13, w2, b2 = experts.w13_weight, experts.w2_weight, experts.w2_bias
    assert w13.shape == (EXPERTS, 2 * INTER, PADDED) and w2.shape == (EXPERTS, PADDED, INTER)
    assert {name: p.data_ptr() for name, p in experts.named_parameters()} == pointers
    torch.testing.assert_close(w13[..., :HIDDEN], want["w13_weight"].mT)
    torch.testing.assert_close(w2[:, :HIDDEN], want["w2_weight"].mT)
    torch.testing.assert_close(b2[:, :HIDDEN], want["w2_bias"])
    torch.testing.assert_close(experts.w13_bias, want["w13_bias"])
    for pad in (w13[..., HIDDEN:], w2[:, HIDDEN:], b2[:, HIDDEN:]):
        assert bool((pad == 0).all())  # zero padding: zero input columns, no NaN


def test_without_the_patch_the_padded_load_fails_and_an_unpadded_one_is_untouched(world_one):
    from vllm_flashinfer_ep.vllm.patches import BY_NAME, _helper

    patch = BY_NAME["padded_expert_load"]
    _helper.undo(patch)
    try:
        with pytest.raises(RuntimeError):
            _load(_gpt_oss_model(PADDED))
    finally:
        _helper.apply(patch)
    model = _gpt_oss_model(HIDDEN)  # HT, or a native LL size: nothing padded
    _load(model)
    experts = model.layers[0].mlp.experts
    assert experts.w13_weight.shape == (EXPERTS, 2 * INTER, HIDDEN)
    want = _checkpoint()["layers.0.mlp.experts.w2_weight"]
    torch.testing.assert_close(experts.w2_weight, want.mT)


def test_a_failed_load_leaves_the_padded_weights_whole(world_one):
    """A checkpoint tensor of another shape: vLLM's error, and every parameter is its whole
    padded tensor again (the engine stops; nothing is left narrowed)."""
    model = _gpt_oss_model(PADDED)
    bad = _checkpoint()
    bad["layers.0.mlp.experts.w2_bias"] = torch.zeros(EXPERTS, HIDDEN + 1)
    with pytest.raises(RuntimeError):
        _load(model, bad)
    experts = model.layers[0].mlp.experts
    assert experts.w13_weight.shape == (EXPERTS, 2 * INTER, PADDED)
    assert experts.w2_weight.shape == (EXPERTS, PADDED, INTER)
    assert experts.w2_bias.shape == (EXPERTS, PADDED)


def test_other_backends_load_as_vllm_does(world_one):
    """vLLM's own padding backends (deepep_low_latency) keep vLLM's loader as it is."""
    model = _gpt_oss_model(PADDED)
    model.parallel_config.all2all_backend = "deepep_low_latency"
    with pytest.raises(RuntimeError):
        _load(model)


def test_bf16_gpt_oss_is_accepted_under_both_backends(tmp_path):
    model = write_model(tmp_path / "gpt-oss", base=GPT_OSS)
    engine_config(model, LOW_LATENCY)  # hidden 2880 padded to 4096 at load (logged)
    engine_config(model, HIGH_THROUGHPUT)  # HT does not pad


def test_mxfp4_gpt_oss_is_accepted_and_a_flat_moe_backend_fails_in_both(tmp_path, monkeypatch):
    model = write_model(tmp_path / "gpt-oss-mxfp4", base=GPT_OSS, quantization_config=MXFP4)
    for backend in (LOW_LATENCY, HIGH_THROUGHPUT):
        config = engine_config(model, backend)
        assert config.model_config.quantization in rules.MXFP4_METHODS
        assert config.kernel_config.moe_backend == "auto"  # vLLM's pick, not pinned
    engine_config(model, HIGH_THROUGHPUT, moe_backend="triton")
    engine_config(model, LOW_LATENCY, moe_backend="marlin")
    reason = _engine_refusal(model, LOW_LATENCY, moe_backend="triton")
    assert "Pass --moe-backend auto" in reason
    rc, checks = _doctor_ep(monkeypatch, model, LOW_LATENCY, "--moe-backend", "triton")
    assert rc == 1 and checks["experts"].fix == reason
    lora = _engine_refusal(model, LOW_LATENCY, enable_lora=True)
    assert "do not support LoRA" in lora
    rc, checks = _doctor_ep(monkeypatch, model, LOW_LATENCY, "--enable-lora")
    assert rc == 1 and checks["experts"].fix == lora
    rc, checks = _doctor_ep(monkeypatch, model, LOW_LATENCY)
    assert checks["checkpoint precision"].ok and checks["experts"].ok
