"""Accept our backend names in `ParallelConfig.all2all_backend` (and so in the CLI).

Patches: vllm/config/parallel.py l.45-60 `All2AllBackend` Literal, field
`ParallelConfig.all2all_backend` (l.220). The pydantic dataclass validates against
the field type, and `literal_to_kwargs` (vllm/engine/arg_utils.py l.220-234) builds
`--all2all-backend` choices from it, cached by `_compute_kwargs` (l.324).
How: replace the field's type and annotation with a Literal that adds our names,
`rebuild_dataclass(force=True)`, and clear `_compute_kwargs`'s cache.
"""

from __future__ import annotations

from typing import Literal, get_args

from vllm_flashinfer_ep.backends import BACKENDS

TARGET = "vllm.config.parallel.ParallelConfig.all2all_backend"


def _field():
    from vllm.config.parallel import ParallelConfig

    return ParallelConfig, ParallelConfig.__dataclass_fields__["all2all_backend"]


def is_applied() -> bool:
    _, field = _field()
    return all(name in get_args(field.type) for name in BACKENDS)


def apply() -> None:
    if is_applied():
        return
    import pydantic.dataclasses
    import vllm.config.parallel as parallel_mod
    import vllm.engine.arg_utils as arg_utils

    cls, field = _field()
    names = tuple(get_args(field.type)) + tuple(b for b in BACKENDS if b not in get_args(field.type))
    new_type = Literal[names]  # type: ignore[valid-type]
    field.type = new_type
    cls.__annotations__["all2all_backend"] = new_type
    parallel_mod.All2AllBackend = new_type
    pydantic.dataclasses.rebuild_dataclass(cls, force=True)
    arg_utils._compute_kwargs.cache_clear()
