"""doctor's host checks: the installed packages and the plugin entry point, the package's
VLLM_FLASHINFER_EP_* variables, and what a missing CUDA driver explains."""

from __future__ import annotations

import importlib.metadata
import os

from vllm_flashinfer_ep import envs, is_supported_vllm
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.vllm import config_rules as rules


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_checks() -> list[Check]:
    vllm = _version("vllm")
    fi = _version("flashinfer-python")
    checks = [
        Check(
            "vllm",
            is_supported_vllm(vllm),
            vllm or "not installed",
            "pip install vllm==0.33.0 (the only vLLM this plugin patches)",
        ),
        Check(
            "flashinfer-python",
            fi == "0.7.2.post1",
            fi or "not installed",
            "pip install flashinfer-python==0.7.2.post1",
        ),
        Check(
            "nccl-extensions",
            _version("nccl-extensions") is not None,
            _version("nccl-extensions") or "not installed",
            "pip install 'nccl-extensions>=0.1.0'",
        ),
    ]
    plugins = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    checks.append(
        Check(
            "vLLM plugin entry point",
            "flashinfer_ep" in plugins,
            f"vllm.general_plugins: {sorted(plugins)}",
            "pip install vllm-flashinfer-ep (the entry point makes vLLM load the plugin)",
        )
    )
    allowed = os.environ.get("VLLM_PLUGINS")  # vLLM loads only the plugins it names
    if allowed is not None:
        named = allowed.split(",")
        checks.append(
            Check(
                "VLLM_PLUGINS",
                "flashinfer_ep" in named,
                f"VLLM_PLUGINS={allowed!r}",
                "vLLM loads only the general plugins VLLM_PLUGINS names: add flashinfer_ep "
                "to it, or unset it",
            )
        )
    from vllm_flashinfer_ep.runtime.transport import handle_supports_update

    checks.append(
        Check(
            "FlashInfer Handle.update",
            handle_supports_update(),
            "present (CUDA graphs possible with flashinfer_ep_low_latency)"
            if handle_supports_update()
            else "missing",
            "install flashinfer-python==0.7.2.post1 (older releases cannot update handles)",
        )
    )
    return checks


def driver_consequences(checks: list[Check]) -> list[Check]:
    """Without the CUDA driver, libnccl_ep cannot be dlopened either (it links libcuda.so.1):
    one problem, one fix. That failure becomes a [warn] naming the driver, not a second
    [FAIL] with a reinstall hint; a libnccl_ep failure for any other reason stays."""
    driver = next((c for c in checks if c.name == "CUDA driver"), None)
    if driver is None or driver.ok:
        return checks
    return [
        Check(
            c.name,
            True,
            "not checked: loading it needs the CUDA driver (libcuda.so.1), which does not "
            "load here (see CUDA driver)",
            "fix the CUDA driver, then run doctor again",
            warn=True,
        )
        if c.name == "libnccl_ep" and not c.ok and "libcuda" in c.detail
        else c
        for c in checks
    ]


def variables_check(backend: str | None = None) -> Check:
    """The package's VLLM_FLASHINFER_EP_* variables, as config time parses them. With
    another `--all2all-backend` the engine reads none of them and accepts bad values: a
    warning then, not a failure."""
    from vllm_flashinfer_ep.backends import is_ours

    name = "VLLM_FLASHINFER_EP_* variables"
    try:
        envs.validate_all()
        problem = None
        transport = rules.transport_reason()  # the engine's check, FlashInfer asked as there
        if transport is not None:
            problem = (f"{envs.TRANSPORT}=nixl_ep", transport)
    except Exception as exc:  # noqa: BLE001 - FlashInferEPEnvVarError: one line naming each
        problem = (str(exc), "fix or unset them")
    if problem is not None and backend is not None and not is_ours(backend):
        return Check(
            name,
            True,
            f"{problem[0]} (not read with --all2all-backend {backend})",
            f"{problem[1]} before serving with a flashinfer_ep backend",
            warn=True,
        )
    if problem is not None:
        return Check(name, False, *problem)
    set_ = sorted(k for k in os.environ if k.startswith(envs.PREFIX))
    return Check(
        "VLLM_FLASHINFER_EP_* variables", True, ", ".join(set_) if set_ else "none set (defaults)"
    )
