"""The two per-128-group FP8 quantizers, and what each must keep computing.

runtime/fp8_wire.group_quantize (torch, no vLLM) and vllm/receive_quant.group_quantize
(vLLM's per_token_group_quant_fp8) stay separate on purpose; their docstrings say why.
These tests pin each one's numerics and calls, so a change of either shows.
"""

from __future__ import annotations

import pytest
import torch

from vllm_flashinfer_ep.runtime import fp8_wire
from vllm_flashinfer_ep.vllm import receive_quant

FP8 = torch.float8_e4m3fn
FMAX = torch.finfo(FP8).max


def _input() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1024, generator=gen) * torch.logspace(-3, 3, 6)[:, None]
    x[2, 128:256] = 0  # a zero group
    x[3, :128] = 1e-12  # a group below vLLM's amax floor of 1e-10
    x[4, 256:384] = 1e4  # large values
    return x.to(torch.bfloat16)


def test_runtime_quantizer_numerics():
    x = _input()
    q, s = fp8_wire.group_quantize(x)
    assert q.dtype == FP8 and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (6, 1024 // 128) and s.is_contiguous()
    groups = x.float().view(6, -1, 128)
    amax = groups.abs().amax(-1)
    tiny = torch.finfo(torch.float32).tiny
    # scale = amax / 448 exactly (FP32 division); a zero group gets the smallest normal scale
    assert torch.equal(s, torch.where(amax > 0, amax / FMAX, torch.full_like(amax, tiny)))
    assert s[2, 1] == tiny and s[3, 0] == pytest.approx(1e-12 / FMAX, rel=1e-2)
    # E4M3 of x / scale, round to nearest, within +-448
    want = (groups / s[..., None]).clamp(-FMAX, FMAX).to(FP8).view(x.shape)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert float(q.float().abs().amax()) == FMAX  # every group's largest element maps to 448
    assert not bool(q[2, 128:256].float().any())


def test_vllm_quantizer_is_vllm_s_block_quantization(monkeypatch):
    """The HT prepare's quantizer is vLLM's own, called as a 128x128 block-FP8 layer's
    Triton experts call it: the platform's FP8 type, no static scale, no per-token
    scales, blocks [128, 128]."""
    import vllm.model_executor.layers.fused_moe.utils as moe_utils

    calls = []

    def spy(x, scale, **kwargs):
        calls.append((x, scale, kwargs))
        return "q", "s"

    monkeypatch.setattr(moe_utils, "moe_kernel_quantize_input", spy)
    x = _input()
    assert receive_quant.group_quantize(x) == ("q", "s")
    [(got, scale, kwargs)] = calls
    assert got is x and scale is None
    assert kwargs == {
        "quant_dtype": receive_quant.fp8_dtype(),
        "per_act_token_quant": False,
        "block_shape": [128, 128],
    }
