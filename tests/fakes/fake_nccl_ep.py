"""A CPU fake of the `nccl.ep` names runtime/fp8_wire.py drives through FlashInfer's
handle (`Handle.dispatch` with a dispatch quantization recipe, `Handle.complete`).

It refuses what nccl_ep.h (nccl-extensions 0.1.0) refuses for the DS_FP8E3M4 recipe: HT,
hidden not a multiple of 512, non-BF16 input tokens, input scales present, output scales
absent or not FP32 [local experts, rows, hidden / 128], output tokens not E4M3
[local experts, rows, hidden], no `expert_counters`. The transport itself is the fake
FlashInfer handle's BF16 dispatch (tests/fakes/fake_moe_ep.py): the received rows are
quantized as the recipe does (FP32 scale = amax / 448 per 128 elements, as measured on
the H200), rows past each expert's count are left NaN.

For HT it takes the forward recipe (FWD) runtime/fp8_wire.py's HtFp8Wire issues:
E4M3 rows and their scales forwarded as they are, and refuses what nccl_ep.h refuses
there: absent input or output scales, an absent topk_weights (HT's forward pass), a
non-zero round_scales, output dtypes or row widths unlike the inputs', rows or storage
not 16-byte aligned, and (loudly, where the library would read past them) input rows
unlike the handle's routing.

It also takes the plain calls runtime/native_handle.py issues for eager LL rounds
(`update`, BF16 `dispatch`, `combine`) and, like nccl.ep.Tensor, descriptors made from
a raw address with dtype and shape (resolved here through the CPU address). It refuses
what nccl_ep.h refuses there: LL `update` with a layout_info, an LL expert-major
combine without per-token weights, outputs of the wrong shape or dtype, and any call
off FlashInfer's op stream.
"""

from __future__ import annotations

import ctypes
import enum
import math
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
GROUP = 128
_FWD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, FP8, torch.float8_e5m2)


class NcclInvalid(ValueError):
    """nccl.core.typing.NcclInvalid: what an ncclInvalidArgument return raises."""


class DispatchQuantizationRecipe(enum.IntEnum):
    NONE = 0
    FWD = 1
    DS_FP8E3M4 = 2


class Tensor:
    """A descriptor: address, dtype and shape. From a tensor (anchored to it) or, like
    nccl.ep.Tensor, from a raw address with `dtype` and `shape` (anchored to nothing: the
    caller keeps the memory alive); `buffer` is then a view of that CPU memory."""

    def __init__(
        self, buffer: Any, *, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
    ) -> None:
        if isinstance(buffer, int) and not isinstance(buffer, bool):
            if dtype is None or shape is None:
                raise ValueError("Raw integer pointer requires `dtype` and `shape` kwargs")
            self.anchor = None
            self.data, self.datatype, self.sizes = buffer, dtype, tuple(shape)
            return
        if dtype is not None or shape is not None:
            raise ValueError("`dtype`/`shape` are only valid with a raw integer pointer")
        if not isinstance(buffer, torch.Tensor):
            raise NcclInvalid(f"cannot resolve {type(buffer).__name__!r}")
        if not buffer.is_contiguous():
            raise NcclInvalid("nccl.ep.Tensor carries no strides: the buffer must be contiguous")
        self.anchor = buffer
        self.data, self.datatype, self.sizes = buffer.data_ptr(), buffer.dtype, tuple(buffer.shape)

    @property
    def buffer(self) -> torch.Tensor:
        """The memory described, as a tensor (what the native kernels read and write)."""
        if self.anchor is not None:
            return self.anchor
        numel = math.prod(self.sizes)
        nbytes = numel * torch.empty(0, dtype=self.datatype).element_size()
        raw = (ctypes.c_byte * nbytes).from_address(self.data)
        return torch.frombuffer(raw, dtype=self.datatype, count=numel).view(self.sizes)


@dataclass
class DispatchInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class DispatchOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None
    topk_idx: Tensor | None = None


@dataclass
class LayoutInfo:
    expert_counters: Tensor | None = None


@dataclass
class CombineInputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None
    scales: Tensor | None = None


@dataclass
class CombineOutputs:
    tokens: Tensor | None = None
    topk_weights: Tensor | None = None


@dataclass
class CombineConfig:
    send_only: int = 0


@dataclass
class DispatchConfig:
    send_only: int = 0
    round_scales: int = 0
    quantization_recipe: DispatchQuantizationRecipe = DispatchQuantizationRecipe.NONE


class NativeHandle:
    """The nccl.ep Handle under one fake FlashInfer handle (`owner`)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self.dispatches = 0  # FP8 dispatches (DS_FP8E3M4, FWD)
        self.bf16_dispatches = 0
        self.updates = 0
        self.combines = 0

    def update(
        self, topk_idx: Tensor, *, layout_info: LayoutInfo | None = None, stream: int
    ) -> None:
        self._require_op_stream(stream, "update")
        owner = self._owner
        if layout_info is not None and not owner._is_ht:
            raise NcclInvalid("LL update takes no layout_info")
        ids = topk_idx.buffer
        if ids.dtype != torch.int64 or tuple(ids.shape) != (owner._num_tokens, owner._top_k):
            raise NcclInvalid(
                f"topk_idx must be int64 {(owner._num_tokens, owner._top_k)} (the handle's), got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        owner._native_update(ids)
        self.updates += 1

    def combine(
        self,
        inputs: CombineInputs,
        outputs: CombineOutputs,
        *,
        config: CombineConfig | None = None,
        stream: int,
    ) -> None:
        self._require_op_stream(stream, "combine")
        owner = self._owner
        if config is not None and not isinstance(config, CombineConfig):
            raise NcclInvalid(
                f"combine config must be a CombineConfig, got {type(config).__name__}"
            )
        if inputs.tokens is None or outputs.tokens is None:
            raise NcclInvalid("inputs.tokens and outputs.tokens are required")
        if not owner._is_ht and outputs.topk_weights is None:
            raise NcclInvalid("LL expert-major combine needs outputs.topk_weights")
        weights = outputs.topk_weights.buffer if outputs.topk_weights is not None else None
        if weights is not None and (
            weights.dtype != torch.float32
            or tuple(weights.shape) != (owner._num_tokens, owner._top_k)
        ):
            raise NcclInvalid(
                f"outputs.topk_weights must be FP32 {(owner._num_tokens, owner._top_k)}, got "
                f"{weights.dtype} {tuple(weights.shape)}"
            )
        owner._combine(inputs.tokens.buffer, outputs.tokens.buffer, weights)
        self.combines += 1

    def dispatch(
        self,
        inputs: DispatchInputs,
        outputs: DispatchOutputs,
        *,
        layout_info: LayoutInfo | None = None,
        config: DispatchConfig | None = None,
        stream: int,
    ) -> None:
        self._require_op_stream(stream, "dispatch")
        if config is not None and not isinstance(config, DispatchConfig):
            raise NcclInvalid(
                f"dispatch config must be a DispatchConfig, got {type(config).__name__}"
            )
        recipe = (
            config.quantization_recipe if config is not None else DispatchQuantizationRecipe.NONE
        )
        if recipe == DispatchQuantizationRecipe.NONE:
            return self._dispatch_bf16(inputs, outputs, layout_info)
        if recipe == DispatchQuantizationRecipe.FWD:
            return self._dispatch_forwarded(inputs, outputs, config)
        if recipe != DispatchQuantizationRecipe.DS_FP8E3M4:
            raise NotImplementedError(f"the fake nccl.ep has no recipe {recipe!r}")
        owner = self._owner
        if owner._is_ht:
            raise NcclInvalid("DS_FP8E3M4 is an LL-only recipe")
        if inputs.tokens is None or outputs.tokens is None:
            raise NcclInvalid("inputs.tokens and outputs.tokens are required")
        x = inputs.tokens.buffer
        hidden = x.shape[1]
        if x.dtype != torch.bfloat16:
            raise NcclInvalid(f"DS_FP8E3M4 takes BF16 tokens, got {x.dtype}")
        if hidden % 512:
            raise NcclInvalid(f"DS_FP8E3M4 needs hidden % 512 == 0, got {hidden}")
        if inputs.scales is not None:
            raise NcclInvalid("DS_FP8E3M4: inputs.scales must be absent")
        if outputs.scales is None:
            raise NcclInvalid("DS_FP8E3M4: outputs.scales is required")
        if layout_info is None or layout_info.expert_counters is None:
            raise NcclInvalid("LL expert-major dispatch needs layout_info.expert_counters")
        q, s, counters = (
            outputs.tokens.buffer,
            outputs.scales.buffer,
            layout_info.expert_counters.buffer,
        )
        experts = owner._fleet.num_local_experts
        rows = owner._fleet.params.max_tokens_per_rank * owner._fleet.bootstrap.world_size
        if q.dtype != FP8 or tuple(q.shape) != (experts, rows, hidden):
            raise NcclInvalid(
                f"outputs.tokens must be E4M3 {(experts, rows, hidden)}, got {q.dtype} {tuple(q.shape)}"
            )
        if s.dtype != torch.float32 or tuple(s.shape) != (experts, rows, hidden // GROUP):
            raise NcclInvalid(
                f"outputs.scales must be FP32 {(experts, rows, hidden // GROUP)}, got {s.dtype} {tuple(s.shape)}"
            )
        from tests.fakes.fake_moe_ep import DispatchInputParams

        out = owner.dispatch(DispatchInputParams(x=[x]))  # the collective, in BF16
        counts = out.expert_counts
        q.fill_(float("nan"))
        s.fill_(float("nan"))
        for e in range(experts):
            n = int(counts[e])
            if n:
                groups = out.expert_tensors[e, :n].float().view(n, -1, GROUP)
                scale = groups.abs().amax(-1).clamp_min(1e-10) / torch.finfo(FP8).max
                q[e, :n] = (groups / scale[..., None]).to(FP8).view(n, hidden)
                s[e, :n] = scale
        counters.copy_(counts)
        self.dispatches += 1

    def _dispatch_forwarded(
        self, inputs: DispatchInputs, outputs: DispatchOutputs, config: DispatchConfig
    ) -> None:
        """FWD on HT: tokens and scales travel as bytes, into flat outputs."""
        owner = self._owner
        owner._check_alive("dispatch")
        if not owner._is_ht:
            raise NotImplementedError("the fake nccl.ep forwards quantized rows on HT only")
        for name in ("tokens", "scales"):
            if getattr(inputs, name) is None or getattr(outputs, name) is None:
                raise NcclInvalid(f"FWD: inputs.{name} and outputs.{name} are required")
        if inputs.topk_weights is None:
            raise NcclInvalid("HT forward dispatch requires inputs.topk_weights")
        if config.round_scales:
            raise NcclInvalid("FWD: round_scales must be 0")
        rows = owner._fleet.params.max_tokens_per_rank * owner._fleet.bootstrap.world_size
        x, s = inputs.tokens.buffer, inputs.scales.buffer
        q, qs = outputs.tokens.buffer, outputs.scales.buffer
        for name, t, allowed in (
            ("tokens", x, _FWD_DTYPES),
            ("scales", s, _FWD_DTYPES + (torch.uint8,)),
        ):
            if t.dim() != 2 or t.dtype not in allowed:
                raise NcclInvalid(
                    f"FWD: inputs.{name} must be 2D of {allowed}, got {t.dtype} {tuple(t.shape)}"
                )
        for name, src, dst in (("tokens", x, q), ("scales", s, qs)):
            if dst.dtype != src.dtype or tuple(dst.shape) != (rows, src.shape[1]):
                raise NcclInvalid(
                    f"FWD: outputs.{name} must be {src.dtype} {(rows, src.shape[1])} like the "
                    f"inputs, got {dst.dtype} {tuple(dst.shape)}"
                )
            for t in (src, dst):
                if (t.shape[1] * t.element_size()) % 16 or t.data_ptr() % 16:
                    raise NcclInvalid(f"FWD: {name} rows and storage must be 16-byte aligned")
        if x.shape[0] != owner._num_tokens or s.shape[0] != owner._num_tokens:
            raise NcclInvalid(
                f"fake nccl.ep: {x.shape[0]} token / {s.shape[0]} scale rows on a handle routing "
                f"{owner._num_tokens} (the real library would read past them silently)"
            )
        weights = inputs.topk_weights.buffer
        if weights.dtype != torch.float32 or tuple(weights.shape) != (
            owner._num_tokens,
            owner._top_k,
        ):
            raise NcclInvalid(
                f"inputs.topk_weights must be FP32 {(owner._num_tokens, owner._top_k)}"
            )
        width = x.shape[1] * x.element_size() // 4  # the row's bytes, as FP32 words
        packed = torch.cat(
            [x.view(torch.uint8).view(torch.float32), s.view(torch.uint8).view(torch.float32)], 1
        )
        got = owner._send(packed, weights)
        flat = got.expert_tensors.reshape(rows, -1)
        q.view(torch.uint8).copy_(flat[:, :width].contiguous().view(torch.uint8))
        qs.view(torch.uint8).copy_(flat[:, width:].contiguous().view(torch.uint8))
        if outputs.topk_weights is not None:
            outputs.topk_weights.buffer.copy_(got.recv_topk_weights)
        if outputs.topk_idx is not None:
            outputs.topk_idx.buffer.copy_(got.recv_topk_idx)
        self.dispatches += 1

    def _dispatch_bf16(
        self, inputs: DispatchInputs, outputs: DispatchOutputs, layout_info: LayoutInfo | None
    ) -> None:
        owner = self._owner
        if owner._is_ht:
            raise NotImplementedError("the fake nccl.ep's direct BF16 dispatch is LL only")
        if inputs.tokens is None or outputs.tokens is None:
            raise NcclInvalid("inputs.tokens and outputs.tokens are required")
        if layout_info is None or layout_info.expert_counters is None:
            raise NcclInvalid("LL expert-major dispatch needs layout_info.expert_counters")
        x, out = inputs.tokens.buffer, outputs.tokens.buffer
        if x.shape[0] != owner._num_tokens:
            # The real library does not check: it reads routing rows past the activations.
            raise NcclInvalid(
                f"fake nccl.ep: {x.shape[0]} activation rows on a handle routing "
                f"{owner._num_tokens} (the real library would read past them silently)"
            )
        experts = owner._fleet.num_local_experts
        rows = owner._fleet.params.max_tokens_per_rank * owner._fleet.bootstrap.world_size
        if out.dtype != x.dtype or tuple(out.shape) != (experts, rows, x.shape[1]):
            raise NcclInvalid(
                f"outputs.tokens must be {x.dtype} {(experts, rows, x.shape[1])}, got {out.dtype} {tuple(out.shape)}"
            )
        from tests.fakes.fake_moe_ep import DispatchInputParams

        got = owner.dispatch(DispatchInputParams(x=[x]))  # the collective
        if got.expert_tensors.data_ptr() != out.data_ptr():
            out.copy_(got.expert_tensors)
        layout_info.expert_counters.buffer.copy_(got.expert_counts)
        self.bf16_dispatches += 1

    def complete(self, *, config: int = 0, stream: int) -> None:
        """No-op: the fake's dispatch is complete when it returns."""
        self._require_op_stream(stream, "complete")

    def _require_op_stream(self, stream: int, op: str) -> None:
        """Work issued on another stream than FlashInfer's op stream escapes a capture (the
        graph records nothing and its replay does not dispatch) or races the handle's own
        stream outside it; the real library cannot tell, the fake refuses it."""
        want = self._owner._op_stream()
        if stream != want:
            raise NcclInvalid(f"{op} issued on stream {stream}, not the handle's op stream {want}")
