"""The received rows as blocks (experts/kernels/row_blocks.py).

vLLM's fused-MoE kernel reads the list in place of its sorted token ids, so a row left out
is a token's expert output lost and a row listed twice or under another expert is a wrong
sum. The torch builder is checked here against those properties for every routing shape
that matters; the Triton kernel (what CUDA runs) must write the same values, checked in
Triton's interpreter (tests/unit/interpreter.py). On the GPU: tests/kernels/.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.unit.interpreter import count_kinds, failures, run_cases
from vllm_flashinfer_ep.experts.kernels import row_blocks as rb
from vllm_flashinfer_ep.experts.kernels.row_blocks import (
    RowBlocks,
    max_blocks,
    row_blocks,
    torch_row_blocks,
)

CAPACITY = 256
# (experts, rows per expert, BLOCK_M): powers of two and not, one expert, a real model's
# local experts at world 1.
SHAPES = [(8, 16, 16), (5, 32, 16), (1, 64, 64), (3, 8, 32), (128, 256, 64), (256, 64, 16)]


def _need(counts: list[int], block_m: int) -> int:
    return sum(-(-c // block_m) for c in counts)


def listed_rows(blocks: RowBlocks, counts: list[int], rows: int, block_m: int) -> list[int]:
    """The rows `blocks` lists, block by block, after checking the layout vLLM's kernel
    reads: each used block one expert's consecutive rows then the sentinel, blocks in
    expert order, the used count clamped to the list, nothing but sentinels past it."""
    sorted_ids, expert_ids, blocks_rows = blocks
    num_blocks, sentinel = expert_ids.numel(), len(counts) * rows
    assert sorted_ids.dtype == expert_ids.dtype == blocks_rows.dtype == torch.int32
    assert sorted_ids.shape == (num_blocks * block_m,) and blocks_rows.shape == (1,)
    assert blocks.block_m == block_m
    used = min(_need(counts, block_m), num_blocks)
    assert int(blocks_rows) == used * block_m
    ids = sorted_ids.view(num_blocks, block_m).tolist()
    want_owner = [e for e, c in enumerate(counts) for _ in range(-(-c // block_m))]
    listed, first = [], {}
    for b in range(num_blocks):
        if b >= used:
            assert int(expert_ids[b]) == -1 and ids[b] == [sentinel] * block_m, b
            continue
        e = int(expert_ids[b])
        assert e == want_owner[b], (b, e, want_owner[b])
        start = (b - first.setdefault(e, b)) * block_m
        real = [e * rows + r for r in range(start, min(start + block_m, counts[e]))]
        assert ids[b] == real + [sentinel] * (block_m - len(real)), b
        listed += real
    return listed


def _all_rows(counts: list[int], rows: int) -> list[int]:
    return [e * rows + r for e, c in enumerate(counts) for r in range(c)]


def _routing_counts(tokens: int, experts: int, top_k: int, gen) -> list[int]:
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=experts).tolist()


def _spread_and_packed(experts: int, top_k: int, tokens: int) -> list[list[int]]:
    """Routings at the edges of the bound: rows over as many experts as can take them (a
    partial block each), and every token on the same top_k experts."""
    spread = [0] * experts
    for i in range(tokens * top_k):
        spread[i % experts] += 1
    packed = [tokens if e < top_k else 0 for e in range(experts)]
    return [spread, packed]


def _blocks(counts: list[int], rows: int, block_m: int, num_blocks: int) -> RowBlocks:
    return row_blocks(torch.tensor(counts, dtype=torch.int32), rows, block_m, num_blocks)


def _cases() -> list[dict]:
    """Count kinds x bounds (tighter than the blocks in use, one program, several, the
    whole buffer) per shape, and the extreme routings at their bound."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for experts, rows, bm in SHAPES:
        kinds = count_kinds(experts, rows, gen)
        kinds.append(torch.randint(0, 3, (experts,), generator=gen).tolist())  # sparse
        whole = experts * -(-rows // bm)
        for counts in kinds:
            for nb in (1, 7, rb.BLOCKS_PER_PROGRAM + 1, whole):
                cases.append(dict(kind="blocks", rows=rows, bm=bm, counts=counts, nb=nb))
    for bm, tokens in itertools.product((16, 64), (1, 9, 100)):
        for counts in _spread_and_packed(64, 8, tokens):
            nb = max_blocks(tokens * 8, 64, CAPACITY, bm)
            cases.append(dict(kind="blocks", rows=CAPACITY, bm=bm, counts=counts, nb=nb))
    cases.append(dict(kind="blocks", rows=32, bm=16, counts=[5, 32, 0], nb=4, int64=True))
    return cases


CASES = _cases()


def check_kernel(case: dict) -> str | None:
    """In the interpreter's child: the Triton kernel's list equals the torch builder's."""
    dtype = torch.int64 if case.get("int64") else torch.int32
    counts = torch.tensor(case["counts"], dtype=dtype)
    args = (counts, case["rows"], case["bm"], case["nb"])
    want, got = torch_row_blocks(*args), rb.triton_row_blocks(*args)
    for name, w, g in zip(RowBlocks._fields, want, got):
        if w.dtype != g.dtype or not torch.equal(w, g):
            return f"{name} differs: {g.tolist()[:64]} != {w.tolist()[:64]}"
    return None


def test_the_triton_kernel_writes_the_torch_builder_s_list_in_the_interpreter():
    assert failures(CASES, run_cases(__file__, "check_kernel", CASES), "blocks") == []


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{len(c['counts'])}x{c['rows']}-bm{c['bm']}-nb{c['nb']}"
)
def test_the_torch_builder_lists_every_received_row_it_has_room_for(case):
    counts, rows, bm, nb = case["counts"], case["rows"], case["bm"], case["nb"]
    listed = listed_rows(_blocks(counts, rows, bm, nb), counts, rows, bm)
    if nb >= _need(counts, bm):
        assert listed == _all_rows(counts, rows)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens", [1, 7, 64, 256])
def test_every_received_row_is_listed_once_in_its_experts_block(block_m, tokens):
    gen = torch.Generator().manual_seed(tokens * block_m)
    experts, top_k = 32, 4
    counts = _routing_counts(tokens, experts, top_k, gen)
    bound = max_blocks(tokens * top_k, experts, CAPACITY, block_m)
    listed = listed_rows(_blocks(counts, CAPACITY, block_m, bound), counts, CAPACITY, block_m)
    assert listed == _all_rows(counts, CAPACITY)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_the_bound_holds_for_extreme_routings(block_m):
    experts, top_k = 64, 8
    for tokens in (1, 2, 3, 9, 31, 32, 100, 256):
        bound = max_blocks(tokens * top_k, experts, CAPACITY, block_m)
        for counts in _spread_and_packed(experts, top_k, tokens):
            assert _need(counts, block_m) <= bound, (tokens, counts)
            blocks = _blocks(counts, CAPACITY, block_m, bound)
            assert listed_rows(blocks, counts, CAPACITY, block_m) == _all_rows(counts, CAPACITY)


def test_the_bound_holds_for_every_routing_of_small_shapes():
    """Every routing of at most `bound` rows into the buffer needs at most `max_blocks`
    (else rows are dropped), which is never more than the rows nor the buffer's blocks."""
    for experts, rows, block_m in ((3, 5, 2), (2, 8, 4), (4, 3, 4), (1, 9, 4)):
        buffer_blocks = experts * -(-rows // block_m)
        worst = [0] * (experts * rows + 1)  # the most blocks a routing of n rows needs
        for counts in itertools.product(range(rows + 1), repeat=experts):
            n = sum(counts)
            worst[n] = max(worst[n], _need(list(counts), block_m))
        for bound in range(experts * rows + 1):
            got = max_blocks(bound, experts, rows, block_m)
            assert max(worst[: bound + 1]) <= got <= min(max(1, bound), buffer_blocks), bound


def test_the_launch_follows_the_batch_not_the_buffer():
    # The point: a decode token of a 128-expert model lists 8 blocks, not 128 x 16.
    assert max_blocks(1 * 8, 128, CAPACITY, 16) == 8
    # 2048 rows: 128 full blocks plus at most one partial block per expert.
    assert max_blocks(256 * 8, 128, CAPACITY, 16) == 256 < 128 * CAPACITY // 16
    assert max_blocks(10**6, 128, CAPACITY, 16) == 128 * CAPACITY // 16  # the buffer's own
    assert max_blocks(0, 128, CAPACITY, 16) == 1  # never an empty grid


def test_a_short_list_leaves_rows_out():
    """What the bound guards against: a list shorter than the blocks in use keeps its
    first blocks (expert 0's, then expert 2's first) and drops the rest."""
    counts = [3, 0, 5]
    blocks = _blocks(counts, 8, 2, 3)
    assert listed_rows(blocks, counts, 8, 2) == [0, 1, 2, 16, 17]


def test_cpu_tensors_take_the_torch_builder_and_cuda_ones_the_kernel(monkeypatch):
    counts = torch.tensor([3, 0, 17], dtype=torch.int32)
    monkeypatch.setattr(rb, "triton_row_blocks", lambda *a: pytest.fail("kernel on CPU"))
    got = row_blocks(counts, 32, 16, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, torch_row_blocks(counts, 32, 16, 4)))
    launched = []
    monkeypatch.setattr(rb, "triton_row_blocks", lambda *a: launched.append(a) or "kernel")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert row_blocks(counts, 32, 16, 4) == "kernel" and launched == [(counts, 32, 16, 4)]


def test_row_ids_beyond_int32_are_refused():
    with pytest.raises(ValueError, match="int32"):
        rb.triton_row_blocks(torch.zeros(2**16, dtype=torch.int32), 2**15, 16, 4)
