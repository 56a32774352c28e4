"""Index of every vLLM 0.33.0 symbol this package patches.

vLLM 0.33.0 has no registry for all2all backends, so each touch point is a small,
named, version-guarded patch in its own module. `register()` applies all of them in
every vLLM process (CLI, API server, engine core, workers); each `apply()` is
idempotent and each module has an `is_applied()` that the tests assert.

Platform patches (matter before workers start: CLI parsing, engine config)
--------------------------------------------------------------------------
1. platform/parallel_config_backend.py -- `ParallelConfig.all2all_backend` Literal
   What: add `flashinfer_ep_low_latency`, `flashinfer_ep_high_throughput`.
   Why:  pydantic rejects unknown names; argparse builds choices from the Literal.
   How:  replace field type + annotation, `rebuild_dataclass(force=True)`,
         `_compute_kwargs.cache_clear()`.
   Upstream fix: an all2all backend registry (vLLM PR #50556, OOT P/F registry) or
         the names in-tree (PR #47948).  Removal: when vLLM ships either.
2. platform/arg_utils_help.py -- `vllm.engine.arg_utils.get_kwargs`
   What: `--all2all-backend` help describes our backends.
   Why:  help text comes from vLLM's field docstring.   How: wrap, append text.
   Upstream fix: same registry with per-backend help.   Removal: with 1.
3. platform/parallel_config_properties.py -- `ParallelConfig.use_sequence_parallel_moe`,
   `ParallelConfig.use_batched_dp_moe`
   What: both backends use SP MoE under DP+TP+EP; LL counts as batched DP MoE (sets
         the 256-token default that becomes the LL per-rank capacity).
   Why:  hard-coded backend lists.   How: replace the properties, defer otherwise.
   Upstream fix: backend capability flags in the registry.   Removal: with 1.
4. platform/vllm_config_post_init.py -- `VllmConfig.__post_init__`
   What: config-time validation (quantization, dtype, top_k, hidden size, FT+HT, DBO,
         nccl.ep presence, torch CUDA major, no-op warning).
   Why:  no hook for backend-specific checks.   How: wrap, validate first.
   Upstream fix: a `validate(vllm_config)` hook in the registry.   Removal: with 1.
5. platform/compilation_cudagraph.py -- `CompilationConfig.set_splitting_ops_for_v1`
   What: per-backend CUDA-graph policy (vllm_flashinfer_ep/vllm/cudagraph_policy.py).
   Why:  vLLM's only gate is DeepEP-HT under VLLM_COMPILE.   How: wrap, apply first.
   Upstream fix: a per-backend `supports_cudagraph` capability.   Removal: with 1.
5b. platform/vllm_envs_known.py -- `vllm.envs.environment_variables`
   What: our documented VLLM_FLASHINFER_EP_* names become known variables.
   Why:  `Platform.validate_environ` logs "Unknown vLLM environment variable" for them.
   How:  add one raw-string getter per name (values are validated by patch 4).
   Upstream fix: a plugin hook for extra env vars.   Removal: then.

Worker patches (matter in workers: communicator init, model load, FT sentinel)
-----------------------------------------------------------------------------
6. worker/cuda_communicator.py -- `CudaCommunicator.__init__`
   What: our managers on the EP group.   Why: name -> manager if/elif ends in
         ValueError; the class must stay CudaCommunicator (identity-checked).
   How:  wrap; call original with use_all2all=False, then install ours.
   Upstream fix: manager registry.   Removal: with 1.
7. worker/prepare_finalize_selection.py -- `all2all_utils.maybe_make_prepare_finalize`
   What: our LL/HT prepare/finalize.   Why: if/elif returns None for unknown names.
   How:  wrap; rebind in all2all_utils and every loaded vllm module importing it.
   Upstream fix: PR #50556 (OOT prepare/finalize registry).   Removal: when released.
8. worker/fused_moe_parallel_config.py -- `FusedMoEParallelConfig.use_batched_activation_format`
   What: True for LL.   Why: oracles pick Batched experts from it.   How: replace property.
   Upstream fix: P/F-declared activation format before expert selection.   Removal: with 7.
9. worker/hidden_size_roundup.py -- `all2all_utils.maybe_roundup_layer_hidden_size`
   What: LL rounds to NCCL-EP's sizes (no 3072), logged.   Why: DeepEP/NIXL lists only.
   How:  replace module attribute (reached by a function-local import).
   Upstream fix: P/F class method in the registry.   Removal: with 7.
10. worker/ft_backend_set.py -- `gpu_worker_sentinel.FT_BACKEND_SET`
   What: add LL.   Why: the sentinel raises for other backends.   How: rebind global.
   Upstream fix: ask the manager's `support_fault_tolerance` instead.   Removal: then.
11. worker/router_gate_width.py -- `GateLinear.forward`
   What: the router sees unpadded activations.   Why: vLLM pads activations to the
         rounded hidden size (9) before the runner applies the gate it holds; the gate's
         weight has the checkpoint width (shape error at hidden 3072).
   How:  wrap, slice rows back to the gate's input_size (zeros dropped, same logits).
   Upstream fix: gate before padding in the MoE runner.   Removal: then, or with 9.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class PatchEntry:
    module: str
    stage: str  # "platform" | "worker"

    def load(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")


PATCHES: tuple[PatchEntry, ...] = (
    PatchEntry("platform.parallel_config_backend", "platform"),
    PatchEntry("platform.arg_utils_help", "platform"),
    PatchEntry("platform.parallel_config_properties", "platform"),
    PatchEntry("platform.vllm_config_post_init", "platform"),
    PatchEntry("platform.compilation_cudagraph", "platform"),
    PatchEntry("platform.vllm_envs_known", "platform"),
    PatchEntry("worker.cuda_communicator", "worker"),
    PatchEntry("worker.prepare_finalize_selection", "worker"),
    PatchEntry("worker.fused_moe_parallel_config", "worker"),
    PatchEntry("worker.hidden_size_roundup", "worker"),
    PatchEntry("worker.ft_backend_set", "worker"),
    PatchEntry("worker.router_gate_width", "worker"),
)


def apply_all() -> None:
    for entry in PATCHES:
        entry.load().apply()


def status() -> dict[str, bool]:
    """{module: is_applied()} for every patch."""
    return {entry.module: entry.load().is_applied() for entry in PATCHES}
