"""A CPU fake of the `nccl.ep` names runtime/fp8_wire.py drives through FlashInfer's
handle (`Handle.dispatch` with a dispatch quantization recipe, `Handle.complete`).

It refuses what nccl_ep.h (nccl-extensions 0.1.0) refuses for the DS_FP8E3M4 recipe: HT,
hidden not a multiple of 512, non-BF16 input tokens, input scales present, output scales
absent or not FP32 [local experts, rows, hidden / 128], output tokens not E4M3
[local experts, rows, hidden], no `expert_counters`. The transport itself is the fake
FlashInfer handle's BF16 dispatch (tests/fakes/fake_moe_ep.py): the received rows are
quantized as the recipe does (FP32 scale = amax / 448 per 128 elements, as measured on
the H200), rows past each expert's count are left NaN.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
GROUP = 128


class NcclInvalid(ValueError):
    """nccl.core.typing.NcclInvalid: what an ncclInvalidArgument return raises."""


class DispatchQuantizationRecipe(enum.IntEnum):
    NONE = 0
    FWD = 1
    DS_FP8E3M4 = 2


class Tensor:
    def __init__(self, buffer: torch.Tensor) -> None:
        if not isinstance(buffer, torch.Tensor):
            raise NcclInvalid(f"cannot resolve {type(buffer).__name__!r}")
        if not buffer.is_contiguous():
            raise NcclInvalid("nccl.ep.Tensor carries no strides: the buffer must be contiguous")
        self.buffer = buffer


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
class DispatchConfig:
    send_only: int = 0
    round_scales: int = 0
    quantization_recipe: DispatchQuantizationRecipe = DispatchQuantizationRecipe.NONE


class NativeHandle:
    """The nccl.ep Handle under one fake FlashInfer handle (`owner`)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self.dispatches = 0

    def dispatch(
        self, inputs: DispatchInputs, outputs: DispatchOutputs, *, layout_info: LayoutInfo | None = None,
        config: DispatchConfig | None = None, stream: int,
    ) -> None:
        self._require_op_stream(stream, "dispatch")
        recipe = config.quantization_recipe if config is not None else DispatchQuantizationRecipe.NONE
        if recipe != DispatchQuantizationRecipe.DS_FP8E3M4:
            raise NotImplementedError("the fake nccl.ep dispatches with the DS_FP8E3M4 recipe only")
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
        q, s, counters = outputs.tokens.buffer, outputs.scales.buffer, layout_info.expert_counters.buffer
        experts = owner._fleet.num_local_experts
        rows = owner._fleet.params.max_tokens_per_rank * owner._fleet.bootstrap.world_size
        if q.dtype != FP8 or tuple(q.shape) != (experts, rows, hidden):
            raise NcclInvalid(f"outputs.tokens must be E4M3 {(experts, rows, hidden)}, got {q.dtype} {tuple(q.shape)}")
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
