"""Everything the package reads of FlashInfer's internals: one table, one check.

FlashInfer's public API cannot pass NCCL-EP a quantization recipe (the FP8 wire), and its
handle methods cost more host time than the nccl.ep calls (the direct eager rounds), so
both read private attributes of `NcclEpHandle`, each a row of `INTERNALS`. Per-round reads
stay plain attribute reads (`read_in`); tests/unit/test_flashinfer_internals.py fails on
an unlisted read or an unread row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

READ_FROM = "flashinfer-python 0.7.2.post1"
HANDLE_OWNER = "NcclEpHandle"  # flashinfer/moe_ep/backends/split/comm/nccl_ep/handle.py
HANDLE_MODULE = "flashinfer.moe_ep.backends.split.comm.nccl_ep.handle"

ATTRIBUTE, MODULE = "attribute", "module"

PER_ROUND = (
    "on every round that makes the call: an accessor or a getattr by name would add a call "
    "per read to rounds that are host-bound when eager; check() has verified the attribute "
    "before the first such call (native_reason)"
)


@dataclass(frozen=True)
class Internal:
    """One thing the package reads of FlashInfer's internals."""

    name: str  # the attribute name, or the module path (MODULE)
    kind: str  # ATTRIBUTE | MODULE
    owner: str  # what holds it
    what: str
    why: str
    upstream: str  # the public accessor in flashinfer.moe_ep that would remove the read
    accessor: str | None = None  # the function of this module that reads it, if any
    read_in: tuple[str, ...] = ()  # modules that read it in place (per round)
    in_place: str = ""  # why those reads are not behind an accessor
    read_from: str = READ_FROM

    @property
    def how(self) -> str:
        places = []
        if self.accessor:
            places.append(f"through flashinfer_internals.{self.accessor}() (not per round)")
        if self.read_in:
            modules = ", ".join(m.rpartition(".")[2] + ".py" for m in self.read_in)
            places.append(f"in place in {modules} ({self.in_place})")
        return "read " + "; and ".join(places)

    def entry(self) -> str:
        target = f"{self.owner}.{self.name}" if self.kind == ATTRIBUTE else self.name
        return (
            f"flashinfer:{self.name} [{self.read_from}] {self.kind} {target}\n"
            f"  What: {self.what}\n  Why: {self.why}\n  How: {self.how}\n"
            f"  Upstream fix: {self.upstream}\n  Removal: when FlashInfer offers it"
        )


_NATIVE = "vllm_flashinfer_ep.runtime.native_handle"
_FP8 = "vllm_flashinfer_ep.runtime.fp8_wire"
_DIRECT = (
    "the direct eager rounds (native_handle.py) and the FP8 wire (fp8_wire.py) issue "
    "nccl.ep calls on it"
)


def _attr(name: str, **fields: Any) -> Internal:
    return Internal(name, ATTRIBUTE, HANDLE_OWNER, **fields)


# The order native_handle's check reports them in.
INTERNALS: tuple[Internal, ...] = (
    _attr(
        "_handle",
        what="the nccl.ep Handle under FlashInfer's (update, dispatch, complete, combine)",
        why=_DIRECT,
        upstream="a public NcclEpHandle.native_handle, or FlashInfer's dispatch taking a "
        "quantization recipe and its handle methods costing what the nccl.ep calls cost",
        read_in=(_NATIVE, _FP8),
        in_place=PER_ROUND,
    ),
    _attr(
        "_ep",
        what="the nccl.ep module FlashInfer drives (descriptor types, the recipe enum)",
        why="the direct calls build their descriptors with the module the handle was made "
        "with; the FP8 wire checks it has the recipe",
        upstream="a public NcclEpHandle.nccl_ep (NcclEpFleet.nccl_ep is public; a handle "
        "does not expose its fleet)",
        accessor="nccl_ep_of",
        read_in=(_NATIVE, _FP8),
        in_place=PER_ROUND,
    ),
    _attr(
        "_wrap",
        what="FlashInfer's address-keyed nccl.ep tensor-descriptor memo (a method)",
        why="the LL FP8 dispatch wraps its input as FlashInfer's own dispatch does",
        upstream="FlashInfer's dispatch taking a quantization recipe",
        read_in=(_FP8,),
        in_place=PER_ROUND,
    ),
    _attr(
        "_op_stream",
        what="the stream FlashInfer issues on (a method: the capturing stream under capture)",
        why="the FP8 dispatch is issued, and captured, where FlashInfer's own would be",
        upstream="a public NcclEpHandle.op_stream(), or the recipe in FlashInfer's dispatch",
        read_in=(_FP8,),
        in_place=PER_ROUND,
    ),
    _attr(
        "_stream",
        what="the handle's own stream (FlashInfer's op stream outside capture)",
        why="the direct eager calls issue on the pool's stream, so only on a handle whose "
        "own stream it is",
        upstream="a public NcclEpHandle.stream (NcclEpFleet.stream is public)",
        accessor="handle_stream",
    ),
    _attr(
        "_recv_count_t",
        what="the per-local-expert received counts NCCL-EP writes at dispatch",
        why="the LL FP8 dispatch points NCCL-EP at the counters FlashInfer's dispatch uses, "
        "which the experts read",
        upstream="a public NcclEpHandle.expert_counts, or the recipe in FlashInfer's dispatch",
        read_in=(_FP8,),
        in_place=PER_ROUND,
    ),
    _attr(
        "_num_tokens_in",
        what="the token count the handle's routing holds (update rebinds it)",
        why="the FP8 dispatches refuse activations of another row count before NCCL-EP, "
        "which does not check",
        upstream="a public NcclEpHandle.num_tokens, or the recipe in FlashInfer's dispatch",
        read_in=(_FP8,),
        in_place=PER_ROUND,
    ),
    _attr(
        "_is_ht",
        what="the algorithm the handle runs (HT or LL)",
        why="the direct calls are written for LL, the FP8 forward recipe for HT",
        upstream="a public NcclEpHandle.algorithm (the fleet's params are public; a handle "
        "does not expose its fleet)",
        accessor="is_ht",
    ),
    _attr(
        "_is_rank_major",
        what="whether an LL handle uses the rank-major layout",
        why="the direct calls are written for the expert-major layout",
        upstream="a public NcclEpHandle.layout",
        accessor="is_rank_major",
    ),
    _attr(
        "_staged",
        what="whether the handle splits send and complete (HandleAlgoKnobSplitOperation)",
        why="the direct calls complete every dispatch themselves",
        upstream="a public NcclEpHandle.staged",
        accessor="is_staged",
    ),
    Internal(
        HANDLE_MODULE,
        MODULE,
        "flashinfer.moe_ep",
        what=f"{HANDLE_OWNER}, to ask whether it has update()",
        why="whether handles can be re-targeted inside captured forwards decides, at config "
        "time, before any fleet exists, whether a handle pool backs CUDA graphs",
        upstream=f"{HANDLE_OWNER} (or a capability flag) exported by flashinfer.moe_ep",
        accessor="handle_class",
    ),
)

BY_NAME: dict[str, Internal] = {row.name: row for row in INTERNALS}
HANDLE_ATTRIBUTES: tuple[str, ...] = tuple(
    row.name for row in INTERNALS if row.kind == ATTRIBUTE and row.owner == HANDLE_OWNER
)


def missing(handle: Any) -> list[str]:
    return [name for name in HANDLE_ATTRIBUTES if not hasattr(handle, name)]


def check(handle: Any) -> str | None:
    """Why the package cannot read what it needs of `handle` (None: it can)."""
    lacking = missing(handle)
    if lacking:
        return (
            f"the installed FlashInfer's handle ({type(handle).__name__}) lacks {lacking}; "
            f"the direct nccl.ep calls are written against {READ_FROM}"
        )
    return None


def index() -> str:
    return "\n".join(row.entry() for row in INTERNALS)


# Each reads its row of INTERNALS, once per handle or at config time, never per round.


def nccl_ep_of(handle: Any) -> Any:
    return handle._ep


def handle_stream(handle: Any) -> int:
    return handle._stream


def is_ht(handle: Any) -> bool:
    return handle._is_ht


def is_rank_major(handle: Any) -> bool:
    return handle._is_rank_major


def is_staged(handle: Any) -> bool:
    return handle._staged


def handle_class() -> type | None:
    """None: not importable."""
    try:
        module = importlib.import_module(HANDLE_MODULE)
    except Exception:  # noqa: BLE001 - any import failure means "no such class"
        return None
    return getattr(module, HANDLE_OWNER, None)
