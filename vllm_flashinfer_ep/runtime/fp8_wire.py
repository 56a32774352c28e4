"""FP8 on the wire: block-FP8 layers dispatch E4M3 rows with one FP32 scale per 128 elements
(vLLM's per_token_group_quant_fp8 layout), hidden + hidden / 32 bytes a row instead of
2 * hidden, and no quantization pass after receive.
Low latency (`Fp8Wire`): NCCL-EP quantizes inside its dispatch (DS_FP8E3M4, nccl_ep.h).
FlashInfer 0.7.2.post1's NcclEpHandle sets no recipe, so the dispatch is issued on the
nccl.ep handle underneath (runtime/flashinfer_internals.py; `native_reason`); update and
combine stay the pool's. Remove when FlashInfer's handle takes a quantization recipe.
High throughput (`HtFp8Wire`): DS_FP8E3M4 is LL-only, so the caller quantizes and the
forward recipe (FWD) carries rows, scales and routing weights as they are. Both need
hidden % 512 == 0 (16-byte aligned rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep import fp8_numerics as num
from vllm_flashinfer_ep.errors import HandlePoolError
from vllm_flashinfer_ep.runtime import flashinfer_internals as internals
from vllm_flashinfer_ep.runtime import native_handle

SCALE_GROUP = num.GROUP  # elements per FP32 scale (the recipe's, and 128x128 blocks' K group)
HIDDEN_MULTIPLE = 512  # the recipe's hidden-size rule (16-byte aligned FP8 payload)
OFF = f" (set {envs.FP8_DISPATCH}=0 to dispatch BF16 and quantize after receive)"


def hidden_reason(hidden: int) -> str | None:
    """Why NCCL-EP's FP8 dispatch cannot carry rows of this hidden size (None: it can)."""
    if hidden % HIDDEN_MULTIPLE:
        return (
            f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE} (NCCL-EP's FP8 "
            "dispatch reads E4M3 rows and FP32 scale rows in 16-byte units)"
        )
    return None


def native_reason(handle: Any, recipe: str = "DS_FP8E3M4") -> str | None:
    """Why this handle cannot take the FP8 dispatch with `recipe` (None: it can)."""
    reason = native_handle.native_reason(handle, ht=recipe == "FWD")
    if reason is not None:
        return reason
    recipes = getattr(internals.nccl_ep_of(handle), "DispatchQuantizationRecipe", None)
    if recipes is None or not hasattr(recipes, recipe):
        return f"the installed nccl.ep has no {recipe} dispatch recipe (nccl-extensions >= 0.1.0)"
    return None


def group_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [tokens, hidden] -> (E4M3, FP32 scales [tokens, hidden / 128]), amax / 448 per 128
    elements (zero groups: the smallest normal scale), for callers without vLLM. The engine
    uses vllm/receive_quant.group_quantize; without E8M0 both agree where amax >= 1e-10."""
    rows, hidden = x.shape
    groups = x.float().view(rows, hidden // SCALE_GROUP, SCALE_GROUP)
    scales = (groups.abs().amax(-1) / num.FP8_MAX).clamp_min(num.TENSOR_SCALE_FLOOR)
    q = (groups / scales[..., None]).clamp(-num.FP8_MAX, num.FP8_MAX).to(num.FP8)
    return q.view(rows, hidden), scales


def bytes_per_row(hidden: int, fp8: bool) -> int:
    """Bytes one dispatched row moves: BF16, or E4M3 plus its FP32 group scales."""
    return hidden + 4 * (hidden // SCALE_GROUP) if fp8 else 2 * hidden


class Fp8Wire:
    """The FP8 receive buffers of one LL runtime (shared by its layers) and their dispatch."""

    def __init__(
        self,
        local_experts: int,
        rows: int,
        hidden: int,
        device: torch.device,
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

    def dispatch(
        self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch x [tokens, hidden] BF16 on `handle`'s routing -> (tokens, scales, counts)."""
        if scales is not None:
            raise HandlePoolError("the LL FP8 dispatch quantizes BF16 itself: pass no scales")
        kind = type(handle)
        if kind not in self._checked:
            reason = native_reason(handle)
            if reason is not None:
                raise HandlePoolError(f"flashinfer_ep FP8 dispatch: {reason}{OFF}")
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


@dataclass
class HtFp8Received:
    """What an HT FP8 dispatch wrote (flat rows, like FlashInfer's BF16 HT output)."""

    expert_tensors: torch.Tensor  # [rows, hidden] E4M3, the first `received` rows valid
    scales: torch.Tensor  # [rows, hidden / 128] FP32
    recv_topk_idx: torch.Tensor  # [rows, top_k] int64 local expert ids, -1 = another rank
    recv_topk_weights: torch.Tensor  # [rows, top_k] FP32


Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class HtFp8Wire:
    """The FP8 receive buffers of one HT runtime (shared by its layers) and their dispatch.
    `weights`: the routing weights every handle of the pool has bound (HandlePool.
    topk_weights). `quantize`: BF16 rows -> (E4M3, FP32 scales per 128), the layers' own."""

    def __init__(
        self,
        rows: int,
        hidden: int,
        weights: torch.Tensor,
        quantize: Quantizer = group_quantize,
        dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        reason = hidden_reason(hidden)
        if reason is not None:
            raise ValueError(reason)
        device, top_k = weights.device, weights.shape[1]
        self.hidden = hidden
        self.quantize = quantize
        self._weights = weights
        self.tokens = torch.empty(rows, hidden, dtype=dtype, device=device)
        self.scales = torch.empty(rows, hidden // SCALE_GROUP, dtype=torch.float32, device=device)
        self.topk_weights = torch.empty(rows, top_k, dtype=torch.float32, device=device)
        self.topk_idx = torch.empty(rows, top_k, dtype=torch.int64, device=device)
        self.received = HtFp8Received(self.tokens, self.scales, self.topk_idx, self.topk_weights)
        self._checked: set[type] = set()
        self._descriptors: tuple[Any, ...] | None = None
        self._inputs: Any = None  # this dispatch's inputs, alive until the next one
        self.dispatches = 0

    @property
    def memory_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.tokens, self.scales, self.topk_weights, self.topk_idx)
        )

    def _input_error(self, x: torch.Tensor, scales: torch.Tensor | None, rows: int) -> str | None:
        """What is wrong with a forwarded dispatch's inputs (the recipe converts nothing)."""
        want_x = (rows, self.hidden)
        want_s = (rows, self.hidden // SCALE_GROUP)
        if x.dtype != self.tokens.dtype:
            return f"rows must be {self.tokens.dtype} (quantized before dispatch), got {x.dtype}"
        if tuple(x.shape) != want_x:
            return f"rows must be {want_x}, got {tuple(x.shape)}"
        if scales is None:
            return "no scales were given: the forward recipe carries the caller's scales"
        if scales.dtype != torch.float32:
            return f"scales must be torch.float32, got {scales.dtype}"
        if tuple(scales.shape) != want_s:
            return f"scales must be {want_s} (one per {SCALE_GROUP} elements), got {tuple(scales.shape)}"
        return None

    def dispatch(
        self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None = None
    ) -> HtFp8Received:
        """Dispatch x [tokens, hidden] E4M3 and its FP32 scales on `handle`'s routing."""
        kind = type(handle)
        if kind not in self._checked:
            reason = native_reason(handle, "FWD")
            if reason is not None:
                raise HandlePoolError(f"flashinfer_ep HT FP8 dispatch: {reason}{OFF}")
            self._checked.add(kind)
        rows = handle._num_tokens_in
        wrong = self._input_error(x, scales, rows)
        if wrong is not None:
            raise HandlePoolError(
                f"HT FP8 dispatch (the handle routes {rows} tokens): {wrong}{OFF}"
            )
        if not (x.is_contiguous() and scales.is_contiguous()):  # read by pointer, row by row
            x, scales = x.contiguous(), scales.contiguous()
        ep = handle._ep
        d = self._descriptors
        if d is None or d[0] is not ep:
            d = self._descriptors = (
                ep,
                ep.DispatchOutputs(
                    tokens=ep.Tensor(self.tokens),
                    scales=ep.Tensor(self.scales),
                    topk_weights=ep.Tensor(self.topk_weights),
                    topk_idx=ep.Tensor(self.topk_idx),
                ),
                ep.DispatchConfig(
                    quantization_recipe=ep.DispatchQuantizationRecipe.FWD, round_scales=0
                ),
            )
        inputs = ep.DispatchInputs(
            tokens=ep.Tensor(x),
            scales=ep.Tensor(scales),
            topk_weights=ep.Tensor(self._weights[:rows]),
        )
        stream = handle._op_stream()
        handle._handle.dispatch(inputs, d[1], layout_info=None, config=d[2], stream=stream)
        handle._handle.complete(stream=stream)
        self._inputs = inputs
        self.dispatches += 1
        return self.received
