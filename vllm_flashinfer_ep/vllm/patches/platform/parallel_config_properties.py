"""Treat our backends like DeepEP in two `ParallelConfig` properties.

Patches: vllm/config/parallel.py
- `use_sequence_parallel_moe` (l.768-786): hard-coded list of 9 backends; without our
  names DP+TP+EP would send duplicated tokens through the all2all. Both backends.
- `use_batched_dp_moe` (l.796-805): deepep_low_latency/nixl_ep only; when True and
  --max-num-batched-tokens is unset, vLLM defaults it to 256
  (`DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP`), which becomes the LL per-rank
  capacity (`FusedMoEConfig.max_num_tokens`). Low latency only.
How: replace each property on the class with one that answers for our names and
defers to the original otherwise.
"""

from __future__ import annotations

from vllm_flashinfer_ep.backends import BACKENDS, LOW_LATENCY
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = (
    "vllm.config.parallel.ParallelConfig.use_sequence_parallel_moe",
    "vllm.config.parallel.ParallelConfig.use_batched_dp_moe",
)


def is_applied() -> bool:
    from vllm.config.parallel import ParallelConfig

    return is_marked(ParallelConfig.__dict__["use_sequence_parallel_moe"]) and is_marked(
        ParallelConfig.__dict__["use_batched_dp_moe"]
    )


def apply() -> None:
    from vllm.config.parallel import ParallelConfig

    if is_applied():
        return
    sp_original = ParallelConfig.__dict__["use_sequence_parallel_moe"].fget
    batched_original = ParallelConfig.__dict__["use_batched_dp_moe"].fget

    def use_sequence_parallel_moe(self) -> bool:
        if self.all2all_backend in BACKENDS:
            return (
                self.enable_expert_parallel
                and self.tensor_parallel_size > 1
                and self.data_parallel_size > 1
            )
        return sp_original(self)

    def use_batched_dp_moe(self) -> bool:
        if self.all2all_backend == LOW_LATENCY:
            return self.enable_expert_parallel and self.data_parallel_size > 1
        return batched_original(self)

    ParallelConfig.use_sequence_parallel_moe = property(mark(use_sequence_parallel_moe, sp_original))
    ParallelConfig.use_batched_dp_moe = property(mark(use_batched_dp_moe, batched_original))
