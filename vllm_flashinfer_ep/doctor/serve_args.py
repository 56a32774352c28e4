"""doctor's verdicts on the parallel `vllm serve` arguments: the --all2all-backend name,
micro-batching, fault tolerance, expert placement, and whether expert parallelism runs."""

from __future__ import annotations

from vllm_flashinfer_ep import backends
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.doctor.settings import ServeSettings, checked_backend
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.vllm import config_rules as rules


def accepted_backends() -> tuple[str, ...]:
    """The --all2all-backend names `vllm serve` accepts with this plugin: the patched field
    Literal (patches/platform.make_backend_literal), less vLLM's passthrough backend."""
    from typing import get_args

    from vllm.config.kernel import PASSTHROUGH_ALL2ALL_BACKEND
    from vllm.config.parallel import ParallelConfig

    from vllm_flashinfer_ep.vllm.patches.platform import make_backend_literal

    field_type = ParallelConfig.__dataclass_fields__["all2all_backend"].type
    names = get_args(make_backend_literal(field_type))
    return tuple(n for n in names if n != PASSTHROUGH_ALL2ALL_BACKEND)


def _backend_check(name: str) -> Check:
    """--all2all-backend: one of ours, another vLLM backend (the checks are then those of
    low latency), or a name vLLM's parser refuses."""
    if backends.is_ours(name):
        return Check("all2all backend", True, name)
    ours = " or ".join(f"--all2all-backend {b}" for b in backends.BACKENDS)
    if name not in accepted_backends():
        return Check(
            "all2all backend",
            False,
            f"{name} is not a name vLLM accepts: `vllm serve` refuses it when it parses "
            f"its arguments; the checks below are those of {LOW_LATENCY}",
            f"pass {ours}",
        )
    return Check(
        "all2all backend",
        True,
        f"{name} is not a flashinfer_ep backend; the checks below are those of {LOW_LATENCY}",
        f"pass {ours} to use NCCL-EP",
        warn=True,
    )


def serve_checks(settings: ServeSettings) -> list[Check]:
    """The engine's config-time verdicts on the parallel `vllm serve` arguments."""
    checks = [_backend_check(settings.backend)]
    backend = checked_backend(settings.backend)
    flag = f"--all2all-backend {backend}"
    if settings.use_ubatching:
        reason = rules.ubatching_reason(flag, settings.use_ubatching)
        asked = ["--enable-dbo"] if settings.enable_dbo else []
        if settings.ubatch_size > 1:
            asked.append(f"--ubatch-size {settings.ubatch_size}")
        checks.append(Check("micro-batching", reason is None, " ".join(asked), reason or ""))
    if settings.enable_fault_tolerance:
        reason = rules.fault_tolerance_reason(flag, backend, settings.enable_fault_tolerance)
        detail = f"--enable-fault-tolerance with {backend}"
        checks.append(Check("fault tolerance", reason is None, detail, reason or ""))
    if settings.enable_elastic_ep:
        reason = rules.elastic_ep_reason(flag, True)
        checks.append(Check("elastic EP", False, "--enable-elastic-ep", reason or ""))
    if settings.expert_placement_strategy != "linear":
        reason = rules.placement_reason(flag, settings.expert_placement_strategy)
        detail = f"--expert-placement-strategy {settings.expert_placement_strategy}"
        checks.append(Check("expert placement", reason is None, detail, reason or ""))
    warning = rules.unused_backend_warning(
        backend, settings.use_all2all, settings.enable_expert_parallel
    )
    sizes = [f"--data-parallel-size {settings.data_parallel_size}"]
    if settings.prefill_context_parallel_size > 1:
        sizes.append(f"--prefill-context-parallel-size {settings.prefill_context_parallel_size}")
    sizes.append(f"--tensor-parallel-size {settings.tensor_parallel_size}")
    detail = f"EP world {settings.ep_world} ({' x '.join(sizes)}), " + (
        "--enable-expert-parallel" if settings.enable_expert_parallel else "expert parallel off"
    )
    checks.append(Check("expert parallel", True, detail, warning or "", warn=warning is not None))
    return checks
