"""Torch reference MoE and routing for the benchmark and the tests: expert e maps a row x
to x * scale[e], exact enough in BF16 to prove every row reached the right expert and came
back to the right token with the right weight."""

from __future__ import annotations

import torch


def random_routing(
    num_tokens: int, num_experts: int, top_k: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (int64) and normalized fp32 weights."""
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int64)
    weights = torch.rand(num_tokens, top_k, device=device, generator=generator) + 0.1
    weights = weights / weights.sum(dim=1, keepdim=True)
    return ids.contiguous(), weights.to(torch.float32).contiguous()


def reference_moe(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * scales[ids[t, k]] * x[t], in fp32, cast to x.dtype."""
    factor = (weights.float() * scales.float()[ids]).sum(dim=1, keepdim=True)
    return (x.float() * factor).to(x.dtype)
