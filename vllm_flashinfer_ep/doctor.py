"""`vllm-flashinfer-ep doctor`: can this host serve with the flashinfer_ep backends?

Prints package versions, the NCCL-EP stack (libnccl_ep, loaded libnccl, nvcc for the
runtime JIT), GPUs and their compute capability, the package's VLLM_FLASHINFER_EP_*
variables, and for `--model` (a local dir or a Hugging Face id, config only) the
engine's config-time verdicts on it: hidden size, top_k, dtype, quantization, the LL
fleet's memory estimate against the GPU, a fixed RDMA buffer against the fleet. Those
come from the engine's own rules (vllm/config_validation.py, through the one model-shape
reader, model_shape.py): what the engine would refuse is [FAIL] with the engine's reason,
what it would change or cannot check is [warn]. Pass the `vllm serve` arguments after
--model (scripts/serve.sh does): the ones that change a verdict are read, the others
ignored. Exits 1 listing what to fix when anything would stop a server, the missing CUDA
driver first. Runs on a machine without GPUs (and says that it cannot serve there).
`--no-gpu` runs what an image build can check; `--link-runtime PREFIX` makes the stable
NCCL/nvcc paths an image's ENV names.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_flashinfer_ep import __version__, backends, envs, is_supported_vllm, model_shape
from vllm_flashinfer_ep.backends import LOW_LATENCY
from vllm_flashinfer_ep.runtime import env_checks
from vllm_flashinfer_ep.runtime.buffer_sizes import LL_BUFFER_BUDGET_FRACTION
from vllm_flashinfer_ep.runtime.env_checks import Check
from vllm_flashinfer_ep.runtime.limits import (
    MAX_TOPK_HT,
    MAX_TOPK_LL,
    SUPPORTED_HIDDEN_SIZES,
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


class ModelConfigError(Exception):
    """The model's config.json cannot be read; `fix` says what to do about it."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _read_config_json(path: Path, fix: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path} is not valid JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(data).__name__}, not an object", fix)
    return data


def load_model_config(model: str) -> dict[str, Any]:
    path = Path(model).expanduser()
    if path.is_file():
        raise FileNotFoundError(f"{model} is a file; pass the model directory (with config.json)")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{cfg} does not exist")
        return _read_config_json(
            cfg, f"repair {cfg}: it must be the model's Hugging Face config (a JSON object)"
        )
    if _looks_like_path(model):
        raise FileNotFoundError(f"no such directory: {model} (nor a Hugging Face id: org/name)")
    from huggingface_hub import hf_hub_download

    cached = Path(hf_hub_download(model, "config.json"))
    return _read_config_json(
        cached, f"the cached download is damaged: delete {cached} and run again to fetch it anew"
    )


@dataclass(frozen=True)
class ServeSettings:
    """The `vllm serve` arguments the model checks depend on; None: vLLM's default."""

    backend: str = LOW_LATENCY
    dtype: str = "auto"
    quantization: str | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_eplb: bool = False
    eplb_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        eplb = dict(args.eplb_config or {})
        eplb.update(getattr(args, "eplb_overrides", {}) or {})
        return cls(
            backend=args.all2all_backend,
            dtype=args.dtype,
            quantization=args.quantization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_model_len=args.max_model_len,
            data_parallel_size=args.data_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            enable_eplb=bool(args.enable_eplb),
            eplb_config=eplb,
        )

    @property
    def tokens(self) -> int:
        # LL under DP+EP is vLLM's "batched DP MoE": its default step budget is
        # SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP (256).
        return self.max_num_batched_tokens or 256

    @property
    def ep_world(self) -> int:
        # vLLM's EP group: DP x TP ranks (config_validation.ep_world_size).
        return self.data_parallel_size * self.tensor_parallel_size


def model_checks(
    model: str, tokens_per_rank: int | None = None, settings: ServeSettings | None = None
) -> list[Check]:
    """The engine's config-time verdicts on `model` (config_validation's rules, read through
    model_shape, the reader config validation uses), as doctor lines."""
    settings = settings or ServeSettings()
    if tokens_per_rank is not None:
        settings = replace(settings, max_num_batched_tokens=tokens_per_rank)
    try:
        cfg = load_model_config(model)
    except ModelConfigError as exc:
        return [Check("model config", False, str(exc), exc.fix)]
    except Exception as exc:  # noqa: BLE001 - report why the config is unreadable
        return [
            Check("model config", False, str(exc), "pass a local model dir or a reachable HF id")
        ]
    from vllm_flashinfer_ep.vllm import config_validation as rules

    shape = model_shape.read_shape(
        cfg,
        redundant_experts=model_shape.redundant_experts(settings.enable_eplb, settings.eplb_config),
    )
    checks = []
    backend = settings.backend
    if not backends.is_ours(backend):
        checks.append(
            Check(
                "all2all backend",
                True,
                f"{backend} is not a flashinfer_ep backend; the checks below "
                f"are those of {LOW_LATENCY}",
                warn=True,
            )
        )
        backend = LOW_LATENCY
    flag = f"--all2all-backend {backend}"
    low_latency = backend == LOW_LATENCY
    hidden = shape.hidden_size
    if hidden is not None:
        reason = rules.hidden_reason(flag, backend, hidden)
        if not low_latency:
            detail = f"{hidden} (high throughput takes any hidden size)"
        elif reason is not None:
            detail = f"{hidden} (LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
        elif round_up_ll_hidden_size(hidden) == hidden:
            detail = f"{hidden} (a native NCCL-EP LL size)"
        else:
            detail = (
                f"{hidden} -> rounded up to {round_up_ll_hidden_size(hidden)} for {LOW_LATENCY} "
                f"(LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
            )
        checks.append(
            Check(
                "LL hidden size" if low_latency else "hidden size",
                reason is None,
                detail,
                reason or "",
            )
        )
    if shape.top_k is None:
        checks.append(
            Check(
                "top_k",
                False,
                "no experts-per-token field: not an MoE config?",
                "pass an MoE model",
            )
        )
    else:
        reason = rules.top_k_reason(flag, backend, shape.top_k)
        checks.append(
            Check(
                "top_k",
                reason is None,
                f"{shape.top_k} (limits: low latency {MAX_TOPK_LL}, high throughput {MAX_TOPK_HT})",
                reason or "",
            )
        )
    checks.append(_dtype_check(shape, settings, flag))
    method = settings.quantization or shape.quant_method
    block = shape.weight_block_size
    reason = rules.quantization_reason(flag, method, block)
    checks.append(
        Check(
            "checkpoint precision",
            reason is None,
            f"quantization {method or 'none'}"
            + (f", weight_block_size {block}" if block is not None else ""),
            reason or "",
        )
    )
    fleet = shape.ll_fleet_shape() if low_latency else None
    if fleet is not None:
        total = rules.device_memory_bytes()
        checks.append(_ll_memory_check(rules, flag, shape, fleet, settings, total))
        rdma = _rdma_check(rules, flag, fleet, settings, total)
        if rdma is not None:
            checks.append(rdma)
    return checks


def _dtype_check(shape: model_shape.ModelShape, settings: ServeSettings, flag: str) -> Check:
    from vllm_flashinfer_ep.vllm.config_validation import dtype_reason

    served = model_shape.served_dtype(settings.dtype, shape.dtype)
    detail = f"{served or 'unknown'} (checkpoint {shape.dtype or 'names none'}, --dtype {settings.dtype})"
    if served is None:
        return Check(
            "dtype",
            True,
            detail,
            "config.json names no dtype: vLLM reads it from the "
            "weights; pass --dtype bfloat16 to be sure",
            warn=True,
        )
    reason = dtype_reason(flag, served)
    return Check("dtype", reason is None, detail, reason or "")


def _vllm_defaults(settings: ServeSettings) -> tuple[float, int, bool]:
    """vLLM 0.33.0's defaults where the serve arguments leave them unset:
    --gpu-memory-utilization, --max-num-seqs (`vllm serve`'s, by GPU memory, at most the
    step budget) and chunked prefill (on)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    gmu = settings.gpu_memory_utilization or EngineArgs.gpu_memory_utilization
    seqs = settings.max_num_seqs
    if seqs is None:
        world = settings.tensor_parallel_size * settings.pipeline_parallel_size
        seqs = min(
            EngineArgs.get_batch_defaults(world)[1].get(UsageContext.OPENAI_API_SERVER, 128),
            settings.tokens,
        )
    chunked = True if settings.enable_chunked_prefill is None else settings.enable_chunked_prefill
    return gmu, seqs, chunked


def _ll_memory_check(
    rules,
    flag: str,
    shape: model_shape.ModelShape,
    fleet: tuple[int, int, int],
    settings: ServeSettings,
    total: int | None,
) -> Check:
    """The LL fleet's estimated GPU memory per GPU and the engine's verdict on it
    (config_validation.ll_memory_verdict: fits, lowered, or refused)."""
    hidden, experts, top_k = fleet
    tokens = settings.tokens
    gmu, seqs, chunked = _vllm_defaults(settings) if total is not None else (1.0, 1, True)
    verdict = rules.ll_memory_verdict(
        flag,
        fleet,
        tokens,
        total,
        gmu,
        max_num_seqs=seqs,
        chunked_prefill=chunked,
        max_model_len=settings.max_model_len or shape.max_position_embeddings,
    )
    parts, gib = verdict.parts, 1 << 30
    redundant = (
        f" ({shape.routed_experts} + {shape.redundant_experts} EPLB redundant)"
        if shape.redundant_experts
        else ""
    )
    detail = (
        f"about {verdict.need / gib:.2f} GiB per GPU at --max-num-batched-tokens {tokens}: "
        f"NCCL-EP fixed {parts['fixed'] / gib:.2f} + buffers {parts['buffers'] / gib:.2f} + "
        f"FlashInfer receive buffer {parts['receive'] / gib:.2f} + {verdict.handles} pooled handles and "
        f"their padding staging {parts['pool'] / 1e6:.1f} MB "
        f"({experts} experts{redundant}, hidden {hidden}, top_k {top_k})"
    )
    name = "LL memory estimate"
    if verdict.refusal is not None:
        return Check(name, False, detail, verdict.refusal)
    if verdict.budget is None:
        return Check(
            name,
            True,
            detail + "; not checked: no GPU visible here",
            "run doctor on the GPU host to check it against GPU memory",
            warn=True,
        )
    if verdict.lowered_to is not None:
        return Check(
            name,
            True,
            detail,
            f"the engine lowers --max-num-batched-tokens from {tokens} "
            f"to {verdict.lowered_to}: the fleet {verdict.why}",
            warn=True,
        )
    return Check(name, True, f"{detail}; fits the budget of {verdict.budget / gib:.2f} GiB")


def _rdma_check(
    rules, flag: str, fleet: tuple[int, int, int], settings: ServeSettings, total: int | None
) -> Check | None:
    """VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES against the fleet, as config time checks it."""
    try:
        rdma = envs.rdma_buffer_bytes()
    except Exception:  # noqa: BLE001 - a bad value is reported by the variables check
        return None
    if rdma == 0:
        return None
    budget = None
    if total is not None:
        gmu, _, _ = _vllm_defaults(settings)
        budget = int(int(total * gmu) * LL_BUFFER_BUDGET_FRACTION)
    reason = rules.rdma_buffer_reason(flag, rdma, fleet, settings.tokens, settings.ep_world, budget)
    return Check("RDMA buffer", reason is None, f"{envs.RDMA_BUFFER_BYTES}={rdma}", reason or "")


def variables_check() -> Check:
    """The package's VLLM_FLASHINFER_EP_* variables, as config time parses them."""
    try:
        envs.validate_all()
    except Exception as exc:  # noqa: BLE001 - FlashInferEPEnvVarError: one line naming each
        return Check("VLLM_FLASHINFER_EP_* variables", False, str(exc), "fix or unset them")
    set_ = sorted(k for k in os.environ if k.startswith(envs.PREFIX))
    return Check(
        "VLLM_FLASHINFER_EP_* variables", True, ", ".join(set_) if set_ else "none set (defaults)"
    )


def run(args: argparse.Namespace) -> int:
    if args.link_runtime is not None:
        for line in env_checks.link_runtime_paths(args.link_runtime):
            print(line)
        return 0
    print(f"vllm-flashinfer-ep {__version__}")
    ignored = getattr(args, "ignored_serve_args", None)
    if ignored:
        print(f"(vllm serve arguments doctor does not check: {' '.join(ignored)})")
    if args.no_gpu:
        sections = [
            ("packages", package_checks()),
            ("image (no GPU needed)", env_checks.image_checks()),
        ]
    else:
        # The driver first: without it every GPU check fails, and it is the thing to fix.
        sections = [("GPU stack", env_checks.runtime_checks()), ("packages", package_checks())]
    sections.append(("package settings", [variables_check()]))
    if args.model:
        settings = ServeSettings.from_args(args)
        sections.append((f"model {args.model}", model_checks(args.model, settings=settings)))
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _tokens(text: str) -> int:
    """vLLM's parser for --max-num-batched-tokens (accepts 8k, 2K, ...)."""
    from vllm.utils.argparse_utils import human_readable_int

    try:
        value = human_readable_int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _model_len(text: str) -> int | None:
    """vLLM's parser for --max-model-len (8k, 32K, -1 / auto: from the model)."""
    from vllm.utils.argparse_utils import human_readable_int_or_auto

    value = human_readable_int_or_auto(text)
    return value if value > 0 else None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def split_eplb_overrides(extra: list[str]) -> tuple[dict[str, Any], list[str]]:
    """vLLM's dotted form `--eplb-config.KEY VALUE` (or `=VALUE`) among arguments the
    parser did not know: ({KEY: value}, the rest)."""
    overrides: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--eplb-config."):
            key, eq, value = arg[len("--eplb-config.") :].partition("=")
            if not eq and i + 1 < len(extra):
                i += 1
                value = extra[i]
            try:
                overrides[key.replace("-", "_")] = json.loads(value)
            except json.JSONDecodeError:
                overrides[key.replace("-", "_")] = value
        else:
            rest.append(arg)
        i += 1
    return overrides, rest


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
        "as given to `vllm serve` (the model checks use them; any other "
        "serve argument is accepted and ignored)",
    )
    serve.add_argument(
        "--all2all-backend",
        default=LOW_LATENCY,
        metavar="NAME",
        help=f"the backend to check for (default {LOW_LATENCY})",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=_tokens,
        default=None,
        metavar="N",
        help="tokens per rank the LL fleet is sized for (default: vLLM's 256 for LL)",
    )
    serve.add_argument("--dtype", default="auto", choices=model_shape.DTYPE_CHOICES)
    serve.add_argument("--quantization", "-q", default=None)
    serve.add_argument("--max-num-seqs", type=_positive, default=None, metavar="N")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F")
    serve.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None
    )
    serve.add_argument("--max-model-len", type=_model_len, default=None, metavar="N")
    serve.add_argument("--data-parallel-size", "-dp", type=_positive, default=1, metavar="N")
    serve.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="N")
    serve.add_argument("--pipeline-parallel-size", "-pp", type=_positive, default=1, metavar="N")
    serve.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=False)
    serve.add_argument(
        "--eplb-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="e.g. '{\"num_redundant_experts\": 32}' (or --eplb-config.num_redundant_experts 32)",
    )
    parser.set_defaults(func=run, accepts_serve_args=True)
