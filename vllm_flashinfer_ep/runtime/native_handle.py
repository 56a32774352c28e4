"""Eager LL rounds issued on the nccl.ep handle underneath FlashInfer's.

An eager decode step is host-bound, and FlashInfer's handle methods spend more host time
than the nccl.ep calls they make (docs/benchmarks.md). `NativeEager` issues pooled,
unpadded LL rounds outside capture with descriptors that pin no memory (`DescriptorMemo`),
into FlashInfer's own receive buffer. Off with `VLLM_FLASHINFER_EP_NATIVE_EAGER=0`; remove
when FlashInfer's methods cost about as much.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from vllm_flashinfer_ep.errors import HandlePoolError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import flashinfer_internals as internals

logger = get_logger(__name__)


def native_reason(handle: Any, ht: bool = False) -> str | None:
    """Why this package cannot issue nccl.ep calls under `handle` (None: it can)."""
    missing = internals.check(handle)
    if missing is not None:
        return missing
    if ht:
        if not internals.is_ht(handle) or internals.is_staged(handle):
            return "the HT FP8 dispatch needs an HT handle without split send/complete"
        return None
    if internals.is_ht(handle) or internals.is_rank_major(handle) or internals.is_staged(handle):
        return "direct nccl.ep calls are LL expert-major only, without split send/complete"
    return None


class DescriptorMemo:
    """nccl.ep descriptors keyed by (address, dtype, shape), holding no tensor; bounded."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries, self.built = max_entries, 0
        self._memo: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self._memo)

    def tensor(self, ep: Any, t: torch.Tensor) -> Any:
        if not t.is_contiguous():
            raise ValueError(
                f"nccl.ep descriptors carry no strides: a tensor of shape {tuple(t.shape)} "
                f"and strides {t.stride()} must be made contiguous first"
            )
        key = (t.data_ptr(), t.dtype, t.shape)
        desc = self._memo.get(key)
        if desc is None:
            desc = self._memo[key] = self._raw(ep, t)
        return desc

    def bundle(self, kind: Any, ep: Any, **tensors: torch.Tensor) -> Any:
        """`kind(field=descriptor, ...)` (an nccl.ep bundle), memoized by its tensors' keys."""
        key = (kind, *((name, t.data_ptr(), t.dtype, t.shape) for name, t in tensors.items()))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = kind(**{n: self.tensor(ep, t) for n, t in tensors.items()})
        return found

    def _raw(self, ep: Any, t: torch.Tensor) -> Any:
        if len(self._memo) >= self.max_entries:
            self._memo.clear()
        self.built += 1
        resolved = ep.Tensor(t)  # dtype and shape as nccl.ep resolves them
        return ep.Tensor(resolved.data, dtype=resolved.datatype, shape=resolved.sizes)


class _Configs(NamedTuple):
    """What every direct round passes alike, built once per nccl.ep module and buffer."""

    ep: Any
    dispatch: Any  # DispatchConfig: not staged
    combine: Any  # CombineConfig: not staged
    layout: Any  # LayoutInfo: the per-expert counters NCCL-EP writes at dispatch
    received: Any  # DispatchOutputs: FlashInfer's receive buffer
    recv: torch.Tensor | None  # the buffer they were built for


class NativeEager:
    """The direct nccl.ep calls of one pool's eager LL rounds (`usable`: once per handle)."""

    def __init__(self, stream: int) -> None:
        self.stream = stream  # the handles' own stream, which these calls must use
        self.memo = DescriptorMemo()
        self.recv: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        self._usable: dict[int, bool] = {}  # id(handle) -> whether direct calls may run
        self._configs: _Configs | None = None
        # The last update/dispatch's and combine's descriptors, alive until the next of
        # their kind as FlashInfer keeps its own (the memo may be cleared meanwhile).
        self._keep_dispatch: tuple[Any, ...] = ()
        self._keep_combine: tuple[Any, ...] = ()
        self.rounds = 0
        self._logged = False

    def record(self, out: Any) -> None:
        """Follow FlashInfer's receive buffer and counts (it replaces them on a new shape)."""
        self.recv, self.counts = out.expert_tensors, out.expert_counts

    def usable(self, handle: Any) -> bool:
        ok = self._usable.get(id(handle))
        if ok is None:
            reason = native_reason(handle)
            if reason is None:
                stream = internals.handle_stream(handle)
                if stream != self.stream:
                    reason = f"the handle issues on stream {stream}, not {self.stream}"
            if reason is not None and not self._logged:
                self._logged = True
                logger.info(
                    "flashinfer_ep: eager rounds run through FlashInfer's handle methods: %s",
                    reason,
                )
            ok = self._usable[id(handle)] = reason is None
        return ok

    def update(self, handle: Any, topk_ids: torch.Tensor) -> None:
        """Re-target `handle` to this layer's routing (LL takes no layout_info)."""
        ids = self.memo.tensor(handle._ep, topk_ids)
        handle._handle.update(ids, layout_info=None, stream=self.stream)
        # NCCL-EP may read the ids until the round's combine.
        self._keep_dispatch = (ids, topk_ids)

    def dispatch(self, handle: Any, x: torch.Tensor, scales: torch.Tensor | None = None) -> tuple:
        """Dispatch BF16 `x` into FlashInfer's receive buffer: (rows, None, counts)."""
        if scales is not None:
            raise HandlePoolError("the direct BF16 dispatch takes no scales (FP8: the wire)")
        ep, native, stream = handle._ep, handle._handle, self.stream
        configs = self._configs_for(ep)
        inputs = self.memo.bundle(ep.DispatchInputs, ep, tokens=x)
        native.dispatch(
            inputs,
            configs.received,
            layout_info=configs.layout,
            config=configs.dispatch,
            stream=stream,
        )
        native.complete(stream=stream)
        self._keep_dispatch += (inputs, x)
        self.rounds += 1
        return self.recv, None, self.counts

    def _configs_for(self, ep: Any) -> _Configs:
        configs = self._configs
        if configs is None or configs.ep is not ep or configs.recv is not self.recv:
            memo = self.memo
            configs = self._configs = _Configs(
                ep,
                ep.DispatchConfig(send_only=0, round_scales=0),
                ep.CombineConfig(send_only=0),
                ep.LayoutInfo(expert_counters=memo.tensor(ep, self.counts))
                if self.counts is not None
                else None,
                ep.DispatchOutputs(tokens=memo.tensor(ep, self.recv))
                if self.recv is not None
                else None,
                self.recv,
            )
        return configs

    def combine(
        self, handle: Any, expert_out: torch.Tensor, out: torch.Tensor | None, weights: torch.Tensor
    ) -> torch.Tensor:
        if out is None:
            out = expert_out.new_empty(weights.shape[0], expert_out.shape[-1])
        ep, memo = handle._ep, self.memo
        inputs = memo.bundle(ep.CombineInputs, ep, tokens=expert_out)
        outputs = memo.bundle(ep.CombineOutputs, ep, tokens=out, topk_weights=weights)
        handle._handle.combine(
            inputs, outputs, config=self._configs_for(ep).combine, stream=self.stream
        )
        self._keep_combine = (inputs, outputs)
        return out
