"""Gate CUDA-graph mode per flashinfer_ep backend, in every compilation mode.

Patches: `vllm.config.compilation.CompilationConfig.set_splitting_ops_for_v1`
(vllm/config/compilation.py l.1162), called from `VllmConfig.__post_init__`
(vllm/config/vllm.py l.2155-2164) with the backend and the effective DP size. Its own
gate (DeepEP-HT only, l.1242-1258) sits after an early return for non-VLLM_COMPILE
modes, so it never runs for the other compilation modes.
How: wrap it; apply `cudagraph_policy.apply` before the original runs.
"""

from __future__ import annotations

from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = "vllm.config.compilation.CompilationConfig.set_splitting_ops_for_v1"


def is_applied() -> bool:
    from vllm.config.compilation import CompilationConfig

    return is_marked(CompilationConfig.set_splitting_ops_for_v1)


def apply() -> None:
    from vllm.config.compilation import CompilationConfig

    from vllm_flashinfer_ep.vllm import cudagraph_policy

    if is_applied():
        return
    original = CompilationConfig.set_splitting_ops_for_v1

    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1):
        cudagraph_policy.apply(self, all2all_backend, data_parallel_size)
        return original(self, all2all_backend, data_parallel_size)

    CompilationConfig.set_splitting_ops_for_v1 = mark(set_splitting_ops_for_v1, original)
