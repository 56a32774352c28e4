"""Harness-only bridge: vLLM 0.33.0 Python sources on the device image.

Never imported by the package. The device has torch 2.11.0+cu130 and triton
3.6.0 but no vLLM; scripts/stage_vllm_device.sh stages vLLM's Python sources
only (no compiled extensions, which are also built for torch 2.14), and
scripts/device_vllm_env.sh puts them on PYTHONPATH with an empty placeholder
for ``vllm._C_stable_libtorch``. Two things are then missing:

1. vLLM's compiled ops. ``vllm/_custom_ops.py`` and the fused-MoE modules look
   them up lazily as ``torch.ops._C.<name>`` / ``torch.ops._moe_C.<name>`` at
   call time (a few at import time). ``apply()`` registers torch fallbacks under
   those names, with vLLM's own schemas, for exactly the ops the unquantized
   BF16 paths below call, and only where the op is not already registered:

   * import time (``quantization/utils/w8a8_utils.py`` etc., on the CUDA
     platform): the ``cutlass_*_supported`` / ``*_supports_*`` capability
     queries -> False, so vLLM never selects a CUTLASS kernel.
   * ``TritonExperts`` (standard layout; ``fused_moe.py`` /
     ``experts/triton_moe.py``): ``_moe_C::moe_align_block_size``
     (``moe_align_block_size.py``), ``_C::silu_and_mul`` (``activation.py``),
     ``_moe_C::moe_sum`` (``TritonExperts.moe_sum``).
   * ``BatchedTritonExperts`` (``experts/fused_batched_moe.py``):
     ``_C::masked_moe_activation`` (``activation.py``, called with
     ``valid_token_counts``); its GEMMs are Triton.
   * also ``_C::gelu_and_mul`` / ``gelu_tanh_and_mul`` (same code path as
     silu_and_mul, other activations).

   The Triton GEMM kernels themselves are vLLM's, unchanged.

   Also ``vllm.vllm_flash_attn``: its ``__init__`` raises ImportError when the
   flash-attention .so files are absent, and on the CUDA platform the fused-MoE
   import chain reaches it (fused_moe/utils.py -> models/utils.py ->
   model_loader -> layers/attention -> v1/attention/backends/fa_utils.py).
   ``apply()`` installs the package without running that ``__init__`` and
   re-exports the real ``flash_attn_interface`` names (FA2/FA3_AVAILABLE is
   False there; attention is never called by the MoE tests).

2. torch symbols newer than 2.11. Every ``torch.*`` attribute chain and
   ``from torch... import`` in the modules the import chain loads (CUDA
   platform) was resolved against torch 2.11.0+cu130 (the device's build, run
   on CPU): two are missing, both off the eager MoE path (see
   ``_TORCH_COMPAT``). ``apply()`` fills an entry only if it is absent and
   records what it did.

Usage (before importing any vllm.model_executor module)::

    import vllm_device_shim
    patched = vllm_device_shim.apply()
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

PATCHED: list[str] = []
_LIBS: dict[str, torch.library.Library] = {}
_APPLIED = False


def _note(what: str) -> None:
    if what not in PATCHED:
        PATCHED.append(what)


# --------------------------------------------------------------------------
# 1. torch compatibility (2.14 names used by vLLM 0.33.0, absent in 2.11)
# --------------------------------------------------------------------------


def _accelerator_empty_host_cache() -> None:
    # torch 2.11 has the C hook but not the torch.accelerator wrapper
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()


# (dotted owner, attribute, fallback factory). Set only when missing.
# Measured: of the 749 torch.* references in the modules the MoE import chain
# loads (CUDA platform), these are the ones torch 2.11.0 lacks:
#   torch.accelerator.empty_host_cache  distributed/parallel_state.py shutdown
#       (vLLM already catches AttributeError; filled to keep the log quiet)
#   torch._inductor.utils.maybe_log_cudagraph_partition  env_override.py,
#       imported inside an inductor-partition hook only used by torch.compile
#       with graph partition; not on the eager MoE path, not patched.
_TORCH_COMPAT: list[tuple[str, str, Callable[[], object]]] = [
    ("torch.accelerator", "empty_host_cache", lambda: _accelerator_empty_host_cache),
]


def _resolve(dotted: str):
    obj = torch
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _apply_torch_compat() -> None:
    for owner_name, attr, factory in _TORCH_COMPAT:
        owner = _resolve(owner_name)
        if owner is None or hasattr(owner, attr):
            continue
        setattr(owner, attr, factory())
        _note(f"{owner_name}.{attr} (torch fallback)")


# --------------------------------------------------------------------------
# 2. vLLM compiled-op fallbacks (torch.ops._C / torch.ops._moe_C)
# --------------------------------------------------------------------------


def _has_op(ns: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, ns), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _register(ns: str, schema: str, fn: Callable) -> None:
    name = schema.split("(", 1)[0]
    if _has_op(ns, name):
        return
    lib = _LIBS.get(ns)
    if lib is None:
        lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")  # noqa: TOR901
    lib.define(schema)
    lib.impl(name, fn, "CompositeExplicitAutograd")
    _note(f"torch.ops.{ns}.{name}")


def _false(cuda_device_capability: int) -> bool:
    return False


def _gated(act: Callable[[torch.Tensor], torch.Tensor]):
    def fn(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        xf = x.float()
        out.copy_((act(xf[..., :d]) * xf[..., d:]).to(out.dtype))

    return fn


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}


def _masked_moe_activation(
    out: torch.Tensor,
    x: torch.Tensor,
    valid_token_counts: torch.Tensor,
    activation: str,
    clamp_limit: float = 0.0,
    alpha: float = 1.0,
    beta: float = 0.0,
    situ_beta: float = 1.0,
    situ_linear_beta: float = -1.0,
) -> None:
    act = _ACTS.get(activation)
    if act is None:
        raise NotImplementedError(
            f"vllm_device_shim: masked_moe_activation({activation!r}) has no torch "
            f"fallback (only {sorted(_ACTS)})"
        )
    # Rows at or past each count are left untouched (vLLM zero-fills `out`).
    # No host read of the counts: this must also run under CUDA-graph capture.
    x3 = x if x.dim() == 3 else x.unsqueeze(0)
    o3 = out if out.dim() == 3 else out.unsqueeze(0)
    d = x3.shape[-1] // 2
    full = (act(x3[..., :d].float()) * x3[..., d:].float()).to(o3.dtype)
    rows = torch.arange(x3.shape[1], device=x3.device).view(1, -1, 1)
    valid = rows < valid_token_counts.view(-1, 1, 1).to(rows.dtype)
    o3.copy_(torch.where(valid, full, o3))


def _moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    maybe_expert_map: torch.Tensor | None,
    scatter_idx: torch.Tensor | None = None,
) -> None:
    """Same outputs as vLLM's CUDA kernel for the no-expert-map case: each
    expert's routed slots (flat indices into topk_ids) padded to a multiple of
    block_size with the sentinel topk_ids.numel(); one expert id per block;
    the padded total. Order within an expert is ascending (the kernel's is
    unspecified). Blocks past the total get -1 and are never read."""
    if maybe_expert_map is not None or scatter_idx is not None:
        raise NotImplementedError(
            "vllm_device_shim: moe_align_block_size fallback covers the no-expert-map path only"
        )
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    order = torch.argsort(flat, stable=True)
    total = int(padded.sum())
    if total > sorted_token_ids.numel():
        raise RuntimeError("vllm_device_shim: moe_align_block_size output too small")
    sorted_token_ids.fill_(numel)
    experts_ids.fill_(-1)
    starts = torch.cumsum(padded, 0) - padded
    src_starts = torch.cumsum(counts, 0) - counts
    for e in torch.nonzero(counts).flatten().tolist():
        c, s, p = int(counts[e]), int(starts[e]), int(padded[e])
        src = int(src_starts[e])
        sorted_token_ids[s : s + c] = order[src : src + c].to(sorted_token_ids.dtype)
        experts_ids[s // block_size : (s + p) // block_size] = e
    num_tokens_post_pad.fill_(total)


def _moe_sum(
    x: torch.Tensor,
    output: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    if expert_map is not None and topk_ids is not None:
        keep = (expert_map[topk_ids.long()] >= 0).unsqueeze(-1)
        x = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    output.copy_(x.float().sum(dim=1).to(output.dtype))


_OPS: list[tuple[str, str, Callable]] = [
    # capability queries, called at import time on the CUDA platform
    ("_C", "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool", _false),
    ("_C", "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool", _false),
    ("_C", "cutlass_scaled_mm_supports_fp4(int cuda_device_capability) -> bool", _false),
    ("_C", "cutlass_group_gemm_supported(int cuda_device_capability) -> bool", _false),
    ("_C", "mxfp4_experts_quant_supported(int cuda_device_capability) -> bool", _false),
    # activations (activation.py: apply_moe_activation)
    ("_C", "silu_and_mul(Tensor! result, Tensor input) -> ()", _gated(F.silu)),
    ("_C", "gelu_and_mul(Tensor! out, Tensor input) -> ()", _gated(F.gelu)),
    ("_C", "gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()", _gated(_ACTS["gelu_tanh"])),
    (
        "_C",
        "masked_moe_activation(Tensor! out, Tensor input, Tensor valid_token_counts, "
        "str activation, float clamp_limit=0.0, float alpha=1.0, float beta=0.0, "
        "float situ_beta=1.0, float situ_linear_beta=-1.0) -> ()",
        _masked_moe_activation,
    ),
    # routing / reduction (moe_align_block_size.py, TritonExperts.moe_sum)
    (
        "_moe_C",
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
        "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad, "
        "Tensor? maybe_expert_map, Tensor(a!)? scatter_idx=None) -> ()",
        _moe_align_block_size,
    ),
    (
        "_moe_C",
        "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, "
        "Tensor? expert_map=None) -> ()",
        _moe_sum,
    ),
]


# names vllm/vllm_flash_attn/__init__.py re-exports
_FA_NAMES = (
    "FA2_AVAILABLE",
    "FA3_AVAILABLE",
    "compile_flash_attn_varlen_func_from_specs",
    "fa_version_unsupported_reason",
    "flash_attn_varlen_func",
    "get_scheduler_metadata",
    "is_fa_version_supported",
)


def _bridge_flash_attn() -> None:
    name = "vllm.vllm_flash_attn"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return
    pkg_dir = os.path.join(os.path.dirname(spec.origin), "vllm_flash_attn")
    if not os.path.isdir(pkg_dir) or glob.glob(os.path.join(pkg_dir, "_vllm_fa*_C*.so")):
        return  # absent, or the real extensions are there: leave it alone
    parent = importlib.import_module("vllm")  # light: no model_executor import
    mod = types.ModuleType(name)
    mod.__path__ = [pkg_dir]
    mod.__package__ = name
    mod.__file__ = os.path.join(pkg_dir, "__init__.py")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__spec__.submodule_search_locations = mod.__path__
    sys.modules[name] = mod
    try:
        iface = importlib.import_module(name + ".flash_attn_interface")
    except Exception:
        del sys.modules[name]
        raise
    for n in _FA_NAMES:
        if hasattr(iface, n):
            setattr(mod, n, getattr(iface, n))
    parent.vllm_flash_attn = mod
    _note("vllm.vllm_flash_attn (package __init__ bypassed: no FA .so staged)")


def _bridge_stream_is_capturing() -> None:
    """torch 2.11's ``torch.Stream`` has no ``is_capturing()`` (2.14 has).

    vLLM 0.33.0 calls ``torch.accelerator.current_stream().is_capturing()`` in
    exactly one place, ``experts/fused_batched_moe.py::_is_capturing_or_compiling``
    (l.41-46). Replace that helper with the same question asked through
    ``torch.cuda.is_current_stream_capturing()``, which 2.11 has.
    """
    if hasattr(torch.Stream, "is_capturing"):
        return
    mod = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.fused_batched_moe")

    def _is_capturing_or_compiling() -> bool:
        return torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()

    mod._is_capturing_or_compiling = _is_capturing_or_compiling
    _note("vllm fused_batched_moe._is_capturing_or_compiling (torch.Stream.is_capturing missing)")


def apply(*, ops: bool = True, torch_compat: bool = True) -> list[str]:
    """Patch what is missing; return (and keep in PATCHED) what was patched.

    Call before importing vllm.model_executor.*: some capability queries run
    at import time. Idempotent.
    """
    global _APPLIED
    if torch_compat:
        _apply_torch_compat()
    if ops:
        for ns, schema, fn in _OPS:
            _register(ns, schema, fn)
        _bridge_flash_attn()
    if torch_compat:
        _bridge_stream_is_capturing()
    _APPLIED = True
    os.environ.setdefault("VLLM_DEVICE_SHIM", "1")
    return list(PATCHED)


def describe() -> str:
    return "vllm_device_shim patched: " + (", ".join(PATCHED) if PATCHED else "nothing")
