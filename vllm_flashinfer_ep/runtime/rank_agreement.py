"""EP ranks that must build the same transport, compared before they pair collectives.

Every rank of an EP group builds its own config (one vLLM process per DP rank; under an
external load balancer or across nodes each from its own command line and environment),
and the LL capacity depends on each GPU's memory. Ranks that built different capacities,
pool sizes or library versions would pair collectives that do not match: garbage or a
hang inside NCCL-EP. `require_same` exchanges each rank's view once, over the EP CPU
group (runtime/exchange.py: bounded by the package's deadline), and every rank raises the
same error naming the item, the ranks and the flag or variable that sets it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Any

from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.exchange import Exchange

LIBRARIES = (
    "vllm",
    "flashinfer-python",
    "nccl-extensions",
    "nccl4py",
    "nvidia-nccl-cu13",
    "vllm-flashinfer-ep",
)
GENERIC_FIX = (
    "Every EP rank must run the same vLLM arguments, the same VLLM_FLASHINFER_EP_* variables "
    "and the same library versions on GPUs with the same memory"
)


class RankMismatchError(FlashInferEPConfigError):
    """EP ranks would pair collectives built from different settings."""


def require_same(
    exchange: Exchange,
    items: Mapping[str, Any],
    *,
    what: str = "load check",
    fixes: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Raise RankMismatchError on every rank unless every rank holds equal `items`;
    returns every rank's items (rank order).

    `fixes[item]`: what sets the item (a flag or variable), named in the error."""
    everyone = exchange(dict(items), what)
    check_same(everyone, what=what, fixes=fixes)
    return everyone


def check_same(
    everyone: list[Mapping[str, Any]],
    *,
    what: str,
    fixes: Mapping[str, str] | None = None,
    keys: Iterable[str] | None = None,
) -> None:
    """The comparison of `require_same` on payloads already exchanged (`keys`: only
    these items; default: every item any rank sent)."""
    if keys is None:
        keys = dict.fromkeys(k for rank_items in everyone for k in rank_items)
    for key in keys:
        values = [rank_items.get(key, "<not set on this rank>") for rank_items in everyone]
        if all(v == values[0] for v in values[1:]):
            continue
        by_value: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            by_value.setdefault(repr(value), []).append(rank)
        views = "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())
        fix = (fixes or {}).get(key)
        set_by = f" It is set by {fix}." if fix else ""
        raise RankMismatchError(
            f"flashinfer_ep: the EP ranks disagree on the {key} ({views}), found at the "
            f"{what}.{set_by} {GENERIC_FIX}; make the listed ranks agree."
        )


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries whose collectives must match across ranks."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
