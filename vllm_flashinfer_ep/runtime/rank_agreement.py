"""EP ranks that must build the same transport, compared before they pair collectives.

Every rank of an EP group builds its own config (one vLLM process per DP rank; under an
external load balancer or across nodes each from its own command line and environment),
and the LL capacity depends on each GPU's memory. Ranks that built different capacities,
pool sizes or library versions would pair collectives that do not match: garbage or a
hang inside NCCL-EP. `require_same` exchanges each rank's view once, over the EP CPU
group, and every rank raises the same error naming the item and the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

from vllm_flashinfer_ep.errors import FlashInferEPConfigError

# This rank's payload in, every rank's payload out (rank order): one collective.
Exchange = Callable[[Any], list[Any]]

LIBRARIES = (
    "vllm",
    "flashinfer-python",
    "nccl-extensions",
    "nvidia-nccl-cu13",
    "vllm-flashinfer-ep",
)


class RankMismatchError(FlashInferEPConfigError):
    """EP ranks would pair collectives built from different settings."""


def require_same(exchange: Exchange, items: Mapping[str, Any]) -> None:
    """Raise RankMismatchError on every rank unless every rank holds equal `items`."""
    everyone = exchange(dict(items))
    keys = list(dict.fromkeys(k for rank_items in everyone for k in rank_items))
    for key in keys:
        values = [rank_items.get(key, "<not set on this rank>") for rank_items in everyone]
        if all(v == values[0] for v in values[1:]):
            continue
        by_value: dict[str, list[int]] = {}
        for rank, value in enumerate(values):
            by_value.setdefault(repr(value), []).append(rank)
        views = "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())
        raise RankMismatchError(
            f"flashinfer_ep: the EP ranks disagree on the {key} ({views}). Every EP rank must "
            "run the same vLLM arguments, the same VLLM_FLASHINFER_EP_* variables and the "
            "same library versions on GPUs with the same memory; make the listed ranks agree."
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


def torch_exchange(cpu_group: Any) -> Exchange:
    """An Exchange over a torch.distributed (gloo) group."""

    def exchange(payload: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(cpu_group)
        dist.all_gather_object(out, payload, group=cpu_group)
        return out

    return exchange


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
