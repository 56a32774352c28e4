"""Every vLLM 0.33.0 touch point of the package, and how to remove it: `PATCHES`.

vLLM 0.33.0 has no all2all backend registry. Each row is one patch's index entry and the
input of `_helper.py`, which checks the target before replacing it and can undo it; the
replacements live in `platform.py` (before workers start) and `worker.py` (in workers).
`index()` also lists the FlashInfer internals read (runtime/flashinfer_internals.py).
"""

from __future__ import annotations

from vllm_flashinfer_ep.runtime import flashinfer_internals
from vllm_flashinfer_ep.vllm.patches import _helper
from vllm_flashinfer_ep.vllm.patches import platform as P
from vllm_flashinfer_ep.vllm.patches import worker as W
from vllm_flashinfer_ep.vllm.patches._helper import (
    FIELD,
    GLOBAL,
    PROPERTY,
    WRAP,
    Patch,
    PatchTargetError,
    undo,
)

REGISTRY = "an all2all backend registry (vLLM PR #50556, OOT P/F registry) or the names in-tree (PR #47948)"


def _has_default_backend(literal) -> bool:
    from typing import get_args

    return "allgather_reducescatter" in get_args(literal)


PATCHES: tuple[Patch, ...] = (
    # ------------------------------------------------------------------ platform
    Patch(
        "backend_names",
        "platform",
        "vllm.config.parallel:ParallelConfig.all2all_backend",
        FIELD,
        P.make_backend_literal,
        _has_default_backend,
        what="`--all2all-backend` accepts flashinfer_ep_low_latency / _high_throughput",
        why="pydantic validates the Literal field type; argparse builds choices from it",
        how="field type + annotation replaced, pydantic dataclass rebuilt, CLI cache cleared",
        upstream=REGISTRY,
        removal="when vLLM ships either",
        after=P.clear_cli_cache,
    ),
    Patch(
        "backend_help",
        "platform",
        "vllm.engine.arg_utils:get_kwargs",
        WRAP,
        P.make_get_kwargs,
        ("cls",),
        what="`--all2all-backend` help describes our backends",
        why="help text comes from vLLM's field docstring",
        how="wrap, append one line each",
        upstream="per-backend help in the registry",
        removal="with backend_names",
    ),
    Patch(
        "sequence_parallel_moe",
        "platform",
        "vllm.config.parallel:ParallelConfig.use_sequence_parallel_moe",
        PROPERTY,
        P.make_use_sequence_parallel_moe,
        ("self",),
        what="both backends use SP MoE under DP+TP+EP",
        why="hard-coded list of 9 backends; otherwise DP+TP+EP sends duplicated tokens",
        how="replace the property, defer for other backends",
        upstream="backend capability flag in the registry",
        removal="with backend_names",
    ),
    Patch(
        "batched_dp_moe",
        "platform",
        "vllm.config.parallel:ParallelConfig.use_batched_dp_moe",
        PROPERTY,
        P.make_use_batched_dp_moe,
        ("self",),
        what="LL counts as batched DP MoE (its step budget = the LL per-rank capacity)",
        why="deepep_low_latency / nixl_ep only",
        how="replace the property, defer otherwise",
        upstream="backend capability flag in the registry",
        removal="with backend_names",
    ),
    Patch(
        "default_step_budget",
        "platform",
        "vllm.engine.arg_utils:EngineArgs._set_default_max_num_seqs_and_batched_tokens_args",
        WRAP,
        P.make_default_step_budget,
        ("self", "usage_context", "model_config", "parallel_config"),
        what="LL's default --max-num-batched-tokens is 512, not vLLM's 256 for batched DP "
        "MoE, at most the largest CUDA graph capture size; logged, only where unset",
        why="vLLM's 256 queued prompts when LL was served under load (docs/benchmarks.md); "
        "vLLM keeps one default for every batched DP MoE backend",
        how="wrap: after vLLM's defaults, raise an unset LL budget (config_rules)",
        upstream="a per-backend default step budget in the registry",
        removal="with backend_names",
    ),
    Patch(
        "config_validation",
        "platform",
        "vllm.config.vllm:VllmConfig.__post_init__",
        WRAP,
        P.make_post_init,
        ("self",),
        what="config-time checks (quantization, dtype, top_k, hidden, FT+HT, DBO, nccl.ep, CUDA)",
        why="no hook for backend-specific checks; they must fail before any worker starts",
        how="wrap, validate first (FlashInferEPConfigError is not folded by pydantic)",
        upstream="a `validate(vllm_config)` hook in the registry",
        removal="with backend_names",
    ),
    Patch(
        "cudagraph_policy",
        "platform",
        "vllm.config.compilation:CompilationConfig.set_splitting_ops_for_v1",
        WRAP,
        P.make_set_splitting_ops,
        ("self", "all2all_backend", "data_parallel_size"),
        what="per-backend CUDA-graph mode (vllm/cudagraph_policy.py)",
        why="vLLM's only gate is DeepEP-HT under VLLM_COMPILE",
        how="wrap, decide first",
        upstream="a per-backend `supports_cudagraph` capability",
        removal="with backend_names",
    ),
    Patch(
        "known_env_vars",
        "platform",
        "vllm.envs:environment_variables",
        GLOBAL,
        P.make_environment_variables,
        lambda value: isinstance(value, dict),
        what="the package's documented VLLM_FLASHINFER_EP_* variables are known to vLLM",
        why="`Platform.validate_environ` logs 'Unknown vLLM environment variable detected' "
        "(or fails under --fail-on-environ-validation) for VLLM_* names outside this table",
        how="rebind the module global with a copy plus one raw-string getter per name "
        "(read through the module at call time); values are validated by config_validation",
        upstream="a plugin hook to declare environment variables",
        removal="then",
    ),
    # -------------------------------------------------------------------- worker
    Patch(
        "communicator_manager",
        "worker",
        "vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator.__init__",
        WRAP,
        W.make_communicator_init,
        (
            "self",
            "cpu_group",
            "device",
            "device_group",
            "unique_name",
            "global_ranks",
            "global_world_size",
            "tcp_store_group",
            "use_all2all",
        ),
        what="our manager on the EP group's CudaCommunicator",
        why="name -> manager if/elif ends in ValueError; the class must stay CudaCommunicator",
        how="wrap; original with use_all2all=False, then install ours",
        upstream="manager registry",
        removal="with backend_names",
    ),
    Patch(
        "prepare_finalize",
        "worker",
        "vllm.model_executor.layers.fused_moe.all2all_utils:maybe_make_prepare_finalize",
        WRAP,
        W.make_prepare_finalize_selection,
        (
            "moe",
            "quant_config",
            "routing_tables",
            "allow_new_interface",
            "use_monolithic",
            "all2all_manager",
        ),
        what="the manager builds our LL/HT prepare/finalize",
        why="the selection if/elif returns None for unknown names",
        how="wrap in place (every importer holds this function object): registry lookup first",
        upstream="PR #50556 (factory registry consulted by this function)",
        removal="when released",
        in_place=True,
    ),
    Patch(
        "experts_selection",
        "worker",
        "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel.__init__",
        WRAP,
        W.make_kernel_init,
        ("self", "prepare_finalize", "fused_experts"),
        what="LL MoE kernels run the received-rows experts (experts/) in place of vLLM's "
        "batched Triton and DeepGEMM experts",
        why="vLLM's batched experts launch programs over every row of the expert-major "
        "buffer whatever the batch; the empty ones set a decode step's time. vLLM's "
        "oracles pick experts classes from fixed tables, one per quantization family",
        how="wrap the kernel's constructor (every oracle builds its kernel through it): for "
        "an LL prepare/finalize, the wing's class built with the arguments of vLLM's pick",
        upstream="an out-of-tree experts registry, or experts picked per prepare/finalize "
        "(PR #50556's registry extended to experts)",
        removal="then",
    ),
    Patch(
        "round_split",
        "worker",
        "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel.apply",
        WRAP,
        W.make_kernel_apply,
        (
            "self",
            "hidden_states",
            "w1",
            "w2",
            "topk_weights",
            "topk_ids",
            "activation",
            "global_num_experts",
            "expert_map",
            "apply_router_weight_on_input",
            "shared_experts",
            "shared_experts_input",
        ),
        what="an LL MoE forward above the fleet's round capacity runs as several rounds "
        "where VLLM_FLASHINFER_EP_LL_ROUND_TOKENS asks (round_chunks.py); other kernels "
        "call vLLM's apply unchanged",
        why="a modular kernel runs one prepare, experts and finalize per forward: nothing "
        "in vLLM cuts a forward into pieces the transport's buffers hold",
        how="wrap the kernel's apply (every quantization method calls it): a "
        "prepare/finalize carrying a RoundSplit runs it once per round",
        upstream="a prepare/finalize hook in vLLM's modular kernel that bounds the tokens "
        "of one dispatch and runs a longer forward in pieces (no upstream change known)",
        removal="then",
    ),
    Patch(
        "batched_activation_format",
        "worker",
        "vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig.use_batched_activation_format",
        PROPERTY,
        W.make_batched_activation_format,
        ("self",),
        what="True for LL",
        why="oracles pick Batched experts from it before the P/F exists",
        how="replace the property",
        upstream="P/F-declared activation format",
        removal="with prepare_finalize",
    ),
    Patch(
        "hidden_size_roundup",
        "worker",
        "vllm.model_executor.layers.fused_moe.all2all_utils:maybe_roundup_layer_hidden_size",
        WRAP,
        W.make_hidden_size_roundup,
        ("hidden_size", "act_dtype", "moe_parallel_config"),
        what="LL rounds to NCCL-EP's sizes (no 3072), logged",
        why="DeepEP/NIXL lists only",
        how="wrap the module attribute (reached by a function-local import)",
        upstream="P/F class method in the registry",
        removal="with prepare_finalize",
    ),
    Patch(
        "padded_expert_load",
        "worker",
        "vllm.model_executor.models.gpt_oss:GptOssModel._load_weights_other",
        WRAP,
        W.make_padded_expert_load,
        ("self", "ep_rank_end", "ep_rank_start", "weights", "stacked_params_mapping"),
        what="an unquantized gpt-oss checkpoint loads into LL's padded expert weights",
        why="LL pads hidden 2880 to 4096 (hidden_size_roundup); this loader copies each "
        "expert tensor whole (`param.copy_`), a shape error on the wider parameters",
        how="wrap: each padded expert parameter is a view of its leading columns while the "
        "loader runs, its padding zeroed",
        upstream="the loader narrowing into padded parameters, as its MXFP4 path does "
        "through FusedMoE.weight_loader",
        removal="then, or with hidden_size_roundup",
    ),
    Patch(
        "ft_backend_set",
        "worker",
        "vllm.v1.worker.sentinel.gpu_worker_sentinel:FT_BACKEND_SET",
        GLOBAL,
        W.make_ft_backend_set,
        lambda value: isinstance(value, frozenset),
        what="the FT sentinel accepts LL",
        why="it raises for backends outside the set",
        how="rebind the module global (read at call time)",
        upstream="ask the manager's `support_fault_tolerance`",
        removal="then",
    ),
    Patch(
        "capture_phase",
        "worker",
        "vllm.distributed.parallel_state:GroupCoordinator.graph_capture",
        WRAP,
        W.make_graph_capture,
        ("self", "graph_capture_context"),
        what="the handle pools learn every token count vLLM captures",
        why="vLLM captures counts the configured capture sizes do not list (rounded to "
        "1 + num_speculative_tokens, ceil(size / tp) under sequence-parallel MoE, drafter "
        "graphs), sized after model load; a handle cannot be created inside a capture",
        how="wrap the method (entered for the TP, PP and DP groups around every capture "
        "loop): runtime/capture.py's capture phase while it is open",
        upstream="the captured token counts handed to the all2all manager before capture",
        removal="then",
    ),
    Patch(
        "router_gate_width",
        "worker",
        "vllm.model_executor.layers.fused_moe.router.gate_linear:GateLinear.forward",
        WRAP,
        W.make_gate_forward,
        ("self", "x"),
        what="the router sees unpadded activations",
        why="vLLM pads activations to the rounded hidden size (hidden_size_roundup) before "
        "the runner applies its gate; the gate weight has the checkpoint width (shape error "
        "at hidden 3072)",
        how="wrap, slice rows back to the gate's input_size (zeros dropped, same logits)",
        upstream="gate before padding in the MoE runner",
        removal="then, or with hidden_size_roundup",
    ),
)

BY_NAME: dict[str, Patch] = {patch.name: patch for patch in PATCHES}


def apply_all(stage: str | None = None) -> None:
    """Apply every patch (of one stage); one PatchTargetError lists every moved target."""
    _helper.apply_all(p for p in PATCHES if stage is None or p.stage == stage)


def undo_all() -> None:
    """Undo every patch of the table."""
    for patch in reversed(PATCHES):
        undo(patch)


def status() -> dict[str, bool]:
    """{patch name: applied} for every patch."""
    return {patch.name: _helper.is_applied(patch) for patch in PATCHES}


def index() -> str:
    """Every row as text: the vLLM patches, then the FlashInfer internals."""
    rows = [patch.entry() for patch in PATCHES]
    return "\n".join([*rows, flashinfer_internals.index()])


__all__ = [
    "PATCHES",
    "BY_NAME",
    "Patch",
    "PatchTargetError",
    "apply_all",
    "undo_all",
    "status",
    "index",
]
