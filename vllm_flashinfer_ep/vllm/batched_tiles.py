"""The Triton tile of vLLM's batched experts under low latency, chosen per batch.

vLLM 0.33.0's `BatchedTritonExperts.apply` looks its tile up with
`try_get_optimal_moe_config(..., M=rows per expert buffer)`: the expert-major buffer's
row count (the LL capacity times the EP world, 256 by default), whatever the batch. Those
lookups go to the fused-MoE tuning tables, measured for a different kernel (tokens sorted
by expert) at M tokens. At a real model's shape the table entry for M=256 is a large tile
(H200, E=128, N=768: 32x256x128) that makes the batched kernel spill registers, and every
decode step pays for it although it carries a few rows per expert.

Here the tile is vLLM's generic rule (`get_default_config`) at M = the rows one expert can
receive in this forward (tokens on this rank times the EP world, at most the buffer's
rows): the tile vLLM would choose without tuning tables for a batch of that size. The
lookup runs in Python, so a captured CUDA graph keeps the tile of its own size.
A user's tuned tables (`VLLM_TUNED_CONFIG_FOLDER` holding a file for the shape) are left
in charge, and an explicit `override_config` still wins.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from vllm_flashinfer_ep.log import get_logger

logger = get_logger(__name__)

# vLLM 0.33.0's BatchedTritonExperts.apply parameters; the wrapper forwards them by name.
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


def matches_vllm_apply(fused_experts: Any, leaving: str) -> bool:
    """Whether the experts' `apply` has vLLM 0.33.0's parameters (the wrappers here and in
    compact_experts.py forward them by name); if not, log what is left to vLLM."""
    params = tuple(inspect.signature(type(fused_experts).apply).parameters)
    if params == APPLY_PARAMS:
        return True
    logger.warning(
        "flashinfer_ep: BatchedTritonExperts.apply has parameters %s, not vLLM 0.33.0's; "
        "leaving %s to vLLM",
        params,
        leaving,
    )
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


def install(fused_experts: Any) -> bool:
    """Make `fused_experts` (if it is vLLM's BatchedTritonExperts) pick its tile per batch.

    The most rows one local expert can receive in a forward: this rank's tokens (the
    routing handed to the experts; the LL prepare leaves it as the router made it) times
    the ranks that dispatch to it, at most the buffer's rows. Under CUDA graphs every
    rank runs the padded common count; in eager DP steps with uneven counts a rank with
    fewer tokens picks a smaller tile than the busiest sender would (speed only: the
    kernel masks by the received counts). Returns whether the instance now chooses.
    """
    from vllm.model_executor.layers.fused_moe import get_config, override_config
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        BatchedTritonExperts,
    )

    if not ENABLED or not isinstance(fused_experts, BatchedTritonExperts):
        return False
    if getattr(fused_experts.apply, "_flashinfer_ep_tiles", False):
        return True  # already wrapped (the setup hook ran again)
    if not matches_vllm_apply(fused_experts, "its tile choice"):
        return False
    original = fused_experts.apply
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

    apply._flashinfer_ep_tiles = True  # type: ignore[attr-defined]
    fused_experts.apply = apply
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
