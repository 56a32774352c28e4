"""The fused block-list kernel and the listed-rows activation (vllm/block_list.py) on the GPU.

The kernel must write what the torch builder writes, for the edge counts (no rows, one
row, every expert full) and the bounds the experts use, and, captured in a CUDA graph,
rebuild the list from whatever counts the replay finds. The listed activation must write
what vLLM's masked activation writes on every received row, captured and replayed with new
counts too. Prints the captured replay times (per layer; a decode step builds one list and
runs one activation per MoE layer).
Command (docs/contributing/gpu_runs.md): python3 -m pytest tests/kernels/test_block_list_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.vllm import block_list
from vllm_flashinfer_ep.vllm.compact_experts import max_blocks

pytestmark = pytest.mark.gpu

SHAPES = [(8, 16, 16), (5, 32, 16), (1, 64, 64), (64, 256, 16), (128, 256, 64), (256, 64, 16)]


def _counts(kind: str, experts: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "empty":
        c = torch.zeros(experts, dtype=torch.int32)
    elif kind == "full":
        c = torch.full((experts,), rows, dtype=torch.int32)
    elif kind == "one row":
        c = torch.zeros(experts, dtype=torch.int32)
        c[experts // 2] = 1
    else:
        c = torch.randint(0, rows + 1, (experts,), generator=gen, dtype=torch.int32)
    return c.cuda()


@pytest.mark.parametrize(("experts", "rows", "block_m"), SHAPES)
def test_the_compiled_kernel_equals_the_torch_builder(experts, rows, block_m):
    gen = torch.Generator().manual_seed(experts)
    whole = experts * -(-rows // block_m)
    for kind in ("empty", "full", "one row", "random", "random"):
        counts = _counts(kind, experts, rows, gen)
        for nb in (1, 7, block_list.BLOCKS_PER_PROGRAM + 1, whole):
            want = block_list.torch_expert_blocks(counts, rows, block_m, nb)
            got = block_list.fused_expert_blocks(counts, rows, block_m, nb)
            for w, g in zip(want, got):
                assert w.dtype == g.dtype and torch.equal(w, g), (kind, nb)


def _us_per_layer(graph, layers: int = 48, replays: int = 20) -> float:
    """GPU us per layer of a graph that captured `layers` layers, over `replays` replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / layers * 1000


@pytest.mark.parametrize(("experts", "rows", "block_m"), [(64, 256, 16), (128, 256, 64)])
def test_a_captured_list_follows_the_counts_of_each_replay(experts, rows, block_m):
    gen = torch.Generator().manual_seed(1)
    nb = min(experts * -(-rows // block_m), 64 + experts)
    counts = _counts("random", experts, rows, gen)
    times = {}
    for name, build in (
        ("fused", block_list.fused_expert_blocks),
        ("torch", block_list.torch_expert_blocks),
    ):
        build(counts, rows, block_m, nb)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [build(counts, rows, block_m, nb) for _ in range(48)]  # 48 MoE layers
        for kind in ("sparse", "empty", "full", "random"):
            new = _counts("one row" if kind == "sparse" else kind, experts, rows, gen)
            counts.copy_(new)
            graph.replay()
            want = block_list.torch_expert_blocks(new, rows, block_m, nb)
            for w, g in zip(want, outs[-1]):
                assert torch.equal(w, g), (name, kind)
        times[name] = _us_per_layer(graph)
    print(
        f"BLOCK_LIST experts={experts} rows={rows} block_m={block_m} blocks={nb}: "
        f"captured us per layer fused {times['fused']:.2f} torch {times['torch']:.2f} "
        f"(torch/fused {times['torch'] / times['fused']:.2f}x)"
    )


def _vllm_masked_silu(out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> None:
    from vllm.model_executor.layers.fused_moe.activation import (
        MoEActivation,
        apply_moe_activation,
    )

    apply_moe_activation(MoEActivation.SILU, out, x, valid_token_counts=counts)


def _activation_layer(name, out, x, counts, block_m, nb) -> None:
    """One MoE layer's activation: the block list ("list"), the block list and the listed
    rows ("listed"), or vLLM's op ("vllm")."""
    experts, rows, d = out.shape
    if name in ("list", "listed"):
        blocks = block_list.fused_expert_blocks(counts, rows, block_m, nb)
        if name == "listed":
            block_list.listed_silu_and_mul(out.view(-1, d), x.view(-1, 2 * d), blocks)
    else:
        _vllm_masked_silu(out, x, counts)


def _assert_received_rows_equal(counts, rows, got, want) -> None:
    """Every received row as vLLM writes it: equal, or one rounding apart where Triton's
    exp and CUDA's expf differ in the last bit (counted, at most 1 in 1000)."""
    valid = torch.arange(rows, device="cuda")[None, :] < counts[:, None]
    g, w = got[valid].float(), want[valid].float()
    assert torch.isfinite(g).all()
    eps = torch.finfo(got.dtype).eps
    assert torch.allclose(g, w, rtol=2 * eps, atol=0), float((g - w).abs().max())
    assert int((g != w).sum()) <= 1e-3 * g.numel()


@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"), [(128, 256, 768, 16), (64, 256, 512, 64), (8, 32, 96, 16)]
)
def test_the_listed_activation_equals_vllm_s_masked_activation(experts, rows, d, block_m):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(experts, rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    whole = experts * -(-rows // block_m)
    for kind in ("empty", "full", "one row", "random"):
        counts = _counts(kind, experts, rows, gen)
        blocks = block_list.fused_expert_blocks(counts, rows, block_m, whole)
        want = torch.full((experts, rows, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = want.clone()
        _vllm_masked_silu(want, x, counts)
        block_list.listed_silu_and_mul(got.view(-1, d), x.view(-1, 2 * d), blocks)
        torch.cuda.synchronize()
        _assert_received_rows_equal(counts, rows, got, want)
        assert torch.isnan(got[torch.arange(rows, device="cuda")[None, :] >= counts[:, None]]).all()


def _routed(experts: int, tokens: int, seed: int) -> torch.Tensor:
    """Rows per expert when `tokens` tokens each pick 8 distinct experts (top_k 8)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:8] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=experts).to(torch.int32)


def test_a_captured_listed_activation_follows_each_replay_s_counts_and_is_timed():
    """Qwen3-30B-A3B's shape (128 local experts, 256 rows, intermediate 768) at the bound
    of a 1-token and a 128-token forward: 48 layers captured, replayed with new routings,
    against vLLM's masked activation; timed captured, the block list alone too (the GEMMs
    build it anyway, so the listed activation's own cost is the difference)."""
    experts, rows, d, block_m = 128, 256, 768, 16
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(experts, rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    out = torch.zeros(experts, rows, d, device="cuda", dtype=torch.bfloat16)
    for tokens in (1, 128):
        nb = max_blocks(tokens * 8, experts, rows, block_m)  # what the experts size it to
        counts = _routed(experts, tokens, 3).cuda()
        times = {}
        for name in ("list", "listed", "vllm"):
            args = (name, out, x, counts, block_m, nb)
            # one eager pass first (Triton compiles outside the capture), then 48 layers
            graph = capture_graph(lambda a=args: [_activation_layer(*a) for _ in range(48)])
            for seed in (4, 5) if name != "list" else ():
                counts.copy_(_routed(experts, tokens, seed))
                out.fill_(float("nan"))
                graph.replay()
                want = torch.full_like(out, float("nan"))
                _vllm_masked_silu(want, x, counts)
                torch.cuda.synchronize()
                _assert_received_rows_equal(counts, rows, out, want)
            times[name] = _us_per_layer(graph)
            del graph
        print(
            f"LISTED_ACTIVATION tokens={tokens} blocks={nb}: captured us per layer: "
            f"listed activation {times['listed'] - times['list']:.2f} (with the block list "
            f"{times['listed']:.2f}), vLLM's masked activation {times['vllm']:.2f}"
        )
