"""The FP8 received-rows experts' activation and quantization in one kernel
(vllm/listed_quant.py) on the GPU, against vLLM's own ops.

vLLM's path for the intermediate is its SiLU-and-mul, then its dynamic FP8 quantization
(`per_token_group_quant_fp8` for block layers, with and without power-of-two scales;
`scaled_fp8_quant` per token for per-channel layers). On every received row the kernel
must write the bytes vLLM's ops write (up to where Triton's exp and CUDA's expf differ in
the last bit), for the edge counts and inside a captured graph replayed with new counts.
Prints the captured time per layer against the path it replaces (the listed activation,
then the gather, vLLM's quantization and the scatters of compact_experts_fp8).
Command (docs/contributing/gpu_runs.md): python3 -m pytest tests/kernels/test_listed_quant_gpu.py -rs -s -q
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_block_list_gpu import _counts, _routed, _us_per_layer
from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.vllm import block_list, compact_experts_fp8, listed_quant
from vllm_flashinfer_ep.vllm.compact_experts import max_blocks

pytestmark = pytest.mark.gpu

SCHEMES = [(128, False), (128, True), (None, False)]  # (group, ue8m0); None: per token


def _vllm(x: torch.Tensor, group: int | None, ue8m0: bool):
    """vLLM's activation, then its quantization, over every row of x [rows, 2d]."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
    )

    y = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    torch.ops._C.silu_and_mul(y, x)
    if group is None:
        return ops.scaled_fp8_quant(y, use_per_token_if_dynamic=True)
    return per_token_group_quant_fp8(y, group, use_ue8m0=ue8m0)


def _assert_listed_rows_equal(blocks, rows, got, want, shared_scales: bool = False) -> None:
    """`shared_scales`: a scale spans rows (per tensor), so one last-bit difference in the
    activation at a maximum moves every row's scale by an ulp: scales compared within
    2 units of bfloat16 only, bytes as for per-row scales."""
    ids = blocks[0]
    listed = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    listed[ids[ids < rows].long()] = True
    (gq, gs), (wq, ws) = got, want
    gs, ws = gs[listed], ws[listed]
    assert torch.allclose(gs, ws, rtol=2**-7, atol=0), float((gs - ws).abs().max())
    assert shared_scales or int((gs != ws).sum()) <= max(1, 1e-3 * gs.numel())
    gq, wq = gq[listed].float(), wq[listed].float()
    assert torch.allclose(gq, wq, rtol=2**-3, atol=2**-9), float((gq - wq).abs().max())
    assert int((gq != wq).sum()) <= 1e-3 * max(1, gq.numel())


@pytest.mark.parametrize(("group", "ue8m0"), SCHEMES)
@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"),
    # 768: Qwen3-30B-A3B's intermediate; 4224: per token past one program's tile
    [(128, 256, 768, 16), (64, 256, 512, 64), (8, 32, 1536, 16), (4, 32, 4224, 16)],
)
def test_listed_rows_get_vllm_s_bytes(experts, rows, d, block_m, group, ue8m0):
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(experts * rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    x[0, :d] = 0  # an all-zero row: the floors on the scale
    whole = experts * -(-rows // block_m)
    for kind in ("empty", "full", "one row", "random"):
        counts = _counts(kind, experts, rows, gen)
        blocks = block_list.fused_expert_blocks(counts, rows, block_m, whole)
        got = listed_quant.silu_mul_quant(x, blocks, group, ue8m0)
        want = _vllm(x, group, ue8m0)
        torch.cuda.synchronize()
        _assert_listed_rows_equal(blocks, experts * rows, got, want)


def _layer(name, x, counts, rows, block_m, nb, group, ue8m0):
    """One MoE layer's intermediate: the block list ("list"), then the fused kernel
    ("fused"), or the listed activation and the gather / quantize / scatter ("split",
    whose vLLM quantization makes the same E8M0 choice)."""
    total, d = x.shape[0], x.shape[1] // 2
    blocks = block_list.fused_expert_blocks(counts, rows, block_m, nb)
    if name == "fused":
        return listed_quant.silu_mul_quant(x, blocks, group, ue8m0)
    if name == "split":
        out = torch.empty(total, d, dtype=x.dtype, device=x.device)
        block_list.listed_silu_and_mul(out, x, blocks)
        return compact_experts_fp8.quantize_listed_rows(out, blocks[0], _split_qc(group))
    return None


def _split_qc(group: int | None):
    """The quant config fields the split path's vLLM quantization reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        quant_dtype=torch.float8_e4m3fn,
        per_act_token_quant=group is None,
        block_shape=None if group is None else [group, group],
    )


def _replays_match_vllm(graph, written, x, counts, gen, shape, want, shared_scales=False) -> None:
    """Replay a captured graph with new routings and rows, its outputs reset to sentinels
    first, against vLLM's ops: `written()` is the (q, s) its last layer writes, `want(x)`
    vLLM's over every row, `shape` (experts, tokens, rows, block_m, blocks)."""
    experts, tokens, rows, block_m, nb = shape
    for seed in (4, 5):
        counts.copy_(_routed(experts, tokens, seed))
        x.copy_(torch.randn(x.shape, generator=gen).mul_(3).to(torch.bfloat16))
        q, s = written()
        q.view(torch.uint8).fill_(0x55)
        s.fill_(float("nan"))
        graph.replay()
        blocks = block_list.torch_expert_blocks(counts, rows, block_m, nb)
        torch.cuda.synchronize()
        _assert_listed_rows_equal(blocks, experts * rows, (q, s), want(x), shared_scales)


@pytest.mark.parametrize("group", [128, None])
def test_a_captured_kernel_follows_each_replay_s_counts_and_is_timed(group):
    """Qwen3-30B-A3B's shape (128 local experts, 256 rows, intermediate 768) at the bound
    of a 1-token and a 128-token forward: 48 layers captured, replayed with new routings,
    against vLLM's ops (new inputs and sentinel outputs before each replay); timed against
    the split path it replaces, the block list alone too."""
    experts, rows, d, block_m = 128, 256, 768, 16
    ue8m0 = group is not None and compact_experts_fp8._e8m0_scales()  # as vLLM chooses here
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(experts * rows, 2 * d, generator=gen) * 3).to(torch.bfloat16).cuda()
    for tokens in (1, 128):
        nb = max_blocks(tokens * 8, experts, rows, block_m)
        counts = _routed(experts, tokens, 3).cuda()
        times = {}
        for name in ("list", "fused", "split"):
            outs = []
            args = (name, x, counts, rows, block_m, nb, group, ue8m0)
            graph = capture_graph(lambda a=args, o=outs: o.append([_layer(*a) for _ in range(48)]))
            if name == "fused":
                _replays_match_vllm(
                    graph,
                    lambda o=outs: o[-1][-1],
                    x,
                    counts,
                    gen,
                    (experts, tokens, rows, block_m, nb),
                    lambda x: _vllm(x, group, ue8m0),
                )
            times[name] = _us_per_layer(graph)
            del graph
        print(
            f"LISTED_QUANT {'group 128' if group else 'per token'} tokens={tokens} blocks={nb}: "
            f"captured us per layer past the block list: fused {times['fused'] - times['list']:.2f}, "
            f"listed activation + gather/quantize/scatter {times['split'] - times['list']:.2f}"
        )


def _vllm_input(x: torch.Tensor, group: int | None, ue8m0: bool):
    """vLLM's quantization of the received rows x [rows, d] (what the LL prepare runs)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        per_token_group_quant_fp8,
    )

    if group is None:
        return ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    return per_token_group_quant_fp8(x, group, use_ue8m0=ue8m0)


@pytest.mark.parametrize(("group", "ue8m0"), SCHEMES)
@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"),
    # 2048: Qwen3-30B-A3B's hidden size; 7168: DeepSeek-V3's, per token past one tile
    [(128, 256, 2048, 16), (64, 256, 2048, 64), (8, 32, 7168, 16)],
)
def test_received_rows_get_vllm_s_bytes(experts, rows, d, block_m, group, ue8m0):
    """`quantize_rows` (listed_quant.INPUT_ENABLED): the received rows' own quantization
    over the block list, against vLLM's ops on every row, at the edge counts."""
    gen = torch.Generator().manual_seed(d + block_m)
    x = (torch.randn(experts * rows, d, generator=gen) * 3).to(torch.bfloat16).cuda()
    x[0] = 0  # an all-zero row: the floors on the scale
    whole = experts * -(-rows // block_m)
    for kind in ("empty", "full", "one row", "random"):
        counts = _counts(kind, experts, rows, gen)
        blocks = block_list.fused_expert_blocks(counts, rows, block_m, whole)
        got = listed_quant.quantize_rows(x, blocks, group, ue8m0)
        torch.cuda.synchronize()
        _assert_listed_rows_equal(blocks, experts * rows, got, _vllm_input(x, group, ue8m0))


@pytest.mark.parametrize("group", [128, None])
def test_captured_received_rows_quantization_is_timed(group):
    """Qwen3-30B-A3B's shape (128 local experts, 256 rows, hidden 2048) at the bound of a
    1-token and a 128-token forward: 48 layers captured and replayed with new routings and
    rows, against vLLM's ops; timed against the gather / quantize / scatter it replaces."""
    experts, rows, d, block_m = 128, 256, 2048, 16
    ue8m0 = group is not None and compact_experts_fp8._e8m0_scales()
    qc = _split_qc(group)
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(experts * rows, d, generator=gen) * 3).to(torch.bfloat16).cuda()
    for tokens in (1, 128):
        nb = max_blocks(tokens * 8, experts, rows, block_m)
        counts = _routed(experts, tokens, 3).cuda()
        times = {}
        for name in ("list", "fused", "split"):
            outs = []

            def layer(name=name, outs=outs, counts=counts, nb=nb):
                blocks = block_list.fused_expert_blocks(counts, rows, block_m, nb)
                if name == "fused":
                    outs.append(listed_quant.quantize_rows(x, blocks, group, ue8m0))
                elif name == "split":
                    outs.append(compact_experts_fp8.quantize_listed_rows(x, blocks[0], qc))

            graph = capture_graph(lambda: [layer() for _ in range(48)])
            if name == "fused":
                _replays_match_vllm(
                    graph,
                    lambda o=outs: o[-1],
                    x,
                    counts,
                    gen,
                    (experts, tokens, rows, block_m, nb),
                    lambda x: _vllm_input(x, group, ue8m0),
                )
            times[name] = _us_per_layer(graph)
            del graph
        print(
            f"LISTED_INPUT_QUANT {'group 128' if group else 'per token'} tokens={tokens} "
            f"blocks={nb}: captured us per layer past the block list: fused "
            f"{times['fused'] - times['list']:.2f}, gather/quantize/scatter "
            f"{times['split'] - times['list']:.2f}"
        )


def _vllm_tensor(x: torch.Tensor, blocks, rows: int, per_expert: bool, act: bool):
    """vLLM's activation (`act`), then its dynamic per-tensor quantization of the listed
    rows: each expert's with their own scale (its batched experts' eager loop) or all of
    them with one (their captured path, and the LL prepare's input scale)."""
    from vllm import _custom_ops as ops

    total = x.shape[0]
    y = x
    if act:
        y = torch.empty(total, x.shape[1] // 2, dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(y, x)
    ids = blocks[0]
    listed = torch.unique(ids[ids < total].long())
    # E4M3 written through bytes (index writes into float8 tensors are not every build's)
    q = torch.zeros(total, y.shape[1], dtype=torch.uint8, device=x.device)
    s = torch.full((total, 1), float("nan"), device=x.device)
    owners = listed // rows if per_expert else torch.zeros_like(listed)
    for owner in torch.unique(owners).tolist():
        at = listed[owners == owner]
        gq, gs = ops.scaled_fp8_quant(y[at].contiguous())
        q[at], s[at] = gq.view(torch.uint8), gs
    return q.view(torch.float8_e4m3fn), s


@pytest.mark.parametrize("act", [True, False], ids=["intermediate", "input"])
@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert", "one-scale"])
@pytest.mark.parametrize(
    ("experts", "rows", "d", "block_m"),
    # Qwen3-30B-A3B: intermediate 768, hidden 2048; a few experts at a wider row
    [(128, 256, 768, 16), (128, 256, 2048, 16), (8, 32, 1536, 64)],
)
def test_dynamic_per_tensor_rows_get_vllm_s_bytes(experts, rows, d, block_m, per_expert, act):
    """`tensor_quant` (listed_quant.TENSOR_ENABLED): the max over the listed rows, then
    the quantization, against vLLM's SiLU-and-mul and dynamic per-tensor quantization of
    the same rows, at the edge counts."""
    gen = torch.Generator().manual_seed(d + block_m)
    x = (torch.randn(experts * rows, 2 * d if act else d, generator=gen) * 3).to(torch.bfloat16)
    x = x.cuda()
    whole = experts * -(-rows // block_m)
    for kind in ("empty", "full", "one row", "random"):
        counts = _counts(kind, experts, rows, gen)
        blocks = block_list.fused_expert_blocks(counts, rows, block_m, whole)
        got = listed_quant.tensor_quant(x, blocks, rows, per_expert, act)
        want = _vllm_tensor(x, blocks, rows, per_expert, act)
        torch.cuda.synchronize()
        _assert_listed_rows_equal(blocks, experts * rows, got, want, shared_scales=True)
        if not act:  # no exp on the way: vLLM's scales exactly
            ids = blocks[0]
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
    blocks = block_list.fused_expert_blocks(counts, rows, block_m, experts)
    for per_expert in (True, False):
        got = listed_quant.tensor_quant(x, blocks, rows, per_expert, act)[1]
        want = _vllm_tensor(x, blocks, rows, per_expert, act)[1]
        at = blocks[0][blocks[0] < experts * rows].long()
        torch.cuda.synchronize()
        assert torch.isfinite(got[at]).all()
        assert torch.allclose(got[at], want[at], rtol=2**-7, atol=0), per_expert


@pytest.mark.parametrize("act", [True, False], ids=["intermediate", "input"])
def test_captured_dynamic_per_tensor_quantization_is_timed(act):
    """Qwen3-30B-A3B's shape (128 local experts, 256 rows; intermediate 768, hidden 2048)
    at the bound of a 1-token and a 128-token forward: 48 layers captured (one scale over
    the listed rows, as in a graph) and replayed with new routings and rows, against
    vLLM's ops; timed against the path it replaces (the listed activation, the scale over
    the gathered rows, vLLM's quantization, the scatters)."""
    from types import SimpleNamespace

    experts, rows, block_m = 128, 256, 16
    d = 768 if act else 2048
    qc = SimpleNamespace(quant_dtype=torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(13)
    x = (torch.randn(experts * rows, 2 * d if act else d, generator=gen) * 3).to(torch.bfloat16)
    x = x.cuda()
    y = torch.empty(experts * rows, d, dtype=torch.bfloat16, device="cuda")
    for tokens in (1, 128):
        nb = max_blocks(tokens * 8, experts, rows, block_m)
        counts = _routed(experts, tokens, 3).cuda()
        times = {}
        for name in ("list", "kernels", "split"):
            outs = []

            def layer(name=name, outs=outs, counts=counts, nb=nb):
                blocks = block_list.fused_expert_blocks(counts, rows, block_m, nb)
                if name == "kernels":
                    outs.append(listed_quant.tensor_quant(x, blocks, rows, False, act))
                elif name == "split":
                    src = x
                    if act:
                        block_list.listed_silu_and_mul(y, x, blocks)
                        src = y
                    outs.append(
                        compact_experts_fp8.quantize_listed_rows_per_tensor(
                            src, blocks[0], rows, qc, None, one_scale=True
                        )
                    )

            graph = capture_graph(lambda: [layer() for _ in range(48)])
            if name == "kernels":

                def want(x, counts=counts, nb=nb):
                    blocks = block_list.torch_expert_blocks(counts, rows, block_m, nb)
                    return _vllm_tensor(x, blocks, rows, False, act)

                _replays_match_vllm(
                    graph,
                    lambda o=outs: o[-1],
                    x,
                    counts,
                    gen,
                    (experts, tokens, rows, block_m, nb),
                    want,
                    shared_scales=True,
                )
            times[name] = _us_per_layer(graph)
            del graph
        print(
            f"LISTED_TENSOR_QUANT {'intermediate' if act else 'input'} tokens={tokens} "
            f"blocks={nb}: captured us per layer past the block list: two launches "
            f"{times['kernels'] - times['list']:.2f}, the path it replaces "
            f"{times['split'] - times['list']:.2f}"
        )
