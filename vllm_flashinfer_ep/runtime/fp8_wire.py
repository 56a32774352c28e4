"""FP8 on the LL wire: NCCL-EP quantizes BF16 activations to E4M3 inside its dispatch.

Why: 128x128 block-FP8 MoE layers quantize their activations to E4M3 with one FP32
scale per 128 elements before the experts. NCCL-EP's LL dispatch does exactly that in
its kernel with the DS_FP8E3M4 recipe (nccl_ep.h: BF16 tokens in; E4M3 tokens
[local experts, rows, hidden] and FP32 scales [local experts, rows, hidden / 128] out;
hidden a multiple of 512). A dispatched row then moves hidden + hidden / 32 bytes instead
of 2 * hidden, and the quantization pass after receive disappears. The scales are
amax / 448 per 128-element group, vLLM's own convention (per_token_group_quant_fp8;
measured equal on the H200), so the experts see what vLLM's quantization would give.

How: FlashInfer 0.7.2.post1's NcclEpHandle builds its dispatch config without a recipe,
so this module issues the dispatch on the nccl.ep handle underneath it, through the
attributes in native_handle.NATIVE_ATTRIBUTES, checked once per handle class
(`native_reason`). Update and combine (BF16) stay the pool's (FlashInfer's, or its direct
calls). Remove when FlashInfer's handle takes a dispatch quantization recipe.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep.errors import HandlePoolError
from vllm_flashinfer_ep.runtime import native_handle

SCALE_GROUP = 128  # elements per FP32 scale (the recipe's, and 128x128 blocks' K group)
HIDDEN_MULTIPLE = 512  # the recipe's hidden-size rule (16-byte aligned FP8 payload)


def hidden_reason(hidden: int) -> str | None:
    """Why NCCL-EP's FP8 dispatch cannot carry rows of this hidden size (None: it can)."""
    if hidden % HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE} (NCCL-EP's FP8 "
            "dispatch recipe DS_FP8E3M4)"
        )
    return None


def native_reason(handle: Any) -> str | None:
    """Why this handle cannot take the FP8 dispatch (None: it can)."""
    reason = native_handle.native_reason(handle)
    if reason is not None:
        return reason
    recipes = getattr(handle._ep, "DispatchQuantizationRecipe", None)
    if recipes is None or not hasattr(recipes, "DS_FP8E3M4"):
        return "the installed nccl.ep has no DS_FP8E3M4 dispatch recipe (nccl-extensions >= 0.1.0)"
    return None


def bytes_per_row(hidden: int, fp8: bool) -> int:
    """Bytes one dispatched row moves: BF16, or E4M3 plus its FP32 group scales."""
    return hidden + 4 * (hidden // SCALE_GROUP) if fp8 else 2 * hidden


class Fp8Wire:
    """The FP8 receive buffers of one LL runtime (shared by its layers, like FlashInfer's
    BF16 receive buffer) and the dispatch that fills them."""

    def __init__(
        self, local_experts: int, rows: int, hidden: int, device: torch.device,
        dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        reason = hidden_reason(hidden)
        if reason is not None:
            raise ValueError(reason)
        self.tokens = torch.empty(local_experts, rows, hidden, dtype=dtype, device=device)
        self.scales = torch.empty(
            local_experts, rows, hidden // SCALE_GROUP, dtype=torch.float32, device=device
        )
        self._checked: set[type] = set()
        self._descriptors: tuple[Any, ...] | None = None
        self._inputs: Any = None  # the last input descriptor, alive until the next dispatch
        self.dispatches = 0

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.scales))

    def dispatch(self, handle: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch x [tokens, hidden] BF16 on `handle`'s current routing; returns the
        E4M3 tokens, their scales and the per-expert received counts (device tensors)."""
        kind = type(handle)
        if kind not in self._checked:
            reason = native_reason(handle)
            if reason is not None:
                raise HandlePoolError(f"flashinfer_ep FP8 dispatch: {reason}")
            self._checked.add(kind)
        if x.shape[0] != handle._num_tokens_in or x.shape[1] != self.tokens.shape[2]:
            raise HandlePoolError(
                f"FP8 dispatch of {tuple(x.shape)} activations on a handle routing "
                f"{handle._num_tokens_in} tokens into hidden {self.tokens.shape[2]}"
            )
        ep, counts = handle._ep, handle._recv_count_t
        d = self._descriptors
        if d is None or d[0] is not ep or d[1] is not counts:
            d = self._descriptors = (
                ep,
                counts,
                ep.DispatchOutputs(tokens=ep.Tensor(self.tokens), scales=ep.Tensor(self.scales)),
                ep.LayoutInfo(expert_counters=ep.Tensor(counts)),
                ep.DispatchConfig(quantization_recipe=ep.DispatchQuantizationRecipe.DS_FP8E3M4),
            )
        inputs = ep.DispatchInputs(tokens=handle._wrap(x))
        stream = handle._op_stream()
        handle._handle.dispatch(inputs, d[2], layout_info=d[3], config=d[4], stream=stream)
        handle._handle.complete(stream=stream)
        self._inputs = inputs
        self.dispatches += 1
        return self.tokens, self.scales, counts
