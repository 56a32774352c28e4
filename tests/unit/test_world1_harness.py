"""The engine tests' world-1 harness, checked at config level on CPU with real vLLM objects.

The harness (tests/engine/world1_harness.py) must make a dp=1 engine config look like one
rank of a dp=2 EP engine for the flashinfer_ep backends, and change nothing for others.
It patches vLLM classes for the whole process, so it runs in a subprocess here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.script_result import script_result

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
import world1_harness
world1_harness.install()
from tiny_models import write_model
from pathlib import Path
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
from vllm_flashinfer_ep.vllm import cudagraph_policy

model = write_model(Path(sys.argv[1]))
out = {}
for name, kwargs in {
    "ll": dict(enable_expert_parallel=True, all2all_backend="flashinfer_ep_low_latency"),
    "ht": dict(enable_expert_parallel=True, all2all_backend="flashinfer_ep_high_throughput"),
    "ll_no_ep": dict(all2all_backend="flashinfer_ep_low_latency"),
    "default_ep": dict(enable_expert_parallel=True),
    "ll_rounds": dict(enable_expert_parallel=True, all2all_backend="flashinfer_ep_low_latency"),
}.items():
    cudagraph_policy.LAST_DECISION = None
    os.environ.pop("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", None)
    if name == "ll_rounds":
        os.environ["VLLM_FLASHINFER_EP_LL_ROUND_TOKENS"] = "512"
    cfg = EngineArgs(model=model, skip_tokenizer_init=True, **kwargs).create_engine_config()
    par = cfg.parallel_config
    moe = FusedMoEParallelConfig.make(
        tp_size_=1, pcp_size_=1, dp_size_=1, sp_size_=1, vllm_parallel_config=par
    )
    out[name] = dict(
        use_all2all=par.use_all2all,
        max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
        use_ep=moe.use_ep,
        ep_size=moe.ep_size,
        all2all_kernels=moe.use_all2all_kernels,
        batched_format=moe.use_batched_activation_format,
        decided=cudagraph_policy.LAST_DECISION is not None,
    )
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def harness_result(tmp_path_factory):
    work = tmp_path_factory.mktemp("harness")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "tests" / "engine"), str(REPO / "tests" / "unit"), str(REPO)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    return script_result(SCRIPT, [str(work / "model")], env, timeout=600)


def test_low_latency_at_world1_looks_like_one_rank_of_dp2(harness_result):
    ll = harness_result["ll"]
    assert ll["use_all2all"] and ll["use_ep"] and ll["all2all_kernels"]
    assert ll["ep_size"] == 1
    assert ll["batched_format"]  # oracles pick BatchedExperts, as for dp=2
    # LL's default budget = its per-rank capacity (vLLM's 128 sequences here: 256)
    assert ll["max_num_batched_tokens"] == 256
    assert ll["decided"]  # the package's CUDA-graph policy ran as for dp=2


def test_low_latency_rounds_at_world1_take_the_budget_a_dp2_rank_takes(harness_result):
    """With VLLM_FLASHINFER_EP_LL_ROUND_TOKENS a dp=2 LL rank no longer counts as batched
    DP MoE (patches/platform.py): the harness answers as the package does for dp=2, so
    the step budget is vLLM's for engines without EP, not LL's 512."""
    rounds, default_ep = harness_result["ll_rounds"], harness_result["default_ep"]
    assert rounds["batched_format"] and rounds["all2all_kernels"]
    assert rounds["max_num_batched_tokens"] == default_ep["max_num_batched_tokens"] > 512


def test_high_throughput_at_world1(harness_result):
    ht = harness_result["ht"]
    assert ht["use_all2all"] and ht["use_ep"] and ht["all2all_kernels"]
    assert not ht["batched_format"]
    assert ht["decided"]


def test_harness_changes_nothing_without_ep_or_for_other_backends(harness_result):
    for name in ("ll_no_ep", "default_ep"):
        r = harness_result[name]
        assert not r["use_all2all"] and not r["use_ep"] and not r["all2all_kernels"], name
        assert not r["decided"], name


SWITCHES = (
    "FLASHINFER_EP_TEST_FAULT",
    "FLASHINFER_EP_TEST_DP_EXPECTED_M",
    "FLASHINFER_EP_TEST_DUMMY_SCALE",
)


def _after_install(name: str, value: str | None, shown: str) -> str:
    """What the expression `shown` gives after the harness installs in a fresh process
    with switch `name` at `value` (None: unset) and the others unset, or "error <message>"."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests" / "engine"), str(REPO)])
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    for switch in (*SWITCHES, *_removed()):
        env.pop(switch, None)
    if value is not None:
        env[name] = value
    script = (
        "import world1_harness\n"
        "try:\n"
        "    world1_harness.install()\n"
        "except ValueError as e:\n"
        "    print('RESULT error', e)\n"
        "else:\n"
        f"    print('RESULT', {shown})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), "")
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return line.removeprefix("RESULT ")


def _removed() -> dict[str, str]:
    import sys as _sys

    _sys.path.insert(0, str(REPO / "tests" / "engine"))
    try:
        import world1_harness
    finally:
        _sys.path.remove(str(REPO / "tests" / "engine"))
    return world1_harness.REMOVED_ENVS


def test_the_harness_switches_are_exactly_the_listed_ones():
    """engine_runner keys kept results by SWITCHES: the harness reads no other switch."""
    import sys as _sys

    _sys.path.insert(0, str(REPO / "tests" / "engine"))
    try:
        import world1_harness
    finally:
        _sys.path.remove(str(REPO / "tests" / "engine"))
    assert set(world1_harness.SWITCHES) == set(SWITCHES)
    source = (REPO / "tests" / "engine" / "world1_harness.py").read_text()
    read = set(re.findall(r"FLASHINFER_EP_TEST_[A-Z_0-9]+", source))
    assert set(SWITCHES) <= read <= set(SWITCHES) | set(world1_harness.REMOVED_ENVS)


@pytest.mark.parametrize(
    "name",
    [
        "FLASHINFER_EP_TEST_DEEP_GEMM_RECEIVED_ROWS",
        "FLASHINFER_EP_TEST_LISTED_QUANT",
        "FLASHINFER_EP_TEST_VLLM_TILES",
    ],
)
def test_a_removed_switch_is_refused_by_name(name):
    """A copied old command fails instead of measuring the default."""
    got = _after_install(name, "1", "'installed'")
    assert got.startswith("error") and name in got, got


DG_APPLY = (
    "getattr(__import__('vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe', "
    "fromlist=['x']).BatchedDeepGemmExperts.apply, '_flashinfer_ep_test_dp_expected_m', False)"
)


@pytest.mark.parametrize(
    "value, expected",
    [(None, "False"), ("", "False"), ("0", "False"), ("1", "True"), ("yes", "error")],
)
def test_the_dp_expected_m_switch_reaches_vllm_s_deep_gemm_experts(value, expected):
    """FLASHINFER_EP_TEST_DP_EXPECTED_M=1 puts the harness's methods on vLLM's DeepGEMM
    experts class; unset, empty or 0 leaves vLLM's; anything else is refused by name."""
    name = "FLASHINFER_EP_TEST_DP_EXPECTED_M"
    got = _after_install(name, value, DG_APPLY)
    assert got.split()[0] == expected, got
    if expected == "error":
        assert name in got


@pytest.fixture
def harness(monkeypatch):
    """tests/engine/world1_harness.py imported here, vLLM's DeepGEMM methods put back after."""
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    monkeypatch.syspath_prepend(str(REPO / "tests" / "engine"))
    for name in ("apply", "estimate_expected_m"):
        monkeypatch.setattr(BatchedDeepGemmExperts, name, getattr(BatchedDeepGemmExperts, name))
    import world1_harness

    return world1_harness


def test_the_dp_expected_m_is_vllm_s_estimate_for_the_forward_s_tokens(harness, monkeypatch):
    """With the switch's patch and no DP metadata (or no forward context), the package's
    DeepGEMM experts hand vLLM's apply every argument as given and estimate_expected_m
    gives vLLM's DP formula over topk_ids' rows (rounded up to 16, within [16, rows]); with
    DP metadata, vLLM's own estimate; applying it twice changes nothing."""
    from types import SimpleNamespace

    import torch
    import vllm.forward_context as fc
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    from tests.helpers import moe_config, vllm_apply
    from vllm_flashinfer_ep.backends import LOW_LATENCY
    from vllm_flashinfer_ep.experts.deep_gemm import APPLY_PARAMS, DeepGemmExperts

    seen, given = [], []

    @vllm_apply
    def recording_apply(self, kw):
        given.append(kw)
        rows, top_k = kw["hidden_states"].shape[1], kw["topk_ids"].shape[1]
        seen.append(self.estimate_expected_m(kw["global_num_experts"], rows, top_k))
        return "vllm's result"

    monkeypatch.setattr(BatchedDeepGemmExperts, "apply", recording_apply)
    harness.patch_deep_gemm_expected_m()
    patched = BatchedDeepGemmExperts.apply
    harness.patch_deep_gemm_expected_m()  # a second time: a no-op
    assert BatchedDeepGemmExperts.apply is patched
    one = torch.ones(128, dtype=torch.float32)
    qc = fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])
    config = moe_config(
        experts=128, top_k=8, hidden=256, inter=256, max_num_tokens=256, backend=LOW_LATENCY
    )
    experts = DeepGemmExperts(config, qc, max_num_tokens=256, num_dispatchers=1)

    def call(tokens: int, global_experts: int = 128, top_k: int = 8):
        kw = {name: object() for name in APPLY_PARAMS}  # each must arrive as is
        kw.update(
            hidden_states=torch.empty(1, 256, 1),
            w1=torch.empty(1, 2, 1),
            w2=torch.empty(1, 1, 1),
            topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64),
            global_num_experts=global_experts,
            a1q_scale=None,
        )
        experts.apply(**kw)
        assert given[-1].keys() == kw.keys() and all(given[-1][k] is kw[k] for k in kw)

    monkeypatch.setattr(fc, "_forward_context", None)  # no forward context
    call(1)
    monkeypatch.setattr(fc, "_forward_context", SimpleNamespace(dp_metadata=None))
    call(128)  # 128 x 8 / 128 = 8 -> 16
    call(300)  # 18.75 -> 18 -> rounded up to 32
    call(1024)  # 64
    call(256, global_experts=8)  # 256 x 8 / 8 = 256: the rows
    assert seen == [16, 16, 32, 64, 256]
    across = torch.tensor([1024, 1024])  # DP metadata: vLLM's estimate from it
    dp = SimpleNamespace(dp_metadata=SimpleNamespace(num_tokens_across_dp_cpu=across))
    monkeypatch.setattr(fc, "_forward_context", dp)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: dp)
    monkeypatch.setattr("vllm_flashinfer_ep.experts.deep_gemm._warmed", {(None,)})
    monkeypatch.setattr(DeepGemmExperts, "_warm", lambda self, call: None)
    call(1)
    assert seen[-1] == 128


def test_a_deep_gemm_apply_of_another_shape_is_refused(harness, monkeypatch):
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    monkeypatch.setattr(BatchedDeepGemmExperts, "apply", lambda self, *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="is not vLLM 0.33.0's"):
        harness.patch_deep_gemm_expected_m()


DUMMY_LOADER = (
    "getattr(__import__('vllm.model_executor.model_loader.dummy_loader', fromlist=['x'])"
    ".DummyModelLoader.load_weights, '_flashinfer_ep_test_dummy_scale', False)"
)


@pytest.mark.parametrize(
    "value, expected",
    [(None, "False"), ("", "False"), ("0", "False"), ("1", "True"), ("yes", "error")],
)
def test_the_dummy_scale_switch_reaches_vllm_s_dummy_loader(value, expected):
    """FLASHINFER_EP_TEST_DUMMY_SCALE=1 wraps vLLM's DummyModelLoader.load_weights;
    unset, empty or 0 leaves vLLM's; anything else is refused by name."""
    name = "FLASHINFER_EP_TEST_DUMMY_SCALE"
    got = _after_install(name, value, DUMMY_LOADER)
    assert got.split()[0] == expected, got
    if expected == "error":
        assert name in got


def _dummy_model():
    """A module tree as vLLM's dummy loader leaves it: every float tensor uniform in
    +-1e-3 (FP8: +-1) from a generator seeded 1234, norms 1, FP8 weights with scales."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n, dtype=torch.bfloat16), requires_grad=False)

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            fp8, f32 = torch.float8_e4m3fn, torch.float32
            self.w13_weight = nn.Parameter(torch.empty(4, 512, 256, dtype=fp8), False)
            self.w13_weight_scale_inv = nn.Parameter(torch.empty(4, 4, 2, dtype=f32), False)
            self.w2_weight = nn.Parameter(torch.empty(4, 256, 256, dtype=fp8), False)
            self.w2_weight_scale_inv = nn.Parameter(torch.empty(4, 2, 2, dtype=f32), False)

    model = nn.Module()
    model.norm = RMSNorm(256)
    model.proj = nn.Linear(1024, 256, bias=True, dtype=torch.bfloat16).requires_grad_(False)
    model.experts = Experts()
    for name, tensor in model.named_parameters():
        if "norm" in name:
            continue
        g = torch.Generator().manual_seed(1234)
        r = 1.0 if tensor.dtype == torch.float8_e4m3fn else 1e-3
        tensor.data.copy_(torch.empty(tensor.shape).uniform_(-r, r, generator=g))
    return model


def test_dummy_weights_are_rescaled_to_their_fan_in(harness):
    """std 1/sqrt(fan_in) for BF16 weights, FP8 codes kept with a power-of-two scale of the
    same effect, 1-D tensors (norms, biases) untouched, the same result every time."""
    import torch

    model, again = _dummy_model(), _dummy_model()
    fp8_before = model.experts.w13_weight.float().clone()
    bias = model.proj.bias.clone()
    harness.scale_dummy_weights(model)
    harness.scale_dummy_weights(again)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a.float(), b.float())
    assert abs(model.proj.weight.float().std().item() * 1024**0.5 - 1) < 0.05
    assert torch.equal(model.proj.bias, bias) and torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.experts.w13_weight.float(), fp8_before)
    for name, fan_in in (("w13", 256), ("w2", 256)):
        weight = getattr(model.experts, f"{name}_weight").float()
        scale = getattr(model.experts, f"{name}_weight_scale_inv")
        assert torch.all(scale == scale.flatten()[0])  # one value, a power of two
        assert torch.log2(scale).frac().abs().max() == 0
        effective = weight.std().item() * scale.flatten()[0].item() * fan_in**0.5
        assert 0.6 < effective < 1.5, effective


def test_a_tensor_two_modules_share_is_rescaled_once(harness):
    import torch
    from torch import nn

    one = nn.Linear(64, 64, bias=False).requires_grad_(False)
    one.weight.data.fill_(1e-3)
    model = nn.Module()
    model.a, model.b = nn.Module(), nn.Module()
    model.a.proj = model.b.proj = one  # the same module (and tensor) under two parents
    model.c = nn.Linear(64, 64, bias=False).requires_grad_(False)
    model.c.weight = one.weight  # the same tensor in another module
    harness.scale_dummy_weights(model)
    assert torch.allclose(one.weight, torch.full_like(one.weight, 3**0.5 / 8))


def _gpt_oss_experts(hidden: int, inter: int = 8, mxfp4: bool = False):
    """A model with gpt-oss's expert tensors at `hidden` and `inter` (LL pads hidden 2880
    to 4096; MXFP4 experts pad the intermediate size too) and the model's config (hidden
    2880, intermediate 8 / 64), filled as vLLM's dummy loader fills them."""
    import torch
    from torch import nn
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    model = nn.Module()
    model.config = SimpleNamespace(hidden_size=2880, intermediate_size=64 if mxfp4 else 8)
    model.experts = nn.Module()
    if mxfp4:
        shapes = {
            "w13_weight": (2 * inter, hidden // 2),
            "w13_weight_scale": (2 * inter, hidden // 32),
            "w2_weight": (hidden, inter // 2),
            "w2_weight_scale": (hidden, inter // 32),
        }
    else:
        shapes = {"w13_weight": (2 * inter, hidden), "w2_weight": (hidden, inter)}
    shapes.update({"w13_bias": (2 * inter,), "w2_bias": (hidden,)})
    for name, shape in shapes.items():
        dtype = torch.uint8 if mxfp4 and "bias" not in name else torch.bfloat16
        param = nn.Parameter(torch.empty((2, *shape), dtype=dtype), requires_grad=False)
        initialize_single_dummy_weight(param, name=name)
        model.experts.register_parameter(name, param)
    return model


def test_padded_expert_dummies_are_the_unpadded_engine_s_weights(harness):
    """Under LL's padding (2880 to 4096) the EP engine's expert tensors hold what the
    engine without EP draws, then zeros, and are rescaled to the same values."""
    import torch

    padded, plain = _gpt_oss_experts(4096), _gpt_oss_experts(2880)
    harness.scale_dummy_weights(padded)
    harness.scale_dummy_weights(plain)
    for name, dim in (("w13_weight", 2), ("w2_weight", 1), ("w2_bias", 1)):
        wide, want = getattr(padded.experts, name), getattr(plain.experts, name)
        assert torch.equal(wide.narrow(dim, 0, 2880), want), name
        assert not wide.narrow(dim, 2880, 4096 - 2880).any(), name
    assert torch.equal(padded.experts.w13_bias, plain.experts.w13_bias)


def test_padded_mxfp4_expert_dummies_are_the_unpadded_engine_s_bytes(harness):
    """MXFP4 under LL: hidden 2880 padded to 4096 and the intermediate size 64 to 128 (as
    vLLM's Marlin MXFP4 experts pad it): codes, scales and biases of the engine without
    EP in the leading block, zeros around it."""
    import torch

    padded = _gpt_oss_experts(4096, inter=128, mxfp4=True)
    plain = _gpt_oss_experts(2880, inter=64, mxfp4=True)
    harness.scale_dummy_weights(padded)
    harness.scale_dummy_weights(plain)
    for name, want in plain.experts.named_parameters():
        wide = getattr(padded.experts, name)
        block = tuple(slice(0, n) for n in want.shape)
        assert torch.equal(wide[block], want), name
        rest = wide.clone()
        rest[block] = 0
        assert not rest.any(), name
