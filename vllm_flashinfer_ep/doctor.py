"""`vllm-flashinfer-ep doctor`: can this host serve with the flashinfer_ep backends?

Prints package versions, the NCCL-EP stack (libnccl_ep, loaded libnccl, nvcc for the
runtime JIT), GPUs and their compute capability, and for `--model` (a local dir or a
Hugging Face id, config only) the low-latency hidden-size decision and the top_k
check. Exits 1 listing what to fix when anything would stop a server, the missing
CUDA driver first. Runs on a machine without GPUs (and says that it cannot serve there).
`--no-gpu` runs what an image build can check; `--link-runtime PREFIX` makes the stable
NCCL/nvcc paths an image's ENV names.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from vllm_flashinfer_ep import __version__, is_supported_vllm
from vllm_flashinfer_ep.runtime import env_checks
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.runtime.limits import (
    MAX_TOPK_HT,
    MAX_TOPK_LL,
    SUPPORTED_HIDDEN_SIZES,
    config_top_k,
    round_up_ll_hidden_size,
)


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
        Check("nccl-extensions", _version("nccl-extensions") is not None,
              _version("nccl-extensions") or "not installed", "pip install 'nccl-extensions>=0.1.0'"),
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


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or model.count("/") != 1


def load_model_config(model: str) -> dict[str, Any]:
    path = Path(model).expanduser()
    if path.is_file():
        raise FileNotFoundError(f"{model} is a file; pass the model directory (with config.json)")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{cfg} does not exist")
        return json.loads(cfg.read_text())
    if _looks_like_path(model):
        raise FileNotFoundError(f"no such directory: {model} (nor a Hugging Face id: org/name)")
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(model, "config.json")).read_text())


def model_checks(model: str, tokens_per_rank: int = 256) -> list[Check]:
    try:
        cfg = load_model_config(model)
    except Exception as exc:  # noqa: BLE001 - report why the config is unreadable
        return [Check("model config", False, str(exc), "pass a local model dir or a reachable HF id")]
    text = cfg.get("text_config", cfg)
    checks = []
    hidden = text.get("hidden_size")
    if isinstance(hidden, int):
        try:
            rounded = round_up_ll_hidden_size(hidden)
            detail = (
                f"{hidden} (a native NCCL-EP LL size)"
                if rounded == hidden
                else f"{hidden} -> rounded up to {rounded} for flashinfer_ep_low_latency "
                f"(LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
            )
            checks.append(Check("LL hidden size", True, detail))
        except ValueError as exc:
            checks.append(Check("LL hidden size", False, str(exc), "use flashinfer_ep_high_throughput"))
    top_k = config_top_k(text.get)
    if top_k is None:
        checks.append(Check("top_k", False, "no experts-per-token field: not an MoE config?", "pass an MoE model"))
    else:
        checks.append(
            Check(
                "top_k",
                top_k <= MAX_TOPK_LL,
                f"{top_k} (limits: low latency {MAX_TOPK_LL}, high throughput {MAX_TOPK_HT})",
                "flashinfer_ep_high_throughput only" if top_k <= MAX_TOPK_HT else "pick another --all2all-backend",
            )
        )
    memory = _ll_memory_check(text, tokens_per_rank)
    if memory is not None:
        checks.append(memory)
    dtype = text.get("torch_dtype") or cfg.get("torch_dtype") or text.get("dtype")
    quant = cfg.get("quantization_config") or text.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    from vllm_flashinfer_ep.vllm.receive_quant import carries_block

    carried = not quant or (method == "fp8" and carries_block(block))
    checks.append(
        Check(
            "checkpoint precision",
            carried,
            f"dtype {dtype}, quantization {method}"
            + (f", weight_block_size {block}" if block is not None else ""),
            "the backends run BF16 and FP8 checkpoints (per-tensor or 128x128 blocks): serve "
            "one of those, or pick another --all2all-backend",
        )
    )
    return checks


def _ll_memory_check(text: dict[str, Any], tokens: int) -> Check | None:
    """The LL fleet's estimated GPU memory per GPU (runtime/buffer_sizes.py, measured
    device-wide), with the handle pool a served engine with vLLM's default capture sizes
    warms; None when the config lacks the shape."""
    from vllm_flashinfer_ep.bench.memory import served_pool_sizes
    from vllm_flashinfer_ep.runtime import buffer_sizes
    from vllm_flashinfer_ep.vllm.config_validation import EXPERT_COUNT_CONFIG_KEYS

    hidden, top_k = text.get("hidden_size"), config_top_k(text.get)
    experts = next((text[k] for k in EXPERT_COUNT_CONFIG_KEYS if isinstance(text.get(k), int)), None)
    if not isinstance(hidden, int) or top_k is None or experts is None:
        return None
    try:
        hidden = round_up_ll_hidden_size(hidden)
    except ValueError:
        return None
    handles = len(served_pool_sizes(tokens))
    parts = buffer_sizes.ll_memory_parts(tokens, hidden, experts, top_k, handles)
    gib = 1 << 30
    return Check(
        "LL memory estimate",
        True,
        f"about {sum(parts.values()) / gib:.2f} GiB per GPU at --max-num-batched-tokens {tokens}: "
        f"NCCL-EP fixed {parts['fixed'] / gib:.2f} + buffers {parts['buffers'] / gib:.2f} + "
        f"FlashInfer receive buffer {parts['receive'] / gib:.2f} + {handles} pooled handles and "
        f"their padding staging {parts['pool'] / 1e6:.1f} MB "
        f"({experts} experts, hidden {hidden}, top_k {top_k})",
    )


def run(args: argparse.Namespace) -> int:
    if args.link_runtime is not None:
        for line in env_checks.link_runtime_paths(args.link_runtime):
            print(line)
        return 0
    print(f"vllm-flashinfer-ep {__version__}")
    if args.no_gpu:
        sections = [("packages", package_checks()), ("image (no GPU needed)", env_checks.image_checks())]
    else:
        # The driver first: without it every GPU check fails, and it is the thing to fix.
        sections = [("GPU stack", env_checks.runtime_checks()), ("packages", package_checks())]
    if args.model:
        sections.append((f"model {args.model}", model_checks(args.model, args.max_num_batched_tokens)))
    failed = []
    for title, checks in sections:
        print(f"\n{title}:")
        for check in checks:
            print("  " + check.line())
            if not check.ok:
                failed.append(check)
    if failed:
        print(f"\n{len(failed)} problem(s); fix them before `vllm serve ... --all2all-backend flashinfer_ep_*`:")
        for check in failed:
            print(f"  - {check.name}: {check.fix}")
        return 1
    print("\nall checks passed")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="check this host and a model for the flashinfer_ep backends",
                                   description=__doc__)
    parser.add_argument("--model", help="local model dir or Hugging Face id (reads config.json only)")
    parser.add_argument("--max-num-batched-tokens", type=_positive, default=256, metavar="N",
                        help="tokens per rank the LL memory estimate is made for (vLLM's flag; "
                        "LL defaults to 256)")
    parser.add_argument("--no-gpu", action="store_true",
                        help="only what needs no GPU or driver (image build): packages, loaded NCCL, "
                        "nvcc, nccl.ep, plugin entry point")
    parser.add_argument("--link-runtime", type=Path, metavar="PREFIX",
                        help="link PREFIX/lib/libnccl.so.2 and PREFIX/bin/nvcc to the pip-installed "
                        "NCCL and CUDA-13 nvcc (image build) and exit")
    parser.set_defaults(func=run)
