"""`vllm-flashinfer-ep doctor`: can this host serve with the flashinfer_ep backends?

Prints package versions, the NCCL-EP stack (libnccl_ep, loaded libnccl, nvcc for the
runtime JIT), GPUs and their compute capability, the package's VLLM_FLASHINFER_EP_*
variables, the engine's verdicts on the `vllm serve` arguments (the --all2all-backend
name, dual-batch overlap, fault tolerance, expert parallelism) and for `--model` (a local
dir or a Hugging Face id, config only) its config-time verdicts on the model: hidden size,
top_k, dtype, quantization, the HT per-rank step budget, the LL fleet's memory estimate
against the GPU, a fixed RDMA buffer against the fleet. Those come from the engine's own
rules (vllm/config_rules.py, vllm/fp8_experts_choice.py, vLLM's ParallelConfig
properties), read through the one model-shape reader (model_shape.py): what the engine
would refuse is [FAIL] with the engine's reason, what it would change, warn about or
cannot check is [warn]. Pass the `vllm serve` arguments after --model (scripts/serve.sh
does): the ones that change a verdict are read, the others listed as not checked. Exits 1 listing what to fix when
anything would stop a server, the missing CUDA driver first (what fails only because of
it is not a second problem). Runs on a machine without GPUs (and says that it cannot
serve there). Without network, pass a local model dir or set HF_HUB_OFFLINE=1 to read
the Hugging Face cache.
`--no-gpu` runs what an image build can check; `--link-runtime PREFIX` makes the stable
NCCL/nvcc paths an image's ENV names.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_flashinfer_ep import __version__, model_shape
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.doctor.cli_args import (
    json_object,
    model_len,
    non_negative,
    positive,
    split_eplb_overrides,
    switch,
    tokens,
)
from vllm_flashinfer_ep.doctor.engine_config import NAME, accepted, engine_check, serve_args_of
from vllm_flashinfer_ep.doctor.host import driver_consequences, package_checks, variables_check
from vllm_flashinfer_ep.doctor.model_config import load_model_config
from vllm_flashinfer_ep.doctor.model_verdicts import draft_check, model_checks
from vllm_flashinfer_ep.doctor.serve_args import accepted_backends, serve_checks
from vllm_flashinfer_ep.doctor.settings import ServeSettings
from vllm_flashinfer_ep.runtime import env_checks
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.vllm import config_rules as rules

__all__ = [
    "ServeSettings",
    "accepted_backends",
    "add_parser",
    "load_model_config",
    "model_checks",
    "run",
    "serve_checks",
    "split_eplb_overrides",
]


# What the engine config does not check (the worker does, on its GPU).
HOST = ("GPU stack", "packages", "image (no GPU needed)")


def run(args: argparse.Namespace) -> int:
    if args.link_runtime is not None:
        for line in env_checks.link_runtime_paths(args.link_runtime):
            print(line)
        return 0
    print(f"vllm-flashinfer-ep {__version__}")
    ignored = getattr(args, "ignored_serve_args", None)
    if ignored:
        print(f"(vllm serve arguments only the engine config reads: {' '.join(ignored)})")
    if args.no_gpu:
        sections = [
            ("packages", package_checks()),
            ("image (no GPU needed)", env_checks.image_checks()),
        ]
    else:
        # The driver first: without it every GPU check fails, and it is the thing to fix.
        sections = [
            ("GPU stack", driver_consequences(env_checks.runtime_checks())),
            ("packages", package_checks()),
        ]
    settings = ServeSettings.from_args(args)
    sections.append(("package settings", [variables_check(settings.backend)]))
    if args.model or settings != ServeSettings():
        try:
            serve = serve_checks(settings)
        except ImportError as exc:  # vLLM missing or broken: the packages section says so
            serve = [
                Check(
                    "vllm serve arguments",
                    True,
                    f"not checked: vLLM does not import ({exc})",
                    "see packages",
                    warn=True,
                )
            ]
        sections.append(("vllm serve arguments", serve))
    serve_args = serve_args_of(getattr(args, "argv", None) or [])
    engine = None
    if args.model or serve_args:
        try:
            engine = engine_check(args.model, serve_args, settings.backend)
        except ImportError as exc:  # vLLM missing or broken: the packages section says so
            engine = Check(NAME, True, f"not built: vLLM does not import ({exc})", "", warn=True)
        sections.append(("engine config", [engine]))
    if args.model:
        sections.append((f"model {args.model}", model_checks(args.model, settings=settings)))
    draft = draft_check(getattr(args, "speculative_config", None), settings)
    if draft is not None:
        sections.append(("speculative draft", [draft]))
    if engine is not None and engine.ok and not engine.warn:  # the engine built its config
        sections = [
            (title, checks if title in HOST else [accepted(c, settings.backend) for c in checks])
            for title, checks in sections
        ]
    failed = []
    for title, checks in sections:
        print(f"\n{title}:")
        for check in checks:
            print("  " + check.line())
            if not check.ok:
                failed.append(check)
    if failed:
        print(
            f"\n{len(failed)} problem(s); fix them before `vllm serve ... --all2all-backend flashinfer_ep_*`:"
        )
        for check in failed:
            print(f"  - {check.name}: {check.fix}")
        return 1
    print("\nall checks passed")
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this host and a model for the flashinfer_ep backends",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--model", help="local model dir or Hugging Face id (reads config.json only)"
    )
    parser.add_argument(
        "--no-gpu",
        action="store_true",
        help="only what needs no GPU or driver (image build): packages, loaded NCCL, "
        "nvcc, nccl.ep, plugin entry point",
    )
    parser.add_argument(
        "--link-runtime",
        type=Path,
        metavar="PREFIX",
        help="link PREFIX/lib/libnccl.so.2 and PREFIX/bin/nvcc to the pip-installed "
        "NCCL and CUDA-13 nvcc (image build) and exit",
    )
    serve = parser.add_argument_group(
        "vllm serve arguments",
        "as given to `vllm serve` (the checks use them; any other serve "
        "argument is accepted and listed as not checked)",
    )
    serve.add_argument(
        "--all2all-backend",
        default=LOW_LATENCY,
        metavar="NAME",
        help=f"the backend to check for (default {LOW_LATENCY})",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=tokens,
        default=None,
        metavar="N",
        help="tokens per rank the LL fleet is sized for (default: the package's "
        f"{rules.LL_DEFAULT_STEP_TOKENS} for LL, at most the largest CUDA graph capture size)",
    )
    serve.add_argument("--dtype", default="auto", choices=model_shape.DTYPE_CHOICES)
    serve.add_argument("--quantization", "-q", default=None)
    serve.add_argument(
        "--moe-backend",
        default="auto",
        metavar="NAME",
        help="FP8 models: auto/triton, or deep_gemm (LL, 128x128 block FP8)",
    )
    serve.add_argument("--max-num-seqs", type=positive, default=None, metavar="N")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F")
    switch(serve, "--enable-chunked-prefill", default=None)
    serve.add_argument("--max-model-len", type=model_len, default=None, metavar="N")
    serve.add_argument("--data-parallel-size", "-dp", type=positive, default=1, metavar="N")
    serve.add_argument("--tensor-parallel-size", "-tp", type=positive, default=1, metavar="N")
    serve.add_argument("--pipeline-parallel-size", "-pp", type=positive, default=1, metavar="N")
    serve.add_argument(
        "--prefill-context-parallel-size", "-pcp", type=positive, default=1, metavar="N"
    )
    switch(serve, "--enable-expert-parallel", "-ep")
    serve.add_argument(
        "--expert-placement-strategy", default="linear", choices=("linear", "round_robin")
    )
    serve.add_argument(
        "--hf-overrides",
        type=json_object,
        default=None,
        metavar="JSON",
        help="applied to config.json before its shape is read, as vLLM applies them",
    )
    switch(serve, "--enable-eplb")
    serve.add_argument(
        "--eplb-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="e.g. '{\"num_redundant_experts\": 32}' (or --eplb-config.num_redundant_experts 32)",
    )
    switch(serve, "--enable-dbo")
    serve.add_argument("--ubatch-size", type=non_negative, default=0, metavar="N")
    switch(serve, "--enable-fault-tolerance")
    switch(serve, "--enable-elastic-ep")
    switch(serve, "--enable-lora")
    serve.add_argument(
        "--speculative-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="a draft_model draft's config.json is read: MoE drafts of that method fail",
    )
    serve.add_argument(
        "--fault-tolerance-config",
        type=json_object,
        default=None,
        metavar="JSON",
        help="turns fault tolerance on, as in vLLM",
    )
    parser.set_defaults(func=run, accepts_serve_args=True)
