"""The received-rows kernels (experts/kernels/) on the GPU, against vLLM's own ops.

- the blocks: the Triton build writes what the torch build writes, for the edge counts and
  the bounds the experts use, and a captured build follows each replay's counts;
- SiLU-and-mul: what vLLM's masked activation writes on every received row;
- quantization (with and without the fused activation): the bytes and scales vLLM's
  SiLU-and-mul and dynamic FP8 quantization give (per 128-element group with and without
  power-of-two scales, per token, per tensor dynamic per expert or one scale, per tensor
  with a static scale), up to where Triton's exp and CUDA's expf differ in the last bit;
  captured and replayed with new counts and rows.
Command: python3 -m pytest tests/kernels/test_received_rows_kernels_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from vllm_flashinfer_ep.experts.kernels import activation, quantize, row_blocks
from vllm_flashinfer_ep.experts.kernels.row_blocks import max_blocks
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = pytest.mark.gpu

SHAPES = [(8, 16, 16), (5, 32, 16), (1, 64, 64), (64, 256, 16), (128, 256, 64), (256, 64, 16)]
KINDS = ("empty", "full", "one row", "random")


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


def _routed(experts: int, tokens: int, seed: int) -> torch.Tensor:
    """Rows per expert when `tokens` tokens each pick 8 distinct experts (top_k 8)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:8] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=experts).to(torch.int32)


@pytest.mark.parametrize(("experts", "rows", "block_m"), SHAPES)
def test_the_triton_blocks_equal_the_torch_blocks(experts, rows, block_m):
    gen = torch.Generator().manual_seed(experts)
    whole = experts * -(-rows // block_m)
    for kind in (*KINDS, "random"):
        counts = _counts(kind, experts, rows, gen)
        for nb in (1, 7, row_blocks.BLOCKS_PER_PROGRAM + 1, whole):
            want = row_blocks.torch_row_blocks(counts, rows, block_m, nb)
            got = row_blocks.triton_row_blocks(counts, rows, block_m, nb)
            for w, g in zip(want, got):
                assert w.dtype == g.dtype and torch.equal(w, g), (kind, nb)


@pytest.mark.parametrize(("experts", "rows", "block_m"), [(64, 256, 16), (128, 256, 64)])
def test_captured_blocks_follow_the_counts_of_each_replay(experts, rows, block_m):
    gen = torch.Generator().manual_seed(1)
    nb = min(experts * -(-rows // block_m), 64 + experts)
    counts = _counts("random", experts, rows, gen)
    outs = []
    graph = capture_graph(lambda: outs.append(row_blocks.row_blocks(counts, rows, block_m, nb)))
    for kind in KINDS:
        new = _counts(kind, experts, rows, gen)
        counts.copy_(new)
        graph.replay()
        want = row_blocks.torch_row_blocks(new, rows, block_m, nb)
        for w, g in zip(want, outs[-1]):
            assert torch.equal(w, g), kind
    del graph


def _received(counts: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.arange(rows, device="cuda")[None, :] < counts[:, None]


def _vllm_masked_silu(out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> None:
    from vllm.model_executor.layers.fused_moe.activation import (
        MoEActivation,
        apply_moe_activation,
    )

    apply_moe_activation(MoEActivation.SILU, out, x, valid_token_counts=counts)


@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"), [(128, 256, 768, 16), (64, 256, 512, 64), (8, 32, 96, 16)]
)
def test_silu_and_mul_equals_vllm_s_masked_activation(experts, rows, d, block_m):
    """Equal on every received row, or one rounding apart where Triton's exp and CUDA's
    expf differ in the last bit (at most 1 in 1000); nothing else written."""
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(experts, rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    whole = experts * -(-rows // block_m)
    for kind in KINDS:
        counts = _counts(kind, experts, rows, gen)
        blocks = row_blocks.row_blocks(counts, rows, block_m, whole)
        want = torch.full((experts, rows, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        got = want.clone()
        _vllm_masked_silu(want, x, counts)
        activation.silu_and_mul(got.view(-1, d), x.view(-1, 2 * d), blocks)
        torch.cuda.synchronize()
        valid = _received(counts, rows)
        g, w = got[valid].float(), want[valid].float()
        eps = torch.finfo(torch.bfloat16).eps
        assert torch.allclose(g, w, rtol=2 * eps, atol=0), float((g - w).abs().max())
        assert int((g != w).sum()) <= 1e-3 * g.numel()
        assert torch.isnan(got[~valid]).all()


def _assert_rows_equal(blocks, rows, got, want, shared_scales: bool = False) -> None:
    """Received rows' bytes and scales as vLLM's ops give them. `shared_scales`: a scale
    spans rows (per tensor), so one last-bit difference of the activation at a maximum
    moves every row's scale by an ulp: scales within 2 units of bfloat16 only."""
    ids = blocks.sorted_ids
    listed = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    listed[ids[ids < rows].long()] = True
    (gq, gs), (wq, ws) = got, want
    gs, ws = gs[listed], ws[listed]
    assert torch.allclose(gs, ws, rtol=2**-7, atol=0), float((gs - ws).abs().max())
    assert shared_scales or int((gs != ws).sum()) <= max(1, 1e-3 * gs.numel())
    gq, wq = gq[listed].float(), wq[listed].float()
    assert torch.allclose(gq, wq, rtol=2**-3, atol=2**-9), float((gq - wq).abs().max())
    assert int((gq != wq).sum()) <= 1e-3 * max(1, gq.numel())


def _vllm_rows(x: torch.Tensor, group: int | None, ue8m0: bool, act: bool):
    """vLLM's activation (`act`), then its dynamic quantization, over every row."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
    )

    y = x
    if act:
        y = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(y, x)
    if group is None:
        return ops.scaled_fp8_quant(y, use_per_token_if_dynamic=True)
    return per_token_group_quant_fp8(y, group, use_ue8m0=ue8m0)


ROW_SCHEMES = [(128, False), (128, True), (None, False)]  # (group, ue8m0); None: per token


@pytest.mark.parametrize("act", [True, False], ids=["intermediate", "input"])
@pytest.mark.parametrize(("group", "ue8m0"), ROW_SCHEMES)
@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"),
    # 768: Qwen3-30B-A3B's intermediate, 2048 its hidden; 4224 and 7168: per token past
    # one program's tile
    [(128, 256, 768, 16), (64, 256, 2048, 64), (8, 32, 4224, 16), (8, 32, 7168, 16)],
)
def test_quantize_rows_gives_vllm_s_bytes(experts, rows, d, block_m, group, ue8m0, act):
    gen = torch.Generator().manual_seed(d + block_m)
    width = 2 * d if act else d
    x = (torch.randn(experts * rows, width, generator=gen) * 3).to(torch.bfloat16).cuda()
    x[0, :d] = 0  # an all-zero row: the floors on the scale
    whole = experts * -(-rows // block_m)
    for kind in KINDS:
        counts = _counts(kind, experts, rows, gen)
        blocks = row_blocks.row_blocks(counts, rows, block_m, whole)
        got = quantize.quantize_rows(x, blocks, group, ue8m0, act)
        torch.cuda.synchronize()
        _assert_rows_equal(blocks, experts * rows, got, _vllm_rows(x, group, ue8m0, act))


def _vllm_tensor(x, blocks, rows: int, per_expert: bool, act: bool, static=None):
    """vLLM's activation (`act`), then its per-tensor quantization of the received rows:
    each expert's with their own dynamic scale (its batched experts' eager loop), all with
    one (their captured path, and the LL prepare's input scale), or with `static`."""
    from vllm import _custom_ops as ops

    total = x.shape[0]
    y = x
    if act:
        y = torch.empty(total, x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(y, x)
    ids = blocks.sorted_ids
    listed = torch.unique(ids[ids < total].long())
    # E4M3 written through bytes (index writes into float8 tensors are not every build's)
    q = torch.zeros(total, y.shape[1], dtype=torch.uint8, device=x.device)
    s = torch.full((total, 1), float("nan"), device=x.device)
    owners = listed // rows if per_expert else torch.zeros_like(listed)
    for owner in torch.unique(owners).tolist():
        at = listed[owners == owner]
        gq, gs = ops.scaled_fp8_quant(y[at].contiguous(), static)
        q[at], s[at] = gq.view(torch.uint8), gs.reshape(1, 1)
    return q.view(torch.float8_e4m3fn), s


@pytest.mark.parametrize("act", [True, False], ids=["intermediate", "input"])
@pytest.mark.parametrize("scale", ["per-expert", "one-scale", "static"])
@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"),
    [(128, 256, 768, 16), (128, 256, 2048, 16), (8, 32, 1536, 64)],
)
def test_tensor_quant_gives_vllm_s_bytes(experts, rows, d, block_m, scale, act):
    gen = torch.Generator().manual_seed(d + block_m)
    x = (torch.randn(experts * rows, 2 * d if act else d, generator=gen) * 3).to(torch.bfloat16)
    x = x.cuda()
    static = torch.tensor([0.02], device="cuda") if scale == "static" else None
    per_expert = scale == "per-expert"
    whole = experts * -(-rows // block_m)
    for kind in KINDS:
        counts = _counts(kind, experts, rows, gen)
        blocks = row_blocks.row_blocks(counts, rows, block_m, whole)
        got = quantize.tensor_quant(x, blocks, rows, per_expert, act, static)
        want = _vllm_tensor(x, blocks, rows, per_expert, act, static)
        torch.cuda.synchronize()
        _assert_rows_equal(blocks, experts * rows, got, want, shared_scales=static is None)
        if not act or static is not None:  # no exp on the way to the scale: exactly vLLM's
            ids = blocks.sorted_ids
            at = ids[ids < experts * rows].long()
            assert torch.equal(got[1][at], want[1][at]), kind


@pytest.mark.parametrize("act", [True, False], ids=["intermediate", "input"])
def test_a_nan_counts_as_zero_in_the_dynamic_per_tensor_max(act):
    """vLLM's max skips NaN (fmaxf); an atomic max over the float's bits would take it."""
    experts, rows, d, block_m = 8, 32, 512, 16
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(experts * rows, 2 * d if act else d, generator=gen) * 3).to(torch.bfloat16)
    x = x.cuda()
    x[2 * rows + 1, 5] = float("nan")  # expert 2's second row
    counts = torch.full((experts,), 4, dtype=torch.int32, device="cuda")
    blocks = row_blocks.row_blocks(counts, rows, block_m, experts)
    for per_expert in (True, False):
        got = quantize.tensor_quant(x, blocks, rows, per_expert, act)[1]
        want = _vllm_tensor(x, blocks, rows, per_expert, act)[1]
        at = blocks.sorted_ids[blocks.sorted_ids < experts * rows].long()
        torch.cuda.synchronize()
        assert torch.isfinite(got[at]).all()
        assert torch.allclose(got[at], want[at], rtol=2**-7, atol=0), per_expert


@pytest.mark.parametrize(
    "how", ["group", "token", "tensor-one-scale", "tensor-static", "silu_and_mul"]
)
def test_captured_kernels_follow_each_replay_s_counts_and_rows(how):
    """Qwen3-30B-A3B's shape (128 local experts, 256 rows, intermediate 768) at the bound of
    a 1-token and a 128-token forward, blocks and kernel captured together, replayed with
    new routings and rows (outputs reset to sentinels first) against vLLM's ops."""
    from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

    experts, rows, d, block_m = 128, 256, 768, 16
    ue8m0 = how == "group" and bool(is_deep_gemm_e8m0_used())
    static = torch.tensor([0.02], device="cuda") if how == "tensor-static" else None
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(experts * rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    act_out = torch.empty(experts * rows, d, dtype=torch.bfloat16, device="cuda")
    for tokens in (1, 128):
        nb = max_blocks(tokens * 8, experts, rows, block_m)
        counts = _routed(experts, tokens, 3).cuda()
        outs = []

        def layer(counts=counts, nb=nb, outs=outs):
            blocks = row_blocks.row_blocks(counts, rows, block_m, nb)
            if how == "silu_and_mul":
                activation.silu_and_mul(act_out, x, blocks)
            elif how.startswith("tensor"):
                outs.append(quantize.tensor_quant(x, blocks, rows, False, True, static))
            else:
                group = 128 if how == "group" else None
                outs.append(quantize.quantize_rows(x, blocks, group, ue8m0, True))

        graph = capture_graph(layer)
        for seed in (4, 5):
            counts.copy_(_routed(experts, tokens, seed))
            x.copy_(torch.randn(x.shape, generator=gen).mul_(3).to(torch.bfloat16))
            if how == "silu_and_mul":
                act_out.fill_(float("nan"))
            else:
                q, s = outs[-1]
                q.view(torch.uint8).fill_(0x55)
                s.fill_(float("nan"))
            graph.replay()
            blocks = row_blocks.torch_row_blocks(counts, rows, block_m, nb)
            torch.cuda.synchronize()
            if how == "silu_and_mul":
                want = torch.full_like(act_out, float("nan"))
                _vllm_masked_silu(want.view(experts, rows, d), x.view(experts, rows, 2 * d), counts)
                valid = _received(counts, rows).reshape(-1)
                eps = torch.finfo(torch.bfloat16).eps
                g, w = act_out[valid].float(), want[valid].float()
                assert torch.allclose(g, w, rtol=2 * eps, atol=0), (tokens, seed)
            elif how.startswith("tensor"):
                want = _vllm_tensor(x, blocks, rows, False, True, static)
                _assert_rows_equal(blocks, experts * rows, outs[-1], want, static is None)
            else:
                group = 128 if how == "group" else None
                want = _vllm_rows(x, group, ue8m0, True)
                _assert_rows_equal(blocks, experts * rows, outs[-1], want)
        del graph
