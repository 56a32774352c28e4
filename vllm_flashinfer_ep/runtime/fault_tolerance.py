"""Fault tolerance in vLLM's conventions on FlashInfer's NCCL-EP fleet FT API (LL only:
NCCL-EP has no HT FT; nothing here may run under CUDA-graph capture).

- Mask polarity: FlashInfer writes 1 = active; vLLM's `query_active_mask()` wants 1 = masked.
- Fault signal: vLLM reads `query_fault()` every step on a stream and copies it to the CPU
  non-blocking, so it is a GPU bool: the masks against the baseline, OR the host flags.
Every FT fleet counts (read at each call, later ones included): any mask or fault is one.
The baseline is the all-active mask only, the one state recovery returns to.
`clean_buffers` (vLLM's retry) re-admits every peer (`ncclEpMaskClean` sets every mask
active, nccl_ep.h), then the survivors agree on who took part (`reconcile_active_mask`):
a silent peer is masked again and reads as a fault, as does a fleet whose recovery
failed. No degraded serving.

Under EXPERT_MAJOR the clean may leave stale bytes in the LL staging buffer (FlashInfer's
warning), which the plugin cannot reset or provably drain: docs/fault_tolerance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import is_capturing

logger = get_logger(__name__)

# flashinfer/moe_ep/core/comm/fault_tolerance.py
ACTIVE = 1
# The survivors' agreement (a store round trip) waits at least this long for a peer.
AGREE_MIN_S = 5.0


class FaultToleranceAdapter:
    def __init__(
        self, fleets: Sequence[Any] | Callable[[], Sequence[Any]], device: torch.device | int | str
    ) -> None:
        """`fleets`: the fleets, or a callable returning the current ones."""
        self._fleets: Callable[[], Sequence[Any]] = (
            fleets if callable(fleets) else (lambda fixed=tuple(fleets): fixed)
        )
        self.device = torch.device(device)
        # Fleets whose last recovery raised: a fault until a later retry recovers them.
        self._unrecovered: list[str] = []
        # The all-active mask (FlashInfer polarity), never a snapshot of a live mask.
        self._baseline: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._ft_fleets(required=False))

    def _ft_fleets(self, *, required: bool = True) -> list[Any]:
        fleets = [f for f in self._fleets() if getattr(f, "supports_fault_tolerance", False)]
        if required and not fleets:
            raise RuntimeError(
                "no flashinfer_ep fleet with fault tolerance: start vLLM with "
                "--enable-fault-tolerance and --all2all-backend flashinfer_ep_low_latency"
            )
        return fleets

    def _masked(self, op: str) -> torch.Tensor:
        """Bool [ep_world] on the GPU: True where any FT fleet masks the rank (fresh
        tensors: NCCL-EP writes the fleet's mask buffer in place)."""
        _reject_capture(op)
        masked: torch.Tensor | None = None
        for fleet in self._ft_fleets():
            mask = fleet.query_active_mask().to(torch.int32)
            if self._baseline is None:
                self._baseline = torch.full_like(mask, ACTIVE)
            off = torch.ne(mask, self._baseline)
            masked = off if masked is None else masked | off
        assert masked is not None
        return masked

    def query_active_mask(self) -> torch.Tensor:
        """int32 [ep_world] on the GPU, vLLM polarity: 0 = live, 1 = masked (by any fleet)."""
        return self._masked("query_active_mask").to(torch.int32)

    def query_fault(self) -> torch.Tensor:
        """Scalar bool on the GPU: some FT fleet masks a peer or raised its fault flag."""
        fault = self._masked("query_fault").any()
        if self._unrecovered or any(fleet.query_fault() for fleet in self._ft_fleets()):
            fault = torch.ones((), dtype=torch.bool, device=fault.device)
        return fault

    def clean_buffers(self) -> None:
        """vLLM's retry: re-admit every masked peer in every FT fleet, then agree on who
        answered. Collective: every fleet, in order, on every rank, whatever this rank
        sees. A failure is logged, not raised (vLLM's DP group is still re-created), and
        stays reported by `query_fault` until a later retry recovers it."""
        _reject_capture("clean_buffers")
        self._unrecovered = []
        refused: list[str] = []
        wait_s = max(envs.ft_timeout_ms() / 1000, AGREE_MIN_S)  # the kernels' own rule
        for index, fleet in enumerate(self._ft_fleets()):
            try:
                fleet.clear_faults(readmit=True)
            except Exception as exc:  # noqa: BLE001 - reported through query_fault
                # NCCL-EP's clean failed, or no round ran yet (no handle); still agree below.
                refused.append(f"fleet {index}: {type(exc).__name__}: {exc}")
            if fleet.query_active_mask().numel() == 1:
                continue  # EP world 1: nobody to agree with
            try:
                # Even after a failed clean: FlashInfer numbers store keys by first use.
                fleet.reconcile_active_mask(timeout_s=wait_s)
            except Exception as exc:  # noqa: BLE001 - e.g. the peers evicted this rank
                self._unrecovered.append(f"fleet {index}: {type(exc).__name__}: {exc}")
        masked = self._masked("clean_buffers").nonzero().flatten().tolist()
        flagged = [i for i, fleet in enumerate(self._ft_fleets()) if fleet.query_fault()]
        detail = "".join(f"; {f}" for f in refused + self._unrecovered)
        if masked or flagged or self._unrecovered:
            logger.error(
                "flashinfer_ep: recovery incomplete, the fault stays reported (masked EP "
                "ranks %s, fleets with the fault flag %s%s). Re-admission is collective: "
                "send retry to every engine; a dead engine needs a restart.",
                masked,
                flagged,
                detail,
            )
        elif refused:
            logger.warning("flashinfer_ep: re-admission refused, no peer masked here%s", detail)
        else:
            logger.info("flashinfer_ep: recovery re-admitted every EP rank")


def _reject_capture(op: str) -> None:
    if is_capturing():
        raise RuntimeError(
            f"flashinfer_ep fault tolerance: {op} cannot run under CUDA-graph capture"
        )
