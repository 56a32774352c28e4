"""Make vLLM's MoE oracles pick BatchedExperts for the low-latency backend.

Patches: `FusedMoEParallelConfig.use_batched_activation_format`
(vllm/model_executor/layers/fused_moe/config.py l.1066: DeepEP-LL or NIXL only).
Why: the oracles choose Batched vs Standard experts from it before the
prepare/finalize exists (oracle/unquantized.py l.256-261); a mismatch trips the
format assert in `FusedMoEKernel._post_init_setup` (modular_kernel.py l.1756-1764).
How: the class is a plain dataclass; replace the property with one that is True for
flashinfer_ep_low_latency when the all2all kernels are in use.
"""

from __future__ import annotations

from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = "vllm.model_executor.layers.fused_moe.config.FusedMoEParallelConfig.use_batched_activation_format"


def is_applied() -> bool:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    return is_marked(FusedMoEParallelConfig.__dict__["use_batched_activation_format"])


def apply() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    if is_applied():
        return
    original = FusedMoEParallelConfig.__dict__["use_batched_activation_format"].fget

    def use_batched_activation_format(self) -> bool:
        if self.all2all_backend == LOW_LATENCY:
            return bool(self.use_all2all_kernels)
        return original(self)

    FusedMoEParallelConfig.use_batched_activation_format = property(
        mark(use_batched_activation_format, original)
    )
