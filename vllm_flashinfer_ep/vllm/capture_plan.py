"""What vLLM will capture, in its order, computed from the engine config as the model
runner computes it: the capture plan the EP ranks compare when the capture phase opens.

Why: every captured size runs one eager warm-up forward first, whose MoE rounds are
collective, and the pool learns the counts the configured sizes lack (speculative
decoding, sequence-parallel MoE). Two ranks whose load-time settings agree can still
capture different sequences (the runner resolves the CUDA-graph mode and rounds the
sizes after model load; equal capture sizes with different speculation give different
decode counts), and would then pair a handle of one size with a handle of another. The
plan is computed with vLLM's own descriptor code (V2: `CudaGraphManager._init_candidates`;
V1: `CudagraphDispatcher.initialize_cudagraph_keys`), on objects that hold only the
config, so computing it creates no graph pool and touches no GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_flashinfer_ep.log import get_logger

logger = get_logger(__name__)

# What sets each item of the plan, named when ranks disagree on it.
FIXES = {
    "model runner": "VLLM_USE_V2_MODEL_RUNNER (and the features that force the V1 runner)",
    "resolved CUDA-graph mode": (
        "--compilation-config cudagraph_mode (-cc.cudagraph_mode) or --enforce-eager; the "
        "runner lowers it where an attention backend cannot capture"
    ),
    "resolved CUDA-graph capture sizes": (
        "--compilation-config cudagraph_capture_sizes / max_cudagraph_capture_size "
        "(the V1 runner rounds them to 1 + num_speculative_tokens)"
    ),
    "decode query length": "--speculative-config num_speculative_tokens",
    "MoE token counts in capture order": (
        "--speculative-config, --max-num-seqs, --compilation-config (cudagraph_mode, "
        "cudagraph_capture_sizes), --enable-lora/--max-loras, --tensor-parallel-size"
    ),
}


@dataclass(frozen=True)
class CapturePlan:
    """The captures of the model runner, each as (mode, MoE tokens per EP rank, LoRAs)."""

    runner: str
    mode: str
    capture_sizes: tuple[int, ...]
    decode_query_len: int
    order: tuple[tuple[str, int, int], ...] | str  # a str: why it could not be computed

    def counts(self) -> list[int]:
        """The MoE token counts, each once, in capture order."""
        if isinstance(self.order, str):
            return []
        return list(dict.fromkeys(count for _, count, _ in self.order))

    def items(self) -> dict[str, Any]:
        return {
            "model runner": self.runner,
            "resolved CUDA-graph mode": self.mode,
            "resolved CUDA-graph capture sizes": list(self.capture_sizes),
            "decode query length": self.decode_query_len,
            "MoE token counts in capture order": (
                self.order if isinstance(self.order, str) else list(self.order)
            ),
        }


def plan_of(vllm_config: Any) -> CapturePlan:
    """The plan of this engine config as it stands (after the runner resolved it)."""
    from vllm.config import CUDAGraphMode

    comp = vllm_config.compilation_config
    mode = comp.cudagraph_mode or CUDAGraphMode.NONE
    sizes = tuple(sorted(int(s) for s in (comp.cudagraph_capture_sizes or ())))
    query_len = 1 + int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
    try:
        v2 = bool(vllm_config.use_v2_model_runner)
    except Exception as exc:  # noqa: BLE001 - the runner choice itself refused
        v2, runner = True, f"unknown ({type(exc).__name__}: {exc})"
    else:
        runner = "v2" if v2 else "v1"
    try:
        if mode == CUDAGraphMode.NONE or not sizes:
            descs: list[tuple[str, int, int]] = []
        elif v2:
            descs = _v2_descs(vllm_config, mode, query_len)
        else:
            descs = _v1_descs(vllm_config, mode, query_len)
        order: tuple[tuple[str, int, int], ...] | str = tuple(
            (name, moe_tokens(vllm_config, n), loras) for name, n, loras in descs
        )
    except Exception as exc:  # noqa: BLE001 - vLLM's internals moved: compared as such
        order = f"not computed ({type(exc).__name__}: {exc})"
        logger.warning("flashinfer_ep: the capture plan could not be computed: %s", order)
    return CapturePlan(runner, mode.name, sizes, query_len, order)


def moe_tokens(vllm_config: Any, num_tokens: int) -> int:
    """The MoE tokens one EP rank dispatches in a forward of `num_tokens`: its
    sequence-parallel chunk where vLLM splits the tokens over TP."""
    par = vllm_config.parallel_config
    if getattr(par, "use_sequence_parallel_moe", False):
        return math.ceil(num_tokens / par.tensor_parallel_size)
    return num_tokens


def lora_capture_cases(vllm_config: Any) -> list[int]:
    """vLLM's LoRA capture cases (V2 runner's `get_lora_capture_cases`)."""
    lora = getattr(vllm_config, "lora_config", None)
    if lora is None:
        return [0]
    from vllm.v1.worker.gpu.lora_utils import get_lora_capture_cases

    return list(get_lora_capture_cases(lora, vllm_config.compilation_config))


def _v2_descs(vllm_config: Any, mode: Any, query_len: int) -> list[tuple[str, int, int]]:
    """V2: `CudaGraphManager.capture` runs PIECEWISE, then FULL, each list as
    `_init_candidates` sorted it (largest first)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    manager = object.__new__(CudaGraphManager)  # the candidates need the config only
    manager.vllm_config = vllm_config
    manager.compilation_config = vllm_config.compilation_config
    manager.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
    manager.cudagraph_mode = mode
    manager.decode_query_len = query_len
    manager.varlen_decode = False  # adaptive verification: not with this backend's DP
    manager.ubatch_runner = None  # micro-batching is refused at config time
    manager.tp_size = vllm_config.parallel_config.tensor_parallel_size
    manager.lora_capture_cases = lora_capture_cases(vllm_config)
    manager._candidates, manager._capture_descs = {}, {}
    manager._init_candidates()
    return [
        (m.name, d.num_tokens, d.num_active_loras)
        for m in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
        for d in manager._capture_descs.get(m, [])
    ]


def _v1_descs(vllm_config: Any, mode: Any, query_len: int) -> list[tuple[str, int, int]]:
    """V1: `capture_model` walks `CudagraphDispatcher.get_capture_descs()`."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    dispatcher = object.__new__(CudagraphDispatcher)  # its __init__ checks compilation
    dispatcher.vllm_config = vllm_config
    dispatcher.compilation_config = vllm_config.compilation_config
    dispatcher.uniform_decode_query_len = query_len
    dispatcher.cudagraph_keys = {CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
    dispatcher.keys_initialized = False
    lora = getattr(vllm_config, "lora_config", None)
    dispatcher.specialize_lora_count = lora.specialize_active_lora if lora is not None else False
    dispatcher.cudagraph_mode = CUDAGraphMode.NONE
    dispatcher.initialize_cudagraph_keys(mode, query_len)
    return [
        (m.name, d.num_tokens, d.num_active_loras)
        for m, descs in dispatcher.get_capture_descs()
        for d in descs
    ]
