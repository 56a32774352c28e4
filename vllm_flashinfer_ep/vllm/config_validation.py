"""Engine-config-time checks for the flashinfer_ep backends.

Runs inside `VllmConfig.__post_init__` (see patches/vllm_config.py), in the process
that builds the engine config, before any worker starts. Every failure is one
FlashInferEPConfigError that names the flag to change. Checks that need a GPU or the
native library (libnccl version, libnccl_ep load, nvcc, compute capability) run in
the worker, in the manager's constructor, before model load.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from vllm_flashinfer_ep import backends, envs
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.log import get_logger
from vllm_flashinfer_ep.runtime.limits import (
    HT_MAX_TOKENS_PER_RANK,
    MIN_CUDA_MAJOR,
    SUPPORTED_HIDDEN_SIZES,
    config_top_k,
    max_top_k,
)

logger = get_logger(__name__)

def model_top_k(hf_config: Any) -> int | None:
    return config_top_k(lambda name: getattr(hf_config, name, None))


def validate(vllm_config: Any) -> None:
    par = vllm_config.parallel_config
    backend = par.all2all_backend
    if not backends.is_ours(backend):
        return
    flag = f"--all2all-backend {backend}"
    # The package's own variables: a bad value fails here, not after a GPU start-up.
    envs.validate_all()

    if par.use_ubatching:
        raise FlashInferEPConfigError(
            f"{flag} does not support micro-batching (dual-batch overlap): NCCL-EP's receive "
            "buffers are shared by all handles of a fleet, so two micro-batches would overwrite "
            "each other. Remove --enable-dbo (and --ubatch-size)."
        )
    if par.enable_fault_tolerance and not backends.supports_fault_tolerance(backend):
        raise FlashInferEPConfigError(
            f"{flag} has no fault tolerance (NCCL-EP supports it for low latency only): use "
            "--all2all-backend flashinfer_ep_low_latency or remove --enable-fault-tolerance."
        )
    if importlib.util.find_spec("nccl") is None or importlib.util.find_spec("nccl.ep") is None:
        raise FlashInferEPConfigError(
            f"{flag} needs NCCL-EP: pip install 'nccl-extensions>=0.1.0' (module nccl.ep is missing)."
        )
    cuda = torch.version.cuda
    if not cuda or int(cuda.split(".")[0]) < MIN_CUDA_MAJOR:
        raise FlashInferEPConfigError(
            f"{flag} needs torch built for CUDA >= {MIN_CUDA_MAJOR} (found "
            f"{cuda or 'a CPU build'}); install torch 2.14.0+cu130 as vLLM 0.33.0 pins it."
        )

    model = vllm_config.model_config
    if model is not None:
        _validate_model(model, backend, flag)
    if backend == backends.HIGH_THROUGHPUT and par.use_all2all:
        _clamp_ht_tokens(vllm_config, flag)

    if not par.use_all2all:
        logger.warning(
            "%s is selected but does nothing here: the MoE all2all only runs with "
            "--data-parallel-size > 1 and --enable-expert-parallel.",
            backend,
        )
    elif not par.enable_expert_parallel:
        logger.warning(
            "%s is selected without --enable-expert-parallel: vLLM will use its "
            "all-gather/reduce-scatter path, not NCCL-EP.",
            backend,
        )


def _clamp_ht_tokens(vllm_config: Any, flag: str) -> None:
    """Keep each step within NCCL-EP's high-throughput limit of tokens per rank.

    The HT fleet cannot take more than HT_MAX_TOKENS_PER_RANK tokens per rank, and vLLM's
    profile run sends --max-num-batched-tokens tokens through every MoE layer at start-up,
    so a larger budget would fail there. Chunked prefill keeps any prompt length servable.
    """
    sched = vllm_config.scheduler_config
    if sched is None or sched.max_num_batched_tokens <= HT_MAX_TOKENS_PER_RANK:
        return
    asked = sched.max_num_batched_tokens
    if not sched.enable_chunked_prefill and vllm_config.model_config is not None:
        if vllm_config.model_config.max_model_len > HT_MAX_TOKENS_PER_RANK:
            raise FlashInferEPConfigError(
                f"{flag} takes at most {HT_MAX_TOKENS_PER_RANK} tokens per rank and step, but "
                f"--max-num-batched-tokens is {asked} with chunked prefill off and "
                f"--max-model-len {vllm_config.model_config.max_model_len}. Enable chunked "
                f"prefill or pass --max-model-len <= {HT_MAX_TOKENS_PER_RANK}."
            )
    sched.max_num_batched_tokens = HT_MAX_TOKENS_PER_RANK
    if sched.max_num_scheduled_tokens is not None:
        sched.max_num_scheduled_tokens = min(sched.max_num_scheduled_tokens, HT_MAX_TOKENS_PER_RANK)
    logger.warning(
        "%s: NCCL-EP high throughput takes at most %d tokens per rank and step; "
        "--max-num-batched-tokens lowered from %d to %d (pass a value <= %d to silence this).",
        flag,
        HT_MAX_TOKENS_PER_RANK,
        asked,
        HT_MAX_TOKENS_PER_RANK,
        HT_MAX_TOKENS_PER_RANK,
    )


def _validate_model(model: Any, backend: str, flag: str) -> None:
    if getattr(model, "is_moe", True) is False:
        return
    quant = getattr(model, "quantization", None)
    if quant:
        raise FlashInferEPConfigError(
            f"{flag} dispatches BF16 only, but the model is quantized ({quant}). Serve a BF16 "
            "checkpoint, or pick another --all2all-backend (e.g. deepep_low_latency)."
        )
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype != torch.bfloat16:
        raise FlashInferEPConfigError(
            f"{flag} dispatches BF16 only, but the model dtype is {dtype}. Pass --dtype bfloat16."
        )
    hf = model.hf_text_config
    top_k = model_top_k(hf)
    limit = max_top_k(backend == backends.LOW_LATENCY)
    if top_k is not None and top_k > limit:
        other = (
            " Try --all2all-backend flashinfer_ep_high_throughput."
            if backend == backends.LOW_LATENCY and top_k <= max_top_k(False)
            else " Pick another --all2all-backend."
        )
        raise FlashInferEPConfigError(
            f"{flag}: the model routes each token to {top_k} experts, more than this backend "
            f"supports ({limit}, see vllm_flashinfer_ep/runtime/limits.py).{other}"
        )
    hidden = getattr(hf, "hidden_size", None)
    if (
        backend == backends.LOW_LATENCY
        and isinstance(hidden, int)
        and hidden > SUPPORTED_HIDDEN_SIZES[-1]
    ):
        raise FlashInferEPConfigError(
            f"{flag}: hidden size {hidden} exceeds the largest NCCL-EP low-latency size "
            f"{SUPPORTED_HIDDEN_SIZES[-1]}. Use --all2all-backend flashinfer_ep_high_throughput."
        )
