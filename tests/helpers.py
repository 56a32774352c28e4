"""Small helpers shared by the test folders (import as `tests.helpers`)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import signal
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: scripts that only start servers need no torch
    import torch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# NVLink multicast stays off in every process a multi-GPU test starts: on shared hosts a
# program that uses it can take the host's GPUs out of service (NCCL, PyTorch, NVSHMEM).
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Where a test records the process groups of servers it starts in their own session, so a
# device call killed mid-test leaves none behind for the next (device_suite.sh kills them).
SERVER_GROUPS_ENV = "FLASHINFER_EP_TEST_SERVER_GROUPS"


def remember_group(pgid: int) -> None:
    path = os.environ.get(SERVER_GROUPS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{pgid}\n")


def forget_group(pgid: int) -> None:
    path = os.environ.get(SERVER_GROUPS_ENV)
    if path and os.path.exists(path):
        kept = [g for g in Path(path).read_text().split() if g != str(pgid)]
        Path(path).write_text("".join(f"{g}\n" for g in kept))


def default_sigint() -> None:
    """`preexec_fn` of a child a test interrupts with SIGINT as Ctrl-C at a terminal would:
    SIGINT back to its default. A suite started in the background of a non-interactive
    shell (`cmd &`, as CI runners and `nohup` do) runs with SIGINT ignored; children
    inherit that, Python then installs no KeyboardInterrupt handler, and the test's
    interrupt is lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def no_interrupts():
    """Teardown that must finish: a second SIGINT (`timeout -s INT` signals pytest, then its
    process group) would otherwise stop it halfway and leave a server holding the GPUs."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to change
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def visible_gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def model_is_local(model: str) -> bool:
    """The model's config and every weight shard are on disk (a dir, or the HF cache)."""
    path = Path(model)
    if path.is_dir():
        return (path / "config.json").is_file()
    from huggingface_hub import try_to_load_from_cache

    def cached(filename: str) -> str | None:
        hit = try_to_load_from_cache(model, filename)
        return hit if isinstance(hit, str) else None

    if cached("config.json") is None:
        return False
    index = cached("model.safetensors.index.json")
    if index is not None:
        shards = set(json.loads(Path(index).read_text(encoding="utf-8"))["weight_map"].values())
        return all(cached(shard) is not None for shard in shards)
    return cached("model.safetensors") is not None


class _ParseError(Exception):
    pass


@functools.cache
def _serve_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.plugins import load_general_plugins
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load_general_plugins()  # as `vllm serve` does: plugin backend names become choices
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))

    def error(message: str):
        raise _ParseError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def parse_serve_args(serve_argv: Sequence[str]) -> argparse.Namespace:
    """`vllm serve` arguments parsed by vLLM's real parser; ValueError instead of exit."""
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

    try:
        args = _serve_parser().parse_args(list(serve_argv))
    except (argparse.ArgumentError, _ParseError) as exc:
        raise ValueError(f"vllm serve rejects {list(serve_argv)}: {exc}") from exc
    args.subparser = "serve"
    validate_parsed_serve_args(args)
    return args


# Trivial experts for transport tests: expert e maps a row x to x * scales[e].
def scale_expert_rows(
    expert_x: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Batched-layout expert op: expert_x[e] * scales[e] (rows past the count are ignored by combine)."""
    import torch

    factor = scales.to(expert_x.dtype).view(-1, 1, 1)
    if out is None:
        return expert_x * factor
    return torch.mul(expert_x, factor, out=out)


def reduce_received_rows(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Standard-layout experts + weighted reduce per received row (HT)."""
    factor = (weights.float() * scales.float()[ids]).sum(dim=1, keepdim=True)
    out.copy_((x.float() * factor).to(out.dtype))
    return out


def moe_config(
    *,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    max_num_tokens: int,
    backend: str | None = None,
    device: str | torch.device = "cpu",
):
    """vLLM 0.33.0's FusedMoEConfig of one rank holding every expert (SiLU, BF16), under EP
    with `backend` as its all2all backend, or without EP (None)."""
    import dataclasses

    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    parallel = FusedMoEParallelConfig.make_no_parallel()
    if backend is not None:
        parallel = dataclasses.replace(parallel, use_ep=True, all2all_backend=backend)
    return FusedMoEConfig(
        num_experts=experts,
        experts_per_token=top_k,
        hidden_dim=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=MoEActivation.SILU,
        device=device,
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=parallel,
        in_dtype=torch.bfloat16,
        max_num_tokens=max_num_tokens,
    )


def vllm_apply(body):
    """`body(self, kw)` as an experts `apply` with vLLM 0.33.0's parameters, `kw` every
    argument by vLLM's name (vLLM passes some positionally)."""
    from vllm_flashinfer_ep.experts.deep_gemm import APPLY_PARAMS

    def apply(self, *args, **kw):
        kw.update(zip(APPLY_PARAMS, args))
        return body(self, kw)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = ("self", *APPLY_PARAMS)
    apply.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])
    return apply


@contextlib.contextmanager
def patch_row(name: str):
    """One row of the patch table applied for a test, then put back as it was (other test
    modules register every patch for the session)."""
    from vllm_flashinfer_ep.vllm import patches
    from vllm_flashinfer_ep.vllm.patches import _helper

    patch = patches.BY_NAME[name]
    was = _helper.is_applied(patch)
    _helper.apply(patch)
    try:
        yield patch
    finally:
        if was:
            _helper.apply(patch)
        else:
            _helper.undo(patch)
