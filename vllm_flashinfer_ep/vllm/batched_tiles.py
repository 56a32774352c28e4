"""The Triton tile of vLLM's batched experts under low latency, chosen per batch.

vLLM 0.33.0's `BatchedTritonExperts.apply` looks its tile up with
`try_get_optimal_moe_config(..., M=rows per expert buffer)`: the expert-major buffer's
row count (the LL capacity times the EP world, 256 by default), whatever the batch. Those
lookups go to the fused-MoE tuning tables, measured for a different kernel (tokens sorted
by expert) at M tokens. At a real model's shape the table entry for M=256 can be a large
tile that makes the batched kernel spill registers (docs/benchmarks.md, "Why the experts
were the bottleneck"), and every decode step pays for it although it carries a few rows
per expert.

Here the tile is vLLM's generic rule (`get_default_config`) at M = the rows one expert can
receive in this forward (tokens on this rank times the EP world, at most the buffer's
rows): the tile vLLM would choose without tuning tables for a batch of that size. The
lookup runs in Python, so a captured CUDA graph keeps the tile of its own size.
A user's tuned tables (`VLLM_TUNED_CONFIG_FOLDER` holding a file for the shape) are left
in charge, and an explicit `override_config` still wins.

The wrapper is an instance patch (`PATCH`, vllm/patches/_helper.py): applied per
experts object by the LL prepare/finalize's setup hook (`install`), checked against vLLM
0.33.0's `apply` parameters first, recorded, and undoable; `patches.index()` lists it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.vllm.patches._helper import (
    INSTANCE,
    Patch,
    PatchTargetError,
    apply_instance,
)

logger = get_logger(__name__)

# What the instance patches here and in compact_experts.py replace.
TARGET = "vllm.model_executor.layers.fused_moe.experts.fused_batched_moe:BatchedTritonExperts.apply"
# vLLM 0.33.0's BatchedTritonExperts.apply parameters; the wrappers forward them by name, so
# the patches' check (`expect`) requires exactly these.
APPLY_PARAMS = (
    "self",
    "output",
    "hidden_states",
    "w1",
    "w2",
    "topk_weights",
    "topk_ids",
    "activation",
    "global_num_experts",
    "expert_map",
    "a1q_scale",
    "a2_scale",
    "workspace13",
    "workspace2",
    "expert_tokens_meta",
    "apply_router_weight_on_input",
)
ENABLED = True  # the test harness turns it off to measure vLLM's own lookup
_logged = False


def leave_to_vllm(error: PatchTargetError, leaving: str) -> bool:
    """Log an experts object the instance patch refused (another `apply` than vLLM
    0.33.0's) and what stays vLLM's; False, for `install` to return."""
    logger.warning("flashinfer_ep: %s; leaving %s to vLLM", error, leaving)
    return False


def named_args(args: tuple, kw: dict) -> dict:
    """A wrapped `apply` call's arguments by name (vLLM passes some positionally)."""
    kw.update(zip(APPLY_PARAMS[1:], args))
    return kw


@functools.lru_cache(maxsize=128)
def tile_for_rows(
    rows: int,
    w1_shape: tuple[int, ...],
    w2_shape: tuple[int, ...],
    top_k: int,
    dtype: str | None,
    block_shape: tuple[int, ...] | None,
) -> dict[str, int]:
    """vLLM's generic tile for a batch whose experts receive at most `rows` rows."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_default_config

    experts, _, n = w2_shape
    block = None if block_shape is None else list(block_shape)
    return get_default_config(max(1, rows), experts, n, w1_shape[2], top_k, dtype, block)


def _user_tables(experts: int, n: int, dtype: str | None, block: tuple[int, ...] | None) -> bool:
    """Whether vLLM would read a table for this shape from VLLM_TUNED_CONFIG_FOLDER
    (its `get_moe_configs`: the folder is used whenever the variable is set)."""
    folder = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    if folder is None:
        return False
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name

    block_shape = [block[0], block[1]] if block and block[0] and block[1] else None
    return os.path.exists(
        os.path.join(folder, get_config_file_name(experts, n, dtype, block_shape))
    )


def _tiled_apply(fused_experts: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """`fused_experts.apply` choosing its tile per batch, around `original` (the instance
    patch's replacement)."""
    from vllm.model_executor.layers.fused_moe import get_config, override_config

    checked: dict[tuple, bool] = {}

    def apply(*args: Any, **kw: Any) -> Any:
        kw = named_args(args, kw)
        w1, w2, hidden = kw["w1"], kw["w2"], kw["hidden_states"]
        dtype = fused_experts.quant_config.config_name(hidden.dtype)
        block = None if fused_experts.block_shape is None else tuple(fused_experts.block_shape)
        key = (tuple(w2.shape), dtype, block)
        if key not in checked:
            checked[key] = _user_tables(w2.shape[0], w2.shape[2], dtype, block)
            if checked[key]:
                logger.info(
                    "flashinfer_ep: batched experts use the tuned tables in "
                    "VLLM_TUNED_CONFIG_FOLDER for E=%d, N=%d",
                    w2.shape[0],
                    w2.shape[2],
                )
        if checked[key] or get_config():  # vLLM ignores an empty override too
            return original(**kw)
        rows = min(kw["topk_ids"].shape[0] * fused_experts.num_dispatchers, hidden.shape[1])
        tile = tile_for_rows(
            rows, tuple(w1.shape), tuple(w2.shape), kw["topk_ids"].shape[1], dtype, block
        )
        # vLLM's override_config has no try/finally: a `with` block would leave the tile
        # in place after an exception; resuming the generator by hand always restores.
        scope = override_config(tile)
        scope.__enter__()
        try:
            return original(**kw)
        finally:
            scope.__exit__(None, None, None)

    return apply


PATCH = Patch(
    "batched_tiles",
    "worker",
    TARGET,
    INSTANCE,
    _tiled_apply,
    APPLY_PARAMS,
    what="LL batched Triton experts choose their tile per batch",
    why="vLLM looks the tile up at the expert buffer's rows (LL capacity x EP world), "
    "whatever the batch: a tile that spills registers at real shapes (docs/benchmarks.md)",
    how="per experts object, from the LL prepare/finalize's post_init_setup: wrap its "
    "apply; vLLM's generic tile at the rows an expert can receive, through override_config",
    upstream="BatchedTritonExperts choosing its tile from the rows it can receive in the "
    "forward, not the buffer's size",
    removal="then",
)


def install(fused_experts: Any) -> bool:
    """Make `fused_experts` (if it is vLLM's BatchedTritonExperts) pick its tile per batch.

    The most rows one local expert can receive in a forward: this rank's tokens (the
    routing handed to the experts; the LL prepare leaves it as the router made it) times
    the ranks that dispatch to it, at most the buffer's rows. Under CUDA graphs every
    rank runs the padded common count; in eager DP steps with uneven counts a rank with
    fewer tokens picks a smaller tile than the busiest sender would (speed only: the
    kernel masks by the received counts). Returns whether the instance now chooses
    (applying `PATCH` again is a no-op: the setup hook may run twice).
    """
    if not ENABLED:
        return False
    try:
        if not apply_instance(PATCH, fused_experts):
            return False  # not a BatchedTritonExperts
    except PatchTargetError as error:
        return leave_to_vllm(error, "its tile choice")
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "flashinfer_ep_low_latency: the batched experts' Triton tile is chosen per batch "
            "(vLLM's generic rule at the rows an expert can receive in the forward), not from "
            "the fused-MoE tables at the %d-row buffer size",
            fused_experts.max_num_tokens,
        )
    return True
