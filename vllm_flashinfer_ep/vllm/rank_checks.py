"""What the EP ranks of one manager compare before they pair collectives, and when.

- At a runtime's build (model load): what shapes its fleet, pool and capture
  (`load_items`), before the fleet and handles are created.
- At every MoE layer's build: the layer's quantization and whether this rank can send
  FP8 on the wire (`fp8_wire`), one exchange per layer on every rank, BF16 layers too:
  a rank that skipped it would leave the others waiting.
- When the outermost capture phase opens: the capture plan (`open_capture_phase`),
  before any handle is created in it; then the counts the plan adds are pooled on every
  rank alike.
- In the capture phase, at the first MoE layer of every eager warm-up forward: its
  agreed token count (`capture_checked`), so a rank that warms up another count than
  its peers stops by name instead of pairing a handle of another size.

Every exchange is one bounded collective (runtime/exchange.py); a difference is one
RankMismatchError on every rank, naming the ranks, the item and what sets it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime import capture, rank_agreement
from vllm_flashinfer_ep.runtime.exchange import Exchange
from vllm_flashinfer_ep.vllm import capture_plan

logger = get_logger(__name__)

LOAD_FIXES = {
    "fleet shape (algorithm, experts, hidden size, top_k)": (
        "the model (--model, --hf-overrides, --revision) and --all2all-backend"
    ),
    "fleet capacity (tokens per rank)": (
        "--max-num-batched-tokens (config time lowers it to fit each GPU's memory)"
    ),
    "fault tolerance": "--enable-fault-tolerance",
    "pooled token counts": (
        "--compilation-config cudagraph_capture_sizes, --max-num-batched-tokens and "
        f"{envs.HANDLE_POOL}"
    ),
    "package variables": "the VLLM_FLASHINFER_EP_* variables",
    "library versions": "the installed packages (pip install the same versions)",
    "speculative tokens": "--speculative-config num_speculative_tokens",
    "max_num_seqs": "--max-num-seqs",
    "CUDA-graph mode": "--compilation-config cudagraph_mode (-cc.cudagraph_mode), --enforce-eager",
    "CUDA-graph capture sizes": (
        "--compilation-config cudagraph_capture_sizes / max_cudagraph_capture_size"
    ),
    "LoRA capture cases": (
        "--enable-lora, --max-loras, --compilation-config cudagraph_specialize_lora"
    ),
}
LAYER_QUANTIZATION = "MoE layer quantization"
FP8_WIRE = "FP8 on the wire"  # combined (every rank can), not compared
LAYER_FIXES = {
    LAYER_QUANTIZATION: "the checkpoint's quantization_config and --quantization",
}
WARMUP_COUNT = "token count of a capture warm-up forward"
WARMUP_FIXES = {WARMUP_COUNT: capture_plan.FIXES["MoE token counts in capture order"]}


def load_items(
    vllm_config: Any, fleet: tuple, capacity: int, fault_tolerance: bool, sizes: list[int]
) -> dict[str, Any]:
    """What shapes a runtime's collectives, as this rank sees it at model load."""
    comp = getattr(vllm_config, "compilation_config", None)
    sched = getattr(vllm_config, "scheduler_config", None)
    mode = getattr(comp, "cudagraph_mode", None)
    return {
        "fleet shape (algorithm, experts, hidden size, top_k)": fleet,
        "fleet capacity (tokens per rank)": capacity,
        "fault tolerance": fault_tolerance,
        "pooled token counts": sizes,
        "package variables": envs.settings(),
        "library versions": rank_agreement.library_versions(),
        "speculative tokens": int(getattr(vllm_config, "num_speculative_tokens", 0) or 0),
        "max_num_seqs": getattr(sched, "max_num_seqs", None),
        "CUDA-graph mode": getattr(mode, "name", mode),
        "CUDA-graph capture sizes": sorted(getattr(comp, "cudagraph_capture_sizes", None) or []),
        "LoRA capture cases": capture_plan.lora_capture_cases(vllm_config),
    }


def layer_quantization(quant_config: Any) -> str:
    """A layer's quantization as the EP ranks compare it ("none" for BF16 layers)."""
    if quant_config is None or getattr(quant_config, "quant_dtype", None) is None:
        return "none"
    return (
        f"{quant_config.quant_dtype}, block {getattr(quant_config, 'block_shape', None)}, "
        f"per-token {getattr(quant_config, 'per_act_token_quant', None)}"
    )


class RankChecks:
    """One manager's cross-rank checks over its exchange (None: a single EP rank)."""

    def __init__(self, exchange: Exchange | None, vllm_config: Any) -> None:
        self.exchange = exchange
        self.vllm_config = vllm_config
        self._warmup: Any = None  # the forward whose first MoE layer was checked

    def load(self, items: dict[str, Any]) -> None:
        if self.exchange is not None:
            rank_agreement.require_same(self.exchange, items, what="load check", fixes=LOAD_FIXES)

    def fp8_wire(self, quant_config: Any, can: bool) -> bool:
        """True on every rank iff every rank can send this layer FP8 on the wire; the
        layer's quantization must be the same on every rank."""
        if self.exchange is None:
            return can
        what = "FP8 wire decision of a MoE layer"
        everyone = self.exchange(
            {LAYER_QUANTIZATION: layer_quantization(quant_config), FP8_WIRE: can}, what
        )
        rank_agreement.check_same(everyone, what=what, fixes=LAYER_FIXES, keys=LAYER_FIXES)
        return all(e.get(FP8_WIRE) is True for e in everyone)

    def open_capture_phase(self, pools: Iterable[Any]) -> list[int]:
        """The capture plan, agreed by every rank before any handle is created in the
        phase; then the counts it adds are pooled, on every rank in the same order.
        Returns the counts pooled now."""
        plan = capture_plan.plan_of(self.vllm_config)
        pools = list(pools)
        if self.exchange is not None:
            items = dict(plan.items())
            for index, pool in enumerate(pools):
                items[f"pooled token counts of runtime {index}"] = pool.sizes
            fixes = dict(capture_plan.FIXES)
            fixes.update({k: LOAD_FIXES["pooled token counts"] for k in items if "pooled" in k})
            rank_agreement.require_same(
                self.exchange, items, what="capture plan (capture phase opening)", fixes=fixes
            )
        added: list[int] = []
        for pool in pools:
            planned = [c for c in plan.counts() if c not in pool.handles and c <= pool.capacity]
            if planned:
                pool.learn_planned(planned)
                added.extend(planned)
        return sorted(set(added))

    def capture_checked(self, agreement: Callable[[int], Any]) -> Callable[[int], Any]:
        """`agreement` whose result every rank compares at the first MoE layer of each
        eager warm-up forward of the capture phase (elsewhere: unchanged)."""
        if self.exchange is None:
            return agreement

        def agreed(num_tokens: int) -> Any:
            result = agreement(num_tokens)
            if capture.in_capture_phase() and not capture.is_capturing():
                self._check_warmup(result if isinstance(result, int) else num_tokens)
            return result

        return agreed

    def _check_warmup(self, count: int) -> None:
        forward = _current_forward()
        if forward is not None and self._warmup is not None and self._warmup() is forward:
            return  # a later layer of the forward already checked
        self._warmup = weakref.ref(forward) if forward is not None else (lambda: None)
        rank_agreement.require_same(
            self.exchange,
            {WARMUP_COUNT: count},
            what="capture warm-up forward",
            fixes=WARMUP_FIXES,
        )


def _current_forward() -> Any:
    """vLLM's forward context of the running forward (a new object per forward), or None."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:  # pragma: no cover - vLLM layout changed
        return None
    return get_forward_context() if is_forward_context_available() else None
