"""The shape of one round: data flows down the runtime once, and one issuer runs a round.

- The round's modules form one downward path (`ROUND_PATH`): a module imports only
  modules below it, so a forward never re-enters a module it has left.
- No runtime module is over 400 lines.
- Each round is planned once and every transport call of it (update, dispatch, combine)
  goes through the one issuer its plan chose: the fake's own records say which path
  (FlashInfer's handle methods, direct nccl.ep calls, the FP8 wire) each call took.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.fakes.runtime import build_fake_runtime
from tests.helpers import scale_expert_rows
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.runtime.issuers import WireIssuer

pytestmark = pytest.mark.usefixtures("fake")

RUNTIME = Path(__file__).resolve().parents[2] / "vllm_flashinfer_ep" / "runtime"

# Top to bottom: the path of one layer's round (docs/architecture.md, "One layer's round").
ROUND_PATH = [
    "ep_runtime",
    "rounds",
    "round_plan",
    "issuers",
    "fp8_wire",
    "native_handle",
    "handle_pool",
    "pool_sizes",
    "fleet",
    "streams",
    "capture",
    "transport",
    "flashinfer_internals",
]


def _runtime_imports(path: Path) -> set[str]:
    """The runtime modules one file imports, anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "vllm_flashinfer_ep.runtime":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("vllm_flashinfer_ep.runtime."):
                found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vllm_flashinfer_ep.runtime."):
                    found.add(alias.name.rsplit(".", 1)[1])
    return found


def test_the_round_path_only_imports_downward():
    upward = {
        f"{name} imports {dep}"
        for i, name in enumerate(ROUND_PATH)
        for dep in _runtime_imports(RUNTIME / f"{name}.py")
        if dep in ROUND_PATH[: i + 1]
    }
    assert not upward


def test_every_round_path_module_exists():
    assert all((RUNTIME / f"{name}.py").is_file() for name in ROUND_PATH)


def test_no_runtime_module_is_over_400_lines():
    long = {p.name: n for p in RUNTIME.glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long


# ------------------------------------------------------------------ one issuer
HIDDEN, EXPERTS, TOP_K, CAP = 2048, 8, 2, 16


def _layer(num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, EXPERTS, TOP_K, torch.device("cpu"), gen)
    scales = torch.rand(EXPERTS, generator=gen) + 0.5
    return x, ids, weights, scales


def _runtime():
    """An LL runtime on the fake, sizes 4 and 8 pooled."""
    rt, _ = build_fake_runtime(
        Algorithm.LOW_LATENCY,
        hidden=HIDDEN,
        num_experts=EXPERTS,
        capacity=CAP,
        top_k=TOP_K,
        sizes=(4, 8),
    )
    return rt


def _paths(rt) -> dict[str, int]:
    """Transport calls so far, by the path they took (the fake's own counters)."""
    natives = [h._handle for h in rt.pool.handles.values()]
    log = rt.fleet.log
    direct = {
        "update": sum(n.updates for n in natives),
        "dispatch": sum(n.bf16_dispatches for n in natives),
        "combine": sum(n.combines for n in natives),
    }
    wire = rt.fp8_wire.dispatches if rt.fp8_wire is not None else 0
    every = {op: sum(c.op == op for c in log) for op in ("update", "dispatch", "combine")}
    return {
        **{f"direct {op}": n for op, n in direct.items()},
        "wire dispatch": wire,
        # FlashInfer's methods: every logged call that took neither other path
        "flashinfer update": every["update"] - direct["update"],
        "flashinfer dispatch": every["dispatch"] - direct["dispatch"] - wire,
        "flashinfer combine": every["combine"] - direct["combine"],
    }


# (tokens, agreed, fp8) -> the one path every call of the round takes
ROUNDS = {
    "pooled exact eager: direct nccl.ep": (8, "local", False, "direct"),
    "padded: FlashInfer's methods": (5, "local", False, "flashinfer"),
    "fresh handle: FlashInfer's methods": (6, None, False, "flashinfer"),
    "FP8 pooled exact: wire over direct": (8, "local", True, "wire+direct"),
    "FP8 padded: wire over FlashInfer": (5, "local", True, "wire+flashinfer"),
}


@pytest.mark.parametrize("case", list(ROUNDS))
def test_every_call_of_a_round_goes_through_its_one_issuer(case):
    num_tokens, agreed, fp8, path = ROUNDS[case]
    rt = _runtime()
    if fp8:
        rt.enable_fp8_wire()
    rnd = rt.round
    x, ids, w, s = _layer(8, seed=0)  # a first BF16 round records FlashInfer's receive buffer
    rnd.combine(scale_expert_rows(rnd.dispatch(x, ids, w).expert_x, s), torch.empty_like(x))
    before = _paths(rt)

    x, ids, w, s = _layer(num_tokens, seed=1)
    d = rnd.dispatch(x, ids, w, agreed_tokens=agreed, fp8=fp8)
    plan = rnd.in_flight
    expert_x = d.expert_x
    if fp8:  # what the experts would see: the wire's E4M3 rows, dequantized
        groups = expert_x.float().unflatten(-1, (-1, 128)) * d.expert_x_scale[..., None]
        expert_x = groups.flatten(-2).to(torch.bfloat16)
    out = rnd.combine(scale_expert_rows(expert_x, s), torch.empty_like(x))
    tol = 0.1 if fp8 else 2e-2
    torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=tol, rtol=tol)
    assert rnd.in_flight is None

    planner = rt.round.planner
    wire, _, base = path.rpartition("+")
    issuer = plan.issuer
    if wire:
        assert isinstance(issuer, WireIssuer) and issuer.wire is rt.fp8_wire
        issuer = issuer.base
    assert issuer is (planner.native if base == "direct" else planner.flashinfer)

    after = _paths(rt)
    took = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    update = {} if agreed is None else {f"{base} update": 1}  # a fresh handle binds at creation
    dispatch = {"wire dispatch": 1} if wire else {f"{base} dispatch": 1}
    assert took == {**update, **dispatch, f"{base} combine": 1}


def test_only_a_pooled_eager_round_through_flashinfer_tells_the_direct_calls_the_buffer():
    """Padded (and captured, joined, fresh) rounds leave the direct calls unaware of
    FlashInfer's receive buffer; the first pooled eager round of exactly its size goes
    through FlashInfer's methods and records it, the next one goes direct."""
    rt = _runtime()
    rnd, planner = rt.round, rt.round.planner

    def step(n: int, seed: int):
        x, ids, w, s = _layer(n, seed)
        d = rnd.dispatch(x, ids, w)
        issuer = rnd.in_flight.issuer
        rnd.combine(scale_expert_rows(d.expert_x, s), torch.empty_like(x))
        return issuer

    assert step(5, 1) is planner.flashinfer and planner.native.recv is None  # padded
    assert step(8, 2) is not planner.native and planner.native.recv is not None
    assert step(8, 3) is planner.native


def test_a_side_stream_round_joins_each_call_with_torch_s_stream(monkeypatch):
    """Handle work off torch's current stream is joined around update, dispatch and
    combine: the handle stream waits for torch's before each call, torch's for the handle
    stream after it (runtime/streams.py), through JoinedIssuer."""
    from vllm_flashinfer_ep.runtime import streams as streams_mod
    from vllm_flashinfer_ep.runtime.issuers import JoinedIssuer

    rt = _runtime()
    events: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            events.append(f"{self.name} waits {other.name}")

    handle_stream, torch_stream = Stream("handle"), Stream("torch")
    streams = rt.pool.streams
    monkeypatch.setattr(streams, "stream", handle_stream)
    monkeypatch.setattr(streams, "state", lambda: (False, True))  # a side stream, not captured
    monkeypatch.setattr(streams_mod.torch.cuda, "current_stream", lambda: torch_stream)
    for op in ("update", "dispatch", "combine"):
        real = getattr(rt.fleet.handles[-1].__class__, op)

        def logged(self, *args, _op=op, _real=real, **kwargs):
            events.append(_op)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(rt.fleet.handles[-1].__class__, op, logged)

    x, ids, w, s = _layer(5, seed=4)  # padded: the general path decides the join
    d = rt.round.dispatch(x, ids, w)
    assert isinstance(rt.round.in_flight.issuer, JoinedIssuer)
    out = rt.round.combine(scale_expert_rows(d.expert_x, s), torch.empty_like(x))
    torch.testing.assert_close(out, reference_moe(x, ids, w, s), atol=2e-2, rtol=2e-2)
    joined = [
        ["handle waits torch", op, "torch waits handle"] for op in ("update", "dispatch", "combine")
    ]
    assert events == [e for triple in joined for e in triple]
