"""An LL MoE forward longer than the fleet's round capacity, run as several rounds.

LL's buffers grow with the tokens one round carries (experts x tokens x hidden per GPU),
and the step budget sets how many prompt tokens a step prefills. Split into rounds of at
most the capacity, a forward no longer needs buffers for the whole budget: served, the
scheduler can take the budget vLLM gives an engine without EP while the buffers keep a
decode-sized capacity. Every EP rank runs the same rounds: the largest rank's count for
the forward (vLLM's DP metadata), cut at the capacity; a rank whose tokens end before a
round sends one zero-weight row in it. Captured forwards are never split (config time
keeps the capacity at or above the largest capture size).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_flashinfer_ep.runtime.round_plan import LOCAL, over_capacity

StepAgreement = Callable[[int], "int | str | None"]
# vLLM's FusedMoEKernel.apply bound to one kernel, called by name (its routing arguments
# come in another order than its implementation's); what it returns passes through
Apply = Callable[..., Any]


class RoundSplit:
    """How an LL prepare/finalize's forwards split: rounds of at most `capacity` tokens.

    Set on the prepare/finalize by the manager (VLLM_FLASHINFER_EP_LL_ROUND_TOKENS); the
    patch table's `round_split` row runs every kernel whose prepare/finalize carries one
    through `run`."""

    def __init__(
        self,
        capacity: int,
        world_size: int,
        step_agreement: StepAgreement,
        counters: Any = None,
    ) -> None:
        """`step_agreement(num_tokens)`: the forward's count agreed by every EP rank
        (vllm/forward_state.py), without the capacity. `counters`: the pool's
        (runtime/handle_pool.PoolCounters): MoE layer forwards split."""
        self.capacity = capacity
        self._world_size = world_size
        self._step_agreement = step_agreement
        self._counters = counters

    def _total(self, num_tokens: int) -> int:
        """The largest EP rank's tokens in this forward; this rank's own where every rank
        runs its own count (one rank). Without an agreed count several ranks cannot cut the
        same rounds: refused above the capacity, before any collective."""
        agreed = self._step_agreement(num_tokens)
        if agreed is not None and agreed != LOCAL:
            return int(agreed)
        if num_tokens > self.capacity and self._world_size > 1:
            raise over_capacity(num_tokens, self.capacity, "this rank, with no count agreed")
        return num_tokens

    def run(
        self,
        apply: Apply,
        prepare_finalize: Any,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        **kwargs: Any,
    ) -> Any:
        """`apply` on the whole forward (its result as it returns it), or once per round
        above the capacity, each round under the count every rank agreed for it
        (`prepare_finalize.agreed_as`), the rounds' outputs joined in order."""
        total = self._total(hidden_states.shape[0])
        if total <= self.capacity:
            return apply(
                hidden_states=hidden_states,
                w1=w1,
                w2=w2,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                **kwargs,
            )
        if self._counters is not None:
            self._counters.split_forwards += 1
        shared_input = kwargs.get("shared_experts_input")
        outputs, out = [], None
        for start in range(0, total, self.capacity):
            count = min(self.capacity, total - start)  # the largest rank's tokens in this round
            rows = slice(start, start + self.capacity)  # this rank's rows, to its own end
            x, ids, weights = hidden_states[rows], topk_ids[rows], topk_weights[rows]
            real = x.shape[0] > 0
            if not real:  # this rank's tokens ended: one zero-weight row keeps it in the round
                x, ids, weights = _placeholder(hidden_states, topk_ids, topk_weights)
            if shared_input is not None:
                kwargs["shared_experts_input"] = shared_input[rows] if real else x
            with prepare_finalize.agreed_as(count):
                out = apply(
                    hidden_states=x, w1=w1, w2=w2, topk_weights=weights, topk_ids=ids, **kwargs
                )
            if real:
                outputs.append(out)
        return torch.cat(outputs) if outputs else out[:0]


def _placeholder(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row of zeros routed to the first top_k experts with weight 0 (its output is
    dropped): vLLM's modular kernel takes no empty forward."""
    top_k = topk_ids.shape[1]
    x = hidden_states.new_zeros((1, hidden_states.shape[1]))
    ids = torch.arange(top_k, dtype=topk_ids.dtype, device=topk_ids.device).unsqueeze(0)
    return x, ids, topk_weights.new_zeros((1, top_k))
