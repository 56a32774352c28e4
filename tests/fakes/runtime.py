"""Build the package runtime on the fake transport, and simulate CUDA-graph capture.

- `hide_cuda(monkeypatch)`: the runtime's CUDA-stream paths off, also on GPU hosts.
- `installed_fake()`: installs `fake_moe_ep` as the transport module and always
  removes it again (use it from a fixture).
- `build_fake_runtime(...)`: the real `FleetCache` + `build_runtime` path on the fake.
  `fleet.bootstrap_config` asks `torch.cuda.current_device()`, which has no driver to
  ask on CPU hosts, so it is answered with device 0 for the duration of the call.
- `install_capture_switch(monkeypatch)`: one switch that every `is_capturing` the
  package imported (handle_pool, round_plan, streams, fault_tolerance, ...) and the fake consult.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from unittest import mock

import torch

# Imported so their `is_capturing` names exist when the switch is installed.
import vllm_flashinfer_ep.runtime.fault_tolerance  # noqa: F401
import vllm_flashinfer_ep.runtime.handle_pool  # noqa: F401
import vllm_flashinfer_ep.runtime.round_plan  # noqa: F401
import vllm_flashinfer_ep.runtime.streams  # noqa: F401
from tests.fakes import fake_moe_ep
from vllm_flashinfer_ep.runtime import capture, transport
from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime, build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec

_ORIGINAL_IS_CAPTURING = capture.is_capturing


def hide_cuda(monkeypatch) -> None:
    """Make a GPU host look like the CPU host these tests model.

    The pool orders handle work against CUDA streams whenever
    `torch.cuda.is_available()`, whatever its device; with CPU tensors on a GPU host
    that would ask `torch.cuda.default_stream(cpu)`.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@contextmanager
def installed_fake() -> Iterator[object]:
    transport.use_transport_module(fake_moe_ep)
    try:
        yield fake_moe_ep
    finally:
        transport.use_transport_module(None)


def build_fake_runtime(
    algorithm: str,
    *,
    hidden: int,
    num_experts: int = 8,
    capacity: int = 32,
    top_k: int = 2,
    sizes: Sequence[int] = (),
    fault_tolerance: bool = False,
    world_size: int = 1,
    rank: int = 0,
    device: str = "cpu",
    process_group: object | None = None,
) -> tuple[EPRuntime, fake_moe_ep.FakeFleet]:
    """A runtime built by the package's own FleetCache/build_runtime, on the fake."""
    assert transport._override is fake_moe_ep, "install the fake first (installed_fake())"
    spec = FleetSpec(algorithm, num_experts, capacity, hidden, fault_tolerance=fault_tolerance)
    cache = FleetCache(rank, world_size, process_group=process_group)
    with mock.patch.object(torch.cuda, "current_device", return_value=0):
        rt = build_runtime(cache, spec, top_k, torch.device(device), list(sizes))
    assert isinstance(rt.fleet, fake_moe_ep.FakeFleet)
    return rt, rt.fleet


class CaptureSwitch:
    """Stands in for `is_capturing`; flip `.active` to simulate stream capture."""

    def __init__(self) -> None:
        self.active = False
        self.patched_modules: list[str] = []

    def __call__(self) -> bool:
        return self.active

    @contextmanager
    def capturing(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def install_capture_switch(monkeypatch) -> CaptureSwitch:
    """Patch `capture.is_capturing` and every package module that imported it by name."""
    switch = CaptureSwitch()
    monkeypatch.setattr(capture, "is_capturing", switch)
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm_flashinfer_ep.") and (
            getattr(module, "is_capturing", None) is _ORIGINAL_IS_CAPTURING
        ):
            monkeypatch.setattr(module, "is_capturing", switch)
            switch.patched_modules.append(name)
    return switch
