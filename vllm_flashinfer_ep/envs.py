"""Environment variables read by the package, each with one parser.

vLLM's own `vllm.envs` raises AttributeError for names it does not know, so the plugin
reads its variables from os.environ here, in one place, with their defaults. Every
variable has one parser that accepts exactly the documented values and raises
`FlashInferEPEnvVarError` (naming the variable and what it accepts) for anything else.
The same parsers run at engine-config time (`validate_all`, called from
config_validation) and wherever a worker reads a value, so a bad value fails before
any worker starts and is never silently read as something else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

# Transport under flashinfer.moe_ep: "nccl_ep" (default) or "nixl_ep" (needs a FlashInfer
# built with NIXL-EP; the PyPI wheel is not).
TRANSPORT = "VLLM_FLASHINFER_EP_TRANSPORT"
# "0" turns the persistent handle pool off (every forward creates a fresh handle; the
# low-latency backend then runs without CUDA graphs).
HANDLE_POOL = "VLLM_FLASHINFER_EP_HANDLE_POOL"
# NCCL-EP fault-tolerance timeout in milliseconds (low latency only). NCCL-EP's own
# default is ~100 s, above vLLM's fault-detection deadline, hence our lower default.
FT_TIMEOUT_MS = "VLLM_FLASHINFER_EP_FT_TIMEOUT_MS"
# Size of the NCCL-EP RDMA buffer in bytes; 0 = computed from the fleet shape.
RDMA_BUFFER_BYTES = "VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES"
# "1" skips the worker-side environment checks (nvcc, libnccl version). For experts only.
SKIP_ENV_CHECKS = "VLLM_FLASHINFER_EP_SKIP_ENV_CHECKS"
# "0" sends 128x128 block-FP8 layers' activations in BF16 on both backends (quantized
# after receive) instead of FP8 on the wire (runtime/fp8_wire.py).
FP8_DISPATCH = "VLLM_FLASHINFER_EP_FP8_DISPATCH"
# "0" issues eager LL rounds through FlashInfer's handle methods instead of the nccl.ep
# calls underneath them (runtime/native_handle.py).
NATIVE_EAGER = "VLLM_FLASHINFER_EP_NATIVE_EAGER"
# Block-FP8 LL layers on DeepGEMM: forwards of at most this many rows per expert run the
# received-rows Triton experts, larger ones DeepGEMM (experts/deep_gemm.py).
DEEP_GEMM_RECEIVED_ROWS = "VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS"
# Seconds one CPU exchange among the EP ranks (the load check, the FP8 wire decision, the
# capture plan) may wait for the other ranks before every rank still running stops with a
# named error (runtime/exchange.py). vLLM's gloo groups would wait 1,800 s.
EXCHANGE_TIMEOUT_S = "VLLM_FLASHINFER_EP_EXCHANGE_TIMEOUT_S"
# Tokens per rank one LL round carries (0: a whole step, the LL fleet sized for the step
# budget). Above it, a MoE forward runs as several rounds (vllm/round_chunks.py), so the
# budget can grow without LL's buffers.
LL_ROUND_TOKENS = "VLLM_FLASHINFER_EP_LL_ROUND_TOKENS"

DEFAULT_TRANSPORT = "nccl_ep"
DEFAULT_FT_TIMEOUT_MS = 20_000
# One hour: far above any fault deadline worth having (NCCL-EP's own default is ~100 s),
# and well inside the unsigned 64-bit nanoseconds NCCL-EP's GroupConfig takes.
FT_TIMEOUT_MAX_MS = 3_600_000
FT_TIMEOUT_ACCEPTED = f"an integer number of milliseconds from 1 to {FT_TIMEOUT_MAX_MS} (one hour)"
DEFAULT_EXCHANGE_TIMEOUT_S = 30
# A range check only: config time checks the fleet's memory for the value (at hidden 2048
# and 128 experts, 8192 tokens per round already take 13 GiB).
LL_ROUND_TOKENS_MAX = 65_536
LL_ROUND_TOKENS_ACCEPTED = (
    f"0 (one round per step) or a number of tokens per rank from 1 to {LL_ROUND_TOKENS_MAX}"
)
EXCHANGE_TIMEOUT_MAX_S = 3600
EXCHANGE_TIMEOUT_ACCEPTED = (
    f"an integer number of seconds from 1 to {EXCHANGE_TIMEOUT_MAX_S} (one hour)"
)
# flashinfer.moe_ep split-path transports (flashinfer/moe_ep/backends/split/comm/).
TRANSPORTS: tuple[str, ...] = ("nccl_ep", "nixl_ep")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_ACCEPTED = "1/true/yes/on or 0/false/no/off (case-insensitive)"


@dataclass(frozen=True)
class EnvVar:
    """One documented variable: its default, what it accepts, and its parser."""

    name: str
    default: str
    accepted: str
    parse: Callable[[str, str], Any]  # (name, stripped raw value) -> value
    meaning: str

    def raw(self, environ: Mapping[str, str] | None = None) -> str:
        env = os.environ if environ is None else environ
        return env.get(self.name, "").strip()

    def value(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value; the default when unset or empty."""
        raw = self.raw(environ)
        return self.parse(self.name, raw if raw else self.default)


def _error(name: str, raw: str, accepted: str) -> FlashInferEPEnvVarError:
    return FlashInferEPEnvVarError(f"{name}={raw!r} is not valid: accepted values are {accepted}.")


def _parse_bool(name: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _error(name, raw, BOOL_ACCEPTED)


_INTEGER = re.compile(r"[+-]?[0-9]+")


def _int_parser(
    minimum: int, accepted: str, maximum: int | None = None
) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        # ASCII digits with an optional sign only: int() would also take "20_000" and
        # other scripts' digits, which the accepted text does not promise.
        if _INTEGER.fullmatch(raw) is None:
            raise _error(name, raw, accepted)
        value = int(raw, 10)
        if value < minimum or (maximum is not None and value > maximum):
            raise _error(name, raw, accepted)
        return value

    return parse


# A fixed RDMA buffer (NCCL-EP allocates exactly this and never grows it) must hold the
# LL fleet's layout (runtime/buffer_sizes.py ll_layout_bytes). Any value is checked against
# the fleet at engine-config time; here, a shape-free range: at least the smallest layout
# of any fleet the package builds, ll_layout_bytes(1 token, hidden 2048, 1 expert, top_k 1,
# EP world 1) (a test keeps the two equal; this module imports nothing of the package's
# but its errors), at most 1 TiB (more than any GPU's memory).
RDMA_MIN_BYTES = 17_024
RDMA_MAX_BYTES = 1 << 40


def rdma_min_bytes() -> int:
    """The smallest accepted non-zero VLLM_FLASHINFER_EP_RDMA_BUFFER_BYTES."""
    return RDMA_MIN_BYTES


RDMA_ACCEPTED = (
    f"0 (NCCL-EP sizes the buffer) or an integer number of bytes from {RDMA_MIN_BYTES} "
    f"(NCCL-EP's smallest low-latency layout) to {RDMA_MAX_BYTES} (1 TiB)"
)


def _parse_rdma_bytes(name: str, raw: str) -> int:
    value = _int_parser(0, RDMA_ACCEPTED)(name, raw)
    if value != 0 and not RDMA_MIN_BYTES <= value <= RDMA_MAX_BYTES:
        raise _error(name, raw, RDMA_ACCEPTED)
    return value


# Where the received rows and DeepGEMM cross at Qwen3-30B-A3B's shape on an H100 (the FP8
# experts probe, docs/benchmarks.md); the engine benchmark measured the choice up to 2.
DEFAULT_DEEP_GEMM_RECEIVED_ROWS = "4"
ROWS_ACCEPTED = (
    "a number of rows per expert >= 0 (decimal; 0: DeepGEMM for every forward; inf: the "
    "received rows for every forward)"
)
_DECIMAL = re.compile(r"[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)")


def _parse_rows(name: str, raw: str) -> float:
    if raw.lower() in ("inf", "infinity"):
        return float("inf")
    if _DECIMAL.fullmatch(raw) is None:  # float() would take "nan", "1e3", "1_0"
        raise _error(name, raw, ROWS_ACCEPTED)
    return float(raw)


def _parse_transport(name: str, raw: str) -> str:
    if raw not in TRANSPORTS:
        raise _error(name, raw, " or ".join(TRANSPORTS))
    return raw


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar(
        HANDLE_POOL,
        "1",
        BOOL_ACCEPTED,
        _parse_bool,
        "0 disables the persistent handle pool (LL then runs without CUDA graphs)",
    ),
    EnvVar(
        FT_TIMEOUT_MS,
        str(DEFAULT_FT_TIMEOUT_MS),
        FT_TIMEOUT_ACCEPTED,
        _int_parser(1, FT_TIMEOUT_ACCEPTED, FT_TIMEOUT_MAX_MS),
        "NCCL-EP fault-detection timeout (LL + --enable-fault-tolerance)",
    ),
    EnvVar(
        TRANSPORT,
        DEFAULT_TRANSPORT,
        " or ".join(TRANSPORTS),
        _parse_transport,
        "FlashInfer transport",
    ),
    EnvVar(
        RDMA_BUFFER_BYTES,
        "0",
        RDMA_ACCEPTED,
        _parse_rdma_bytes,
        "fixed NCCL-EP RDMA buffer size (config time also checks it against the LL fleet's layout)",
    ),
    EnvVar(
        SKIP_ENV_CHECKS,
        "0",
        BOOL_ACCEPTED,
        _parse_bool,
        "1 skips the worker's environment checks",
    ),
    EnvVar(
        FP8_DISPATCH,
        "1",
        BOOL_ACCEPTED,
        _parse_bool,
        "0 keeps block-FP8 layers' dispatch in BF16 (quantized after receive)",
    ),
    EnvVar(
        NATIVE_EAGER,
        "1",
        BOOL_ACCEPTED,
        _parse_bool,
        "0 runs eager LL rounds through FlashInfer's handle methods, not direct nccl.ep calls",
    ),
    EnvVar(
        DEEP_GEMM_RECEIVED_ROWS,
        DEFAULT_DEEP_GEMM_RECEIVED_ROWS,
        ROWS_ACCEPTED,
        _parse_rows,
        "block-FP8 LL layers on DeepGEMM: forwards of at most this many rows per expert run "
        "the received-rows Triton experts",
    ),
    EnvVar(
        EXCHANGE_TIMEOUT_S,
        str(DEFAULT_EXCHANGE_TIMEOUT_S),
        EXCHANGE_TIMEOUT_ACCEPTED,
        _int_parser(1, EXCHANGE_TIMEOUT_ACCEPTED, EXCHANGE_TIMEOUT_MAX_S),
        "seconds a CPU exchange among the EP ranks waits for the others before it fails",
    ),
    EnvVar(
        LL_ROUND_TOKENS,
        "0",
        LL_ROUND_TOKENS_ACCEPTED,
        _int_parser(0, LL_ROUND_TOKENS_ACCEPTED, LL_ROUND_TOKENS_MAX),
        "LL: tokens per rank one round carries; steps above it run as several rounds, and "
        "the fleet is sized for it instead of --max-num-batched-tokens",
    ),
)
BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


PREFIX = "VLLM_FLASHINFER_EP_"


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every variable; one error listing each bad one (name and accepted values).

    An unknown name under the package's prefix is refused too: a misspelt variable would
    otherwise leave its default in force without a word.
    """
    env = os.environ if environ is None else environ
    problems = [
        f"{name} is not a vllm-flashinfer-ep variable (known: {', '.join(BY_NAME)})."
        for name in sorted(k for k in env if k.startswith(PREFIX) and k not in BY_NAME)
    ]
    for var in VARIABLES:
        try:
            var.value(env)
        except FlashInferEPEnvVarError as exc:
            problems.append(str(exc))
    if problems:
        raise FlashInferEPEnvVarError(" ".join(problems))


def validate_env(environ: Mapping[str, str]) -> None:
    """`validate_all` for an environment that is not this process's (e.g. an eval config);
    raises ValueError so callers outside the engine need not know the package's errors."""
    try:
        validate_all(environ)
    except FlashInferEPEnvVarError as exc:
        raise ValueError(str(exc)) from exc


def transport() -> str:
    return BY_NAME[TRANSPORT].value()


def handle_pool_enabled() -> bool:
    return BY_NAME[HANDLE_POOL].value()


def fp8_dispatch_enabled() -> bool:
    return BY_NAME[FP8_DISPATCH].value()


def native_eager_enabled() -> bool:
    return BY_NAME[NATIVE_EAGER].value()


def ft_timeout_ms() -> int:
    return BY_NAME[FT_TIMEOUT_MS].value()


def rdma_buffer_bytes() -> int:
    return BY_NAME[RDMA_BUFFER_BYTES].value()


def skip_env_checks() -> bool:
    return BY_NAME[SKIP_ENV_CHECKS].value()


def deep_gemm_received_rows() -> float:
    return BY_NAME[DEEP_GEMM_RECEIVED_ROWS].value()


def exchange_timeout_s() -> int:
    return BY_NAME[EXCHANGE_TIMEOUT_S].value()


def ll_round_tokens() -> int:
    return BY_NAME[LL_ROUND_TOKENS].value()


# How one rank checks its host, issues its calls, runs its own experts and how long it
# waits for its peers: its peers see the same collectives.
RANK_LOCAL = (SKIP_ENV_CHECKS, NATIVE_EAGER, DEEP_GEMM_RECEIVED_ROWS, EXCHANGE_TIMEOUT_S)


def settings() -> dict[str, Any]:
    """The parsed values every EP rank must share (managers compare them across ranks)."""
    return {var.name: var.value() for var in VARIABLES if var.name not in RANK_LOCAL}
