"""The fused block-list kernel (vllm/block_list.py) compiled on the GPU.

It must write what the torch builder writes, for the edge counts (no rows, one row, every
expert full) and the bounds the experts use, and, captured in a CUDA graph, rebuild the
list from whatever counts the replay finds. Prints the captured replay time of both
builders (per layer; a decode step builds one list per MoE layer).
Command (docs/device_vllm.md): python3 -m pytest tests/kernels/test_block_list_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from vllm_flashinfer_ep.vllm import block_list

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
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 20 / 48 * 1000
    print(
        f"BLOCK_LIST experts={experts} rows={rows} block_m={block_m} blocks={nb}: "
        f"captured us per layer fused {times['fused']:.2f} torch {times['torch']:.2f} "
        f"(torch/fused {times['torch'] / times['fused']:.2f}x)"
    )
