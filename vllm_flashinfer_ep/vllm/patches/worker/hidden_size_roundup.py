"""Round MoE layer hidden sizes up to what NCCL-EP's low-latency kernels support.

Patches: `maybe_roundup_layer_hidden_size`
(vllm/model_executor/layers/fused_moe/all2all_utils.py l.148-187), reached through a
function-local import in fused_moe_method_base.py l.96-100, so replacing the module
attribute is enough (loaded modules that imported it by name are rebound too).
Why: vLLM knows the DeepEP/NIXL lists only; NCCL-EP LL supports
`runtime.limits.SUPPORTED_HIDDEN_SIZES` (no 3072). The round-up is logged once per size.
"""

from __future__ import annotations

from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.limits import round_up_ll_hidden_size
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark, rebind_everywhere

logger = get_logger(__name__)

TARGET = "vllm.model_executor.layers.fused_moe.all2all_utils.maybe_roundup_layer_hidden_size"
_logged: set[tuple[int, int]] = set()


def is_applied() -> bool:
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2a

    return is_marked(a2a.maybe_roundup_layer_hidden_size)


def apply() -> None:
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2a

    if is_applied():
        return
    original = a2a.maybe_roundup_layer_hidden_size

    def maybe_roundup_layer_hidden_size(hidden_size, act_dtype, moe_parallel_config):
        if (
            moe_parallel_config.all2all_backend == LOW_LATENCY
            and moe_parallel_config.use_all2all_kernels
        ):
            rounded = round_up_ll_hidden_size(hidden_size)
            if rounded != hidden_size and (hidden_size, rounded) not in _logged:
                _logged.add((hidden_size, rounded))
                logger.info(
                    "flashinfer_ep_low_latency: rounding MoE hidden size %d up to %d "
                    "(NCCL-EP LL kernels exist for specific hidden sizes only)",
                    hidden_size,
                    rounded,
                )
            return rounded
        return original(hidden_size, act_dtype, moe_parallel_config)

    wrapper = mark(maybe_roundup_layer_hidden_size, original)
    a2a.maybe_roundup_layer_hidden_size = wrapper
    rebind_everywhere("maybe_roundup_layer_hidden_size", original, wrapper)
