"""Block-FP8 LL layers on vLLM's `BatchedDeepGemmExperts`, with three additions:
- MN-major activation scales, as DeepGEMM reads them: the wire and the prepare give
  row-major ones, which DeepGEMM would transpose over the whole buffer (`mn_major`).
- masked GEMMs compiled for every `expected_m` a DP forward can ask for at the first eager
  forward with DP metadata (vLLM's warm-up skips masked GEMMs), so no rank compiles
  between dispatch and combine.
- small forwards on the received-rows experts, faster than DeepGEMM's `expected_m`-sized
  tile there: `ReceivedRowsOrDeepGemmExperts` (vLLM's FallbackExperts pattern).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
    BatchedDeepGemmExperts,
)
from vllm.model_executor.layers.fused_moe.experts.fallback import FallbackExperts

from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.experts.received_rows import (
    ReceivedRowsExperts,
    SentPerRank,
    senders_tokens,
)
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.capture import is_capturing
from vllm_flashinfer_ep.vllm.fp8_experts_choice import MOE_BACKEND, rows_reason

logger = get_logger(__name__)

# vLLM 0.33.0's experts `apply` parameters, in order (both classes forward them by name).
APPLY_PARAMS = tuple(
    "output hidden_states w1 w2 topk_weights topk_ids activation global_num_experts "
    "expert_map a1q_scale a2_scale workspace13 workspace2 expert_tokens_meta "
    "apply_router_weight_on_input".split()
)
STEP = 16  # vLLM's expected_m estimate rounds up to multiples of 16, never below 16
_warmed: set[tuple] = set()  # weight shapes whose masked tiles this process compiled


def mn_major(scales: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """[experts, T, groups] FP32 scales -> a new MN-major tensor (strides (T * groups, 1, T))
    of their first `rows` rows per expert (None: all); T % 128 == 0 keeps it TMA-aligned."""
    experts, total, groups = scales.shape
    shape, strides = (experts, total, groups), (total * groups, 1, total)
    out = torch.empty_strided(shape, strides, dtype=torch.float32, device=scales.device)
    rows = total if rows is None else max(0, min(rows, total))
    out[:, :rows].copy_(scales[:, :rows])
    return out


def dp_estimate(tokens: int, top_k: int, global_experts: int, rows_per_expert: int) -> int:
    """The `expected_m` vLLM 0.33.0's `estimate_expected_m` gives when the DP metadata
    holds `tokens` over all ranks (its rounding and clamps)."""
    if global_experts <= 0:
        return rows_per_expert
    estimate = -(-(tokens * top_k // global_experts) // STEP) * STEP
    return min(rows_per_expert, max(STEP, estimate))


def expected_m_values(rows_per_expert: int, top_k: int, global_experts: int) -> list[int]:
    """Every `expected_m` a forward can give: the DP metadata holds at most the buffer's
    rows in tokens over all ranks (each rank sends at most its capacity)."""
    top = dp_estimate(rows_per_expert, top_k, global_experts, rows_per_expert)
    return sorted(set(range(STEP, top + 1, STEP)) | {top})


class DeepGemmExperts(BatchedDeepGemmExperts):
    """vLLM's batched DeepGEMM experts, handed MN-major scales, their masked tiles warmed."""

    def __init__(
        self,
        moe_config: Any,
        quant_config: Any,
        max_num_tokens: int,
        num_dispatchers: int,
        *,
        sent_per_rank: SentPerRank | None = None,
    ) -> None:
        super().__init__(moe_config, quant_config, max_num_tokens, num_dispatchers)
        self._sent_per_rank = sent_per_rank
        self._fixed_m: int | None = None

    def estimate_expected_m(self, *args: Any, **kwargs: Any) -> int:
        if self._fixed_m is not None:  # a warm-up run
            return self._fixed_m
        return super().estimate_expected_m(*args, **kwargs)

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        if a1q_scale is not None and a1q_scale.dim() == 3:  # [experts, rows, groups]
            sent = self._sent_per_rank() if self._sent_per_rank is not None else None
            rows = None if sent is None else sent * self.num_dispatchers
            a1q_scale = mn_major(a1q_scale, rows)
        call = {name: value for name, value in locals().items() if name in APPLY_PARAMS}
        key = (tuple(w1.shape), tuple(w2.shape), hidden_states.shape[1])
        if key not in _warmed and _dp_metadata_present() and not is_capturing():
            _warmed.add(key)
            self._warm(call)
        super().apply(**call)

    def _warm(self, call: dict) -> None:
        """vLLM's apply once per `expected_m` with every count at zero (each tile compiles,
        no row is computed). A failure is logged: the forward's own call still runs."""
        import vllm.envs as vllm_envs

        if vllm_envs.VLLM_DEEP_GEMM_WARMUP == "skip":
            logger.info("VLLM_DEEP_GEMM_WARMUP=skip: DeepGEMM's masked tiles compile when needed")
            return
        meta = call["expert_tokens_meta"]
        counts = meta.expert_num_tokens
        empty = dataclasses.replace(
            meta, expert_num_tokens=counts.new_zeros(counts.shape), expert_num_tokens_cpu=None
        )
        values = expected_m_values(
            call["hidden_states"].shape[1], call["topk_ids"].shape[1], call["global_num_experts"]
        )
        start = time.monotonic()
        try:
            for m in values:
                self._fixed_m = m
                super().apply(**{**call, "expert_tokens_meta": empty})
        except Exception as exc:  # noqa: BLE001 - the forward's own call still runs
            logger.warning(
                "warming DeepGEMM's masked tiles failed (%s: %s)", type(exc).__name__, exc
            )
            return
        finally:
            self._fixed_m = None
        logger.info(
            "DeepGEMM's masked tiles warmed for %d expected_m values (w1 %s) in %.1f s",
            len(values),
            tuple(call["w1"].shape),
            time.monotonic() - start,
        )


def _dp_metadata_present() -> bool:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().dp_metadata is not None


def takes_received_rows(tokens_across: int, top_k: int, global_experts: int, up_to: float) -> bool:
    """Whether a forward of `tokens_across` tokens over all ranks runs the received rows:
    its average rows per expert, tokens x top_k / experts, at most `up_to` (0: never)."""
    return up_to > 0 and global_experts > 0 and tokens_across * top_k <= up_to * global_experts


class ReceivedRowsOrDeepGemmExperts(FallbackExperts):
    """DeepGEMM, with forwards of at most `received_rows_up_to` rows per expert on the
    received-rows experts. Both read the FP8 activations the prepare hands over."""

    def __init__(
        self,
        moe_config: Any,
        quant_config: Any,
        max_num_tokens: int,
        num_dispatchers: int,
        *,
        received_rows_up_to: float = 4.0,
        sent_per_rank: SentPerRank | None = None,
    ) -> None:
        # FallbackExperts.__init__ builds Standard-format experts; these are batched.
        mk.FusedMoEExpertsModular.__init__(
            self, moe_config, quant_config, max_num_tokens, num_dispatchers
        )
        if quant_config.w1_bias is not None or quant_config.w2_bias is not None:
            raise FlashInferEPConfigError(
                f"--moe-backend {MOE_BACKEND}: this layer has MoE expert biases, which vLLM's "
                "DeepGEMM experts drop. Pass --moe-backend triton (the received-rows experts "
                "apply them)."
            )
        reason = rows_reason(f"--moe-backend {MOE_BACKEND}", max_num_tokens, num_dispatchers)
        if reason is not None:
            raise FlashInferEPConfigError(reason)
        self.experts = DeepGemmExperts(
            moe_config, quant_config, max_num_tokens, num_dispatchers, sent_per_rank=sent_per_rank
        )
        if self.experts.supports_packed_ue8m0_act_scales():
            raise FlashInferEPConfigError(
                f"--moe-backend {MOE_BACKEND} is handed FP32 activation scales (Hopper); on "
                "this GPU DeepGEMM wants packed UE8M0 scales. Pass --moe-backend triton."
            )
        self.fallback_experts = ReceivedRowsExperts(
            moe_config, quant_config, max_num_tokens, num_dispatchers, sent_per_rank=sent_per_rank
        )
        self.received_rows_up_to = received_rows_up_to
        self._sent_per_rank = sent_per_rank

    @classmethod
    def in_place_of(
        cls, experts: Any, *, fp8_wire: bool, sent_per_rank: SentPerRank, options: Any
    ) -> ReceivedRowsOrDeepGemmExperts:
        """Built as vLLM built `experts`, with the user's bound for small forwards."""
        return cls(
            experts.moe_config,
            experts.quant_config,
            experts.max_num_tokens,
            experts.num_dispatchers,
            received_rows_up_to=options.deep_gemm_received_rows,
            sent_per_rank=sent_per_rank,
        )

    @staticmethod
    def get_clses() -> tuple[type[mk.FusedMoEExpertsModular], type[mk.FusedMoEExpertsModular]]:
        return DeepGemmExperts, ReceivedRowsExperts

    def supports_packed_ue8m0_act_scales(self) -> bool:
        return False  # refused at construction

    def workspace_shapes(self, *args: Any, **kwargs: Any):
        """Each workspace as large as the larger of the two experts' asks."""
        ours = self.experts.workspace_shapes(*args, **kwargs)
        theirs = self.fallback_experts.workspace_shapes(*args, **kwargs)
        return tuple(tuple(map(max, a, b)) for a, b in zip(ours, theirs))

    def _select_experts_impl(self, hidden_states, w1, w2) -> mk.FusedMoEExpertsModular:
        return self.experts  # the per-forward choice needs the routing: `apply`

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        chosen = self.experts
        if self.received_rows_up_to > 0:  # off: no token count to look up per layer
            sent = self._sent_per_rank() if self._sent_per_rank is not None else None
            tokens = senders_tokens(
                topk_ids.shape[0], self.num_dispatchers, self.max_num_tokens, sent
            )
            if takes_received_rows(
                tokens * self.num_dispatchers,
                topk_ids.shape[1],
                global_num_experts,
                self.received_rows_up_to,
            ):
                chosen = self.fallback_experts
        call = {name: value for name, value in locals().items() if name in APPLY_PARAMS}
        chosen.apply(**call)
