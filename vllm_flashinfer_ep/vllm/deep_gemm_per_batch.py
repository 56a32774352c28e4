"""Block-FP8 LL layers on DeepGEMM: each forward takes DeepGEMM or the received rows.

Why: `--moe-backend auto` gives 128x128 block-FP8 LL layers vLLM's
`BatchedDeepGemmExperts` on Hopper, the fastest experts from a few rows per expert up; at
a fraction of a row per expert the received-rows Triton experts
(vllm/compact_experts_fp8.py) can be faster, as DeepGEMM's tile is sized for
`expected_m` rows per expert. A forward whose rows per expert (the busiest sender's
tokens x senders x top_k / global experts) are at most
VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS (default 4) runs the received rows, any other
DeepGEMM. The default is where the FP8 experts probe's `received_rows` and `deep_gemm_dp`
columns cross at Qwen3-30B-A3B's shape (DeepGEMM at the `expected_m` data parallel ranks
give it, not world 1's whole buffer); the engine benchmark measured the choice faster at
1-32 tokens (docs/benchmarks.md).

Both read vLLM's DeepGEMM weights (on Hopper FP32 block scales in their usual layout) and
quantize the intermediate with vLLM's E8M0 choice; they differ as two FP8 kernels do
(summation order; DeepGEMM's fused activation skips a BF16 rounding), and the GPU tests
hold both to vLLM's batched Triton experts. The LL prepare hands row-major scales (the
wire's, or its own after receive); this wrapper re-lays them MN-major, the rows the round
can have filled, for the DeepGEMM call only. The choice is made on the host per forward:
a captured graph keeps its size's.

The wrapper is an instance patch (`PATCH`, vllm/patches/_helper.py) over
vllm/deep_gemm_warmup.py's, applied to each DeepGEMM experts object by the LL
prepare/finalize's setup hook (`install`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.vllm import compact_experts, deep_gemm_experts, fp8_experts_choice
from vllm_flashinfer_ep.vllm.batched_tiles import APPLY_PARAMS, leave_to_vllm, named_args
from vllm_flashinfer_ep.vllm.deep_gemm_warmup import TARGET
from vllm_flashinfer_ep.vllm.patches._helper import (
    INSTANCE,
    Patch,
    PatchTargetError,
    apply_instance,
)

logger = get_logger(__name__)

# The average rows per expert up to which a forward takes the received rows (0: DeepGEMM
# for every forward); None: the package's VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS, read
# when a layer is set up. Tests set it.
RECEIVED_ROWS_UP_TO: float | None = None
_logged = False


def bound() -> float:
    """The rows per expert up to which a forward runs the received rows, as set up now."""
    return envs.deep_gemm_received_rows() if RECEIVED_ROWS_UP_TO is None else RECEIVED_ROWS_UP_TO


def takes_received_rows(tokens_across: int, top_k: int, global_experts: int, up_to: float) -> bool:
    """Whether a forward of `tokens_across` tokens over all ranks runs the received rows:
    its average rows per expert, tokens x top_k / experts, at most `up_to`."""
    return up_to > 0 and global_experts > 0 and tokens_across * top_k <= up_to * global_experts


def tokens_across(fused_experts: Any, kw: dict, sent_per_rank: int | None) -> int:
    """The most tokens this forward can carry over all ranks: the busiest sender's count
    (compact_experts.senders_tokens) times the senders."""
    senders = fused_experts.num_dispatchers
    capacity = fused_experts.max_num_tokens or kw["hidden_states"].shape[1]
    tokens = compact_experts.senders_tokens(
        kw["topk_ids"].shape[0], senders, capacity, sent_per_rank
    )
    return tokens * senders


def _per_batch_apply(
    fused_experts: Any,
    inner: Callable[..., Any],
    sent_per_rank: Callable[[], int | None] | None,
    up_to: float,
) -> Callable[..., Any]:
    """`fused_experts.apply` choosing per forward between the received rows (at most
    `up_to` rows per expert) and `inner` (DeepGEMM through vLLM's apply), handing the
    latter MN-major scales."""

    def apply(*args: Any, **kw: Any) -> Any:
        kw = named_args(args, kw)
        sent = sent_per_rank() if sent_per_rank else None
        if (
            up_to > 0  # off: no token count to look up per layer
            and compact_experts.ENABLED
            and takes_received_rows(
                tokens_across(fused_experts, kw, sent),
                kw["topk_ids"].shape[1],
                kw["global_num_experts"],
                up_to,
            )
            and compact_experts.eligible(fused_experts, kw)
        ):
            return compact_experts.compact_apply(fused_experts, kw, sent)
        scales = kw["a1q_scale"]
        if scales is not None and scales.dim() == 3:  # [experts, rows, groups]
            rows = None if sent is None else sent * fused_experts.num_dispatchers
            kw["a1q_scale"] = deep_gemm_experts.mn_major(scales, rows)
        return inner(**kw)

    return apply


PATCH = Patch(
    "deep_gemm_per_batch",
    "worker",
    TARGET,
    INSTANCE,
    _per_batch_apply,
    APPLY_PARAMS,
    what="LL batched DeepGEMM experts: small forwards run the received-rows Triton experts "
    "(VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS), the others DeepGEMM with its activation "
    "scales MN-major",
    why="DeepGEMM reads MN-major scales (the FP8 wire gives row-major ones) and, at a "
    "fraction of a row per expert, costs more than the received rows (docs/benchmarks.md)",
    how="per experts object, from the LL prepare/finalize's post_init_setup, over "
    "deep_gemm_warmup: wrap its apply; the received rows (vllm/compact_experts.py) when "
    "the forward's rows per expert are at most the bound, else the scales re-laid for the "
    "rows the round can have filled and vLLM's apply",
    upstream="DeepGEMM experts taking row-major scales without a copy of the whole buffer, "
    "and a small-batch kernel in vLLM's batched DeepGEMM experts",
    removal="then",
)


def install(fused_experts: Any, sent_per_rank: Callable[[], int | None] | None = None) -> bool:
    """Make `fused_experts` (vLLM's BatchedDeepGemmExperts) choose per forward and get its
    scales MN-major. `sent_per_rank()`: see compact_experts.senders_tokens. Returns
    whether it now does (False: not such an object, or its `apply` is not vLLM 0.33.0's,
    logged: DeepGEMM then re-lays the row-major scales itself, every row of the buffer)."""
    up_to = bound()
    try:
        if not apply_instance(PATCH, fused_experts, sent_per_rank, up_to):
            return False
    except PatchTargetError as error:
        return leave_to_vllm(error, "the scale layout and every forward's experts kernel")
    global _logged
    if not _logged:  # the bound these layers were set up with (tests may override it)
        _logged = True
        logger.info(
            "flashinfer_ep_low_latency: block-FP8 layers on DeepGEMM: %s",
            fp8_experts_choice.small_forwards_note(up_to),
        )
    return True
