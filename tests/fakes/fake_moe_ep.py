"""A CPU fake of the `flashinfer.moe_ep` names the runtime uses (nccl_ep split path).

Install it with `vllm_flashinfer_ep.runtime.transport.use_transport_module(fake_moe_ep)`
(and remove it afterwards); `tests/fakes/runtime.py` has fixtures that do both.

What it does: a REAL all2all in torch, on whatever device the tensors are on (CPU in
unit tests), at world size 1 or, through a `FakeGroup` passed as the bootstrap's
process_group, at world size N with one thread per rank (tests/fakes/world.py):
- LL (EXPERT_MAJOR): `expert_tensors` [E_local, max_tokens_per_rank * world, H], the
  rows of each local expert from every rank in an ARBITRARY (seeded, shuffled) order,
  as NCCL-EP promises no order; padding rows poisoned with NaN; `expert_counts` int32
  [E_local]. Combine: out[t] = sum_k w[t, k] * expert_out[e(t, k), row(t, k)] read on
  the rank owning the expert, with `w` read from the weights tensor BOUND at handle
  creation (HandleAlgoKnobTopKWeights), written into `out` in place if given.
- HT (FLAT): received rows (every rank's tokens with a slot here) front-packed in a
  shuffled order, `recv_topk_idx` local expert ids (-1 = expert on another rank),
  `recv_topk_weights` from the bound weights; the received count is written into the
  HandleAlgoKnobNumReceivedTokens target at create and at every update. Combine sums
  each received (pre-reduced) row back into its source token on its source rank.

What it enforces, with FlashInfer's exception types and message style
(flashinfer/moe_ep/backends/split/comm/nccl_ep/{fleet,handle}.py):
- `Handle.update`: same top_k (ValueError), exactly the creation token count
  (ValueError), contiguous ids (ValueError); the first update of a handle cannot be
  the captured one (RuntimeError).
- `dispatch`: activation rows must equal the handle's token count, and may not exceed
  max_tokens_per_rank (MoEEpConfigError, a ValueError).
- Tensors NCCL-EP reads by pointer (ids, bound weights, activations, combine input and
  output) must be contiguous and on the fleet's GPU (the CPU in unit tests): the real
  library refuses CPU ids in `update` and reads strided memory as garbage, so the fake
  raises instead. Combine never converts dtypes: `out` must have the expert output's
  dtype. Non-int64 ids are converted (the handle then holds a copy), as in FlashInfer.
- Every collective (create_handle, update, dispatch, combine, the readmitting
  clear_faults) must pair across ranks: same op, same handle identity (fleet and handle
  creation index: a handle pairs with the peer handle created at the same position of
  its fleet's creation sequence, a fleet with the peer fleet created at the same
  position on its FakeGroup) and, for handles re-targeted with `update` (the package's
  pooled handles, paired at one agreed size), the same token count; per-forward handles
  carry each rank's own count, as NCCL-EP allows (`Handle._op`). On real NCCL-EP a
  mismatch hangs or exchanges garbage; here every rank raises the same RuntimeError
  naming the op, the ranks and what differs (`FakeGroup.exchange`).
- `create_handle` under capture raises (NCCL-EP: handles are created outside capture).
- use of a destroyed handle or fleet raises RuntimeError; combine needs a dispatch.
- LL hidden sizes as `validate_ll_hidden_size`; FT only with LOW_LATENCY.
- FT calls (`query_active_mask`, `query_fault`, `set_active_mask`,
  `clear_faults(readmit=True)`) raise under capture, like `reject_graph_capture`.

Capture state is read at call time from `vllm_flashinfer_ep.runtime.capture.is_capturing`
(the module attribute), so a test that patches it (see `runtime.CaptureSwitch`) drives
the fake and the runtime together.

Every collective is appended to `FakeFleet.log` as a `Call(op, handle, tokens)`;
`handles_created` / `handles_alive` count native handles.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm_flashinfer_ep.runtime import capture

# flashinfer/moe_ep/core/validation/common.py `_NCCL_EP_LL_HIDDEN_SIZES` (copied, not
# imported, to keep the fake light; tests/unit/test_kernel_matrix.py checks they agree).
NCCL_EP_LL_HIDDEN_SIZES: tuple[int, ...] = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
# flashinfer/moe_ep/backends/split/comm/nccl_ep/fleet.py `_HT_MAX_SUPPORTED_TOKENS_PER_RANK`.
HT_MAX_SUPPORTED_TOKENS_PER_RANK = 8192
# The capturing stream's handle in the fake (`Handle._op_stream` under capture).
CAPTURE_STREAM = 7
# flashinfer/moe_ep/core/comm/fault_tolerance.py
ACTIVE = 1
MASKED = 0


# --------------------------------------------------------------------------- errors
class MoEEpConfigError(ValueError):
    """Raised when an EP config field is out-of-range for the chosen backend."""


class MoEEpFaultToleranceUnsupportedError(RuntimeError):
    """Raised when an FT API is called on a Fleet that can't serve it."""


class MoEEpRankEvictedError(RuntimeError):
    """Raised by mask reconciliation when the survivors' agreed mask masks this rank."""


# ------------------------------------------------------------------- config types
class EpAlgorithm(enum.Enum):
    LOW_LATENCY = 0
    HIGH_THROUGHPUT = 1


class EpLayout(enum.Enum):
    EXPERT_MAJOR = 1
    RANK_MAJOR = 2


@dataclass(frozen=True)
class BootstrapConfig:
    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    device: int | None = field(default=None, kw_only=True)
    nccl_comm: int | None = None
    process_group: Any = field(default=None, compare=False, hash=False)
    tcp_store: Any = None

    def __post_init__(self) -> None:
        if self.world_size <= 0:
            raise ValueError(f"world_size must be positive, got {self.world_size}")
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} not in [0, {self.world_size})")
        if self.device is not None and self.device < 0:
            raise ValueError(f"device must be non-negative, got {self.device}")


@dataclass(frozen=True)
class FleetParams:
    num_experts: int
    max_tokens_per_rank: int
    token_hidden_size: int
    dtype_bytes: int = 2
    algorithm: EpAlgorithm = EpAlgorithm.LOW_LATENCY
    layout: EpLayout = EpLayout.EXPERT_MAJOR

    def __post_init__(self) -> None:
        for name in ("num_experts", "max_tokens_per_rank", "token_hidden_size", "dtype_bytes"):
            v = getattr(self, name)
            if v <= 0:
                raise ValueError(f"FleetParams.{name} must be positive, got {v}")
        if self.layout is EpLayout.RANK_MAJOR and self.algorithm is not EpAlgorithm.LOW_LATENCY:
            raise ValueError(
                "FleetParams.layout=RANK_MAJOR is only valid with algorithm=LOW_LATENCY "
                "(HT uses the FLAT layout)."
            )


@dataclass(frozen=True)
class HandleParams:
    topk_ids: torch.Tensor


@dataclass(frozen=True)
class DispatchInputParams:
    x: Sequence[torch.Tensor]


@dataclass(frozen=True)
class DispatchOutput:
    expert_tensors: torch.Tensor
    num_tokens: int
    recv_topk_idx: torch.Tensor | None = None
    recv_topk_weights: torch.Tensor | None = None
    expert_counts: torch.Tensor | None = None
    recv_total_counter: torch.Tensor | None = None
    expert_scales: torch.Tensor | None = None

    def get_num_tokens(self) -> int:
        return self.num_tokens


@dataclass(frozen=True)
class CombineInputParams:
    x: Sequence[torch.Tensor]
    out: torch.Tensor | None = None
    out_is_stable: bool = False


@dataclass(frozen=True)
class CombineOutput:
    x: torch.Tensor


# -------------------------------------------------------------------------- knobs
class AlgoKnob:
    """Base marker for both Fleet and Handle knobs."""


@dataclass(frozen=True)
class FleetAlgoKnobAllocator(AlgoKnob):
    torch_caching: bool = False
    alloc_fn: int = 0
    free_fn: int = 0
    context: int = 0

    def __post_init__(self) -> None:
        if self.torch_caching and (self.alloc_fn or self.free_fn):
            raise ValueError(
                "FleetAlgoKnobAllocator: set either torch_caching=True OR explicit "
                "alloc_fn/free_fn addresses, not both."
            )


@dataclass(frozen=True)
class FleetAlgoKnobRdmaBufferSize(AlgoKnob):
    bytes_: int


@dataclass(frozen=True)
class FleetAlgoKnobFaultTolerance(AlgoKnob):
    enabled: bool = True
    timeout_ms: int = 0
    reconcile_timeout_s: float = 30.0
    coordinator_takeover_s: float = 10.0

    def __post_init__(self) -> None:
        if self.timeout_ms < 0:
            raise ValueError(
                "FleetAlgoKnobFaultTolerance.timeout_ms must be >= 0 "
                f"(0 = transport default), got {self.timeout_ms}"
            )


@dataclass(frozen=True)
class FleetAlgoKnobNumChannelsPerRank(AlgoKnob):
    n: int


@dataclass(frozen=True)
class FleetAlgoKnobNumQpsPerRank(AlgoKnob):
    n: int


@dataclass(frozen=True)
class HandleAlgoKnobTopKWeights(AlgoKnob):
    weights: torch.Tensor


@dataclass(frozen=True)
class HandleAlgoKnobNumReceivedTokens(AlgoKnob):
    target: torch.Tensor


@dataclass(frozen=True)
class HandleAlgoKnobUserStream(AlgoKnob):
    stream: int


def _index_knobs(knobs: Sequence[AlgoKnob]) -> dict[type, AlgoKnob]:
    out: dict[type, AlgoKnob] = {}
    for k in knobs:
        if not isinstance(k, AlgoKnob):
            raise TypeError(f"expected AlgoKnob, got {type(k).__name__}")
        out[type(k)] = k
    return out


# ----------------------------------------------------------------------- call log
class Call(NamedTuple):
    """One collective (or FT) call as the fleet saw it."""

    op: str  # create_handle | update | dispatch | combine | destroy | <ft op>
    handle: int | None  # fleet-local handle id (None for fleet-level calls)
    tokens: int | None  # routing rows the call was made with


def _capturing() -> bool:
    # Looked up at call time so a monkeypatched `capture.is_capturing` is honoured.
    return bool(capture.is_capturing())


def _reject_graph_capture(op: str) -> None:
    if _capturing():
        raise RuntimeError(
            f"Fleet.{op}() must not be called during CUDA-graph capture: capturing it "
            "would freeze fault state. Call it from the host between graph replays."
        )


# -------------------------------------------------------------------------- fleet
class FakeFleet:
    """World-size-1 NCCL-EP fleet in torch, with a call log and FT test hooks."""

    def __init__(
        self, bootstrap: BootstrapConfig, params: FleetParams, algo_knobs: Sequence[AlgoKnob] = ()
    ) -> None:
        if params.algorithm is EpAlgorithm.LOW_LATENCY and (
            params.token_hidden_size not in NCCL_EP_LL_HIDDEN_SIZES
        ):
            supported = ", ".join(str(h) for h in NCCL_EP_LL_HIDDEN_SIZES)
            raise MoEEpConfigError(
                "nccl_ep low-latency does not support token_hidden_size="
                f"{params.token_hidden_size}. Its kernels are instantiated only for: "
                f"{supported}"
            )
        if params.num_experts % bootstrap.world_size != 0:
            raise MoEEpConfigError(
                f"num_experts={params.num_experts} is not divisible by "
                f"world_size={bootstrap.world_size}"
            )
        if (
            params.algorithm is EpAlgorithm.HIGH_THROUGHPUT
            and params.max_tokens_per_rank > HT_MAX_SUPPORTED_TOKENS_PER_RANK
        ):
            params = FleetParams(
                num_experts=params.num_experts,
                max_tokens_per_rank=HT_MAX_SUPPORTED_TOKENS_PER_RANK,
                token_hidden_size=params.token_hidden_size,
                dtype_bytes=params.dtype_bytes,
                algorithm=params.algorithm,
                layout=params.layout,
            )
        self.knobs = _index_knobs(algo_knobs)
        ft = self.knobs.get(FleetAlgoKnobFaultTolerance)
        self._ft = ft if (ft is not None and ft.enabled) else None  # type: ignore[attr-defined]
        if self._ft is not None and params.algorithm is not EpAlgorithm.LOW_LATENCY:
            raise MoEEpConfigError(
                "FleetAlgoKnobFaultTolerance is supported only with "
                "EpAlgorithm.LOW_LATENCY on nccl_ep."
            )
        self._params = params
        self._bootstrap = bootstrap
        group = bootstrap.process_group
        self._group: FakeGroup | None = group if isinstance(group, FakeGroup) else None
        if self._group is not None and self._group.world_size != bootstrap.world_size:
            raise ValueError(
                f"FakeGroup has {self._group.world_size} ranks, bootstrap {bootstrap.world_size}"
            )
        # This fleet's position in this rank's fleet-creation sequence on the group: the
        # peer fleet it pairs with is the one created at the same position.
        self.index = self._group.register_fleet(bootstrap.rank) if self._group is not None else 0
        # The fake's "GPU": the CUDA device the bootstrap names where CUDA is usable,
        # else the CPU (unit tests). Tensors handed to NCCL-EP must live there.
        self.device = (
            torch.device("cuda", bootstrap.device or 0)
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._rounds = itertools.count()
        self._destroyed = False
        self._any_handle_created = False
        self._ids = itertools.count()  # handle creation indexes (Handle.id), per fleet
        self._hot: dict[str, torch.Tensor] = {}
        self.log: list[Call] = []
        self.ft_log: list[str] = []
        self.handles: list[Handle] = []
        self.handles_created = 0
        # FT state: a fleet-owned mask buffer (1 = active), returned as-is like
        # NcclEpFleet.query_active_mask, and the pinned host "async error" flag.
        self._mask = torch.full((bootstrap.world_size,), ACTIVE, dtype=torch.int32)
        self._async_error = False
        self._ft_epoch = 0  # generation of the applied mask (same on every survivor)

    # ------------------------------------------------------------ properties
    @property
    def params(self) -> FleetParams:
        return self._params

    @property
    def bootstrap(self) -> BootstrapConfig:
        return self._bootstrap

    @property
    def stream(self) -> int:
        return self._bootstrap.stream

    @property
    def num_local_experts(self) -> int:
        return self._params.num_experts // self._bootstrap.world_size

    @property
    def handles_alive(self) -> int:
        return sum(1 for h in self.handles if not h.destroyed)

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    def calls(self, op: str | None = None) -> list[Call]:
        return [c for c in self.log if op is None or c.op == op]

    # ------------------------------------------------------------ handles
    def create_handle(self, params: HandleParams, algo_knobs: Sequence[AlgoKnob] = ()) -> Handle:
        self._check_alive()
        if _capturing():
            raise RuntimeError(
                "create_handle: NCCL-EP handle creation allocates and must run outside "
                "CUDA-graph capture (nccl_ep.h: all Handles must be created before the "
                "beginning of the CUDA graph capture)."
            )
        self._any_handle_created = True
        handle = Handle(self, next(self._ids), params, algo_knobs)
        self.handles.append(handle)
        self.handles_created += 1
        return handle

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        self.log.append(Call("fleet_destroy", None, None))

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("Fleet used after destroy()")

    def _exchange(self, op: str, payload: Any) -> list[Any]:
        """This collective's payloads of every rank (world 1: just ours). Every rank must
        name the same op, fleet and, for a handle's collective (`op` a `HandleOp`), the
        same handle and token count."""
        if self._bootstrap.world_size == 1:
            return [payload]
        if self._group is None:
            raise NotImplementedError(
                "the fake moves tokens between ranks only through a FakeGroup passed as "
                "BootstrapConfig.process_group (see tests/fakes/world.py)"
            )
        return self._group.exchange(
            self._bootstrap.rank,
            str(op),
            payload,
            fleet=self.index,
            handle=getattr(op, "handle", None),
            tokens=getattr(op, "tokens", None),
        )

    def _next_round(self) -> int:
        return next(self._rounds)

    def _require_on_device(self, what: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"{what} must be on the GPU ({self.device}), got {t.device}")

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        buf = self._hot.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self._hot[key] = buf
        return buf

    # ------------------------------------------------------- fault tolerance
    @property
    def supports_fault_tolerance(self) -> bool:
        return self._ft is not None

    @property
    def fault_tolerance_knob(self) -> FleetAlgoKnobFaultTolerance | None:
        return self._ft

    def _require_ft(self, op: str) -> None:
        if self._ft is None:
            raise MoEEpFaultToleranceUnsupportedError(
                f"Fleet.{op}() needs FleetAlgoKnobFaultTolerance at Fleet construction"
            )

    def query_active_mask(self, out: torch.Tensor | None = None) -> torch.Tensor:
        self._require_ft("query_active_mask")
        _reject_graph_capture("query_active_mask")
        self.ft_log.append("query_active_mask")
        return self._mask if out is None else out.copy_(self._mask)

    def query_fault(self) -> bool:
        self._require_ft("query_fault")
        _reject_graph_capture("query_fault")
        self.ft_log.append("query_fault")
        return self._async_error

    def set_active_mask(self, mask: Sequence[int] | torch.Tensor) -> None:
        self._require_ft("set_active_mask")
        _reject_graph_capture("set_active_mask")
        values = [int(v) for v in (mask.tolist() if isinstance(mask, torch.Tensor) else mask)]
        if len(values) != self._bootstrap.world_size:
            raise ValueError(
                f"mask has {len(values)} entries, expected {self._bootstrap.world_size}"
            )
        if values[self._bootstrap.rank] != ACTIVE:
            raise ValueError(
                f"rank {self._bootstrap.rank} cannot mask itself (mask[rank] must be 1)"
            )
        self.ft_log.append("set_active_mask")
        self._mask.copy_(torch.tensor([ACTIVE if v == ACTIVE else MASKED for v in values]))
        self._ft_epoch += 1

    def clear_faults(self, *, readmit: bool = False) -> None:
        """readmit=False: clear the async flag (local). readmit=True: ncclEpMaskClean, then
        the flag is cleared, like FlashInfer's pairing. The clean's barrier waits (up to the
        FT timeout) only for peers this rank does not mask, and then sets EVERY mask to
        active (nccl_ep.h: "sets all masks to active"), a dead or absent peer's too: who
        really took part is for `reconcile_active_mask` to find out."""
        self._require_ft("clear_faults")
        if readmit:
            _reject_graph_capture("clear_faults")
            self._check_alive()
            if not self._any_handle_created:
                raise RuntimeError(
                    "clear_faults(readmit=True) requires at least one handle to have been "
                    "created on this Fleet."
                )
            rank, world = self._bootstrap.rank, self._bootstrap.world_size
            if world > 1:
                key = ("mask_clean", self.index, self._ft_epoch)
                unmasked = [r for r, v in enumerate(self._mask.tolist()) if v == ACTIVE]
                self._survivors().post(key, rank, None)
                timeout_s = (self._ft.timeout_ms or 100_000) / 1000  # 0: NCCL-EP's ~100 s
                self._survivors().collect(key, [r for r in unmasked if r != rank], timeout_s)
            self._mask.fill_(ACTIVE)
            self._ft_epoch += 1
        self.ft_log.append(f"clear_faults(readmit={readmit})")
        self._async_error = False

    def reconcile_active_mask(self, *, timeout_s: float | None = None) -> torch.Tensor:
        """Survivors agree one mask through a store (not a collective, which would hang on
        the rank being masked): each publishes its view, waits up to `timeout_s` for the
        peers it believes alive, ANDs what arrived and masks who did not; the lowest
        survivor's result is the one every rank applies. Raises MoEEpRankEvictedError
        when that result masks this rank, as FlashInfer does. Not modelled: a coordinator
        that dies mid-agreement (FlashInfer elects the next survivor; the fake raises)."""
        self._require_ft("reconcile_active_mask")
        _reject_graph_capture("reconcile_active_mask")
        rank, world = self._bootstrap.rank, self._bootstrap.world_size
        wait_s = self._ft.reconcile_timeout_s if timeout_s is None else timeout_s
        view = [ACTIVE if v == ACTIVE else MASKED for v in self._mask.tolist()]
        view[rank] = ACTIVE
        agreed = list(view)
        if world > 1:
            store, key = self._survivors(), ("reconcile", self.index, self._ft_epoch)
            store.post(key, rank, view)
            believed = [r for r in range(world) if view[r] == ACTIVE and r != rank]
            arrived = store.collect(key, believed, wait_s)
            for peer in believed:
                seen = arrived.get(peer)
                if seen is None:
                    agreed[peer] = MASKED
                else:
                    agreed = [ACTIVE if a == b == ACTIVE else MASKED for a, b in zip(agreed, seen)]
            agreed[rank] = ACTIVE
            coordinator = min(r for r in range(world) if agreed[r] == ACTIVE)
            decided = store.decide(("decision", *key), agreed, rank == coordinator, wait_s)
            if decided[rank] != ACTIVE:
                raise MoEEpRankEvictedError(
                    f"rank {rank} was masked out by its peers during mask reconciliation "
                    f"(epoch {self._ft_epoch}); the agreed mask is {decided}."
                )
            agreed = list(decided)
        self.set_active_mask(agreed)
        return torch.tensor(agreed, dtype=torch.int32)

    def _survivors(self) -> FakeGroup:
        if self._group is None:
            raise NotImplementedError(
                "the fake's fault tolerance across ranks needs a FakeGroup passed as "
                "BootstrapConfig.process_group (see tests/fakes/world.py)"
            )
        return self._group

    # Test hooks (what NCCL-EP's kernels would do when a peer times out).
    def mask_rank(self, rank: int) -> None:
        """A peer timed out: NCCL-EP masks it in the device mask (in place)."""
        if rank == self._bootstrap.rank:
            raise ValueError("a rank never masks itself")
        self._mask[rank] = MASKED

    def raise_fault_flag(self) -> None:
        """NCCL-EP set its pinned host async-error flag."""
        self._async_error = True

    def kill_peer(self, rank: int) -> None:
        """A peer died: this rank's kernels time out on it (masked, flag raised). The dead
        rank's thread must take part in nothing any more (return from its rank function)."""
        self.mask_rank(rank)
        self.raise_fault_flag()


# ------------------------------------------------------------------- N ranks, one process
class HandleOp(str):
    """A handle's collective: compares and prints as its op name (so code that checks
    `op == "combine"` is unaffected) and carries the handle's creation index on its fleet
    and its token count, which every rank's call must match."""

    handle: int
    tokens: int

    def __new__(cls, name: str, handle: int, tokens: int) -> HandleOp:
        op = super().__new__(cls, name)
        op.handle, op.tokens = handle, tokens
        return op


class Collective(NamedTuple):
    """What one rank says a collective is; every rank's must be equal for it to pair."""

    op: str
    fleet: int | None = None  # the fleet's creation index on the group
    handle: int | None = None  # the handle's creation index on its fleet
    tokens: int | None = None  # the handle's token count

    def describe(self) -> str:
        where = ""
        if self.handle is not None:
            where = f" on handle {self.handle} of fleet {self.fleet}"
        elif self.fleet is not None:
            where = f" on fleet {self.fleet}"
        size = f" with {self.tokens} tokens" if self.tokens is not None else ""
        return f"{self.op}{where}{size}"


_FIELD_NAMES = {
    "op": "the op",
    "fleet": "the fleet (creation index on the group)",
    "handle": "the handle (creation index on its fleet)",
    "tokens": "the token count",
}


def _disagreement(keys: list[Collective]) -> str:
    """The error every rank raises when `keys` (one per rank) do not all match."""
    by_key: dict[Collective, list[int]] = {}
    for rank, key in enumerate(keys):
        by_key.setdefault(key, []).append(rank)
    views = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {key.describe()}"
        for key, ranks in by_key.items()
    )
    differ = [
        name for field, name in _FIELD_NAMES.items() if len({getattr(k, field) for k in keys}) > 1
    ]
    return (
        f"fake NCCL-EP: the EP ranks disagree on the collective ({views}); they differ in "
        f"{' and '.join(differ)}. NCCL-EP itself checks none of this: it would pair these "
        "calls anyway (a hang or garbage)."
    )


class FakeGroup:
    """One EP group of `world_size` ranks simulated in one process, one thread per rank.

    Pass it as `BootstrapConfig(process_group=...)` to every rank's fleet; each rank's
    package code runs on its own thread (see `tests/fakes/world.py`). Every collective
    (create_handle, update, dispatch, combine, ...) publishes this rank's payload and
    waits for all ranks, so tokens really move between ranks. Each rank also publishes
    what it believes the collective is (`Collective`: op, fleet, handle, token count):
    a rank that skips, reorders or mis-pairs a collective (another handle, another size)
    is caught on every rank, instead of deadlocking or exchanging garbage as NCCL-EP would.
    """

    def __init__(self, world_size: int, timeout_s: float = 30.0) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * world_size
        self._fleets_created = [0] * world_size
        # Fault tolerance's survivors-only rendezvous: a store of posted values (the
        # rendezvous store the real fleet uses), where a missing key means a gone rank.
        self._posted: dict[tuple, Any] = {}
        self._posted_changed = threading.Condition()

    def post(self, key: tuple, rank: int, value: Any) -> None:
        with self._posted_changed:
            self._posted[(*key, rank)] = value
            self._posted_changed.notify_all()

    def collect(self, key: tuple, ranks: Sequence[int], timeout_s: float) -> dict[int, Any]:
        """What `ranks` posted under `key` within `timeout_s` (a rank missing then is gone)."""
        with self._posted_changed:
            self._posted_changed.wait_for(
                lambda: all((*key, r) in self._posted for r in ranks), timeout_s
            )
            return {r: self._posted[(*key, r)] for r in ranks if (*key, r) in self._posted}

    def decide(self, key: tuple, proposal: Any, propose: bool, timeout_s: float) -> Any:
        """One value for `key`: the first proposal posted wins; the others wait for it."""
        with self._posted_changed:
            if propose:
                self._posted.setdefault(key, proposal)
                self._posted_changed.notify_all()
            if not self._posted_changed.wait_for(lambda: key in self._posted, timeout_s):
                raise RuntimeError(f"no decision for {key} within {timeout_s} s")
            return self._posted[key]

    def register_fleet(self, rank: int) -> int:
        """The creation index of `rank`'s next fleet on this group (0, 1, ...)."""
        index = self._fleets_created[rank]
        self._fleets_created[rank] += 1
        return index

    def exchange(
        self,
        rank: int,
        op: str,
        payload: Any,
        *,
        fleet: int | None = None,
        handle: int | None = None,
        tokens: int | None = None,
    ) -> list[Any]:
        """All ranks' payloads of this collective, in rank order. Raises RuntimeError on
        every rank unless every rank named the same op, fleet, handle and token count."""
        if self.world_size == 1:
            return [payload]
        self._slots[rank] = (Collective(op, fleet, handle, tokens), payload)
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        keys = [key for key, _ in got]
        if any(key != keys[0] for key in keys[1:]):
            raise RuntimeError(_disagreement(keys))
        return [p for _, p in got]


def _row_order(n: int, seed: int) -> torch.Tensor:
    """Arbitrary (seeded) order of received rows: NCCL-EP promises no row order."""
    if n <= 1:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- handle
class Handle:
    """Fake NcclEpHandle: fixed token count and top_k, weights bound at creation."""

    def __init__(
        self, fleet: FakeFleet, handle_id: int, params: HandleParams, algo_knobs: Sequence[AlgoKnob]
    ) -> None:
        self._fleet = fleet
        # The creation index on its fleet (0, 1, ...): with the fleet's index, the handle's
        # identity across ranks; it pairs with the peers' handle of the same index.
        self.id = handle_id
        self._retargeted = False  # updated at least once: a pooled handle (see _op)
        self.knobs = _index_knobs(algo_knobs)
        self.destroyed = False
        self._is_ht = fleet.params.algorithm is EpAlgorithm.HIGH_THROUGHPUT
        ids = params.topk_ids
        self._num_tokens = int(ids.shape[0])
        self._top_k = int(ids.shape[1])
        tw = self.knobs.get(HandleAlgoKnobTopKWeights)
        # Bound, not copied: NCCL-EP reads this memory at every dispatch/combine.
        self.bound_weights: torch.Tensor | None = tw.weights if tw is not None else None  # type: ignore[attr-defined]
        if self.bound_weights is not None:
            fleet._require_on_device("HandleAlgoKnobTopKWeights.weights", self.bound_weights)
            _require_contiguous("HandleAlgoKnobTopKWeights.weights", self.bound_weights)
        self._recv_target: torch.Tensor | None = None
        knob = self.knobs.get(HandleAlgoKnobNumReceivedTokens)
        if knob is not None and self._is_ht:
            target = knob.target  # type: ignore[attr-defined]
            if target.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    "HandleAlgoKnobNumReceivedTokens.target must be int32 or int64, "
                    f"got {target.dtype}"
                )
            if target.numel() < 1:
                raise ValueError(
                    "HandleAlgoKnobNumReceivedTokens.target must have >= 1 element, "
                    f"got shape {tuple(target.shape)}"
                )
            self._recv_target = target
        # create_handle = InitHandle + UpdateHandle; like NcclEpHandle, creation does not
        # count as the "eager update" that allows a later captured one.
        self._ran_outside_capture = False
        self._dispatched = False
        # What runtime/fp8_wire.py reads of FlashInfer's NcclEpHandle, with the same
        # meaning (the nccl.ep handle and module underneath, the stream, the counts).
        from tests.fakes import fake_nccl_ep

        self._ep = fake_nccl_ep
        self._handle = fake_nccl_ep.NativeHandle(self)
        self._is_rank_major = False
        self._staged = False
        self._stream = 0  # the fleet's stream, FlashInfer's op stream outside capture
        self._recv_count_t = fleet._buffer(
            "ll_recv_count", (fleet.num_local_experts,), torch.int32, fleet.device
        )
        fleet._require_on_device("topk_ids", ids)
        self._bind(_as_int64(ids), "create_handle")
        fleet.log.append(Call("create_handle", self.id, self._num_tokens))

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def _num_tokens_in(self) -> int:
        return self._num_tokens

    def _wrap(self, t: torch.Tensor) -> Any:
        return self._ep.Tensor(t)

    def _op_stream(self) -> int:
        """Like NcclEpHandle._op_stream: the handle's own stream (0) outside capture, the
        capturing stream under it (CAPTURE_STREAM stands for it here)."""
        return CAPTURE_STREAM if _capturing() else 0

    @property
    def top_k(self) -> int:
        return self._top_k

    # ----------------------------------------------------------------- update
    def update(self, params: HandleParams) -> None:
        self._check_alive("update")
        # Like NcclEpHandle.update: non-int64 ids are converted, so the handle then
        # holds a temporary copy, not the caller's tensor.
        ids = _as_int64(params.topk_ids)
        if ids.shape[1] != self._top_k:
            raise ValueError(
                "Handle.update cannot change top_k: handle was created with "
                f"top_k={self._top_k}, got {ids.shape[1]}. Create a new handle instead."
            )
        if ids.shape[0] != self._num_tokens:
            raise ValueError(
                "Handle.update cannot change the token count: handle was created with "
                f"{self._num_tokens} tokens, got {ids.shape[0]}. The topk_weights bound at "
                "creation (HandleAlgoKnobTopKWeights) still describe the original rows, so "
                "a different count would desynchronize combine. Create a new handle instead."
            )
        if ids.device != self._fleet.device:
            raise ValueError(
                f"Handle.update: topk_ids must be on the GPU, got {ids.device} "
                f"(the fake's GPU is {self._fleet.device})."
            )
        if not ids.is_contiguous():
            raise ValueError("Handle.update: topk_ids must be contiguous.")
        if _capturing():
            if not self._ran_outside_capture:
                raise RuntimeError(
                    "Handle.update: the first update on this handle cannot be the captured "
                    "one -- nothing inside a capture can order it after InitHandle. Run one "
                    "update outside the capture first (the standard warmup does this), having "
                    "synchronized before capture began (torch.cuda.graph does this for you)."
                )
        else:
            self._ran_outside_capture = True
        self._native_update(ids)

    def _native_update(self, ids: torch.Tensor) -> None:
        """ncclEpUpdateHandle: FlashInfer's update after its checks, or a direct call."""
        self._retargeted = True
        self._bind(ids, "update")
        self._dispatched = False
        self._fleet.log.append(Call("update", self.id, self._num_tokens))

    def _bind(self, ids: torch.Tensor, op: str) -> None:
        # The tensor the handle holds (tests check its identity) and the routing the
        # native metadata step computed from it at this point in stream order. The
        # metadata step is collective: HT learns how many rows it will receive.
        self.bound_ids = ids
        self._routing = ids.clone()
        everyone = self._fleet._exchange(self._op(op), self._routing)
        if self._recv_target is not None:
            received = sum(int(self._mine(r).any(dim=1).sum()) for r in everyone)
            self._recv_target.fill_(received)

    # --------------------------------------------------------------- dispatch
    def dispatch(self, params: DispatchInputParams) -> DispatchOutput:
        self._check_alive("dispatch")
        x = params.x[0]
        if x.shape[0] != self._num_tokens:
            raise MoEEpConfigError(
                f"dispatch received {x.shape[0]} activation rows but the handle's routing "
                f"has {self._num_tokens}. Pass the same token count as the topk_ids this "
                "handle was created with or last updated to."
            )
        max_per_rank = self._fleet.params.max_tokens_per_rank
        if x.shape[0] > max_per_rank:
            algo = "HT" if self._is_ht else "LL"
            raise MoEEpConfigError(
                f"nccl_ep {algo} dispatch received {x.shape[0]} tokens on this rank, "
                f"exceeding max_tokens_per_rank ({max_per_rank})."
            )
        # NCCL-EP reads rows by pointer: a strided tensor would be read as garbage.
        _require_contiguous("dispatch x", x)
        self._fleet._require_on_device("dispatch x", x)
        weights = self._require_weights("NCCL-EP dispatch reads the weights bound at creation")
        return self._send(x, weights)

    def _send(self, x: torch.Tensor, weights: torch.Tensor) -> DispatchOutput:
        """The collective under every dispatch: x's rows (any dtype) and `weights` (what
        HT's forward pass carries along) to the ranks holding their experts."""
        sent = (x.clone(), self._routing, weights.to(torch.float32).clone())
        everyone = self._fleet._exchange(self._op("dispatch"), sent)
        self._round = self._fleet._next_round()
        out = self._dispatch_ht(x, everyone) if self._is_ht else self._dispatch_ll(x, everyone)
        self._dispatched = True
        self._fleet.log.append(Call("dispatch", self.id, self._num_tokens))
        return out

    def _mine(self, routing: torch.Tensor) -> torch.Tensor:
        """Slots of `routing` whose expert lives on this rank."""
        e_local = self._fleet.num_local_experts
        first = self._fleet.bootstrap.rank * e_local
        return (routing >= first) & (routing < first + e_local)

    def _dispatch_ll(self, x: torch.Tensor, everyone: list) -> DispatchOutput:
        e_local = self._fleet.num_local_experts
        first = self._fleet.bootstrap.rank * e_local
        rows = self._fleet.params.max_tokens_per_rank * self._fleet.bootstrap.world_size
        out = self._fleet._buffer("ll_recv_buf", (e_local, rows, x.shape[1]), x.dtype, x.device)
        counts = self._fleet._buffer("ll_recv_count", (e_local,), torch.int32, x.device)
        out.fill_(float("nan"))  # padding is garbage in NCCL-EP; make reading it visible
        # (source rank, token, slot) -> (local expert, row) of every slot routed here.
        placed: dict[tuple[int, int, int], tuple[int, int]] = {}
        for e in range(e_local):
            sources = []
            for src, (_, routing, _) in enumerate(everyone):
                tok, slot = (routing == first + e).nonzero(as_tuple=True)
                sources += [(src, int(t), int(k)) for t, k in zip(tok.tolist(), slot.tolist())]
            order = _row_order(len(sources), self._round * 1000 + e)
            for row, i in enumerate(order.tolist()):
                src, t, k = sources[i]
                out[e, row] = everyone[src][0][t]
                placed[(src, t, k)] = (e, row)
            counts[e] = len(sources)
        self._placed = placed
        return DispatchOutput(expert_tensors=out, num_tokens=rows, expert_counts=counts)

    def _dispatch_ht(self, x: torch.Tensor, everyone: list) -> DispatchOutput:
        world = self._fleet.bootstrap.world_size
        max_per_rank = self._fleet.params.max_tokens_per_rank
        num_recv = max_per_rank * world
        h = x.shape[1]
        e_local = self._fleet.num_local_experts
        first = self._fleet.bootstrap.rank * e_local
        out_t = self._fleet._buffer("ht_recv_x", (num_recv, h), x.dtype, x.device)
        out_w = self._fleet._buffer("ht_recv_w", (num_recv, self._top_k), torch.float32, x.device)
        out_idx = self._fleet._buffer("ht_recv_idx", (num_recv, self._top_k), torch.int64, x.device)
        out_t.fill_(float("nan"))
        out_w.fill_(float("nan"))
        out_idx.fill_(-(2**40))
        received: list[tuple[int, int]] = []
        for src, (_, routing, _) in enumerate(everyone):
            tokens = self._mine(routing).any(dim=1).nonzero().flatten().tolist()
            received += [(src, t) for t in tokens]
        order = _row_order(len(received), self._round)
        received = [received[i] for i in order.tolist()]
        for row, (src, t) in enumerate(received):
            xs, routing, w = everyone[src]
            here = self._mine(routing[t])
            out_t[row] = xs[t]
            out_idx[row] = torch.where(here, routing[t] - first, torch.full_like(routing[t], -1))
            out_w[row] = w[t]
        self._received = received
        return DispatchOutput(
            expert_tensors=out_t.view(world, max_per_rank, h),
            num_tokens=num_recv,
            recv_topk_idx=out_idx,
            recv_topk_weights=out_w,
            recv_total_counter=self._recv_target,
        )

    # ---------------------------------------------------------------- combine
    def combine(self, params: CombineInputParams) -> CombineOutput:
        x = params.x[0]
        out = params.out
        if out is None:
            hidden = self._fleet.params.token_hidden_size
            out = torch.empty(self._num_tokens, hidden, dtype=x.dtype, device=x.device)
        weights = None
        if not self._is_ht:
            weights = self._require_weights(
                "NCCL EP LL needs per-token weights to reweight on combine"
            )
        return CombineOutput(x=self._combine(x, out, weights))

    def _combine(
        self, x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        """ncclEpCombine into `out`; LL weights each slot by `weights` (read now, like the
        native combine), which FlashInfer passes from the knob bound at creation."""
        self._check_alive("combine")
        if not self._dispatched:
            raise RuntimeError("Handle.combine called before dispatch on this routing")
        hidden = self._fleet.params.token_hidden_size
        _require_contiguous("combine x", x)
        if tuple(out.shape) != (self._num_tokens, hidden):
            raise ValueError(
                f"combine out has shape {tuple(out.shape)}, expected {(self._num_tokens, hidden)}"
            )
        # The kernel writes x's element type into out's memory: no conversion.
        if out.dtype != x.dtype:
            raise ValueError(f"combine out has dtype {out.dtype}, the expert output {x.dtype}")
        _require_contiguous("combine out", out)
        self._fleet._require_on_device("combine out", out)
        rank = self._fleet.bootstrap.rank
        acc = torch.zeros(self._num_tokens, hidden, dtype=torch.float32, device=x.device)
        if self._is_ht:
            x2d = x.reshape(-1, hidden)
            sent = (x2d[: len(self._received)].clone(), self._received)
            everyone = self._fleet._exchange(self._op("combine"), sent)
            for rows, received in everyone:
                for row, (src, t) in enumerate(received):
                    if src == rank:
                        acc[t] += rows[row].float()
        else:
            assert weights is not None
            e_local = self._fleet.num_local_experts
            rows = self._fleet.params.max_tokens_per_rank * self._fleet.bootstrap.world_size
            if tuple(x.shape) != (e_local, rows, hidden):
                raise ValueError(
                    f"LL combine input has shape {tuple(x.shape)}, expected {(e_local, rows, hidden)}"
                )
            sent = (x.clone(), self._placed)
            everyone = self._fleet._exchange(self._op("combine"), sent)
            # Read the bound weights NOW (like the native combine), not at creation.
            w = weights.to(torch.float32)
            routing = self._routing
            for t in range(self._num_tokens):
                for k in range(self._top_k):
                    owner = int(routing[t, k]) // e_local
                    expert_out, placed = everyone[owner]
                    e, row = placed[(rank, t, k)]
                    acc[t] += w[t, k] * expert_out[e, row].float()
        out.copy_(acc.to(out.dtype))
        self._fleet.log.append(Call("combine", self.id, self._num_tokens))
        return out

    def complete(self) -> None:
        """No-op, like NcclEpHandle.complete in non-staged mode."""

    def destroy(self) -> None:
        if self.destroyed:
            return
        self.destroyed = True
        self._fleet.log.append(Call("destroy", self.id, self._num_tokens))

    # ---------------------------------------------------------------- helpers
    def _op(self, name: str) -> HandleOp:
        """This handle's collective `name`, carrying what the peers' must match.

        The token count is compared for handles re-targeted with `update` only: those are
        the package's pooled handles, which every rank runs at one agreed size (the
        received-rows experts bound their work by it). A per-forward handle (created,
        used once, destroyed) carries each rank's own count, which NCCL-EP pairs: each
        rank's `topk_idx` is its own [num_tokens, top_k], bounded by the fleet's
        max_dispatch_tokens_per_rank only (nccl_ep.h)."""
        return HandleOp(name, self.id, self._num_tokens if self._retargeted else None)

    def _check_alive(self, op: str) -> None:
        if self.destroyed:
            raise RuntimeError(f"Handle.{op}() called on a destroyed handle (id {self.id})")
        self._fleet._check_alive()

    def _require_weights(self, why: str) -> torch.Tensor:
        if self.bound_weights is None:
            raise ValueError(
                f"NcclEpHandle requires HandleAlgoKnobTopKWeights set at handle creation ({why})."
            )
        return self.bound_weights


def _as_int64(ids: torch.Tensor) -> torch.Tensor:
    return ids if ids.dtype == torch.int64 else ids.to(torch.int64)


def _require_contiguous(what: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{what} must be contiguous (NCCL-EP reads it by pointer; strides {t.stride()} "
            "would be read as garbage)"
        )


# ---------------------------------------------------------------------- factories
_FLEET_REGISTRY = {"nccl_ep": FakeFleet}


def create_fleet(
    bootstrap: BootstrapConfig,
    params: FleetParams,
    algo_knobs: Sequence[AlgoKnob] = (),
    backend: str | object = "nccl_ep",
) -> FakeFleet:
    name = getattr(backend, "backend_name", backend)
    if not isinstance(name, str):
        raise TypeError(
            f"backend must be a string or have a .backend_name str attr; got {backend!r}"
        )
    if name not in _FLEET_REGISTRY:
        raise KeyError(f"unknown backend {name!r}; available: {sorted(_FLEET_REGISTRY)}")
    return _FLEET_REGISTRY[name](bootstrap, params, algo_knobs)


def supports_fault_tolerance(backend: str) -> bool:
    return backend == "nccl_ep"


def available_backends() -> list[str]:
    return sorted(_FLEET_REGISTRY)
