"""FaultToleranceAdapter: FlashInfer's FT API converted to vLLM's conventions."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import fake_moe_ep
from tests.fakes.runtime import (
    build_fake_runtime,
    install_capture_switch,
)
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime import fault_tolerance
from vllm_flashinfer_ep.runtime.fault_tolerance import FaultToleranceAdapter
from vllm_flashinfer_ep.runtime.fleet import FleetSpec, create_fleet

HIDDEN = 2048
WORLD = 4


pytestmark = pytest.mark.usefixtures("fake")


def _ft_fleet(rank: int = 0, world: int = WORLD) -> fake_moe_ep.FakeFleet:
    spec = FleetSpec(Algorithm.LOW_LATENCY, 8, 16, HIDDEN, fault_tolerance=True)
    boot = fake_moe_ep.BootstrapConfig(world_size=world, rank=rank)
    return create_fleet(spec, boot)


def _is_bool_scalar(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.dim() == 0


def test_fleet_gets_the_fault_tolerance_knob(monkeypatch):
    monkeypatch.delenv(envs.FT_TIMEOUT_MS, raising=False)
    fleet = _ft_fleet()
    assert fleet.supports_fault_tolerance
    knob = fleet.fault_tolerance_knob
    assert knob.enabled and knob.timeout_ms == envs.DEFAULT_FT_TIMEOUT_MS
    monkeypatch.setenv(envs.FT_TIMEOUT_MS, "1234")
    assert _ft_fleet().fault_tolerance_knob.timeout_ms == 1234
    plain = create_fleet(
        FleetSpec(Algorithm.LOW_LATENCY, 8, 16, HIDDEN),
        fake_moe_ep.BootstrapConfig(world_size=WORLD, rank=0),
    )
    assert not plain.supports_fault_tolerance
    with pytest.raises(FlashInferEPConfigError, match="low-latency"):
        FleetSpec(Algorithm.HIGH_THROUGHPUT, 8, 16, HIDDEN, fault_tolerance=True)


def test_built_runtime_fleet_has_fault_tolerance():
    rt, fleet = build_fake_runtime(
        Algorithm.LOW_LATENCY, hidden=HIDDEN, fault_tolerance=True, sizes=[4]
    )
    adapter = FaultToleranceAdapter([fleet], "cpu")
    assert adapter.enabled
    assert adapter.query_active_mask().tolist() == [0]


def test_mask_polarity_is_vllm_s():
    fleet = _ft_fleet(rank=1)
    adapter = FaultToleranceAdapter([fleet], "cpu")
    mask = adapter.query_active_mask()
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.int32
    assert mask.tolist() == [0, 0, 0, 0]  # vLLM: 0 = live
    fleet.mask_rank(2)  # FlashInfer: 0 = masked
    assert fleet.query_active_mask().tolist() == [1, 1, 0, 1]
    assert adapter.query_active_mask().tolist() == [0, 0, 1, 0]  # vLLM: 1 = masked
    # The adapter never writes FlashInfer's fleet-owned buffer.
    assert fleet.query_active_mask().tolist() == [1, 1, 0, 1]


def test_query_fault_is_a_bool_tensor_and_sees_mask_changes():
    fleet = _ft_fleet()
    adapter = FaultToleranceAdapter([fleet], "cpu")
    fault = adapter.query_fault()
    assert _is_bool_scalar(fault) and not bool(fault)
    # NCCL-EP masks a peer in place in its own buffer: the baseline must be a copy.
    fleet.mask_rank(3)
    fault = adapter.query_fault()
    assert _is_bool_scalar(fault) and bool(fault)
    # Still faulted on the next step: nothing recovered.
    assert bool(adapter.query_fault())


def test_the_baseline_is_all_active_not_the_first_mask_seen():
    fleet = _ft_fleet()
    fleet.mask_rank(1)  # masked before anyone looked: still a fault, never a baseline
    adapter = FaultToleranceAdapter([fleet], "cpu")
    assert bool(adapter.query_fault())
    assert adapter.query_active_mask().tolist() == [0, 1, 0, 0]


def test_host_fault_flag_is_a_fault_even_with_an_unchanged_mask():
    fleet = _ft_fleet()
    adapter = FaultToleranceAdapter([fleet], "cpu")
    fleet.raise_fault_flag()
    fault = adapter.query_fault()
    assert _is_bool_scalar(fault) and bool(fault)
    assert adapter.query_active_mask().tolist() == [0, 0, 0, 0]


def test_clean_buffers_readmits_in_every_fault_tolerant_fleet():
    # World size 1 (re-admission is collective; two ranks: tests/unit/test_ft_recovery.py),
    # fleets with a handle, as re-admission needs one.
    _, a = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, fault_tolerance=True, sizes=[4])
    _, b = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=4096, fault_tolerance=True, sizes=[4])
    _, plain = build_fake_runtime(Algorithm.LOW_LATENCY, hidden=HIDDEN, sizes=[4])
    adapter = FaultToleranceAdapter([plain, a, b], "cpu")
    assert adapter.enabled
    b.raise_fault_flag()  # only the second FT fleet faults: still a fault
    assert bool(adapter.query_fault())
    adapter.clean_buffers()
    assert a.ft_log.count("clear_faults(readmit=True)") == 1
    assert b.ft_log.count("clear_faults(readmit=True)") == 1
    assert plain.ft_log == []
    assert not a.query_fault() and not b.query_fault()
    assert not bool(adapter.query_fault())


def test_without_a_fault_tolerant_fleet():
    plain = create_fleet(
        FleetSpec(Algorithm.LOW_LATENCY, 8, 16, HIDDEN),
        fake_moe_ep.BootstrapConfig(world_size=WORLD, rank=0),
    )
    adapter = FaultToleranceAdapter([plain], "cpu")
    assert not adapter.enabled
    with pytest.raises(RuntimeError, match="--enable-fault-tolerance"):
        adapter.query_fault()


@pytest.mark.parametrize("call", ["query_active_mask", "query_fault", "clean_buffers"])
def test_adapter_refuses_every_call_under_capture(monkeypatch, call):
    fleet = _ft_fleet()
    adapter = FaultToleranceAdapter([fleet], "cpu")
    fleet.raise_fault_flag()
    fleet.ft_log.clear()
    # Only the adapter's view of capture: the refusal must be the adapter's own, before
    # FlashInfer is touched at all.
    monkeypatch.setattr(fault_tolerance, "is_capturing", lambda: True)
    with pytest.raises(
        RuntimeError, match="fault tolerance: .* cannot run under CUDA-graph capture"
    ):
        getattr(adapter, call)()
    assert fleet.ft_log == []  # FlashInfer was not touched
    assert fleet.query_fault()  # the flag was not cleared


def test_fake_fleet_refuses_ft_calls_under_capture(monkeypatch):
    switch = install_capture_switch(monkeypatch)
    fleet = _ft_fleet()
    adapter = FaultToleranceAdapter([fleet], "cpu")
    with switch.capturing():
        for call in (
            fleet.query_active_mask,
            fleet.query_fault,
            lambda: fleet.set_active_mask([1] * WORLD),
            lambda: fleet.clear_faults(readmit=True),
        ):
            with pytest.raises(RuntimeError, match="must not be called during CUDA-graph capture"):
                call()
        with pytest.raises(RuntimeError, match="cannot run under CUDA-graph capture"):
            adapter.query_fault()
    assert not bool(adapter.query_fault())
