"""Each vLLM touch point: the patch is applied and changes vLLM's behaviour."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import vllm_flashinfer_ep
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.limits import SUPPORTED_HIDDEN_SIZES

vllm_flashinfer_ep.register()


def moe_parallel_config(backend: str, dp: int = 2, ep: bool = True):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    fields = FusedMoEParallelConfig.__dataclass_fields__
    values = {name: 1 for name in fields}
    values.update(
        dict(
            use_ep=ep,
            all2all_backend=backend,
            enable_eplb=False,
            dp_size=dp,
            ep_size=dp,
            ep_rank=0,
            dp_rank=0,
            tp_rank=0,
            pcp_rank=0,
            sp_size=1,
        )
    )
    values = {k: v for k, v in values.items() if k in fields and fields[k].init}
    return FusedMoEParallelConfig(**values)


def test_batched_activation_format_for_ll_only():
    assert moe_parallel_config(LOW_LATENCY).use_batched_activation_format is True
    assert moe_parallel_config(HIGH_THROUGHPUT).use_batched_activation_format is False
    assert moe_parallel_config(LOW_LATENCY, dp=1).use_batched_activation_format is False
    assert moe_parallel_config("deepep_low_latency").use_batched_activation_format is True


@pytest.mark.parametrize("hidden,want", [(128, 2048), (2048, 2048), (3072, 4096), (7000, 7168)])
def test_hidden_size_round_up_logged(hidden, want, caplog):
    from vllm.model_executor.layers.fused_moe import all2all_utils

    with caplog.at_level(logging.INFO):
        got = all2all_utils.maybe_roundup_layer_hidden_size(
            hidden, torch.bfloat16, moe_parallel_config(LOW_LATENCY)
        )
    assert got == want and got in SUPPORTED_HIDDEN_SIZES
    if hidden != want:
        assert f"rounding MoE hidden size {hidden} up to {want}" in caplog.text


def test_hidden_size_untouched_for_ht_and_the_function_local_import():
    from vllm.model_executor.layers.fused_moe import all2all_utils

    assert (
        all2all_utils.maybe_roundup_layer_hidden_size(
            3000, torch.bfloat16, moe_parallel_config(HIGH_THROUGHPUT)
        )
        == 3000
    )
    # fused_moe_method_base imports it function-locally from the module: the module attribute is ours
    assert (
        all2all_utils.maybe_roundup_layer_hidden_size.__module__
        == "vllm_flashinfer_ep.vllm.patches.worker"
    )


def test_ft_backend_set_has_ll_only():
    import vllm.v1.worker.sentinel.gpu_worker_sentinel as sentinel

    assert LOW_LATENCY in sentinel.FT_BACKEND_SET
    assert HIGH_THROUGHPUT not in sentinel.FT_BACKEND_SET
    assert {"deepep_low_latency", "nixl_ep"} <= sentinel.FT_BACKEND_SET


def test_sequence_parallel_moe_for_both_backends():
    from vllm.config import ParallelConfig

    for backend in (LOW_LATENCY, HIGH_THROUGHPUT):
        par = ParallelConfig(
            all2all_backend=backend,
            data_parallel_size=2,
            tensor_parallel_size=2,
            enable_expert_parallel=True,
        )
        assert par.use_sequence_parallel_moe and par.use_all2all


def test_prepare_finalize_patched_in_place_for_every_importer():
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.oracle import fp8, unquantized

    from vllm_flashinfer_ep.vllm.patches import BY_NAME, _helper

    function = all2all_utils.maybe_make_prepare_finalize
    assert unquantized.maybe_make_prepare_finalize is function  # one object, nothing rebound
    assert fp8.maybe_make_prepare_finalize is function
    assert _helper.is_applied(BY_NAME["prepare_finalize"])
    assert unquantized.maybe_make_prepare_finalize(
        _moe(LOW_LATENCY), None, all2all_manager=_manager()
    ).runtime


def _manager(backend: str = LOW_LATENCY):
    """A real manager class without its GPU constructor; get_handle records and fakes."""
    from vllm_flashinfer_ep.vllm.managers import MANAGERS
    from vllm_flashinfer_ep.vllm.rank_checks import RankChecks

    class _Manager(MANAGERS[backend]):
        def __init__(self):
            self.calls = []
            self._checks = RankChecks(None, None)  # one rank: nothing to exchange

        def get_handle(self, kwargs):
            self.calls.append(kwargs)
            return SimpleNamespace(
                world_size=2,
                capacity=kwargs["max_num_tokens_per_rank"],
                round=None,
                finish_load=lambda first_round: None,
            )

    return _Manager()


def _moe(backend: str):
    return SimpleNamespace(
        moe_parallel_config=moe_parallel_config(backend),
        num_experts=16,
        max_num_tokens=256,
        hidden_dim=2048,
        experts_per_token=4,
    )


@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_prepare_finalize_selection_builds_ours(backend):
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEActivationFormat

    from vllm_flashinfer_ep.vllm.prepare_finalize import (
        FlashInferEPHighThroughputPrepareAndFinalize,
        FlashInferEPLowLatencyPrepareAndFinalize,
    )

    mgr = _manager(backend)
    pf = all2all_utils.maybe_make_prepare_finalize(_moe(backend), None, all2all_manager=mgr)
    want = (
        FlashInferEPLowLatencyPrepareAndFinalize
        if backend == LOW_LATENCY
        else FlashInferEPHighThroughputPrepareAndFinalize
    )
    assert type(pf) is want
    assert mgr.calls == [
        dict(num_experts=16, max_num_tokens_per_rank=256, hidden_size=2048, top_k=4)
    ]
    fmt = (
        FusedMoEActivationFormat.BatchedExperts
        if backend == LOW_LATENCY
        else FusedMoEActivationFormat.Standard
    )
    assert pf.activation_format == fmt
    assert (
        pf.topk_indices_dtype() == torch.int64
        and pf.num_dispatchers() == 2
        and pf.output_is_reduced()
    )
    if backend == LOW_LATENCY:
        assert pf.max_num_tokens_per_rank() == 256


def test_prepare_finalize_selection_refuses_quantized_and_monolithic():
    from vllm.model_executor.layers.fused_moe import all2all_utils

    quant = SimpleNamespace(quant_dtype=torch.int8, block_shape=None)
    with pytest.raises(FlashInferEPConfigError, match="Serve a BF16 or FP8 checkpoint"):
        all2all_utils.maybe_make_prepare_finalize(
            _moe(LOW_LATENCY), quant, all2all_manager=_manager()
        )
    with pytest.raises(FlashInferEPConfigError, match="--moe-backend triton"):
        all2all_utils.maybe_make_prepare_finalize(
            _moe(LOW_LATENCY), None, None, False, True, _manager()
        )


# ----------------------------------------------------------- CudaCommunicator
class _FakeGroup:
    pass


def _run_comm_init(monkeypatch, backend: str, unique_name: str, use_all2all: bool):
    """The communicator patch applied over a stand-in for vLLM's __init__ (undo, swap, apply)."""
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from vllm_flashinfer_ep.vllm import managers
    from vllm_flashinfer_ep.vllm.patches import BY_NAME, _helper, worker

    seen = {}

    def fake_original(
        self,
        cpu_group,
        device=None,
        device_group=None,
        unique_name="",
        global_ranks=None,
        global_world_size=None,
        tcp_store_group=None,
        use_all2all=False,
    ):
        seen["use_all2all"] = use_all2all
        self.cpu_group = cpu_group
        self.is_ep_communicator = unique_name.split(":")[0] == "ep"
        self.use_all2all = self.is_ep_communicator and use_all2all
        self.all2all_manager = None

    class FakeManager:
        def __init__(self, cpu_group, tcp_store_group=None):
            self.cpu_group = cpu_group

    patch = BY_NAME["communicator_manager"]
    monkeypatch.setattr(worker, "backend_of_current_config", lambda: backend)
    if backend in managers.MANAGERS:
        monkeypatch.setitem(managers.MANAGERS, backend, FakeManager)
    _helper.undo(patch)
    real = CudaCommunicator.__init__
    CudaCommunicator.__init__ = fake_original
    try:
        _helper.apply(patch)
        assert _helper.original(patch) is fake_original
        comm = object.__new__(CudaCommunicator)
        CudaCommunicator.__init__(
            comm, _FakeGroup(), unique_name=unique_name, use_all2all=use_all2all
        )
    finally:
        _helper.undo(patch)
        CudaCommunicator.__init__ = real
        _helper.apply(patch)
    assert _helper.original(patch) is real
    return comm, seen, FakeManager


def test_communicator_installs_our_manager_on_ep_group(monkeypatch):
    comm, seen, fake_mgr = _run_comm_init(monkeypatch, LOW_LATENCY, "ep:0", True)
    assert seen["use_all2all"] is False  # vLLM's if/elif never sees our name
    assert comm.use_all2all is True and isinstance(comm.all2all_manager, fake_mgr)


def test_communicator_leaves_non_ep_groups_alone(monkeypatch):
    comm, seen, _ = _run_comm_init(monkeypatch, HIGH_THROUGHPUT, "tp:0", True)
    assert comm.all2all_manager is None and comm.use_all2all is False


def test_communicator_other_backends_pass_through(monkeypatch):
    comm, seen, _ = _run_comm_init(monkeypatch, "allgather_reducescatter", "ep:0", True)
    assert seen["use_all2all"] is True


def test_manager_runs_worker_checks_before_anything(monkeypatch):
    """A GPU-side problem stops the worker at manager construction, with every fix listed."""
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

    from vllm_flashinfer_ep.errors import FlashInferEPEnvironmentError
    from vllm_flashinfer_ep.runtime import env_checks
    from vllm_flashinfer_ep.runtime.env_checks import Check
    from vllm_flashinfer_ep.vllm.managers import FlashInferEPLowLatencyManager

    def base_init(self, cpu_group, tcp_store_group=None):
        self.rank, self.world_size, self.support_fault_tolerance = 0, 2, False

    monkeypatch.setattr(All2AllManagerBase, "__init__", base_init)
    monkeypatch.setattr(env_checks, "ensure_nvcc_for_jit", lambda log: None)
    monkeypatch.setattr(
        env_checks,
        "runtime_checks",
        lambda: [
            Check("libnccl", False, "2.28.9", "load NCCL >= 2.30.7 (LD_PRELOAD)"),
            Check("nvcc (NCCL-EP JIT)", False, "no nvcc found", "export NCCL_EP_JIT_NVCC"),
        ],
    )
    with pytest.raises(FlashInferEPEnvironmentError, match="LD_PRELOAD") as info:
        FlashInferEPLowLatencyManager(object())
    assert "NCCL_EP_JIT_NVCC" in str(info.value)


def test_router_gate_sees_unpadded_activations():
    """vLLM pads activations to the rounded LL hidden size before its gate: the patch
    slices them back to the gate's input_size (a view), narrower inputs pass unchanged."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_flashinfer_ep.vllm.patches import BY_NAME, _helper

    seen = []

    def stand_in(self, x):
        seen.append(tuple(x.shape))
        return x

    patch = BY_NAME["router_gate_width"]
    _helper.undo(patch)
    real = GateLinear.forward
    GateLinear.forward = stand_in
    try:
        _helper.apply(patch)
        gate = SimpleNamespace(input_size=3072)
        padded = torch.zeros(5, 4096)
        padded[:, :3072] = 1.0
        out = GateLinear.forward(gate, padded)
        assert out.data_ptr() == padded.data_ptr() and bool((out == 1.0).all())
        GateLinear.forward(gate, torch.zeros(5, 3072))
        GateLinear.forward(SimpleNamespace(), torch.zeros(5, 4096))  # no input_size: untouched
    finally:
        _helper.undo(patch)
        GateLinear.forward = real
        _helper.apply(patch)
    assert seen == [(5, 3072), (5, 3072), (5, 4096)]
