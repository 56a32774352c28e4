"""Test-only: run vLLM 0.33.0's expert-parallel all2all path at EP world size 1.

vLLM skips the all2all below two EP ranks, and the GPU test machine has one GPU. This
harness changes five answers of vLLM's configuration objects, and only for the two
flashinfer_ep backends with --enable-expert-parallel, so that a dp=1 engine builds the
same objects a dp=2 engine builds on each rank:

1. `ParallelConfig.use_all2all` -> True (vLLM: dp > 1, or SP, or EP with pcp > 1).
   Effect: `initialize_model_parallel` asks the EP group for an all2all manager.
2. `ParallelConfig.use_batched_dp_moe` -> the package's answer for low latency at dp=2
   (EP, and no VLLM_FLASHINFER_EP_LL_ROUND_TOKENS). Effect: --max-num-batched-tokens
   defaults to LL's 512 (the default_step_budget patch), the LL per-rank capacity a dp=2
   engine gets, or to vLLM's budget for engines without EP where rounds split.
3. `GroupCoordinator.__init__`: the EP group of world size 1 gets its device communicator
   (vLLM builds none at world size 1). Effect: vLLM's own `CudaCommunicator`, through
   the package's patch, builds the package's manager over the EP group's CPU group.
4. `FusedMoEParallelConfig.make` / `.use_all2all_kernels`: EP on at world size 1 (vLLM:
   dp*pcp*tp > 1) and all2all kernels on (vLLM: dp > 1, pcp > 1 or SP). Effect: every MoE
   layer asks `maybe_make_prepare_finalize` (the package's patch) for its
   prepare/finalize, gets the manager's shared runtime and the package's P/F, and the
   oracle builds BatchedExperts (LL) or Standard experts (HT) around it.
5. `CompilationConfig.set_splitting_ops_for_v1`, called from `VllmConfig.__post_init__`,
   sees data_parallel_size=2 (only while building such an engine's config). Effect: the
   package's CUDA-graph policy decides as for a dp=2 engine (LL keeps the mode, HT gets
   NONE), logging its reason.

Another, off unless `FLASHINFER_EP_TEST_DUMMY_SCALE=1` (the model-matrix tests, every
engine of a comparison, EP or not): `--load-format dummy` weights rescaled to a usual
initialisation (scale_dummy_weights), so that a wrong MoE output moves prompt logprobs.

One more, off unless `FLASHINFER_EP_TEST_DP_EXPECTED_M=1` (a measurement switch):
vLLM's batched DeepGEMM experts, which without DP metadata hand DeepGEMM `expected_m` =
the buffer's rows per expert at every forward, get vLLM's DP estimate instead (its
formula, `experts.deep_gemm.dp_estimate`, over this rank's tokens as if they were every
rank's): the tile data parallel ranks pick for the same rows per expert (a dp=2 engine
at half this batch per rank).

It also gives vLLM's workers one method, `flashinfer_ep_test_probe` (what
`engine_run.worker_probe` reads), which a server started with VLLM_SERVER_DEV_MODE=1 runs
through its /collective_rpc endpoint: the serving benchmark reads handle counters that way.

Everything else is the real path: plugin loading through its entry point in every vLLM
process, config validation, manager construction, fleet bootstrap over the EP group,
handle pool warm-up from the engine's capture sizes, model load, vLLM's profile run,
torch.compile, CUDA-graph capture and replay, the package's prepare/finalize inside
vLLM's FusedMoEKernel, and NCCL-EP dispatch/combine kernels. What world size 1 cannot
show: data crossing ranks, DP padding agreement across ranks, non-uniform DP steps, and
fault detection between ranks.

The harness is installed by a test-only `vllm.general_plugins` entry point
(`engine_runner.write_plugin_dist`), so vLLM loads it in every process it starts; it
registers the package first so that its wrappers sit outside the package's.
Never imported by the package.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os

_installed = False
FAULT_ENV = "FLASHINFER_EP_TEST_FAULT"
DP_EXPECTED_M_ENV = "FLASHINFER_EP_TEST_DP_EXPECTED_M"
DUMMY_SCALE_ENV = "FLASHINFER_EP_TEST_DUMMY_SCALE"
# Every switch above: each changes what an engine computes (engine_runner keys kept
# results by them).
SWITCHES = (FAULT_ENV, DP_EXPECTED_M_ENV, DUMMY_SCALE_ENV)
# Switches of earlier versions, whose paths are gone (one path each now, or the package's
# variable): a copied old command would measure the default silently, so they are refused.
REMOVED_ENVS = {
    "FLASHINFER_EP_TEST_DEEP_GEMM_RECEIVED_ROWS": "set VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS",
    **{
        f"FLASHINFER_EP_TEST_{name}": "the received-rows experts have one path"
        for name in (
            "VLLM_TILES",
            "BATCHED_KERNEL",
            "LISTED_ACTIVATION",
            "LISTED_QUANT",
            "LISTED_INPUT_QUANT",
            "FP8_DYNAMIC_TENSOR",
            "LISTED_TENSOR_QUANT",
        )
    },
}


def _ours(backend: str | None) -> bool:
    from vllm_flashinfer_ep.backends import BACKENDS

    return backend in BACKENDS


def _active(parallel_config) -> bool:
    return bool(parallel_config.enable_expert_parallel) and _ours(parallel_config.all2all_backend)


def install() -> None:
    """vllm.general_plugins entry point of the test-only harness distribution."""
    global _installed
    if _installed:
        return
    for name, instead in REMOVED_ENVS.items():
        if os.environ.get(name):
            raise ValueError(f"{name} is gone: {instead}")
    dp_expected_m = os.environ.get(DP_EXPECTED_M_ENV)  # checked before anything is patched
    if dp_expected_m not in (None, "", "0", "1"):
        raise ValueError(f"{DP_EXPECTED_M_ENV}: 0 or 1, got {dp_expected_m!r}")
    dummy_scale = os.environ.get(DUMMY_SCALE_ENV)
    if dummy_scale not in (None, "", "0", "1"):
        raise ValueError(f"{DUMMY_SCALE_ENV}: 0 or 1, got {dummy_scale!r}")
    import vllm_flashinfer_ep

    if not vllm_flashinfer_ep.register():
        raise RuntimeError("vllm_flashinfer_ep.register() refused this vLLM")
    _patch_parallel_config()
    _patch_group_coordinator()
    _patch_fused_moe_parallel_config()
    _patch_splitting_ops()
    _add_worker_probe()
    _maybe_plant_fault()
    if dp_expected_m == "1":
        patch_deep_gemm_expected_m()
    if dummy_scale == "1":
        patch_dummy_loader()
    _installed = True


def _patch_parallel_config() -> None:
    from vllm.config.parallel import ParallelConfig

    all2all = ParallelConfig.__dict__["use_all2all"].fget
    batched = ParallelConfig.__dict__["use_batched_dp_moe"].fget

    def use_all2all(self) -> bool:
        return True if _active(self) else all2all(self)

    def use_batched_dp_moe(self) -> bool:
        from vllm_flashinfer_ep.backends import LOW_LATENCY
        from vllm_flashinfer_ep.vllm.patches.platform import ll_counts_as_batched_dp

        if _active(self) and self.all2all_backend == LOW_LATENCY:
            return ll_counts_as_batched_dp(self, data_parallel_size=2)
        return batched(self)

    ParallelConfig.use_all2all = property(use_all2all)
    ParallelConfig.use_batched_dp_moe = property(use_batched_dp_moe)


def _patch_group_coordinator() -> None:
    from vllm.distributed import parallel_state

    cls = parallel_state.GroupCoordinator
    original = cls.__init__
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        args_ = bound.arguments
        if (
            self.device_communicator is None
            and self.world_size == 1
            and self.unique_name.split(":")[0] == "ep"
            and args_["use_device_communicator"]
            and args_["use_all2all"]
        ):
            from vllm.platforms import current_platform
            from vllm.utils.import_utils import resolve_obj_by_qualname

            comm_cls = resolve_obj_by_qualname(current_platform.get_device_communicator_cls())
            self.device_communicator = comm_cls(
                cpu_group=self.cpu_group,
                device=self.device,
                device_group=self.device_group,
                unique_name=self.unique_name,
                use_all2all=True,
            )

    cls.__init__ = __init__


def _patch_fused_moe_parallel_config() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    make = FusedMoEParallelConfig.__dict__["make"].__func__
    kernels = FusedMoEParallelConfig.__dict__["use_all2all_kernels"].fget

    def make_world1(*args, **kwargs):
        cfg = make(*args, **kwargs)
        par = kwargs.get("vllm_parallel_config", args[4] if len(args) > 4 else None)
        if par is not None and _active(par) and not cfg.use_ep:
            cfg = dataclasses.replace(cfg, use_ep=True, ep_size=1, ep_rank=0, tp_size=1, tp_rank=0)
        return cfg

    def use_all2all_kernels(self) -> bool:
        if _ours(self.all2all_backend) and self.use_ep:
            return True
        return kernels(self)

    FusedMoEParallelConfig.make = staticmethod(make_world1)
    FusedMoEParallelConfig.use_all2all_kernels = property(use_all2all_kernels)


_building: list = []  # parallel configs of the VllmConfigs whose __post_init__ is running


def _patch_splitting_ops() -> None:
    from vllm.config.compilation import CompilationConfig
    from vllm.config.vllm import VllmConfig

    original = CompilationConfig.set_splitting_ops_for_v1
    post_init = VllmConfig.__post_init__

    def __post_init__(self) -> None:
        _building.append(self.parallel_config)
        try:
            post_init(self)
        finally:
            _building.pop()

    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1):
        if _building and _active(_building[-1]):
            data_parallel_size = max(2, data_parallel_size)
        return original(self, all2all_backend, data_parallel_size)

    VllmConfig.__post_init__ = __post_init__
    CompilationConfig.set_splitting_ops_for_v1 = set_splitting_ops_for_v1


PROBE_METHOD = "flashinfer_ep_test_probe"  # the worker method `vllm serve` answers for


def _add_worker_probe() -> None:
    """A worker method `engine_run.worker_probe` behind vLLM's /collective_rpc endpoint
    (VLLM_SERVER_DEV_MODE=1), which calls workers' methods by name only: a benchmark reads
    a served engine's handle counters, budget and resolved compilation as the engine tests
    read an in-process engine's. JSON-safe (enums as strings), for the HTTP answer."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    def probe(self) -> dict:
        import json

        from engine_run import worker_probe

        return json.loads(json.dumps(worker_probe(self.worker), default=str))

    setattr(WorkerWrapperBase, PROBE_METHOD, probe)


DP_EXPECTED_M_TAG = "_flashinfer_ep_test_dp_expected_m"  # on the harness's methods


def patch_deep_gemm_expected_m() -> None:
    """vLLM's BatchedDeepGemmExperts: with no DP metadata (world 1), `expected_m` as vLLM
    estimates it from DP metadata holding this forward's tokens (topk_ids' rows: under a
    CUDA graph the captured size). `apply` records the forward's tokens (its parameters
    checked as vLLM 0.33.0's), `estimate_expected_m` reads them; the package's warm-up,
    which fixes `expected_m` itself, still wins. Applying it twice changes nothing."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    from vllm.model_executor.layers.fused_moe.experts.batched_deep_gemm_moe import (
        BatchedDeepGemmExperts,
    )

    from vllm_flashinfer_ep.experts.deep_gemm import APPLY_PARAMS, dp_estimate

    apply, estimate = BatchedDeepGemmExperts.apply, BatchedDeepGemmExperts.estimate_expected_m
    if getattr(apply, DP_EXPECTED_M_TAG, False):
        return
    params = tuple(inspect.signature(apply).parameters)[1:]
    if params != APPLY_PARAMS:
        raise RuntimeError(
            f"{DP_EXPECTED_M_ENV}: BatchedDeepGemmExperts.apply is not vLLM 0.33.0's ({params})"
        )

    def recording_apply(self, *args, **kwargs):
        bound = inspect.signature(apply).bind(self, *args, **kwargs)
        self._harness_tokens = bound.arguments["topk_ids"].shape[0]
        return apply(self, *args, **kwargs)

    def dp_estimate_m(self, global_num_experts, max_tokens_per_expert, topk):
        has_dp = is_forward_context_available() and get_forward_context().dp_metadata is not None
        tokens = getattr(self, "_harness_tokens", None)
        if has_dp or tokens is None:
            return estimate(self, global_num_experts, max_tokens_per_expert, topk)
        return dp_estimate(tokens, topk, global_num_experts, max_tokens_per_expert)

    for fn in (recording_apply, dp_estimate_m):
        setattr(fn, DP_EXPECTED_M_TAG, True)
    recording_apply.__signature__ = inspect.signature(apply)
    BatchedDeepGemmExperts.apply = recording_apply
    BatchedDeepGemmExperts.estimate_expected_m = dp_estimate_m


def _maybe_plant_fault() -> None:
    """A deliberate fault for the tests that prove the tolerance can fail.

    `uniform_weights`: the LL prepare/finalize dispatches with every routing weight set to
    1/top_k instead of the router's weights.
    """
    fault = os.environ.get(FAULT_ENV, "").strip()
    if not fault:
        return
    if fault != "uniform_weights":
        raise ValueError(f"{FAULT_ENV}: unknown fault {fault!r}")
    from vllm_flashinfer_ep.vllm import prepare_finalize as pf

    cls = pf.FlashInferEPLowLatencyPrepareAndFinalize
    original = cls.prepare

    def prepare(self, a1, topk_weights, topk_ids, *args, **kwargs):
        uniform = topk_weights.new_full(topk_weights.shape, 1.0 / topk_weights.shape[1])
        return original(self, a1, uniform, topk_ids, *args, **kwargs)

    cls.prepare = prepare


# vLLM 0.33.0's dummy floats: uniform in +-1e-3 (8-bit floats: +-1), seeded per tensor.
DUMMY_RANGE, DUMMY_FP8_RANGE = 1e-3, 1.0
DUMMY_SCALE_TAG = "_flashinfer_ep_test_dummy_scale"


def _power_of_two(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def _unpadded_expert_shape(name: str, param, hidden: int, inter: int) -> tuple | None:
    """The shape the engine without EP gives expert tensor `name` (vLLM's layout before
    process_weights_after_loading; MXFP4: two FP4 codes per byte, one E8M0 scale per 32),
    when `param` is wider in some dimension (None: not an expert tensor, or not padded)."""
    import torch

    if param.dtype == torch.uint8:  # MXFP4
        table = {
            "w13_weight": (2 * inter, hidden // 2),
            "w13_weight_scale": (2 * inter, hidden // 32),
            "w2_weight": (hidden, inter // 2),
            "w2_weight_scale": (hidden, inter // 32),
        }
    else:
        table = {"w13_weight": (2 * inter, hidden), "w2_weight": (hidden, inter)}
    table.update({"w13_bias": (2 * inter,), "w2_bias": (hidden,)})
    want = table.get(name.rsplit(".", 1)[-1])
    if want is None or param.dim() != len(want) + 1:
        return None
    shape = (param.shape[0], *want)
    if shape == tuple(param.shape) or any(w > p for w, p in zip(shape, param.shape)):
        return None
    return shape


def unpad_dummy_experts(model) -> dict[int, int]:
    """LL pads a hidden size NCCL-EP lacks (gpt-oss: 2880 to 4096; MXFP4 experts also pad
    their intermediate size), and vLLM's dummy loader draws other values for the wider
    expert tensors than for the engine without EP's. Each padded one gets what vLLM draws
    at the unpadded engine's shape in its leading block and zeros around it, as a
    checkpoint loads. Returns the fan-in of the BF16 ones whose last dimension was padded
    ({id(param): width})."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    inter = getattr(config, "moe_intermediate_size", None) or getattr(
        config, "intermediate_size", None
    )
    fan_ins: dict[int, int] = {}
    if not isinstance(hidden, int) or not isinstance(inter, int):
        return fan_ins
    for name, param in model.named_parameters():
        shape = _unpadded_expert_shape(name, param, hidden, inter)
        if shape is None:
            continue
        drawn = torch.empty(shape, dtype=param.dtype, device=param.device)
        initialize_single_dummy_weight(drawn, name=name.rsplit(".", 1)[-1])
        param.data.zero_()
        param.data[tuple(slice(0, n) for n in shape)].copy_(drawn)
        if torch.is_floating_point(param) and shape[-1] != param.shape[-1]:
            fan_ins[id(param)] = shape[-1]
    return fan_ins


def scale_dummy_weights(model) -> None:
    """vLLM's dummy weights (every float tensor uniform in +-1e-3, norms 1) leave each
    sublayer's output ~1e-3 of its input: the MoE block would move prompt logprobs by less
    than 1e-3 nats, under any tolerance. Rescaled here to std 1/sqrt(fan_in) (fan_in: the
    last dimension, as every vLLM linear, embedding and fused-experts weight is laid out
    before process_weights_after_loading), so every block's output is of its input's order.
    FP8 weights keep their dummy codes; their scales (`<name>_scale_inv` or `<name>_scale`)
    become one power of two, exact under DeepGEMM's E8M0 scales too. 1-D tensors (norms,
    biases, routing bias) are left as vLLM set them. Deterministic: the same weights in
    every engine whose parameters have the same shapes (EP at world 1 keeps every expert)."""
    import torch

    fan_ins = unpad_dummy_experts(model)
    seen: set[int] = set()  # a tensor two modules share is rescaled once
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        for name, param in params.items():
            if param.dim() < 2 or not torch.is_floating_point(param) or "scale" in name:
                continue
            if id(param) in seen:
                continue
            seen.add(id(param))
            target = fan_ins.get(id(param), param.shape[-1]) ** -0.5
            if torch.finfo(param.dtype).bits < 16:
                scale = params.get(f"{name}_scale_inv", params.get(f"{name}_scale"))
                if scale is not None:
                    scale.data.fill_(_power_of_two(target * 3**0.5 / DUMMY_FP8_RANGE))
            else:
                param.data.mul_(target * 3**0.5 / DUMMY_RANGE)


def patch_dummy_loader() -> None:
    """vLLM's DummyModelLoader.load_weights followed by scale_dummy_weights (before
    vLLM's process_weights_after_loading, which runs after load_weights)."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    original = DummyModelLoader.load_weights
    if getattr(original, DUMMY_SCALE_TAG, False):
        return

    def load_weights(self, model, model_config) -> None:
        original(self, model, model_config)
        scale_dummy_weights(model)

    setattr(load_weights, DUMMY_SCALE_TAG, True)
    DummyModelLoader.load_weights = load_weights
