"""EP ranks that disagree stop together and by name, on the fake world (2 and 4 ranks).

Every rank runs the real manager (tests/fakes/managers.py) with its own vLLM config; the
CPU exchanges go through the fake group with the package's deadline. Each item the load
check compares is made to differ on one rank, once: every rank must raise the same
RankMismatchError naming that item and what sets it (so dropping the item from the
comparison, which lets a later item or a collective fail instead, fails the test). The
per-layer FP8 wire decision runs on every rank for every layer, and a rank that stopped
leaves its peers with a named error within the deadline.
"""

from __future__ import annotations

import time
from importlib import metadata
from types import SimpleNamespace

import pytest

from tests.fakes.managers import manager_world, this_rank
from tests.fakes.rank_configs import (
    LL,
    SIZES,
    assert_named_everywhere,
    block_fp8,
    clean_env,
    configs,
    load,
    make_base_config,
    moe,
    speculate,
)
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.runtime import rank_agreement
from vllm_flashinfer_ep.runtime.exchange import ExchangeTimeoutError
from vllm_flashinfer_ep.vllm import managers, rank_checks

pytestmark = pytest.mark.usefixtures("fake")


@pytest.fixture(scope="module")
def base_config():
    return make_base_config()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    clean_env(monkeypatch)


# ------------------------------------------------------------------ the load check
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_agree_build_alike(base_config, world):
    with manager_world(LL, configs(base_config, world)) as w:
        built = w.run(lambda r, m: load(r, m).runtime.pool.sizes)
    assert all(s == built[0] for s in built) and built[0] == [1, 2, 4, 8, 16, 24, 32]
    assert all(x.calls == ["load check", "FP8 wire decision of a MoE layer"] for x in w.exchanges)


# item -> (what the error names as setting it, the last rank's config change or None:
# the test sets the others up itself)
CASES = {
    "fleet shape (algorithm, experts, hidden size, top_k)": ("--hf-overrides", None),
    "fleet capacity (tokens per rank)": ("--max-num-batched-tokens", None),
    "fault tolerance": (
        "--enable-fault-tolerance",
        lambda c: setattr(c.parallel_config, "enable_fault_tolerance", True),
    ),
    "pooled token counts": ("cudagraph_capture_sizes", None),
    "package variables": ("the VLLM_FLASHINFER_EP_* variables", None),
    "library versions": ("pip install the same versions", None),
    "speculative tokens": ("--speculative-config", speculate(1)),
    "max_num_seqs": ("--max-num-seqs", lambda c: setattr(c.scheduler_config, "max_num_seqs", 8)),
    "CUDA-graph mode": (
        "cudagraph_mode",
        lambda c: setattr(c.compilation_config, "cudagraph_mode", _mode("PIECEWISE")),
    ),
    "CUDA-graph capture sizes": (
        "cudagraph_capture_sizes",
        # 24 is pooled as an eager bucket anyway: only the capture sizes differ
        lambda c: setattr(c.compilation_config, "cudagraph_capture_sizes", [*SIZES, 24]),
    ),
    "LoRA capture cases": (
        "--max-loras",
        lambda c: setattr(
            c, "lora_config", SimpleNamespace(max_loras=2, specialize_active_lora=False)
        ),
    ),
}


def _mode(name):
    from vllm.config import CUDAGraphMode

    return CUDAGraphMode[name]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("item", sorted(CASES))
def test_every_load_check_item_that_differs_stops_every_rank_by_name(
    base_config, monkeypatch, item, world
):
    fix, change = CASES[item]
    last = world - 1
    layer = {r: moe() for r in range(world)}
    if item.startswith("fleet shape"):
        layer[last] = moe(hidden=4096)
    elif item.startswith("fleet capacity"):
        layer[last] = moe(tokens=16)
    elif item == "pooled token counts":
        original = managers.pool_sizes_from_config
        monkeypatch.setattr(
            managers,
            "pool_sizes_from_config",
            lambda c: [*original(c), 3] if this_rank() == last else original(c),
        )
    elif item == "package variables":
        original_settings = envs.settings
        monkeypatch.setattr(
            envs,
            "settings",
            lambda: {**original_settings(), envs.FP8_DISPATCH: this_rank() != last},
        )
    elif item == "library versions":  # nccl4py: NCCL-EP's communicator under FlashInfer
        original_version = metadata.version
        monkeypatch.setattr(
            metadata,
            "version",
            lambda name: (
                "0.0.1" if name == "nccl4py" and this_rank() == last else original_version(name)
            ),
        )
    with manager_world(LL, configs(base_config, world, change)) as w:
        outcomes = w.outcomes(lambda r, m: load(r, m, layer[r]))
    assert_named_everywhere(outcomes, item, fix)
    views = str(outcomes[0])
    assert f"rank {last}: " in views and ("rank 0: " if world == 2 else "ranks 0, 1, 2: ") in views


def test_the_compared_libraries_include_nccl4py():
    assert "nccl4py" in rank_agreement.LIBRARIES


# ------------------------------------------------------------ the FP8 wire decision
@pytest.mark.parametrize("world", [2, 4])
def test_an_fp8_layer_on_one_rank_and_bf16_on_another_stops_both_by_name(base_config, world):
    """The BF16 rank takes part in the layer's exchange too: no rank is left waiting."""
    start = time.monotonic()
    with manager_world(LL, configs(base_config, world)) as w:
        outcomes = w.outcomes(lambda r, m: load(r, m, quant=block_fp8() if r == 0 else None))
    assert_named_everywhere(outcomes, rank_checks.LAYER_QUANTIZATION, "quantization_config")
    assert time.monotonic() - start < 5  # well inside the deadline: nobody waited for it


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_cannot_send_fp8_keeps_every_rank_on_bf16(base_config, monkeypatch, world):
    from vllm_flashinfer_ep.runtime.ep_runtime import EPRuntime

    original = EPRuntime.fp8_wire_reason
    monkeypatch.setattr(
        EPRuntime,
        "fp8_wire_reason",
        lambda self: "no recipe here" if this_rank() == world - 1 else original(self),
    )
    with manager_world(LL, configs(base_config, world)) as w:
        fp8 = w.run(lambda r, m: load(r, m, quant=block_fp8())._fp8)
    assert fp8 == [False] * world
    with manager_world(LL, configs(base_config, world)) as w:  # the control: all can
        monkeypatch.setattr(EPRuntime, "fp8_wire_reason", original)
        assert w.run(lambda r, m: load(r, m, quant=block_fp8())._fp8) == [True] * world


# --------------------------------------------------------------- bounded waits
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_dies_at_load_leaves_the_others_a_named_error_within_the_deadline(
    base_config, monkeypatch, world
):
    monkeypatch.setenv(envs.EXCHANGE_TIMEOUT_S, "2")
    dead = world - 1

    def rank_fn(rank, manager):
        if rank == dead:
            return "died"
        return load(rank, manager)

    start = time.monotonic()
    with manager_world(LL, configs(base_config, world)) as w:
        outcomes = w.outcomes(rank_fn)
    assert outcomes[dead] == "died"
    for rank in range(dead):
        assert isinstance(outcomes[rank], ExchangeTimeoutError), outcomes[rank]
        message = str(outcomes[rank])
        assert "the load check" in message and envs.EXCHANGE_TIMEOUT_S in message
        assert f"EP rank {rank} of {world}" in message
    assert all(max(x.waited_s) < 2 + 3 for x in w.exchanges[:dead])  # the deadline, not 30 s
    assert time.monotonic() - start < 20
