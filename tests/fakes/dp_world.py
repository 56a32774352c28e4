"""vLLM 0.33.0's per-step DP agreement, run for real on fake-world ranks (one thread each).

Every DP rank of a vLLM engine agrees each step on how many tokens each rank runs: the
V2 model runner (the default in 0.33.0) all-reduces its count, graph mode and a few flags
in `vllm.v1.worker.gpu.dp_utils.dispatch_cg_and_sync_dp` (`sync_cudagraph_and_dp_padding`),
the V1 runner in `vllm.v1.worker.dp_utils.coordinate_batch_across_dp`; the result enters
`set_forward_context(num_tokens_across_dp=...)`, which builds the forward's `DPMetadata`
(what the package's `forward_state.agreed_token_count` reads). An idle DP rank runs the
worker's dummy batch (`Worker.execute_dummy_batch` -> `_dummy_run`) so that it joins the
collectives. Here all of that is vLLM's own code; only three things are replaced, for the
duration of `dp_world()`:

- The DP process group. `get_dp_group()` (as the two dp_utils modules call it) answers
  the calling thread's `FakeDPGroup`, whose SUM all-reduce runs over a `FakeGroup` of its
  own (DP and EP are separate groups); the V1 path's `dist.all_reduce` is routed there.
- The forward context. vLLM keeps it in one process global (`vllm.forward_context.
  _forward_context`), and the ranks here are threads of one process: `override_forward_context`,
  `get_forward_context` and `is_forward_context_available` are replaced by per-thread
  versions, in `vllm.forward_context` and in every loaded module that imported them by name
  (set_forward_context itself is untouched and calls the per-thread override).
- The model runner. What the runner does around the sync needs a GPU, a model and a KV
  cache; `V2Runner`/`V1Runner` keep only the lines of `execute_model` that pick the batch
  counts, sync them and enter the forward context, and run a test-given MoE `forward`
  inside it. For the idle rank, the real `Worker.execute_dummy_batch` and (V2) the real
  `GPUModelRunner._dummy_run` build the dummy batch and hand it to that `execute_model`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import vllm.forward_context as fc
import vllm.v1.worker.dp_utils as v1_dp_utils
import vllm.v1.worker.gpu.dp_utils as v2_dp_utils
from vllm.config import ParallelConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import BatchDescriptor, set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.worker.utils import get_uniform_decode_token_count

from tests.fakes.fake_moe_ep import FakeGroup
from tests.fakes.world import run_ranks

# --------------------------------------------------------------- per-thread context
_local = threading.local()


@contextmanager
def _override(forward_context: fc.ForwardContext | None) -> Iterator[None]:
    prev = getattr(_local, "forward_context", None)
    _local.forward_context = forward_context
    try:
        yield
    finally:
        _local.forward_context = prev


def _get() -> fc.ForwardContext:
    ctx = getattr(_local, "forward_context", None)
    assert ctx is not None, "Forward context is not set on this rank's thread."
    return ctx


def _available() -> bool:
    return getattr(_local, "forward_context", None) is not None


@contextmanager
def per_thread_forward_context() -> Iterator[None]:
    """vLLM's forward context, one per thread (= per fake rank), while inside."""
    per_thread = {
        "override_forward_context": _override,
        "get_forward_context": _get,
        "is_forward_context_available": _available,
    }
    originals = {name: getattr(fc, name) for name in per_thread}
    # Modules that imported one of them by name hold the original: rebound too.
    with mock.patch.multiple(fc, **per_thread), _rebound(originals, per_thread):
        yield
    assert fc._forward_context is None, "something set vLLM's process-global forward context"


@contextmanager
def _rebound(originals: dict[str, Any], replacements: dict[str, Any]) -> Iterator[None]:
    undo = []
    for module in list(sys.modules.values()):
        attrs = getattr(module, "__dict__", {})
        for name, original in originals.items():
            if module is not fc and attrs.get(name) is original:
                setattr(module, name, replacements[name])
                undo.append((module, name, original))
    try:
        yield
    finally:
        for module, name, original in undo:
            setattr(module, name, original)


# ------------------------------------------------------------------- DP group
class FakeDPGroup:
    """vLLM's DP GroupCoordinator, as far as the per-step DP sync reaches it: the CPU
    SUM all-reduce (V2), and the device, groups and `dist.all_reduce` of V1's `_run_ar`."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self.group, self.rank_in_group, self.world_size = group, rank, group.world_size
        self.device = torch.device("cpu")
        self.cpu_group = self.device_group = self
        self.all_reduces: list[list[list[int]]] = []  # every rank's contribution, in order

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        op = f"dp_all_reduce{tuple(tensor.shape)}"  # ranks must reduce alike shaped tensors
        everyone = self.group.exchange(self.rank_in_group, op, tensor.clone())
        self.all_reduces.append([t.tolist() for t in everyone])
        tensor.copy_(torch.stack(everyone).sum(dim=0))
        return tensor


def _dist_all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, **_: Any) -> None:
    assert isinstance(group, FakeDPGroup), "the DP sync reduced over another group"
    assert op is None or op == torch.distributed.ReduceOp.SUM
    group.cpu_all_reduce_(tensor)


def _current_dp_group() -> FakeDPGroup:
    group = getattr(_local, "dp_group", None)
    assert group is not None, "no fake DP group on this thread (run it through run_dp_ranks)"
    return group


@contextmanager
def dp_world() -> Iterator[None]:
    """vLLM's DP sync over the fake DP groups, and per-thread forward contexts."""
    dist = SimpleNamespace(all_reduce=_dist_all_reduce)
    with (
        per_thread_forward_context(),
        mock.patch.object(v2_dp_utils, "get_dp_group", _current_dp_group),
        mock.patch.object(v1_dp_utils, "get_dp_group", _current_dp_group),
        mock.patch.object(v1_dp_utils, "dist", dist),
    ):
        yield


def run_dp_ranks(
    world_size: int, fn: Callable[[int, FakeGroup], Any], timeout_s: float = 120.0
) -> list:
    """`fn(rank, ep_group)` on `world_size` threads (tests/fakes/world.py), each thread
    holding its rank of a DP group of the same size. Use inside `dp_world()`."""
    dp = FakeGroup(world_size, timeout_s=timeout_s / 2)

    def body(rank: int, ep_group: FakeGroup) -> Any:
        _local.dp_group = FakeDPGroup(dp, rank)
        try:
            return fn(rank, ep_group)
        except BaseException:
            dp._barrier.abort()  # peers waiting in a DP all-reduce fail fast too
            raise
        finally:
            _local.dp_group = None

    return run_ranks(world_size, body, timeout_s=timeout_s)


def dp_group() -> FakeDPGroup:
    """This thread's DP group (its all-reduce log)."""
    return _current_dp_group()


# ----------------------------------------------------------------- configs, loads
def vllm_config(world_size: int, rank: int) -> VllmConfig:
    """A real VllmConfig of DP rank `rank` of `world_size`, with EP, eager (no graphs)."""
    parallel = ParallelConfig(
        data_parallel_size=world_size, data_parallel_rank=rank, enable_expert_parallel=True
    )
    config = VllmConfig(parallel_config=parallel)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    return config


@dataclass(frozen=True)
class Load:
    """What one DP rank's scheduler gives it this step: requests and their new tokens."""

    name: str
    tokens_per_request: tuple[int, ...] = ()  # empty: idle (the engine runs a dummy batch)
    prefill: bool = False

    @property
    def idle(self) -> bool:
        return not self.tokens_per_request

    def scheduler_output(self) -> SchedulerOutput:
        out = SchedulerOutput.make_empty()
        out.num_scheduled_tokens = {
            f"{self.name}-{i}": n for i, n in enumerate(self.tokens_per_request)
        }
        out.total_num_scheduled_tokens = sum(self.tokens_per_request)
        return out


def prefill(tokens: int) -> Load:
    return Load(f"prefill{tokens}", (tokens,), prefill=True)


def decode(requests: int) -> Load:
    return Load(f"decode{requests}", (1,) * requests)


IDLE = Load("idle")


@dataclass
class Step:
    """What one rank ran in one step: the counts vLLM agreed and the MoE layer's result."""

    load: Load
    dummy: bool
    num_tokens: int  # this rank's scheduled tokens (the dummy batch's, when idle)
    forward_tokens: int  # what the forward (and its MoE layer) ran: + DP/graph padding
    num_tokens_across_dp: list[int]  # the forward context's DPMetadata
    result: Any = None


# ---------------------------------------------------------------------- runners
@dataclass
class _Runner:
    """The DP part of a vLLM model runner; `forward(num_tokens)` is the model's MoE layer,
    called inside vLLM's forward context."""

    config: VllmConfig
    forward: Callable[[int], Any]
    steps: list[Step] = field(default_factory=list)
    decode_query_len: int = 1  # 1 + speculative tokens (none here)

    def __post_init__(self) -> None:
        pass

    @property
    def parallel(self) -> ParallelConfig:
        return self.config.parallel_config

    def step(self, load: Load) -> None:
        """One engine step of this rank: its scheduled batch, or the idle rank's dummy
        batch through vLLM's own Worker.execute_dummy_batch."""
        self._load = load
        if load.idle:
            from vllm.v1.worker.gpu_worker import Worker

            Worker.execute_dummy_batch(
                SimpleNamespace(model_runner=self, randomize_dummy_inputs=False)
            )
        else:
            self.execute_model(load.scheduler_output())

    def _forward(
        self, *, dummy: bool, num_tokens: int, forward_tokens: int, **context: Any
    ) -> None:
        with set_forward_context(None, self.config, num_tokens=forward_tokens, **context):
            meta = fc.get_forward_context().dp_metadata
            step = Step(
                self._load,
                dummy,
                num_tokens,
                forward_tokens,
                meta.num_tokens_across_dp_cpu.tolist(),
            )
            step.result = self.forward(forward_tokens)
        self.steps.append(step)

    def execute_model(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError


class V2Runner(_Runner):
    """vLLM 0.33.0's default (V2) runner: `GPUModelRunner.execute_model`'s batch
    counts (vllm/v1/worker/gpu/model_runner.py l.1799-1850: request state, then
    `dispatch_cg_and_sync_dp`), and its `set_forward_context` (l.2068-2080)."""

    # What GPUModelRunner._dummy_run reads before it calls execute_model.
    max_num_reqs = 1024
    max_num_tokens = 8192
    speculator = None
    lora_config = None
    is_first_pp_rank = True
    is_last_pp_rank = False  # _dummy_run returns right after execute_model
    eplb = SimpleNamespace(step=lambda **_: None)
    kv_connector = SimpleNamespace(set_disabled=lambda disabled: None)

    def __post_init__(self) -> None:
        import vllm.v1.worker.gpu.cudagraph_utils as cg

        # An eager engine's graph manager: mode NONE, nothing captured. Its constructor asks
        # the PP group only whether this is the first/last stage.
        pp = SimpleNamespace(is_first_rank=True, is_last_rank=True)
        with mock.patch.object(cg, "get_pp_group", lambda: pp):
            self.cudagraph_manager = cg.CudaGraphManager(
                self.config, torch.device("cpu"), CUDAGraphMode.NONE, self.decode_query_len
            )

    @contextmanager
    def maybe_dummy_run_with_lora(self, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield

    def _dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        return GPUModelRunner._dummy_run(self, num_tokens, *args, **kwargs)

    @torch.inference_mode()  # as vLLM's
    def execute_model(
        self, scheduler_output: SchedulerOutput, *args: Any, dummy_run: bool = False, **kwargs: Any
    ) -> None:
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        num_toks = scheduler_output.total_num_scheduled_tokens
        max_query_len: int | None = max(scheduler_output.num_scheduled_tokens.values())
        # gather_batch_req_state: a dummy batch is uniform by construction; a real one is a
        # decode candidate unless a request is still prefilling.
        has_prefill = not dummy_run and self._load.prefill
        uniform = get_uniform_decode_token_count(
            num_reqs, num_toks, max_query_len, decode_graph_eligible=not has_prefill
        )
        if has_prefill:
            max_query_len = None
        batch_desc, sync = v2_dp_utils.dispatch_cg_and_sync_dp(
            self.cudagraph_manager,
            num_reqs,
            num_toks,
            uniform,
            self.parallel.data_parallel_size,
            self.parallel.data_parallel_rank,
            max_query_len=max_query_len,
            need_eager=False,
            num_active_loras=0,
            parallel_config=self.parallel,
            allow_ubatching=False,
            uniform_decode=uniform == self.decode_query_len,
            allow_skip_drafts=scheduler_output.skip_drafts,
        )
        if batch_desc.num_tokens == 0:
            return  # no DP rank has work
        forward_tokens = max(num_toks, batch_desc.num_tokens)  # prepare_inputs / make_dummy
        self._forward(
            dummy=dummy_run,
            num_tokens=num_toks,
            forward_tokens=forward_tokens,
            cudagraph_runtime_mode=batch_desc.cg_mode,
            num_tokens_across_dp=sync and sync.num_tokens_across_dp,
            batch_descriptor=BatchDescriptor(num_tokens=forward_tokens),
        )


class V1Runner(_Runner):
    """The V1 runner (VLLM_USE_V2_MODEL_RUNNER=0, or features V2 lacks): eager
    `_determine_batch_execution_and_padding` (vllm/v1/worker/gpu_model_runner.py
    l.3740-3770: `coordinate_batch_across_dp`), then `set_forward_context`."""

    @torch.inference_mode()  # as vLLM's
    def _dummy_run(
        self, num_tokens: int, *args: Any, uniform_decode: bool = False, **kwargs: Any
    ) -> None:
        # V1's _dummy_run builds a real batch of `num_tokens` (GPU buffers, attention
        # metadata); its DP part is the same as a scheduled step's.
        self._sync_and_forward(num_tokens, dummy=True, uniform_decode=uniform_decode)

    @torch.inference_mode()  # as vLLM's
    def execute_model(self, scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> None:
        self._sync_and_forward(
            scheduler_output.total_num_scheduled_tokens,
            dummy=False,
            uniform_decode=not self._load.prefill,
        )

    def _sync_and_forward(self, num_tokens: int, *, dummy: bool, uniform_decode: bool) -> None:
        _, across_dp, synced_mode = v1_dp_utils.coordinate_batch_across_dp(
            num_tokens_unpadded=num_tokens,
            allow_microbatching=False,
            parallel_config=self.parallel,
            num_tokens_padded=num_tokens,  # eager: the graph dispatcher pads nothing
            uniform_decode=uniform_decode,
            cudagraph_mode=CUDAGraphMode.NONE.value,
        )
        padded = int(across_dp[self.parallel.data_parallel_rank])
        self._forward(
            dummy=dummy,
            num_tokens=num_tokens,
            forward_tokens=padded,
            cudagraph_runtime_mode=CUDAGraphMode(synced_mode),
            num_tokens_across_dp=across_dp,
            batch_descriptor=BatchDescriptor(num_tokens=padded),
        )


RUNNERS = {"v2": V2Runner, "v1": V1Runner}
