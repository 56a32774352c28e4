"""Make the package's documented environment variables known to vLLM.

Patches: `vllm.envs.environment_variables` (vllm/envs.py l.619), the dict vLLM's
`Platform.validate_environ` (vllm/platforms/interface.py l.1458-1471) checks every
`VLLM_*` variable against, logging "Unknown vLLM environment variable detected" (or
raising under `--fail-on-environ-validation`) for the rest.
Why: vLLM 0.33.0 has no API for plugins to declare variables; our names start with
`VLLM_` (documented, kept), so valid settings were reported as unknown.
How: add one getter per name in `vllm_flashinfer_ep.envs.VARIABLES`. The getters return
the raw string (they never raise: vLLM also calls them when hashing compile-cache
factors); values are validated by `envs.validate_all` at engine-config time.
Upstream fix: a plugin hook for extra env vars.  Removal: then.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from vllm_flashinfer_ep import envs

TARGET = "vllm.envs.environment_variables"


def _getter(name: str, default: str) -> Callable[[], str]:
    def get() -> str:
        return os.environ.get(name, default)

    get.__flashinfer_ep_patch__ = True  # type: ignore[attr-defined]
    return get


def _table() -> dict | None:
    import vllm.envs as vllm_envs

    table = getattr(vllm_envs, "environment_variables", None)
    return table if isinstance(table, dict) else None


def is_applied() -> bool:
    table = _table()
    return table is not None and all(
        getattr(table.get(v.name), "__flashinfer_ep_patch__", False) for v in envs.VARIABLES
    )


def apply() -> None:
    table = _table()
    if table is None or is_applied():
        return
    for var in envs.VARIABLES:
        table.setdefault(var.name, _getter(var.name, var.default))
