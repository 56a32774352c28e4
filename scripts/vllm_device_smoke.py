#!/usr/bin/env python3
"""Smoke test ON THE DEVICE: vLLM 0.33.0's Python fused-MoE path on torch 2.11.

Run after `source scripts/device_vllm_env.sh` (docs/device_vllm.md):

    python3 scripts/vllm_device_smoke.py

Stages (each prints one line; the script exits non-zero at the first failure):
  env      torch / triton / CUDA / where vllm comes from
  shim     tests/kernels/vllm_device_shim.apply() (torch fallbacks for the
           vllm._C / _moe_C ops the unquantized paths call)
  import   the vLLM MoE modules; on failure prints the exact missing symbol
  batched  FusedMoEKernel(BatchedPrepareAndFinalize, BatchedTritonExperts)
  standard FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular, TritonExperts)
  fused_experts  vllm's fused_experts() (torch.ops.vllm.fused_experts)
each compared with a float32 torch MoE reference (BF16, 8 experts, top-2,
hidden 2048).

--cpu-interpret is for checking the harness off the device only: it runs on
CPU with TRITON_INTERPRET=1 and a stand-in CUDA platform (sm_90), so vLLM takes
its CUDA code paths while Triton interprets the kernels (slow; use small -m).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAILED = False


def say(stage: str, status: str, msg: str) -> None:
    print(f"[{stage}] {status}: {msg}", flush=True)


def fail(stage: str, msg: str, exc: BaseException | None = None) -> None:
    global FAILED
    FAILED = True
    say(stage, "FAIL", msg)
    if exc is not None:
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-8)


def missing_symbol(exc: BaseException) -> str:
    """The exact thing an import failure could not find."""
    if isinstance(exc, ModuleNotFoundError):
        return f"module {exc.name!r}"
    if isinstance(exc, ImportError):
        name = getattr(exc, "name", None)
        return f"{exc} (from module {name!r})" if name else str(exc)
    if isinstance(exc, AttributeError):
        obj = getattr(exc, "obj", None)
        attr = getattr(exc, "name", None)
        if attr:
            owner = (
                getattr(obj, "__name__", None) or getattr(obj, "name", None) or type(obj).__name__
            )
            return f"attribute {attr!r} of {owner!r} ({exc})"
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--tokens", type=int, default=64)
    p.add_argument("-e", "--experts", type=int, default=8)
    p.add_argument("-k", "--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument(
        "--intermediate",
        type=int,
        default=1024,
        help="per-expert intermediate size N (w1 is [E, 2N, hidden])",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="activation/weight dtype (default bfloat16; float16 with "
        "--cpu-interpret, whose bf16 tl.dot is wrong in triton 3.6)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--atol",
        type=float,
        default=2e-2,
        help="absolute tolerance, as a fraction of max|reference|",
    )
    p.add_argument("--rtol", type=float, default=5e-2)
    p.add_argument(
        "--max-rel-l2", type=float, default=2e-2, help="bound on ||out - ref|| / ||ref||"
    )
    p.add_argument(
        "--cpu-interpret",
        action="store_true",
        help="off-device harness check: CPU + TRITON_INTERPRET=1",
    )
    args = p.parse_args()
    if args.dtype is None:
        args.dtype = "float16" if args.cpu_interpret else "bfloat16"
    return args


def stage_env(args):
    if args.cpu_interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")
    import torch
    import triton

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "-"
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    where = os.path.dirname(spec.origin) if spec and spec.origin else None
    say(
        "env",
        "ok",
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"triton {triton.__version__}, cuda_available={cuda} ({name}), "
        f"vllm from {where}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}",
    )
    if where is None:
        fail("env", "vllm is not importable: source scripts/device_vllm_env.sh first")
        return None
    if not cuda and not args.cpu_interpret:
        fail("env", "no CUDA device visible (use --cpu-interpret off the device)")
        return None
    return torch.device("cpu") if args.cpu_interpret else torch.device("cuda")


def stage_shim():
    sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))
    import vllm_device_shim

    patched = vllm_device_shim.apply()
    say("shim", "ok", f"{len(patched)} bridged: {', '.join(patched) or 'nothing'}")
    return vllm_device_shim


def emulate_triton_driver() -> None:
    """--cpu-interpret only: vllm.triton_utils disables Triton unless exactly
    one GPU driver is active; report the NVIDIA one active (kernels still run
    in Triton's interpreter)."""
    from triton.backends import backends

    backends["nvidia"].driver.is_active = staticmethod(lambda: True)


def emulate_cuda_platform() -> None:
    """--cpu-interpret only: make vLLM take its CUDA paths without a GPU."""
    import vllm.platforms as P
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class EmulatedH200(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (emulated)"

    P._current_platform = EmulatedH200()

    import torch

    class _NotCapturing:
        def is_capturing(self) -> bool:
            return False

    # CUDA-built torch without a driver cannot answer this on CPU
    torch.accelerator.current_stream = lambda *a, **k: _NotCapturing()


def stage_import(args):
    mods = {}
    names = [
        ("platforms", "vllm.platforms"),
        ("config", "vllm.config"),
        ("forward_context", "vllm.forward_context"),
        ("mk", "vllm.model_executor.layers.fused_moe.modular_kernel"),
        ("moe_config", "vllm.model_executor.layers.fused_moe.config"),
        ("activation", "vllm.model_executor.layers.fused_moe.activation"),
        ("batched_pf", "vllm.model_executor.layers.fused_moe.prepare_finalize.batched"),
        ("no_dp_ep", "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep"),
        ("batched_experts", "vllm.model_executor.layers.fused_moe.experts.fused_batched_moe"),
        ("triton_experts", "vllm.model_executor.layers.fused_moe.experts.triton_moe"),
        ("fused_moe", "vllm.model_executor.layers.fused_moe.fused_moe"),
        ("workspace", "vllm.v1.worker.workspace"),
    ]
    import importlib

    if args.cpu_interpret:
        emulate_triton_driver()
    t0 = time.time()
    for key, mod in names:
        try:
            mods[key] = importlib.import_module(mod)
        except BaseException as exc:  # noqa: BLE001 - report anything
            fail("import", f"{mod}: missing {missing_symbol(exc)}", exc)
            return None
        if key == "platforms" and args.cpu_interpret:
            emulate_cuda_platform()
    plat = mods["platforms"].current_platform
    say(
        "import",
        "ok",
        f"{len(names)} modules in {time.time() - t0:.1f}s; "
        f"current_platform={type(plat).__name__} is_cuda={plat.is_cuda()}",
    )
    if not plat.is_cuda():
        fail("import", "vLLM did not select the CUDA platform")
        return None
    return mods


def make_problem(args, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(args.seed)
    M, E, K, N, top_k = args.tokens, args.experts, args.hidden, args.intermediate, args.topk
    dt = getattr(torch, args.dtype)
    x = (torch.randn(M, K, generator=g) / 4).to(dt)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K**0.5).to(dt)
    w2 = (torch.randn(E, K, N, generator=g) / N**0.5).to(dt)
    logits = torch.randn(M, E, generator=g)
    topk_w, topk_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
    p = dict(x=x, w1=w1, w2=w2, topk_weights=topk_w.float(), topk_ids=topk_ids.to(torch.int32))
    return {k: v.to(device) for k, v in p.items()}


def reference(p):
    """Plain torch MoE, float32 accumulate: sum_k w_k * W2_e(silu(g) * u)."""
    import torch
    import torch.nn.functional as F

    x, w1, w2 = p["x"].float(), p["w1"].float(), p["w2"].float()
    out = torch.zeros_like(x)
    N = w2.shape[-1]
    for e in range(w1.shape[0]):
        rows, slot = torch.nonzero(p["topk_ids"] == e, as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows] @ w1[e].t()
        y = (F.silu(h[:, :N]) * h[:, N:]) @ w2[e].t()
        out.index_add_(0, rows, y * p["topk_weights"][rows, slot].unsqueeze(-1))
    return out


def compare(stage, got, ref, args) -> None:
    import torch

    if got is None or tuple(got.shape) != tuple(ref.shape):
        fail(
            stage,
            f"bad output shape {None if got is None else tuple(got.shape)}, "
            f"want {tuple(ref.shape)}",
        )
        return
    g = got.float()
    err = (g - ref).abs()
    atol = args.atol * float(ref.abs().max())
    tol = atol + args.rtol * ref.abs()
    bad = int((err > tol).sum())
    finite = bool(torch.isfinite(g).all())
    rel = float(err.norm() / ref.norm().clamp_min(1e-12))
    msg = (
        f"max_abs_err={float(err.max()):.4g} rel_l2={rel:.3g} "
        f"(max {args.max_rel_l2}) out_of_tol={bad}/{ref.numel()} "
        f"(atol={atol:.3g}, rtol={args.rtol}) dtype={got.dtype}"
    )
    if finite and bad == 0 and rel <= args.max_rel_l2:
        say(stage, "PASS", msg)
    else:
        fail(stage, msg + ("" if finite else " NON-FINITE"))


def moe_config(mods, args, device, max_num_tokens):
    import torch

    cfg = mods["moe_config"]
    return cfg.FusedMoEConfig(
        num_experts=args.experts,
        experts_per_token=args.topk,
        hidden_dim=args.hidden,
        intermediate_size=args.intermediate,
        num_local_experts=args.experts,
        num_logical_experts=args.experts,
        activation=mods["activation"].MoEActivation.SILU,
        device=device,
        routing_method=cfg.RoutingMethodType.Renormalize,
        moe_parallel_config=cfg.FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=getattr(torch, args.dtype),
        max_num_tokens=max_num_tokens,
    )


def run_kernel(stage, mods, args, device, p, ref, make):
    import torch

    try:
        kernel = make()
        say(
            stage,
            "ok",
            f"built {type(kernel.prepare_finalize).__name__} + "
            f"{type(kernel.fused_experts).__name__}",
        )
        act = mods["activation"].MoEActivation.SILU
        t0 = time.time()
        with torch.inference_mode():
            out = kernel.apply(
                hidden_states=p["x"].clone(),
                w1=p["w1"],
                w2=p["w2"],
                topk_ids=p["topk_ids"],
                topk_weights=p["topk_weights"],
                activation=act,
                global_num_experts=args.experts,
                expert_map=None,
                apply_router_weight_on_input=False,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        say(
            stage,
            "ok",
            f"forward ran in {time.time() - t0:.2f}s (first call: includes Triton compile)",
        )
    except BaseException as exc:  # noqa: BLE001
        fail(stage, f"{type(exc).__name__}: {exc}", exc)
        return
    compare(stage, out, ref, args)


def run_fused_experts(mods, args, p, ref) -> None:
    import torch

    if args.cpu_interpret:
        say(
            "fused_experts",
            "skip",
            "torch.ops.vllm.fused_experts is registered for the CUDA dispatch key only",
        )
        return
    try:
        with torch.inference_mode():
            out = mods["fused_moe"].fused_experts(
                p["x"],
                p["w1"],
                p["w2"],
                p["topk_weights"],
                p["topk_ids"],
                global_num_experts=args.experts,
            )
        torch.cuda.synchronize()
    except BaseException as exc:  # noqa: BLE001
        fail("fused_experts", f"{type(exc).__name__}: {exc}", exc)
        return
    compare("fused_experts", out, ref, args)


def main() -> int:
    args = parse()
    device = stage_env(args)
    if device is None:
        return 1
    try:
        stage_shim()
    except BaseException as exc:  # noqa: BLE001
        fail("shim", f"{type(exc).__name__}: {exc}", exc)
        return 1
    mods = stage_import(args)
    if mods is None:
        return 1

    import torch

    try:
        mods["workspace"].init_workspace_manager(device)
        from vllm.config import VllmConfig, set_current_vllm_config

        vcfg = VllmConfig()
        say("setup", "ok", "workspace manager on " + str(device) + "; default VllmConfig")
    except BaseException as exc:  # noqa: BLE001
        fail("setup", f"{type(exc).__name__}: {exc}", exc)
        return 1

    p = make_problem(args, device)
    ref = reference(p)
    say(
        "reference",
        "ok",
        f"torch MoE M={args.tokens} E={args.experts} top_k={args.topk} "
        f"hidden={args.hidden} N={args.intermediate} {args.dtype} in, fp32 reference, "
        f"|ref|_max={float(ref.abs().max()):.3g}",
    )

    mk = mods["mk"]
    quant = mods["moe_config"].FUSED_MOE_UNQUANTIZED_CONFIG
    max_tokens = args.tokens

    def batched():
        cfg = moe_config(mods, args, device, max_tokens)
        pf = mods["batched_pf"].BatchedPrepareAndFinalize(
            max_num_tokens=max_tokens, num_local_experts=args.experts, num_dispatchers=1, rank=0
        )
        ex = mods["batched_experts"].BatchedTritonExperts(
            moe_config=cfg, quant_config=quant, max_num_tokens=max_tokens, num_dispatchers=1
        )
        return mk.FusedMoEKernel(pf, ex)

    def standard():
        cfg = moe_config(mods, args, device, max_tokens)
        pf = mods["no_dp_ep"].MoEPrepareAndFinalizeNoDPEPModular()
        ex = mods["triton_experts"].TritonExperts(moe_config=cfg, quant_config=quant)
        return mk.FusedMoEKernel(pf, ex)

    with set_current_vllm_config(vcfg):
        run_kernel("batched", mods, args, device, p, ref, batched)
        run_kernel("standard", mods, args, device, p, ref, standard)
        run_fused_experts(mods, args, p, ref)

    say(
        "summary",
        "FAIL" if FAILED else "PASS",
        "vLLM 0.33.0 MoE path on torch " + torch.__version__,
    )
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
