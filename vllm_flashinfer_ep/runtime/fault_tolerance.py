"""Fault tolerance in vLLM's conventions, on top of FlashInfer's NCCL-EP fleet FT API.

Conventions differ, so this adapter converts:
- mask polarity: FlashInfer/NCCL-EP write 1 = active, 0 = masked; vLLM's
  `query_active_mask()` wants 0 = live, 1 = masked.
- fault signal: FlashInfer's `query_fault()` is a host bool read from a pinned flag;
  vLLM calls `query_fault()` every step on its output-copy stream and copies the
  result to the CPU non-blocking, so it must be a stream-ordered GPU bool tensor.
  The adapter compares the current mask with the baseline taken at the last
  recovery on the GPU and ORs in the host flag.
None of these calls may run under CUDA-graph capture (FlashInfer raises there too).
Low latency only: NCCL-EP has no FT for high throughput.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep.runtime.capture import is_capturing


class FaultToleranceAdapter:
    def __init__(self, fleets: list[Any], device: torch.device | int | str) -> None:
        self._fleets = fleets
        self.device = torch.device(device)
        self._baseline: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return any(getattr(f, "supports_fault_tolerance", False) for f in self._fleets)

    def _primary(self) -> Any:
        for fleet in self._fleets:
            if getattr(fleet, "supports_fault_tolerance", False):
                return fleet
        raise RuntimeError(
            "no flashinfer_ep fleet with fault tolerance: start vLLM with "
            "--enable-fault-tolerance and --all2all-backend flashinfer_ep_low_latency"
        )

    def _raw_mask(self, op: str) -> torch.Tensor:
        """FlashInfer's mask (1 = active), copied out of its fleet-owned buffer."""
        _reject_capture(op)
        return self._primary().query_active_mask().to(torch.int32).clone()

    def snapshot_baseline(self) -> None:
        """Remember the current mask as 'no new fault' (after startup or recovery)."""
        self._baseline = self._raw_mask("snapshot_baseline")

    def query_active_mask(self) -> torch.Tensor:
        """int32 [ep_world] on the GPU, vLLM polarity: 0 = live, 1 = masked."""
        return 1 - self._raw_mask("query_active_mask")

    def query_fault(self) -> torch.Tensor:
        """Scalar bool on the GPU: a fault appeared since the last baseline."""
        mask = self._raw_mask("query_fault")
        if self._baseline is None:
            self._baseline = mask.clone()
        fault = torch.ne(mask, self._baseline).any()
        if self._primary().query_fault():
            fault = torch.ones((), dtype=torch.bool, device=mask.device)
        return fault

    def clean_buffers(self) -> None:
        """Rank-local recovery: clear NCCL-EP's sticky error flag and re-baseline."""
        _reject_capture("clean_buffers")
        for fleet in self._fleets:
            if getattr(fleet, "supports_fault_tolerance", False):
                fleet.clear_faults(readmit=False)
        self.snapshot_baseline()


def _reject_capture(op: str) -> None:
    if is_capturing():
        raise RuntimeError(f"flashinfer_ep fault tolerance: {op} cannot run under CUDA-graph capture")
