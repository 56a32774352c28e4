"""DeepGEMM's masked GEMMs compiled at load for every tile data parallel forwards ask for.

Why: vLLM 0.33.0's `BatchedDeepGemmExperts` hands DeepGEMM an `expected_m` estimated for
each forward from the DP metadata (every rank's tokens x top_k / experts, rounded up to
16, clamped to [16, rows per expert]); DeepGEMM picks its tile from it and compiles a
kernel (NVCC) the first time it meets a tile. vLLM's own DeepGEMM warm-up covers linear
layers and contiguous grouped GEMMs, not the masked ones. Without DP metadata (data
parallel size 1) `expected_m` is always the rows per expert, which the profile run
compiles; with it, an eager step (a prefill, every step under `--enforce-eager`) whose
token count crosses into a new tile would make every rank compile inside the MoE layer,
between dispatch and combine, while serving.

Here the first eager call with DP metadata (vLLM's profile run, at load) runs vLLM's own
`apply` once per value `expected_m` can take, up to the largest a forward can give
(`largest_estimate`), with every received count at zero: no row is computed, each tile
compiles. Those compiles run inside the profile run's round, as vLLM's first call's do,
so the other ranks wait for the slowest: docs/backends.md says to keep DeepGEMM's JIT
cache alike on every node. Once per weight shape and process; `VLLM_DEEP_GEMM_WARMUP=skip`
turns it off with vLLM's warm-up; a failed warm-up is logged and vLLM's call still runs.

The wrapper is an instance patch (`PATCH`, vllm/patches/_helper.py), applied to each
DeepGEMM experts object by the LL prepare/finalize's setup hook (`install`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import is_capturing
from vllm_flashinfer_ep.vllm.batched_tiles import APPLY_PARAMS, leave_to_vllm, named_args
from vllm_flashinfer_ep.vllm.patches._helper import (
    INSTANCE,
    Patch,
    PatchTargetError,
    apply_instance,
)

logger = get_logger(__name__)

TARGET = (
    "vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe:"
    "BatchedDeepGemmExperts.apply"
)
STEP = 16  # vLLM's estimate rounds up to multiples of 16 and never goes below 16
_warmed: set[tuple] = set()  # weight shapes whose tiles this process compiled


def dp_estimate(tokens: int, top_k: int, global_experts: int, rows_per_expert: int) -> int:
    """The `expected_m` vLLM 0.33.0's `estimate_expected_m` gives when the DP metadata
    holds `tokens` over all ranks (vLLM's rounding and clamps; no experts: the rows)."""
    from vllm.utils.math_utils import round_up  # the rounding vLLM's estimate applies

    if global_experts <= 0:
        return rows_per_expert
    estimate = round_up(tokens * top_k // global_experts, STEP)
    return min(rows_per_expert, max(STEP, estimate))


def largest_estimate(rows_per_expert: int, top_k: int, global_experts: int) -> int:
    """The largest `expected_m` a forward can give: the DP metadata holds at most the
    buffer's rows in tokens over all ranks (each rank sends at most its capacity; the
    buffer holds capacity x ranks rows per expert)."""
    return dp_estimate(rows_per_expert, top_k, global_experts, rows_per_expert)


def expected_m_values(rows_per_expert: int, bound: int | None = None) -> list[int]:
    """Every `expected_m` vLLM 0.33.0's `BatchedDeepGemmExperts.estimate_expected_m` can
    return for a buffer of `rows_per_expert` rows per expert, up to `bound` (the largest a
    forward can give, `largest_estimate`; None: no bound)."""
    top = rows_per_expert if bound is None else min(bound, rows_per_expert)
    return sorted(set(range(STEP, top + 1, STEP)) | {top})


def _skipped_by_user() -> bool:
    import vllm.envs as envs

    return envs.VLLM_DEEP_GEMM_WARMUP == "skip"


def _dp_metadata_present() -> bool:
    """Whether this forward carries DP metadata (data parallel ranks), from which vLLM
    estimates `expected_m` per forward."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().dp_metadata is not None


@contextlib.contextmanager
def fixed_expected_m(fused_experts: Any, m: int) -> Iterator[None]:
    """Inside, `fused_experts.estimate_expected_m` gives `m`; afterwards it is the object's
    own again, whatever happens."""
    had_own = "estimate_expected_m" in vars(fused_experts)
    own = vars(fused_experts).get("estimate_expected_m")
    fused_experts.estimate_expected_m = lambda *_, **__: m
    try:
        yield
    finally:
        if had_own:
            fused_experts.estimate_expected_m = own
        else:
            del fused_experts.estimate_expected_m


def warm(fused_experts: Any, original: Callable[..., Any], kw: dict) -> int:
    """Run `original` (vLLM's apply) once per `expected_m` value with zero received rows;
    returns how many runs."""
    meta = kw["expert_tokens_meta"]
    empty = dataclasses.replace(
        meta,
        expert_num_tokens=meta.expert_num_tokens.new_zeros(meta.expert_num_tokens.shape),
        expert_num_tokens_cpu=None,
    )
    rows = kw["hidden_states"].shape[1]
    bound = largest_estimate(rows, kw["topk_ids"].shape[1], kw["global_num_experts"])
    values = expected_m_values(rows, bound)
    for m in values:
        with fixed_expected_m(fused_experts, m):
            original(**{**kw, "expert_tokens_meta": empty})
    return len(values)


def _warm_logged(fused_experts: Any, original: Callable[..., Any], kw: dict) -> None:
    """`warm`, unless the user skips DeepGEMM's warm-up; what happened, logged (a failure
    too: vLLM's own call runs after it either way)."""
    if _skipped_by_user():
        logger.info(
            "flashinfer_ep_low_latency: VLLM_DEEP_GEMM_WARMUP=skip: DeepGEMM's masked "
            "GEMM tiles compile when a forward first needs them, while serving"
        )
        return
    start = time.monotonic()
    try:
        runs = warm(fused_experts, original, kw)
    except Exception as exc:  # noqa: BLE001 - vLLM's own call still runs
        logger.warning(
            "flashinfer_ep_low_latency: warming DeepGEMM's masked GEMM tiles failed (%s: %s); "
            "they compile when first needed",
            type(exc).__name__,
            exc,
        )
        return
    logger.info(
        "flashinfer_ep_low_latency: DeepGEMM's masked GEMM tiles warmed for %d expected_m "
        "values (w1 %s) in %.1f s",
        runs,
        tuple(kw["w1"].shape),
        time.monotonic() - start,
    )


def _warming_apply(fused_experts: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """`fused_experts.apply` that warms DeepGEMM's masked tiles on its first eager call
    with DP metadata, around `original` (the instance patch's replacement)."""

    def apply(*args: Any, **kw: Any) -> Any:
        kw = named_args(args, kw)
        key = (tuple(kw["w1"].shape), tuple(kw["w2"].shape), kw["hidden_states"].shape[1])
        if key not in _warmed and _dp_metadata_present() and not is_capturing():
            _warmed.add(key)
            _warm_logged(fused_experts, original, kw)
        return original(**kw)

    return apply


PATCH = Patch(
    "deep_gemm_masked_warmup",
    "worker",
    TARGET,
    INSTANCE,
    _warming_apply,
    APPLY_PARAMS,
    what="LL batched DeepGEMM experts compile every masked-GEMM tile a data parallel "
    "forward can ask for at load",
    why="vLLM estimates DeepGEMM's expected_m per forward from the DP metadata and its "
    "DeepGEMM warm-up skips masked GEMMs, so a new prefill size compiles with NVCC "
    "mid-serving on every rank, between dispatch and combine",
    how="per experts object, from the LL prepare/finalize's post_init_setup: wrap its "
    "apply; the first eager call with DP metadata runs vLLM's apply once per expected_m "
    "value (estimate_expected_m fixed on the object for that run, then restored) with "
    "zero received rows",
    upstream="masked grouped GEMMs in vLLM's DeepGEMM warm-up (deep_gemm_warmup.py)",
    removal="then",
)


def install(fused_experts: Any) -> bool:
    """Make `fused_experts` (vLLM's BatchedDeepGemmExperts) warm its masked tiles at load.
    Returns whether it now does (False: not such an object, or its `apply` is not vLLM
    0.33.0's, logged)."""
    try:
        return apply_instance(PATCH, fused_experts)
    except PatchTargetError as error:
        return leave_to_vllm(error, "DeepGEMM's masked GEMM compiles")


def reset() -> None:
    """Forget which shapes were warmed (tests)."""
    _warmed.clear()
