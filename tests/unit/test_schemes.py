"""The scheme table (experts/schemes.py) against vLLM 0.33.0's own objects.

Wherever vLLM picks its batched Triton experts the received-rows experts run instead, so
the table must take exactly the keys vLLM's class takes, name a real layer's
FusedMoEQuantConfig by the key vLLM's quantization methods give it (and no key where it
cannot run the layer as vLLM would), and quantize each row as its activation key says.
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEQuantConfig,
    fp8_w8a8_moe_quant_config,
    fp8_w8a16_moe_quant_config,
    int8_w8a8_moe_quant_config,
    nvfp4_moe_quant_config,
)
from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import BatchedTritonExperts
from vllm.model_executor.layers.quantization.utils import quant_utils
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8DynamicTensorSym,
    kFp8DynamicTokenSym,
    kFp8Static128BlockSym,
    kFp8StaticChannelSym,
    kFp8StaticTensorSym,
)
from vllm.platforms.interface import DeviceCapability

from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.experts import schemes
from vllm_flashinfer_ep.experts.schemes import Arrivals, Quantizer

# Every QuantKey vLLM names, and no key (16-bit): the candidates for either side.
CANDIDATES: list[QuantKey | None] = [None] + [
    v for k, v in vars(quant_utils).items() if k.startswith("k") and isinstance(v, QuantKey)
]
TABLE = {(s.weight_key, s.activation_key) for s in schemes.SCHEMES}


@pytest.fixture
def device(monkeypatch):
    """vLLM's platform answering as a CUDA device of the capability set (an H100: 9.0)."""
    platform = fused_batched_moe.current_platform
    cls = type(platform)
    capability = {"value": DeviceCapability(9, 0)}
    monkeypatch.setattr(cls, "is_cuda", classmethod(lambda c: True))
    monkeypatch.setattr(cls, "is_rocm", classmethod(lambda c: False))
    monkeypatch.setattr(
        cls, "get_device_capability", classmethod(lambda c, device_id=0: capability["value"])
    )
    return capability


def _accepted(supports) -> set:
    return {(w, a) for w in CANDIDATES for a in CANDIDATES if supports(w, a)}


def test_the_table_takes_exactly_the_keys_vllm_s_batched_triton_experts_take(device):
    assert len(CANDIDATES) > 20 and all(k in CANDIDATES for pair in TABLE for k in pair)
    assert len(schemes.BY_KEYS) == len(schemes.SCHEMES)  # no key twice
    assert len({s.name for s in schemes.SCHEMES}) == len(schemes.SCHEMES)
    vllm_keys = _accepted(BatchedTritonExperts._supports_quant_scheme)
    assert vllm_keys == TABLE == _accepted(schemes.supports)


def test_the_received_rows_experts_take_what_vllm_takes_on_the_device(device):
    """Their `_supports_quant_scheme` is the table and vLLM's: FP8 rows only where vLLM's
    own class takes them (an Ampere GPU has no E4M3)."""
    from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts

    for capability in (DeviceCapability(9, 0), DeviceCapability(8, 0)):
        device["value"] = capability
        vllm_keys = _accepted(BatchedTritonExperts._supports_quant_scheme)
        assert _accepted(ReceivedRowsExperts._supports_quant_scheme) == vllm_keys
    assert vllm_keys == {(None, None)}  # the Ampere's


E, N, K = 4, 256, 128
STATIC = torch.tensor([0.004])


def _fp8(**kw) -> FusedMoEQuantConfig:
    channel = kw.get("per_out_ch_quant")
    w1 = torch.ones(E, N, 1) if channel else torch.ones(E)
    w2 = torch.ones(E, K, 1) if channel else torch.ones(E)
    return fp8_w8a8_moe_quant_config(w1, w2, **kw)


# What vLLM's FP8 methods call each layout (quantization/fp8.py, online/fp8.py,
# compressed-tensors): the row that runs it, and its keys written out here.
LAYOUTS = {
    "bf16": (lambda: FUSED_MOE_UNQUANTIZED_CONFIG, None, None),
    "block": (
        lambda: _fp8(block_shape=[128, 128]),
        kFp8Static128BlockSym,
        kFp8Dynamic128Sym,
    ),
    "channel": (
        lambda: _fp8(per_act_token_quant=True, per_out_ch_quant=True),
        kFp8StaticChannelSym,
        kFp8DynamicTokenSym,
    ),
    "tensor_weights_token_activations": (
        lambda: _fp8(per_act_token_quant=True),
        kFp8StaticTensorSym,
        kFp8DynamicTokenSym,
    ),
    "tensor_static": (
        lambda: _fp8(a1_scale=STATIC, a2_scale=STATIC),
        kFp8StaticTensorSym,
        kFp8StaticTensorSym,
    ),
    "tensor_dynamic": (lambda: _fp8(), kFp8StaticTensorSym, kFp8DynamicTensorSym),
}


def test_a_static_intermediate_scale_alone_is_a_static_layer():
    """vLLM's batched experts quantize the intermediate with a static a2_scale even when
    the input's scale is dynamic: the layer is the static row, not the dynamic one."""
    qc = _fp8(a2_scale=STATIC)
    assert schemes.scheme_of(qc).name == "tensor_static"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_layer_s_quant_config_maps_to_its_row(name):
    build, weight_key, activation_key = LAYOUTS[name]
    qc = build()
    assert schemes.quant_keys(qc) == (weight_key, activation_key)
    assert schemes.scheme_of(qc) is schemes.BY_KEYS[(weight_key, activation_key)]
    assert schemes.scheme_of(qc).name == name


def test_every_row_has_a_layout():
    assert set(LAYOUTS) == {s.name for s in schemes.SCHEMES}


# Layouts no row runs as vLLM would: keys the table lacks, or none at all.
NO_ROW = {
    "static per-token activations": lambda: _fp8(
        per_act_token_quant=True, a1_scale=STATIC, a2_scale=STATIC
    ),
    "block [64, 128]": lambda: _fp8(block_shape=[64, 128]),
    "static scales on a block layer": lambda: _fp8(
        block_shape=[128, 128], a1_scale=STATIC, a2_scale=STATIC
    ),
    # vLLM's batched kernel reads channel 0 of the weights' scales for such activations
    "channel weights, dynamic per-tensor activations": lambda: _fp8(per_out_ch_quant=True),
    "channel weights, static per-tensor activations": lambda: _fp8(
        per_out_ch_quant=True, a1_scale=STATIC, a2_scale=STATIC
    ),
    "int8": lambda: int8_w8a8_moe_quant_config(torch.ones(E), torch.ones(E), None, None),
    "int8 per token": lambda: int8_w8a8_moe_quant_config(
        torch.ones(E), torch.ones(E), None, None, per_act_token_quant=True
    ),
    "fp8 weights, 16-bit activations": lambda: fp8_w8a16_moe_quant_config(
        torch.ones(E), torch.ones(E)
    ),
    "nvfp4": lambda: nvfp4_moe_quant_config(*[torch.ones(E)] * 6),
}


@pytest.mark.parametrize("name", list(NO_ROW))
def test_a_layout_no_row_runs_gets_none(name):
    qc = NO_ROW[name]()
    assert schemes.scheme_of(qc) is None
    keys = schemes.quant_keys(qc)
    assert keys is None or not schemes.supports(*keys)


def _expected(activation_key: QuantKey | None) -> dict:
    """A row's fields from its activation key, as vLLM's batched experts quantize it."""
    if activation_key is None:  # 16-bit GEMMs
        return dict(input=None, intermediate=None, arrivals=None, per_channel=False)
    shape, static = activation_key.scale.group_shape, activation_key.scale.static
    if shape == GroupShape(1, num.GROUP):  # per 128-element group, with 128x128 blocks
        return dict(
            input=Quantizer.GROUP,
            intermediate=Quantizer.GROUP,
            arrivals=Arrivals.ROW_SCALES,
            per_channel=False,
            block_shape=num.BLOCK_SHAPE,
        )
    # every other row hands the fused kernel one A scale per row (per_channel)
    if shape == GroupShape.PER_TOKEN and not static:
        return dict(
            input=Quantizer.TOKEN,
            intermediate=Quantizer.TOKEN,
            arrivals=Arrivals.ROW_SCALES,
            per_channel=True,
        )
    assert shape == GroupShape.PER_TENSOR, activation_key
    if static:  # the checkpoint's scale, both GEMMs
        return dict(
            input=Quantizer.TENSOR_STATIC,
            intermediate=Quantizer.TENSOR_STATIC,
            arrivals=Arrivals.EXPERT_SCALES,
            per_channel=True,
        )
    # dynamic: vLLM's prepare quantizes the batch with one scale; its batched experts the
    # intermediate per expert when eager (one over the buffer when captured)
    return dict(
        input=Quantizer.TENSOR_ONE,
        intermediate=Quantizer.TENSOR_PER_EXPERT_EAGER,
        arrivals=Arrivals.EXPERT_SCALES,
        per_channel=True,
    )


@pytest.mark.parametrize("row", schemes.SCHEMES, ids=lambda s: s.name)
def test_each_row_quantizes_as_its_activation_key_says(row):
    want = {"block_shape": None, **_expected(row.activation_key)}
    got = {field: getattr(row, field) for field in want}
    assert got == want
    assert row.fp8 == (row.activation_key is not None)
    if row.block_shape is not None:  # the weights' blocks are the key's, and the kernel's
        assert tuple(row.weight_key.scale.group_shape) == row.block_shape
    hidden = 7168
    groups = hidden // num.GROUP if row.input is Quantizer.GROUP else 1
    assert row.scale_groups(hidden) == groups
