"""Describe our two backends in `--all2all-backend`'s help text.

Patches: `vllm.engine.arg_utils.get_kwargs` (l.443), which `EngineArgs.add_cli_args`
calls by module-global name for `ParallelConfig`.
How: wrap it; for ParallelConfig append one line per backend to the help string.
"""

from __future__ import annotations

from vllm_flashinfer_ep.backends import HELP
from vllm_flashinfer_ep.vllm.patches._util import is_marked, mark

TARGET = "vllm.engine.arg_utils.get_kwargs"


def is_applied() -> bool:
    import vllm.engine.arg_utils as arg_utils

    return is_marked(arg_utils.get_kwargs)


def apply() -> None:
    import vllm.engine.arg_utils as arg_utils
    from vllm.config.parallel import ParallelConfig

    if is_applied():
        return
    original = arg_utils.get_kwargs

    def get_kwargs(cls):
        kwargs = original(cls)
        if cls is ParallelConfig and "all2all_backend" in kwargs:
            entry = kwargs["all2all_backend"]
            extra = "\n".join(f"- {name}: {text}" for name, text in HELP.items())
            entry["help"] = (entry.get("help") or "") + "\n\nAdded by vllm-flashinfer-ep:\n" + extra
        return kwargs

    arg_utils.get_kwargs = mark(get_kwargs, original)
