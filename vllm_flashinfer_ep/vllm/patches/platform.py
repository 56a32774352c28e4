"""Replacements for the platform patches (CLI parsing, engine config); the table in
`patches/__init__.py` says where each goes and why."""

from __future__ import annotations

from typing import Literal, get_args

from vllm_flashinfer_ep.backends import BACKENDS, HELP, LOW_LATENCY


def make_backend_literal(original):
    """`All2AllBackend` Literal + our names (pydantic validation, argparse choices)."""
    names = tuple(get_args(original))
    return Literal[names + tuple(b for b in BACKENDS if b not in names)]  # type: ignore[valid-type]


def clear_cli_cache() -> None:
    """argparse choices are computed once per class (`_compute_kwargs` is lru_cached)."""
    import vllm.engine.arg_utils as arg_utils

    arg_utils._compute_kwargs.cache_clear()


def make_get_kwargs(original):
    from vllm.config.parallel import ParallelConfig

    def get_kwargs(cls):
        kwargs = original(cls)
        if cls is ParallelConfig and "all2all_backend" in kwargs:
            entry = kwargs["all2all_backend"]
            extra = "\n".join(f"- {name}: {text}" for name, text in HELP.items())
            entry["help"] = (entry.get("help") or "") + "\n\nAdded by vllm-flashinfer-ep:\n" + extra
        return kwargs

    return get_kwargs


def make_use_sequence_parallel_moe(original):
    def use_sequence_parallel_moe(self) -> bool:
        if self.all2all_backend in BACKENDS:
            return (
                self.enable_expert_parallel
                and self.tensor_parallel_size > 1
                and self.data_parallel_size > 1
            )
        return original(self)

    return use_sequence_parallel_moe


def ll_counts_as_batched_dp(par, data_parallel_size: int) -> bool:
    """Whether an LL engine takes vLLM's batched-DP step budget (the LL per-rank capacity;
    vLLM's 256, raised by make_default_step_budget). Rounds split above
    VLLM_FLASHINFER_EP_LL_ROUND_TOKENS: the step budget no longer sizes LL's buffers, so LL
    takes vLLM's budget for other engines. The world-1 test harness asks with
    data_parallel_size=2."""
    from vllm_flashinfer_ep import envs

    split = envs.ll_round_tokens() > 0
    return par.enable_expert_parallel and data_parallel_size > 1 and not split


def make_use_batched_dp_moe(original):
    def use_batched_dp_moe(self) -> bool:
        if self.all2all_backend == LOW_LATENCY:
            return ll_counts_as_batched_dp(self, self.data_parallel_size)
        return original(self)

    return use_batched_dp_moe


def make_default_step_budget(original):
    """LL's default step budget (config_rules.ll_default_step_tokens) where vLLM would give
    its 256 for batched DP MoE; set only when --max-num-batched-tokens is unset, logged."""
    from vllm_flashinfer_ep.log import get_logger
    from vllm_flashinfer_ep.vllm import config_rules

    logger = get_logger(__name__)

    def _set_default_max_num_seqs_and_batched_tokens_args(
        self, usage_context, model_config, parallel_config
    ):
        asked = self.max_num_batched_tokens
        original(self, usage_context, model_config, parallel_config)
        if asked is not None or parallel_config.all2all_backend != LOW_LATENCY:
            return
        if not parallel_config.use_batched_dp_moe:
            return  # rounds asked (vLLM's budget without EP) or no DP+EP
        vllm_chose = self.max_num_batched_tokens
        chosen = config_rules.ll_default_step_tokens(
            vllm_chose, capture_max(self), self.max_num_seqs * model_config.max_model_len
        )
        if chosen == vllm_chose:
            return
        self.max_num_batched_tokens = chosen
        logger.info(
            "--all2all-backend %s: --max-num-batched-tokens unset, LL steps take up to %d "
            "tokens (vLLM chose %d), at most the largest CUDA graph capture size; pass "
            "--max-num-batched-tokens to choose another.",
            LOW_LATENCY,
            chosen,
            vllm_chose,
        )

    return _set_default_max_num_seqs_and_batched_tokens_args


def capture_max(args) -> int:
    """The largest CUDA graph capture size: the one the user set on EngineArgs (flags or
    --compilation-config), else vLLM's default bound by --max-num-seqs (2 x max_num_seqs;
    with speculative decoding vLLM's is larger, so this errs small)."""
    cc = args.compilation_config
    for value in (args.max_cudagraph_capture_size, getattr(cc, "max_cudagraph_capture_size", None)):
        if value is not None:
            return int(value)
    for sizes in (args.cudagraph_capture_sizes, getattr(cc, "cudagraph_capture_sizes", None)):
        if sizes:
            return max(sizes)
    return 2 * args.max_num_seqs


def make_post_init(original):
    from vllm_flashinfer_ep.vllm import config_validation, cudagraph_policy

    def __post_init__(self) -> None:
        config_validation.validate(self)
        with cudagraph_policy.for_engine(self):  # the graph policy sees this engine's layout
            original(self)

    return __post_init__


def make_set_splitting_ops(original):
    from vllm_flashinfer_ep.vllm import cudagraph_policy

    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1):
        cudagraph_policy.apply(self, all2all_backend, data_parallel_size)
        return original(self, all2all_backend, data_parallel_size)

    return set_splitting_ops_for_v1


def make_environment_variables(original: dict) -> dict:
    """vLLM's variable table + one getter per VLLM_FLASHINFER_EP_* name, returning the raw
    string: vLLM calls them when it hashes compile-cache factors, so they never raise."""
    import os

    from vllm_flashinfer_ep import envs

    def getter(name: str, default: str):
        return lambda: os.environ.get(name, default)

    table = dict(original)
    for var in envs.VARIABLES:
        table.setdefault(var.name, getter(var.name, var.default))
    return table
