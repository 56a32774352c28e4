"""vLLM 0.33.0's own modular-kernel combination test on this package's experts (world 1, one GPU).

vLLM's test files are not in this repository: they are read from the git-ignored `.vllm-tests/`
at the repository root, at vLLM's own paths. They are v0.33.0's (commit 4ba787ec9, the wheel's
`__commit_id__`; `git archive v0.33.0` has the same), from PyPI's sdist, sha256
f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112:

    curl -LO https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz
    k=vllm-0.33.0/tests/kernels
    mkdir -p .vllm-tests && tar xzf vllm-0.33.0.tar.gz -C .vllm-tests --strip-components=1 \
        vllm-0.33.0/tests/__init__.py $k/__init__.py $k/moe/__init__.py $k/moe/utils.py \
        $k/moe/test_modular_kernel_combinations.py $k/moe/modular_kernel_tools $k/utils.py \
        $k/quant_utils.py $k/quantization/nvfp4_utils.py

What this adds to vLLM's harness:
- 0.33.0's mk_objects registers no BatchedExperts-format P/F for one GPU, and make_modular_kernel
  takes maybe_make_prepare_finalize's (NoDPEP at world 1 on CUDA): this registers vLLM's
  BatchedPrepareAndFinalize (register_prepare_and_finalize) and builds it for its configs.
- The experts get vLLM's register_experts flags for BatchedTritonExperts / BatchedDeepGemmExperts,
  dtypes cut to FP8, bf16, fp16 (0.33.0's make_fused_experts builds any batched class as is).
- Cases: vLLM's generate_valid_test_cases(world_size=1) (MK_QUANT_CONFIGS x MK_ACTIVATIONS,
  filtered by each class's _supports_quant_scheme), each run by vLLM's
  test_modular_kernel_combinations_singlegpu in a spawned worker, whose worker function is
  this module's: a worker imports this module, which registers the plugin and the above first.

GPU:  python3 tests/kernels/vllm_combinations.py [-v] [-k LABEL-SUBSTRING] [--classes vllm]
      python3 -m pytest tests/kernels/vllm_combinations.py -m gpu -s
CPU:  python3 tests/kernels/vllm_combinations.py --list [--classes vllm]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from itertools import product
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VLLM_TESTS = ROOT / ".vllm-tests"
TEST_MODULE = "tests.kernels.moe.test_modular_kernel_combinations"
TOOLS = "tests.kernels.moe.modular_kernel_tools"
_ENV = "FLASHINFER_EP_VLLM_COMBINATIONS"  # which classes, for the spawned workers
FUSED_MOE = "vllm.model_executor.layers.fused_moe"
CLASSES = {  # (module, class, whose registration flags to mirror)
    "ours": [
        ("vllm_flashinfer_ep.experts.received_rows", "ReceivedRowsExperts", "triton"),
        ("vllm_flashinfer_ep.experts.deep_gemm", "ReceivedRowsOrDeepGemmExperts", "deep_gemm"),
    ],
    "vllm": [
        (f"{FUSED_MOE}.experts.fused_batched_moe", "BatchedTritonExperts", "triton"),
        (f"{FUSED_MOE}.experts.batched_deep_gemm_moe", "BatchedDeepGemmExperts", "deep_gemm"),
    ],
}
FLAGS = {  # vLLM's register_experts flags for BatchedTritonExperts, BatchedDeepGemmExperts
    "triton": dict(needs_matching_quant=True),
    "deep_gemm": dict(needs_matching_quant=False, needs_deep_gemm=True),
}
_S: dict = {}  # this process's setup


def _import_vllm_tests():
    """Import vLLM's test module with `tests` as .vllm-tests/tests; give back this repo's."""
    ours = {
        k: sys.modules.pop(k)
        for k, m in list(sys.modules.items())
        if (k == "tests" or k.startswith("tests."))
        and str(VLLM_TESTS) not in str(getattr(m, "__file__", None) or getattr(m, "__path__", ""))
    }
    try:
        return importlib.import_module(TEST_MODULE)
    finally:
        if ours:  # pytest had imported ours; vLLM's modules below tests.kernels stay loaded
            sys.modules.pop("tests", None), sys.modules.pop("tests.kernels", None)
            sys.modules.update(ours)


def _setup(which: str) -> dict:
    if _S:
        return _S
    os.environ[_ENV] = which
    for p in (str(ROOT), str(VLLM_TESTS)):  # .vllm-tests first: its `tests` is vLLM's
        if p not in sys.path:
            sys.path.insert(0, p)
    import vllm_flashinfer_ep

    vllm_flashinfer_ep.register()
    fm = importlib.import_module(FUSED_MOE)
    if not hasattr(fm, "TritonExperts"):  # exported only where Triton has a driver (not CPU)
        fm.TritonExperts = importlib.import_module(f"{FUSED_MOE}.experts.triton_moe").TritonExperts
    pf = importlib.import_module(f"{FUSED_MOE}.prepare_finalize.batched").BatchedPrepareAndFinalize
    T = _import_vllm_tests()
    M, common = (importlib.import_module(f"{TOOLS}.{m}") for m in ("mk_objects", "common"))
    if pf not in M.PREPARE_FINALIZE_INFO:  # block quant supported; backend None: single GPU
        M.register_prepare_and_finalize(pf, M.batched_format, M.common_float_types, True, None)
    classes = [getattr(importlib.import_module(m), c) for m, c, _ in CLASSES[which]]
    for cls, (_, _, kind) in zip(classes, CLASSES[which]):
        if cls not in M.EXPERT_INFO:  # vLLM's own classes are registered by mk_objects
            dtypes = M.fp8_types + ([torch.bfloat16, torch.float16] if kind == "triton" else [])
            M.register_experts(cls, M.batched_format, dtypes, True, **FLAGS[kind])
    make_mk, make_pf = common.make_modular_kernel, common.maybe_make_prepare_finalize

    def make_modular_kernel(config, vllm_config, quant_config):
        def batched(moe, quant_config, **_):
            return pf(moe.max_num_tokens, moe.num_local_experts, 1, moe.moe_parallel_config.ep_rank)

        new = batched if config.prepare_finalize_type is pf else make_pf
        with mock.patch.object(common, "maybe_make_prepare_finalize", new):
            return make_mk(config, vllm_config, quant_config)

    common.make_modular_kernel = make_modular_kernel
    _S.update(T=T, M=M, common=common, pf=pf, classes=classes, rank_worker=T.rank_worker)
    T.rank_worker = _rank_worker
    return _S


def _rank_worker(*args, **kwargs):
    """vLLM's rank_worker, reached through this module so that spawned workers set up first."""
    return _setup(os.environ[_ENV])["rank_worker"](*args, **kwargs)


if os.environ.get(_ENV):  # a spawned worker, importing this module to unpickle _rank_worker
    _setup(os.environ[_ENV])


def _label(case) -> str:
    q, act, fe = case[4], case[5], case[7]
    quant = "bf16" if q is None or q.quant_dtype is None else str(q.quant_dtype)
    if q is not None and q.quant_dtype == torch.float8_e4m3fn:
        w = "block128" if q.block_shape else "channel" if q.per_out_ch_quant else "tensor"
        a = "block128" if q.block_shape else "token" if q.per_act_token_quant else "tensor-static"
        quant = f"fp8 W={w} A={a}"
    return f"{fe.__name__} | {quant} | {act.name}"


@contextlib.contextmanager
def _as_sm90(s: dict):
    """Validity as on an sm_90 GPU with DeepGEMM, for --list on a host without CUDA."""
    from vllm.platforms import current_platform as p

    def cap(c, device_id=0):
        return (c if isinstance(c, int) else c[0] * 10 + c[1]) <= 90

    yes = staticmethod(lambda: True)
    with contextlib.ExitStack() as stack:
        for target, name, new in [
            (p, "is_cuda", yes),
            (p, "is_cuda_alike", yes),
            (p, "has_device_capability", cap),
            (s["common"], "has_deep_gemm", yes),
        ] + [(c, "_supports_current_device", yes) for c in s["classes"]]:
            stack.enter_context(mock.patch.object(target, name, new))
        yield


def cases(s: dict) -> tuple[list, list[str]]:
    """vLLM's world-1 cases for the classes x the batched P/F, and why other SILU ones are out."""
    T, common, pf = s["T"], s["common"], s["pf"]
    with mock.patch.object(T, "MK_FUSED_EXPERT_TYPES", s["classes"]):
        run = T.generate_valid_test_cases(world_size=1, prepare_finalize_types=[pf])
    out, act = [], T.MoEActivation.SILU
    for q, fe in product(T.MK_QUANT_CONFIGS, s["classes"]):
        case = (T.Ks[0], T.Ns[0], T.Es[0], T.DTYPEs[0], q, act, pf, fe, 1)
        if case not in run:
            cfg = common.Config(T.Ms, *case[:3], T.TOPKs, case[3], q, pf, fe, 1, activation=act)
            why = cfg.is_valid()[1] or ("vLLM's is_nyi_config" if T.is_nyi_config(cfg) else "?")
            out.append(f"{_label(case)}: {why}")
    return run, out


def run_all(which: str, verbose: bool, only: str = "") -> list[tuple[str, str]]:
    s = _setup(which)
    pytestconfig = SimpleNamespace(getoption=lambda name: int(verbose))
    results = []
    for case in [case for case in cases(s)[0] if only in _label(case)]:
        print(f"=== {_label(case)}", flush=True)
        try:
            s["T"].test_modular_kernel_combinations_singlegpu(*case, pytestconfig, None)
            results.append((_label(case), "pass"))
        except pytest.skip.Exception as e:
            results.append((_label(case), f"skip  ({e})"))
        except Exception as e:  # one case's failure must not stop the others
            results.append((_label(case), f"FAIL  ({type(e).__name__}: {str(e)[:300]})"))
    print(f"\nvLLM 0.33.0 modular-kernel combinations, world 1, {s['pf'].__name__}:")
    print("".join(f"  {r[:4]}  {name}{r[4:]}\n" for name, r in results), end="")
    return results


@pytest.mark.gpu
def test_vllm_modular_kernel_combinations():
    from tests.environment_gate import missing

    if not (VLLM_TESTS / (TEST_MODULE.replace(".", "/") + ".py")).exists():
        missing(f"{VLLM_TESTS} is absent: obtain it as this module's docstring says")
    if not torch.cuda.is_available():
        missing("needs a CUDA GPU")
    failed = [name for name, r in run_all("ours", verbose=True) if r.startswith("FAIL")]
    assert not failed, f"failed: {failed}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", choices=sorted(CLASSES), default="ours")
    ap.add_argument("--list", action="store_true", help="print the combinations, run nothing")
    ap.add_argument("-k", default="", help="run only the cases whose label holds this")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not VLLM_TESTS.is_dir():
        print(f"{VLLM_TESTS} is absent: obtain it as this module's docstring says")
        return 2
    try:
        s = _setup(args.classes)
    except ImportError as e:
        print(f"cannot set up the {args.classes} classes: {e!r}")
        return 2
    if not args.list:
        results = run_all(args.classes, args.verbose, args.k)
        return 0 if results and not any(r.startswith("FAIL") for _, r in results) else 1
    fake = not torch.cuda.is_available()
    with _as_sm90(s) if fake else contextlib.nullcontext():
        run, out = cases(s)
    note = " (no CUDA here: as an sm_90 GPU with DeepGEMM would see them)" if fake else ""
    print(f"world 1, P/F {s['pf'].__name__}, {len(run)} cases{note}:")
    print("".join(f"  run  {_label(c)}\n" for c in run) + "".join(f"  out  {o}\n" for o in out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
