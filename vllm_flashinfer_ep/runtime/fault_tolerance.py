"""Fault tolerance in vLLM's conventions, on top of FlashInfer's NCCL-EP fleet FT API.

Conventions differ, so this adapter converts:
- mask polarity: FlashInfer/NCCL-EP write 1 = active, 0 = masked; vLLM's
  `query_active_mask()` wants 0 = live, 1 = masked.
- fault signal: FlashInfer's `query_fault()` is a host bool read from a pinned flag;
  vLLM calls `query_fault()` every step on its output-copy stream and copies the
  result to the CPU non-blocking, so it must be a stream-ordered GPU bool tensor.
  The adapter compares the current masks with the baseline on the GPU and ORs in
  the host flags.

Every fault-tolerant fleet counts (one per MoE shape, fleets created after the
adapter included: it reads the fleet list at each call). A rank is masked if any
fleet masks it; a fault in any fleet is a fault.

The baseline is the all-active mask, and only that: it is what the fleets start
with and the only state recovery may return to. `clean_buffers` (vLLM's retry)
re-admits every masked peer with `clear_faults(readmit=True)`. That is NCCL-EP's
`ncclEpMaskClean`, whose barrier skips masked peers and which then sets every mask
to active (nccl_ep.h), a dead peer's too. So the survivors then agree on who took
part (`reconcile_active_mask`, FlashInfer's store-based agreement: a peer silent
past the FT timeout, and at least AGREE_MIN_S, is masked). A peer that did not answer the retry (dead, or
never sent it) is masked again and keeps reading as a fault, as does a fleet whose
re-admission or agreement failed: the adapter never reports healthy while any
fleet masks a peer (no degraded serving). At EP world 1 there is no peer to agree
with, and no store is needed.

None of these calls may run under CUDA-graph capture (FlashInfer raises there too).
Low latency only: NCCL-EP has no FT for high throughput.

EXPERT_MAJOR and re-admission: FlashInfer warns that `ncclEpMaskClean` computes its
buffer-reset offsets for the RANK_MAJOR layout, so under EXPERT_MAJOR (our layout)
it "may leave stale bytes in the LL staging buffer" -- receive-side count/flag words
or rows of the aborted round that the clean did not reach. The plugin cannot reset
that buffer itself (NCCL-EP allocates it; FlashInfer exposes no handle on it), and
an extra "flush" round would not provably drain it: a stale signal is consumed by
whichever round comes next in place of the real one, whose own signal is then left
for the round after. So nothing is added here; docs/fault_tolerance.md states the
risk (outputs of the first rounds after a re-admission are FlashInfer's to vouch
for) and the clean alternative (restart the engines).
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
# The survivors' agreement is a host round trip through the rendezvous store: it waits
# for a peer at least this long, however short the kernels' FT timeout is set.
AGREE_MIN_S = 5.0


class FaultToleranceAdapter:
    def __init__(
        self,
        fleets: Sequence[Any] | Callable[[], Sequence[Any]],
        device: torch.device | int | str,
    ) -> None:
        """`fleets`: the fleets, or a callable returning the current ones (a manager
        passes `FleetCache.fleets`, so fleets created later are seen too)."""
        self._fleets: Callable[[], Sequence[Any]] = (
            fleets if callable(fleets) else (lambda fixed=tuple(fleets): fixed)
        )
        self.device = torch.device(device)
        # Fleets whose last recovery did not end in an agreed mask (re-admission or
        # agreement raised): a fault until a later retry recovers them.
        self._unrecovered: list[str] = []
        # The all-active mask (FlashInfer polarity), built at the first query from the
        # fleets' own mask. Never a snapshot of a live mask: see the module docstring.
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
        """Bool [ep_world] on the GPU: True where any FT fleet masks the rank.

        Built from fresh tensors, never from FlashInfer's fleet-owned mask buffer
        (NCCL-EP writes it in place)."""
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
        answered.

        Both steps are collective over the survivors of each fleet and run on every
        FT fleet in the same order on every rank, whatever this rank's own view shows
        (another rank may mask a peer that this one does not). A failure is logged,
        not raised, so the retry still re-creates vLLM's DP group on every rank; the
        fault then stays reported (`query_fault`) until a later retry recovers it.
        """
        _reject_capture("clean_buffers")
        self._unrecovered = []
        refused: list[str] = []
        # A peer silent for the FT timeout is dead (the kernels' own rule), given the
        # store's round trip at least AGREE_MIN_S.
        wait_s = max(envs.ft_timeout_ms() / 1000, AGREE_MIN_S)
        for index, fleet in enumerate(self._ft_fleets()):
            try:
                fleet.clear_faults(readmit=True)
            except Exception as exc:  # noqa: BLE001 - reported through query_fault
                # NCCL-EP's clean failed here (its flag stays set), or no round ever ran
                # on the fleet (no handle: not after load, where every fleet's pool has
                # its handles). This rank still takes part in the agreement below.
                refused.append(f"fleet {index}: {type(exc).__name__}: {exc}")
            if fleet.query_active_mask().numel() == 1:
                continue  # EP world 1: nobody to agree with
            try:
                # Every rank agrees on every fleet, in order, even after a failed clean:
                # FlashInfer numbers each fleet's store keys by the order of first use.
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
