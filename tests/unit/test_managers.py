"""The all2all managers: what vLLM's get_handle calls get, and which sizes the pool warms.

Managers are built without vLLM's distributed state (the base constructor is replaced by
one that only sets rank/world size), on the fake transport, with CUDA hidden.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.fakes.runtime import installed_fake
from vllm_flashinfer_ep import backends, envs
from vllm_flashinfer_ep.runtime import fleet as fleet_mod
from vllm_flashinfer_ep.runtime import pool_sizes
from vllm_flashinfer_ep.vllm import managers

CPU = torch.device("cpu")


def _vllm_config(
    mode: str = "FULL_AND_PIECEWISE",
    sizes=(1, 2, 4, 8),
    *,
    sp: bool = False,
    tp: int = 1,
    ft: bool = False,
):
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode[mode], cudagraph_capture_sizes=list(sizes)
        ),
        parallel_config=SimpleNamespace(
            use_sequence_parallel_moe=sp, tensor_parallel_size=tp, enable_fault_tolerance=ft
        ),
    )


@pytest.fixture()
def build(monkeypatch, fake):
    """build(backend, vllm_config, rank=0, world=1) -> manager on the fake, CPU tensors."""
    import vllm.config as vllm_config_mod
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
    )

    def base_init(self, cpu_group, tcp_store_group=None):
        self.cpu_group = cpu_group
        self.rank, self.world_size = cpu_group
        self.support_fault_tolerance = False

    monkeypatch.setattr(All2AllManagerBase, "__init__", base_init)
    monkeypatch.setenv(envs.SKIP_ENV_CHECKS, "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    made = []

    def make(backend, cfg, rank=0, world=1):
        monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: cfg)
        mgr = managers.MANAGERS[backend]((rank, world))
        mgr._device = CPU  # the fake's GPU on CPU hosts
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.destroy()


def _kwargs(**over):
    kw = dict(num_experts=8, max_num_tokens_per_rank=32, hidden_size=2048, top_k=2)
    kw.update(over)
    return kw


# ------------------------------------------------------------------ get_handle
def test_get_handle_builds_the_runtime_from_vllm_s_kwargs(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    rt = mgr.get_handle(_kwargs(num_experts=16, max_num_tokens_per_rank=24, top_k=3))
    spec = rt.spec
    assert (spec.algorithm, spec.num_experts, spec.max_tokens_per_rank, spec.hidden_size) == (
        backends.Algorithm.LOW_LATENCY,
        16,
        24,
        2048,
    )
    assert rt.pool.top_k == 3 and rt.capacity == 24 and not spec.fault_tolerance
    params = rt.fleet.params
    assert (params.num_experts, params.max_tokens_per_rank, params.token_hidden_size) == (
        16,
        24,
        2048,
    )


def test_layers_of_one_shape_share_one_runtime_and_fleet(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    first = mgr.get_handle(_kwargs())
    assert all(mgr.get_handle(_kwargs()) is first for _ in range(5))
    assert mgr.runtimes == [first]
    # One pool, warmed once: capture sizes 1, 2, 4, 8 and eager buckets 12..32.
    assert first.fleet.handles_created == 8


def test_other_shapes_get_their_own_runtime(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    base = mgr.get_handle(_kwargs())
    other_k = mgr.get_handle(_kwargs(top_k=4))
    other_h = mgr.get_handle(_kwargs(hidden_size=4096))
    assert len({id(base), id(other_k), id(other_h)}) == 3
    assert other_k.fleet is base.fleet  # top_k does not change the fleet
    assert other_h.fleet is not base.fleet
    assert other_k.pool.top_k == 4 and other_h.spec.hidden_size == 4096


def test_ht_manager_pools_eager_buckets_padding_at_most_ht_max_pad(build):
    mgr = build(backends.HIGH_THROUGHPUT, _vllm_config())
    rt = mgr.get_handle(_kwargs())
    assert rt.spec.algorithm == backends.Algorithm.HIGH_THROUGHPUT
    # HT is never captured: the buckets alone, from 1 to the capacity.
    assert rt.pool.sizes == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert rt.fleet.handles_created == len(rt.pool.sizes)
    assert rt.round.combine_in.shape == (32, 2048)
    big = mgr.get_handle(_kwargs(max_num_tokens_per_rank=2048)).pool.sizes
    assert big[-1] == 2048 and 1280 in big and 1792 in big
    gaps = [b - a for a, b in zip(big, big[1:])]
    assert max(gaps) == pool_sizes.HT_MAX_PAD


def test_ht_manager_pools_nothing_with_the_pool_off(build, monkeypatch):
    monkeypatch.setenv("VLLM_FLASHINFER_EP_HANDLE_POOL", "0")
    rt = build(backends.HIGH_THROUGHPUT, _vllm_config()).get_handle(_kwargs())
    assert rt.pool.sizes == [] and rt.fleet.handles_created == 0


def test_fault_tolerance_follows_the_config_and_the_backend(build):
    ll = build(backends.LOW_LATENCY, _vllm_config(ft=True))
    assert ll.support_fault_tolerance and ll.get_handle(_kwargs()).spec.fault_tolerance
    assert ll.query_fault().dtype == torch.bool
    ht = build(backends.HIGH_THROUGHPUT, _vllm_config(ft=True))
    assert not ht.support_fault_tolerance and not ht.get_handle(_kwargs()).spec.fault_tolerance


def test_destroy_releases_handles_and_fleets(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    fleet = mgr.get_handle(_kwargs()).fleet
    mgr.destroy()
    assert fleet.handles_alive == 0 and fleet.destroyed and mgr.runtimes == []


# ------------------------------------------------------------------ pool sizes
def test_pool_warms_the_capture_sizes_and_eager_buckets_up_to_capacity(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config(sizes=(8, 1, 4, 2)))
    # Capture sizes exactly; above the largest, buckets to the fleet capacity (32).
    assert mgr.get_handle(_kwargs()).pool.sizes == [1, 2, 4, 8, 12, 16, 24, 32]


def test_pool_sizes_above_capacity_are_dropped(build):
    mgr = build(backends.LOW_LATENCY, _vllm_config(sizes=(1, 16, 64)))
    assert mgr.get_handle(_kwargs(max_num_tokens_per_rank=32)).pool.sizes == [1, 16, 24, 32]


def test_sequence_parallel_adds_the_per_tp_rank_sizes():
    cfg = _vllm_config(sizes=(1, 3, 6, 12), sp=True, tp=2)
    # Under SP each TP rank sends ceil(n / tp) of the n padded tokens.
    assert managers.pool_sizes_from_config(cfg) == [1, 2, 3, 6, 12]
    cfg = _vllm_config(sizes=(5, 9), sp=True, tp=4)
    assert managers.pool_sizes_from_config(cfg) == [2, 3, 5, 9]
    assert managers.pool_sizes_from_config(_vllm_config(sizes=(5, 9), sp=False, tp=4)) == [5, 9]


@pytest.mark.parametrize("mode", ["NONE"])
def test_without_cuda_graphs_the_pool_holds_only_eager_buckets(build, mode):
    assert managers.pool_sizes_from_config(_vllm_config(mode=mode)) == []
    assert managers.pool_sizes_from_config(_vllm_config(sizes=())) == []
    assert managers.pool_sizes_from_config(None) == []
    mgr = build(backends.LOW_LATENCY, _vllm_config(mode=mode))
    assert mgr.get_handle(_kwargs()).pool.sizes == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_every_graph_mode_warms_the_pool(mode):
    assert managers.pool_sizes_from_config(_vllm_config(mode=mode)) == [1, 2, 4, 8]


def test_pool_disabled_by_the_variable(build, monkeypatch):
    monkeypatch.setenv(envs.HANDLE_POOL, "off")
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    assert mgr.get_handle(_kwargs()).pool.sizes == []


# ------------------------------------------------------------------ device pin
def test_fleet_is_bound_to_the_device_vllm_set_not_local_rank(monkeypatch):
    """vLLM binds each worker's device before the manager; LOCAL_RANK may not match it."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    with installed_fake():
        boot = fleet_mod.bootstrap_config(rank=1, world_size=4, process_group="pg")
    assert boot.device == 3
    assert (boot.rank, boot.world_size, boot.stream, boot.auto_bootstrap) == (1, 4, 0, False)
    assert boot.process_group == "pg"
    assert os.environ["LOCAL_RANK"] == "0"


def test_manager_device_is_the_current_device(monkeypatch, fake):
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
    )

    def base_init(self, cpu_group, tcp_store_group=None):
        self.rank, self.world_size = 0, 1

    monkeypatch.setattr(All2AllManagerBase, "__init__", base_init)
    monkeypatch.setenv(envs.SKIP_ENV_CHECKS, "1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    import vllm.config as vllm_config_mod

    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: None)
    mgr = managers.FlashInferEPLowLatencyManager(None)
    assert mgr._device == torch.device("cuda", 5)


def test_environment_checks_run_unless_skipped(monkeypatch, fake):
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
    )

    from vllm_flashinfer_ep.runtime import env_checks

    calls = []

    def base_init(self, cpu_group, tcp_store_group=None):
        self.rank, self.world_size = 0, 1

    monkeypatch.setattr(All2AllManagerBase, "__init__", base_init)
    monkeypatch.setattr(env_checks, "ensure_nvcc_for_jit", lambda log: calls.append("nvcc"))
    monkeypatch.setattr(env_checks, "require_runtime_environment", lambda: calls.append("env"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    import vllm.config as vllm_config_mod

    monkeypatch.setattr(vllm_config_mod, "get_current_vllm_config_or_none", lambda: None)
    for value, expected in (("0", ["nvcc", "env"]), ("true", [])):
        calls.clear()
        monkeypatch.setenv(envs.SKIP_ENV_CHECKS, value)
        managers.FlashInferEPLowLatencyManager(None)
        assert calls == expected


# ------------------------------------------------------------ FP8 on the wire
def _moe(hidden=2048):
    return SimpleNamespace(num_experts=8, max_num_tokens=32, hidden_dim=hidden, experts_per_token=2)


def _block_qc():
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    one = torch.ones(8, dtype=torch.float32)
    return fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])


@pytest.mark.parametrize("backend", [backends.LOW_LATENCY, backends.HIGH_THROUGHPUT])
def test_block_fp8_layers_send_fp8_on_the_wire_and_others_log_why_not_once(build, caplog, backend):
    import logging

    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    from vllm_flashinfer_ep.runtime.fp8_wire import Fp8Wire, HtFp8Wire

    mgr = build(backend, _vllm_config())
    pf = mgr.make_prepare_finalize(_moe(), _block_qc())
    want = HtFp8Wire if backend == backends.HIGH_THROUGHPUT else Fp8Wire
    assert pf._fp8 and isinstance(pf.runtime.fp8_wire, want)
    one = torch.ones(8, dtype=torch.float32)
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            assert not mgr.make_prepare_finalize(_moe(), fp8_w8a8_moe_quant_config(one, one))._fp8
    assert sum("quantize after receive" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "backend,recipe", [(backends.LOW_LATENCY, "DS_FP8E3M4"), (backends.HIGH_THROUGHPUT, "FWD")]
)
def test_a_flashinfer_without_what_the_wire_needs_keeps_bf16_at_load(
    build, caplog, monkeypatch, backend, recipe
):
    """Checked at model load against a warmed handle: the model loads and runs BF16 on the
    wire, logged, instead of failing in its first forward."""
    import logging

    from tests.fakes import fake_nccl_ep

    class OlderRecipes:  # an nccl.ep without the recipe this backend's wire uses
        NONE = 0

    monkeypatch.setattr(fake_nccl_ep, "DispatchQuantizationRecipe", OlderRecipes)
    mgr = build(backend, _vllm_config())
    with caplog.at_level(logging.INFO):
        pf = mgr.make_prepare_finalize(_moe(), _block_qc())
    assert not pf._fp8 and pf.runtime.fp8_wire is None
    assert any(f"no {recipe} dispatch recipe" in r.getMessage() for r in caplog.records)


def test_the_wire_needs_the_pool(build, monkeypatch):
    monkeypatch.setenv(envs.HANDLE_POOL, "0")
    mgr = build(backends.LOW_LATENCY, _vllm_config())
    assert not mgr.make_prepare_finalize(_moe(), _block_qc())._fp8


def test_every_ep_rank_takes_the_wire_or_none_does(build, caplog):
    """A dispatch is collective: when another rank cannot send FP8 (say its FlashInfer lacks
    the recipe), this one keeps BF16 too."""
    import logging

    from vllm_flashinfer_ep.vllm import rank_checks

    mgr = build(backends.LOW_LATENCY, _vllm_config())
    seen = []

    def exchange(payload, what):
        seen.append((what, payload))
        if rank_checks.FP8_WIRE not in payload:
            return [payload, payload]
        return [payload, {**payload, rank_checks.FP8_WIRE: False}]  # the other rank's "no"

    mgr._checks.exchange = exchange
    with caplog.at_level(logging.INFO):
        pf = mgr.make_prepare_finalize(_moe(), _block_qc())
    wire = [p for w, p in seen if w == "FP8 wire decision of a MoE layer"]
    assert [p[rank_checks.FP8_WIRE] for p in wire] == [True] and not pf._fp8
    assert any("another EP rank" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("backend", list(managers.MANAGERS))
def test_a_bf16_first_layer_runs_the_first_round_at_load(build, backend):
    """FlashInfer allocates its BF16 receive buffer at a runtime's first dispatch: the
    manager runs that round after the runtime's first layer (every rank alike), so the
    load log's device-wide figure is what the runtime holds. Zero rows, weight 0, routed to
    this rank's own experts, on the smallest pooled handle; once per runtime."""
    mgr = build(backend, _vllm_config())
    mgr.make_prepare_finalize(_moe(), None)
    (rt,) = mgr.runtimes
    log = list(rt.fleet.log)
    created = [c for c in log if c.op == "create_handle"]
    after = log[log.index(created[-1]) + 1 :]
    smallest = min(rt.pool.sizes)
    assert [(c.op, c.tokens) for c in after if c.op != "update"] == [
        ("dispatch", smallest),
        ("combine", smallest),
    ]
    assert rt.loaded and rt.round.in_flight is None and rt.pool.counters.fresh_created == 0
    if backend == backends.Algorithm.LOW_LATENCY.backend:
        assert rt.round.planner.native.recv is not None  # direct rounds from the first step
    mgr.make_prepare_finalize(_moe(), None)  # the second layer of the shape
    assert rt.fleet.log == log


@pytest.mark.parametrize("backend", list(managers.MANAGERS))
def test_an_fp8_first_layer_allocates_no_bf16_receive_buffer_at_load(build, backend):
    """A runtime whose first layer sends FP8 on the wire runs no BF16 round at load:
    FlashInfer's BF16 receive buffer would be memory no FP8 layer uses."""
    mgr = build(backend, _vllm_config())
    pf = mgr.make_prepare_finalize(_moe(), _block_qc())
    assert pf._fp8
    (rt,) = mgr.runtimes
    assert rt.loaded and not any(c.op in ("dispatch", "combine") for c in rt.fleet.log)
