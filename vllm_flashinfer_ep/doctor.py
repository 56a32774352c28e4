"""`vllm-flashinfer-ep doctor`: can this host serve with the flashinfer_ep backends?

Prints package versions, the NCCL-EP stack (libnccl_ep, loaded libnccl, nvcc for the
runtime JIT), GPUs and their compute capability, the package's VLLM_FLASHINFER_EP_*
variables, the engine's verdicts on the `vllm serve` arguments (the --all2all-backend
name, dual-batch overlap, fault tolerance, expert parallelism) and for `--model` (a local
dir or a Hugging Face id, config only) its config-time verdicts on the model: hidden size,
top_k, dtype, quantization, the HT per-rank step budget, the LL fleet's memory estimate
against the GPU, a fixed RDMA buffer against the fleet. Those come from the engine's own
rules (vllm/config_validation.py, vLLM's ParallelConfig properties, through the one
model-shape reader, model_shape.py): what the engine would refuse is [FAIL] with the
engine's reason, what it would change, warn about or cannot check is [warn]. Pass the
`vllm serve` arguments after --model (scripts/serve.sh does): the ones that change a
verdict are read, the others listed as not checked. Exits 1 listing what to fix when
anything would stop a server, the missing CUDA driver first (what fails only because of
it is not a second problem). Runs on a machine without GPUs (and says that it cannot
serve there). Without network, pass a local model dir or set HF_HUB_OFFLINE=1 to read
the Hugging Face cache.
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
    HT_MAX_TOKENS_PER_RANK,
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
    cached = _hub_config_json(model)
    return _read_config_json(
        cached, f"the cached download is damaged: delete {cached} and run again to fetch it anew"
    )


OFFLINE_FIX = (
    "pass a local model dir (--model /path/to/model), or fetch the model on a host with "
    "network; once it is in the Hugging Face cache, HF_HUB_OFFLINE=1 reads it from there "
    "without trying the network"
)


def _hub_config_json(model: str) -> Path:
    """config.json of a Hugging Face id, as `hf_hub_download` gets it (the cache when
    HF_HUB_OFFLINE=1, as vLLM does), but without its ~25 s of retries where no connection
    to the Hub can be made at all: one HEAD without retries first (huggingface_hub's own
    `get_hf_file_metadata`, its proxy and endpoint settings); where that cannot connect,
    the cached copy or an error that says so. Online, the download is unchanged."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def cached(why: str, fix: str) -> Path:
        try:
            return Path(hf_hub_download(model, "config.json", local_files_only=True))
        except LocalEntryNotFoundError:
            raise ModelConfigError(f"{model}: {why}", fix) from None

    if constants.is_offline_mode():
        return cached(
            "config.json is not in the Hugging Face cache and HF_HUB_OFFLINE=1 forbids "
            "downloading it",
            "pass a local model dir (--model /path/to/model), or unset HF_HUB_OFFLINE "
            "on a host with network to fetch it",
        )
    if _hub_unreachable(model):
        return cached(
            f"cannot connect to {constants.ENDPOINT} (no network?) and its config.json is "
            "not in the Hugging Face cache",
            OFFLINE_FIX,
        )
    try:
        return Path(hf_hub_download(model, "config.json"))
    except LocalEntryNotFoundError as exc:  # the Hub stayed unreachable through the retries
        raise ModelConfigError(f"{model}: {exc}", OFFLINE_FIX) from None


def _hub_unreachable(model: str) -> bool:
    """True when no connection to the Hub can be made (name resolution, refused, connect
    timeout): what huggingface_hub itself takes for "the Internet connection is down"
    before it retries. Any answer from the Hub, or any other error: False."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    try:
        get_hf_file_metadata(hf_hub_url(model, "config.json"))
    except Exception as exc:  # noqa: BLE001 - only a failed connection counts
        names = {cls.__name__ for cls in type(exc).__mro__}
        return "ProxyError" not in names and bool(
            names & {"ConnectError", "ConnectTimeout", "ConnectionError"}
        )
    return False


@dataclass(frozen=True)
class ServeSettings:
    """The `vllm serve` arguments doctor's checks depend on, under vLLM's names (its
    ParallelConfig properties read them); None: vLLM's default."""

    backend: str = LOW_LATENCY
    dtype: str = "auto"
    quantization: str | None = None
    moe_backend: str = "auto"
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    eplb_config: dict[str, Any] = field(default_factory=dict)
    enable_dbo: bool = False
    ubatch_size: int = 0
    enable_fault_tolerance: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeSettings:
        eplb = dict(args.eplb_config or {})
        eplb.update(getattr(args, "eplb_overrides", {}) or {})
        return cls(
            backend=args.all2all_backend,
            dtype=args.dtype,
            quantization=args.quantization,
            moe_backend=args.moe_backend,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_chunked_prefill=args.enable_chunked_prefill,
            max_model_len=args.max_model_len,
            data_parallel_size=args.data_parallel_size,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            prefill_context_parallel_size=args.prefill_context_parallel_size,
            enable_expert_parallel=bool(args.enable_expert_parallel),
            enable_eplb=bool(args.enable_eplb),
            eplb_config=eplb,
            enable_dbo=bool(args.enable_dbo),
            ubatch_size=args.ubatch_size,
            # vLLM: --fault-tolerance-config turns fault tolerance on (EngineArgs.__post_init__)
            enable_fault_tolerance=bool(args.enable_fault_tolerance)
            or args.fault_tolerance_config is not None,
        )

    @property
    def tokens(self) -> int:
        # LL under DP+EP is vLLM's "batched DP MoE": its default step budget is
        # SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP (256).
        return self.max_num_batched_tokens or 256

    @property
    def ep_world(self) -> int:
        # vLLM's EP group: DP x PCP x TP ranks (config_validation.ep_world_size).
        from vllm_flashinfer_ep.vllm.config_validation import ep_world_size

        return ep_world_size(self)

    # vLLM 0.33.0's own ParallelConfig properties, evaluated on these arguments (the
    # fields above carry vLLM's names): whether the all2all runs, and micro-batching.
    @property
    def all2all_backend(self) -> str:
        return self.backend

    @property
    def use_sequence_parallel_moe(self) -> bool:
        return _parallel_property("use_sequence_parallel_moe", self)

    @property
    def use_all2all(self) -> bool:
        return _parallel_property("use_all2all", self)

    @property
    def use_ubatching(self) -> bool:
        return _parallel_property("use_ubatching", self)


def _parallel_property(name: str, settings: ServeSettings) -> bool:
    """vLLM's `ParallelConfig.<name>` (the patched one where the plugin is registered)
    computed from the serve arguments, without building (and validating) a ParallelConfig."""
    from vllm.config.parallel import ParallelConfig

    return bool(getattr(ParallelConfig, name).fget(settings))


def accepted_backends() -> tuple[str, ...]:
    """The --all2all-backend names `vllm serve` accepts with this plugin: vLLM's field
    Literal as the plugin extends it (patches/platform.make_backend_literal), less the
    passthrough backend vLLM's parser leaves out (bound from --moe-backend)."""
    from typing import get_args

    from vllm.config.kernel import PASSTHROUGH_ALL2ALL_BACKEND
    from vllm.config.parallel import ParallelConfig

    from vllm_flashinfer_ep.vllm.patches.platform import make_backend_literal

    field_type = ParallelConfig.__dataclass_fields__["all2all_backend"].type
    names = get_args(make_backend_literal(field_type))
    return tuple(n for n in names if n != PASSTHROUGH_ALL2ALL_BACKEND)


def _backend_check(name: str) -> Check:
    """--all2all-backend: one of ours, another vLLM backend (the checks are then those of
    low latency), or a name vLLM's parser refuses."""
    if backends.is_ours(name):
        return Check("all2all backend", True, name)
    ours = " or ".join(f"--all2all-backend {b}" for b in backends.BACKENDS)
    if name not in accepted_backends():
        return Check(
            "all2all backend",
            False,
            f"{name} is not a name vLLM accepts: `vllm serve` refuses it when it parses "
            f"its arguments; the checks below are those of {LOW_LATENCY}",
            f"pass {ours}",
        )
    return Check(
        "all2all backend",
        True,
        f"{name} is not a flashinfer_ep backend; the checks below are those of {LOW_LATENCY}",
        f"pass {ours} to use NCCL-EP",
        warn=True,
    )


def _checked_backend(name: str) -> str:
    return name if backends.is_ours(name) else LOW_LATENCY


def serve_checks(settings: ServeSettings) -> list[Check]:
    """The engine's config-time verdicts on the parallel `vllm serve` arguments
    (config_validation's rules on vLLM's ParallelConfig properties), as doctor lines."""
    from vllm_flashinfer_ep.vllm import config_validation as rules

    checks = [_backend_check(settings.backend)]
    backend = _checked_backend(settings.backend)
    flag = f"--all2all-backend {backend}"
    if settings.use_ubatching:
        reason = rules.ubatching_reason(flag, settings.use_ubatching)
        asked = ["--enable-dbo"] if settings.enable_dbo else []
        if settings.ubatch_size > 1:
            asked.append(f"--ubatch-size {settings.ubatch_size}")
        checks.append(Check("micro-batching", reason is None, " ".join(asked), reason or ""))
    if settings.enable_fault_tolerance:
        reason = rules.fault_tolerance_reason(flag, backend, settings.enable_fault_tolerance)
        detail = f"--enable-fault-tolerance with {backend}"
        checks.append(Check("fault tolerance", reason is None, detail, reason or ""))
    warning = rules.unused_backend_warning(
        backend, settings.use_all2all, settings.enable_expert_parallel
    )
    sizes = [f"--data-parallel-size {settings.data_parallel_size}"]
    if settings.prefill_context_parallel_size > 1:
        sizes.append(f"--prefill-context-parallel-size {settings.prefill_context_parallel_size}")
    sizes.append(f"--tensor-parallel-size {settings.tensor_parallel_size}")
    detail = f"EP world {settings.ep_world} ({' x '.join(sizes)}), " + (
        "--enable-expert-parallel" if settings.enable_expert_parallel else "expert parallel off"
    )
    checks.append(Check("expert parallel", True, detail, warning or "", warn=warning is not None))
    return checks


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
    # Another backend's name is reported by serve_checks; the checks are those of LL.
    backend = _checked_backend(settings.backend)
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
    total = rules.device_memory_bytes() if fleet is not None else None
    unquantized = rules.unquantized_moe(shape.unquantized_modules)
    memory = None
    if fleet is not None:
        memory = _ll_memory_verdict(rules, flag, shape, fleet, settings, total, method, unquantized)
    if method in rules.FP8_METHODS and reason is None:
        # The engine checks the experts against the step budget after lowering it.
        tokens = (memory.lowered_to if memory else None) or settings.tokens
        checks.append(
            _fp8_experts_check(rules, flag, backend, method, block, settings, tokens, unquantized)
        )
    if not low_latency:
        checks.append(_ht_tokens_check(rules, flag, shape, settings))
    if fleet is not None:
        checks.append(_ll_memory_check(shape, fleet, settings, memory))
        rdma = _rdma_check(rules, flag, fleet, settings, total)
        if rdma is not None:
            checks.append(rdma)
    return checks


def _fp8_experts_check(
    rules,
    flag: str,
    backend: str,
    method: str,
    block: Any,
    settings: ServeSettings,
    tokens: int,
    unquantized: str | None,
) -> Check:
    """--moe-backend for an FP8 model: the engine's verdict (`fp8_experts_reason`), with
    the LL step budget the engine checks it against (`tokens`, after any lowering) and the
    checkpoint's unquantized MoE layers (`unquantized`)."""
    asked = settings.moe_backend
    reason = rules.fp8_experts_reason(
        flag,
        backend,
        method,
        block,
        asked,
        tokens if backend == LOW_LATENCY else None,
        settings.ep_world,
        os.environ,
        unquantized,
    )
    if reason is not None:
        return Check("FP8 experts", False, f"--moe-backend {asked}", reason)
    runs, shown = asked, f"--moe-backend {asked}"
    if asked == "auto":
        runs, why = rules.auto_fp8_experts(
            flag,
            backend,
            method,
            block,
            tokens if backend == LOW_LATENCY else None,
            settings.ep_world,
            os.environ,
            unquantized,
        )
        shown += f" -> {runs} ({why})"
    kind = "DeepGEMM batched" if runs == "deep_gemm" else "Triton"
    return Check("FP8 experts", True, f"{shown}: vLLM's {kind} experts")


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


def _ht_tokens_check(
    rules, flag: str, shape: model_shape.ModelShape, settings: ServeSettings
) -> Check:
    """--max-num-batched-tokens against NCCL-EP's HT limit per rank, the engine's verdict
    (config_validation.ht_tokens_verdict: fits, lowered, or refused)."""
    name = f"HT tokens per rank (at most {HT_MAX_TOKENS_PER_RANK})"
    chunked = True if settings.enable_chunked_prefill is None else settings.enable_chunked_prefill
    max_model_len = settings.max_model_len or shape.max_position_embeddings
    tokens, source = settings.max_num_batched_tokens, ""
    if tokens is None:
        tokens = _vllm_default_tokens(settings)
        source = " (vLLM's default for `vllm serve` on this GPU)"
        if not chunked and max_model_len is not None:
            # vLLM: without chunked prefill the default step budget is at least a prompt
            tokens = max(max_model_len, tokens or 0)
            source = " (vLLM's default with chunked prefill off: --max-model-len)"
    if tokens is None:
        return Check(
            name,
            True,
            "--max-num-batched-tokens unset: vLLM's default depends on the GPU "
            "(16384 on GPUs of 160 GiB or more); not checked: no GPU visible here",
            "run doctor on the GPU host, or pass --max-num-batched-tokens "
            f"<= {HT_MAX_TOKENS_PER_RANK}",
            warn=True,
        )
    verdict = rules.ht_tokens_verdict(
        flag, tokens, chunked_prefill=chunked, max_model_len=max_model_len
    )
    detail = f"--max-num-batched-tokens {tokens}{source}"
    if verdict.refusal is not None:
        return Check(name, False, detail, verdict.refusal)
    if verdict.lowered_to is not None:
        return Check(
            name,
            True,
            detail,
            f"the engine lowers --max-num-batched-tokens from {tokens} to "
            f"{verdict.lowered_to}: {verdict.why} (pass a value <= {verdict.lowered_to} "
            "to silence this)",
            warn=True,
        )
    return Check(name, True, detail)


def _vllm_default_tokens(settings: ServeSettings) -> int | None:
    """vLLM 0.33.0's default --max-num-batched-tokens for `vllm serve` where the step is not
    batched DP MoE (HT), which depends on the GPU; None where no GPU is visible."""
    from vllm_flashinfer_ep.vllm.config_validation import device_memory_bytes

    if device_memory_bytes() is None:
        return None
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    world = settings.tensor_parallel_size * settings.pipeline_parallel_size
    return EngineArgs.get_batch_defaults(world)[0].get(
        UsageContext.OPENAI_API_SERVER, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    )


def _ll_memory_verdict(
    rules,
    flag: str,
    shape: model_shape.ModelShape,
    fleet: tuple[int, int, int],
    settings: ServeSettings,
    total: int | None,
    method: str | None,
    unquantized: str | None,
):
    """config_validation.ll_memory_verdict on the serve arguments (vLLM's defaults where
    they are not given); `method` and `unquantized` decide what `auto` rounds the budget
    for (`budget_backend`)."""
    gmu, seqs, chunked = _vllm_defaults(settings) if total is not None else (1.0, 1, True)
    return rules.ll_memory_verdict(
        flag,
        fleet,
        settings.tokens,
        total,
        gmu,
        max_num_seqs=seqs,
        chunked_prefill=chunked,
        max_model_len=settings.max_model_len or shape.max_position_embeddings,
        token_step=rules.deep_gemm_step(
            rules.budget_backend(
                flag,
                LOW_LATENCY,
                method,
                shape.weight_block_size,
                settings.moe_backend,
                settings.ep_world,
                os.environ,
                unquantized,
            ),
            settings.ep_world,
        ),
    )


def _ll_memory_check(
    shape: model_shape.ModelShape,
    fleet: tuple[int, int, int],
    settings: ServeSettings,
    verdict,
) -> Check:
    """The LL fleet's estimated GPU memory per GPU and the engine's verdict on it
    (config_validation.ll_memory_verdict: fits, lowered, or refused)."""
    hidden, experts, top_k = fleet
    tokens = settings.tokens
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
        sections = [
            ("GPU stack", driver_consequences(env_checks.runtime_checks())),
            ("packages", package_checks()),
        ]
    sections.append(("package settings", [variables_check()]))
    settings = ServeSettings.from_args(args)
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
    if args.model:
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


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
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
        type=_tokens,
        default=None,
        metavar="N",
        help="tokens per rank the LL fleet is sized for (default: vLLM's 256 for LL)",
    )
    serve.add_argument("--dtype", default="auto", choices=model_shape.DTYPE_CHOICES)
    serve.add_argument("--quantization", "-q", default=None)
    serve.add_argument(
        "--moe-backend",
        default="auto",
        metavar="NAME",
        help="FP8 models: auto/triton, or deep_gemm (LL, 128x128 block FP8)",
    )
    serve.add_argument("--max-num-seqs", type=_positive, default=None, metavar="N")
    serve.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F")
    _switch(serve, "--enable-chunked-prefill", default=None)
    serve.add_argument("--max-model-len", type=_model_len, default=None, metavar="N")
    serve.add_argument("--data-parallel-size", "-dp", type=_positive, default=1, metavar="N")
    serve.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="N")
    serve.add_argument("--pipeline-parallel-size", "-pp", type=_positive, default=1, metavar="N")
    serve.add_argument(
        "--prefill-context-parallel-size", "-pcp", type=_positive, default=1, metavar="N"
    )
    _switch(serve, "--enable-expert-parallel", "-ep")
    _switch(serve, "--enable-eplb")
    serve.add_argument(
        "--eplb-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="e.g. '{\"num_redundant_experts\": 32}' (or --eplb-config.num_redundant_experts 32)",
    )
    _switch(serve, "--enable-dbo")
    serve.add_argument("--ubatch-size", type=_non_negative, default=0, metavar="N")
    _switch(serve, "--enable-fault-tolerance")
    serve.add_argument(
        "--fault-tolerance-config",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="turns fault tolerance on, as in vLLM",
    )
    parser.set_defaults(func=run, accepts_serve_args=True)


class _EnableDisable(argparse.Action):
    """vLLM's boolean flags: --enable-X / --disable-X (and --no-enable-X)."""

    def __call__(self, parser, namespace, values, option_string=None):
        negative = option_string.startswith(("--disable-", "--no-"))
        setattr(namespace, self.dest, not negative)


def _switch(group, flag: str, *aliases: str, default: bool | None = False) -> None:
    stem = flag.removeprefix("--enable-")
    group.add_argument(
        flag,
        *aliases,
        f"--disable-{stem}",
        f"--no-enable-{stem}",
        action=_EnableDisable,
        nargs=0,
        default=default,
    )
