"""Build our prepare/finalize objects when a MoE layer is set up.

Patches: `maybe_make_prepare_finalize`
(vllm/model_executor/layers/fused_moe/all2all_utils.py l.190-461), an if/elif on
`moe.use_*_kernels` that returns None for unknown backends (then the oracles'
`assert prepare_finalize is not None` fires). It is imported by name in
fused_moe/oracle/{unquantized,fp8,nvfp4,mxfp4,int8,w4a8,w4a8_int8}.py,
quantization/modelopt_block_quant.py, quantization/utils/humming/moe.py,
fused_moe/eep_reconfigure.py and function-locally in oracle/int_wna16.py.
How: wrap it; for our backends (with the all2all kernels in use) return our P/F,
else defer. The wrapper replaces the attribute on all2all_utils (for later importers)
and on every loaded vllm module holding the original.
"""

from __future__ import annotations

import inspect

from vllm_flashinfer_ep.backends import BACKENDS, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark, rebind_everywhere

TARGET = "vllm.model_executor.layers.fused_moe.all2all_utils.maybe_make_prepare_finalize"


def is_applied() -> bool:
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2a

    return is_marked(a2a.maybe_make_prepare_finalize)


def make_prepare_finalize(moe, quant_config, all2all_manager=None, use_monolithic=False):
    """Our P/F for `moe` (a vLLM FusedMoEConfig), or None when the all2all is off."""
    par = moe.moe_parallel_config
    if par.all2all_backend not in BACKENDS or not par.use_all2all_kernels:
        return None
    if use_monolithic:
        raise FlashInferEPConfigError(
            f"--all2all-backend {par.all2all_backend} works with modular MoE kernels only; "
            "the selected MoE backend is monolithic. Pass --moe-backend triton."
        )
    if quant_config is not None and getattr(quant_config, "quant_dtype", None) is not None:
        raise FlashInferEPConfigError(
            f"--all2all-backend {par.all2all_backend} dispatches BF16 only, but this MoE layer is "
            f"quantized ({quant_config.quant_dtype}). Serve a BF16 checkpoint or pick another "
            "--all2all-backend."
        )
    from vllm.model_executor.layers.fused_moe.all2all_utils import get_ep_all2all_manager

    from vllm_flashinfer_ep.vllm.forward_state import tokens_uniform_across_ranks
    from vllm_flashinfer_ep.vllm.prepare_finalize import (
        FlashInferEPHighThroughputPrepareAndFinalize,
        FlashInferEPLowLatencyPrepareAndFinalize,
    )

    manager = all2all_manager if all2all_manager is not None else get_ep_all2all_manager()
    runtime = manager.get_handle(
        dict(
            num_experts=moe.num_experts,
            max_num_tokens_per_rank=moe.max_num_tokens,
            hidden_size=moe.hidden_dim,
            top_k=moe.experts_per_token,
        )
    )
    cls = (
        FlashInferEPLowLatencyPrepareAndFinalize
        if par.all2all_backend == LOW_LATENCY
        else FlashInferEPHighThroughputPrepareAndFinalize
    )
    return cls(runtime, uniform_fn=tokens_uniform_across_ranks)


def apply() -> None:
    import vllm.model_executor.layers.fused_moe.all2all_utils as a2a

    if is_applied():
        return
    original = a2a.maybe_make_prepare_finalize
    signature = inspect.signature(original)

    def maybe_make_prepare_finalize(moe, quant_config, *args, **kwargs):
        par = moe.moe_parallel_config
        if par.all2all_backend in BACKENDS and par.use_all2all_kernels:
            bound = signature.bind(moe, quant_config, *args, **kwargs).arguments
            return make_prepare_finalize(
                moe,
                quant_config,
                all2all_manager=bound.get("all2all_manager"),
                use_monolithic=bool(bound.get("use_monolithic", False)),
            )
        return original(moe, quant_config, *args, **kwargs)

    wrapper = mark(maybe_make_prepare_finalize, original)
    a2a.maybe_make_prepare_finalize = wrapper
    rebind_everywhere("maybe_make_prepare_finalize", original, wrapper)
