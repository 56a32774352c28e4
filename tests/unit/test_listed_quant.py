"""The FP8 received-rows experts' activation and quantization in one kernel
(vllm_flashinfer_ep/vllm/listed_quant.py), checked in Triton's interpreter against a
torch statement of vLLM's rounding; its GPU test compares it with vLLM's own ops."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.unit.test_block_list import _assert_ok_in_the_interpreter, count_kinds
from vllm_flashinfer_ep.vllm import block_list, listed_quant

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from vllm_flashinfer_ep.vllm import block_list as bl, listed_quant as lq
    cases = json.loads(sys.argv[1])
    _empty = torch.empty

    def filled(*args, **kwargs):
        # the kernel's outputs start as a sentinel, so a write to an unlisted row shows
        t = _empty(*args, **kwargs)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x55)
        else:
            t.fill_(float("nan"))
        return t

    torch.empty = filled  # this child only: what silu_mul_quant allocates

    def rounded(t, dtype):
        # FP32 -> 16 bits as the interpreter rounds: Triton 3.8's interpreter truncates to
        # bfloat16 (compiled kernels round to nearest even) and rounds float16 to nearest.
        if dtype == torch.bfloat16:
            t = (t.contiguous().view(torch.int32) & -65536).view(torch.float32)
        return t.to(dtype).float()

    import triton
    import triton.language as tl

    @triton.jit
    def _to_e4m3(src, dst, n, BLOCK: tl.constexpr):
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + at, mask=at < n)
        tl.store(dst + at, v.to(dst.dtype.element_ty), mask=at < n)

    def e4m3(v):
        # FP32 -> E4M3 through the interpreter's own conversion, as the kernel's q goes:
        # Triton 3.8's interpreter rounds ties away from zero and mishandles some carries
        # and subnormals, where compiled kernels round to nearest even (the GPU test's
        # case, against vLLM's ops). The comparison is of the kernel's arithmetic.
        v = v.contiguous()
        out = _empty(v.shape, dtype=torch.float8_e4m3fn)
        _to_e4m3[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
        return out.float()

    for experts, rows, d, bm, dtype, counts, nb, group, ue8m0, act in cases:
        dtype = getattr(torch, dtype)
        counts = torch.tensor(counts, dtype=torch.int32)
        total = experts * rows
        gen = torch.Generator().manual_seed(len(counts) * d + nb)
        x = (torch.randn(total, 2 * d if act else d, generator=gen) * 3).to(dtype)
        x[0, :d] = 0  # a row (or group) of zeros: the scale floors
        blocks = bl.torch_expert_blocks(counts, rows, bm, nb)
        if act:  # GEMM1's output: SiLU(gate) x up, then quantized
            q, s = lq.silu_mul_quant(x, blocks, group, ue8m0)
            g, u = x[:, :d].float(), x[:, d:].float()
            y = rounded(rounded(g / (1 + torch.exp(-g)), dtype) * u, dtype)
        else:  # the received rows themselves
            q, s = lq.quantize_rows(x, blocks, group, ue8m0)
            y = x.float()
        if group is None:
            amax = y.abs().amax(dim=1, keepdim=True)
            scale = torch.maximum(amax / 448.0, torch.tensor(1.0 / (448.0 * 512.0)))
            wide = scale
        else:
            amax = y.view(total, d // group, group).abs().amax(dim=2).clamp(min=1e-10)
            scale = amax / 448.0
            if ue8m0:
                # vLLM's CUDA kernel floors the scale at 1e-10 before rounding it up
                scale = torch.exp2(torch.ceil(torch.log2(scale.clamp(min=1e-10))))
            wide = scale.repeat_interleave(group, dim=1)
        want_q = e4m3((y / wide).clamp(-448.0, 448.0))
        ids = blocks[0]
        listed = torch.zeros(total, dtype=torch.bool)
        listed[ids[ids < total].long()] = True
        if not (q.view(torch.uint8)[~listed] == 0x55).all() or not s[~listed].isnan().all():
            print("WROTE AN UNLISTED ROW", experts, rows, d, bm, group, counts.tolist(), nb, act)
            sys.exit(1)
        got_s, ref_s = s[listed], scale[listed]
        # numpy's and torch's exp may differ in the last bit, which can move a 16-bit
        # rounding, an amax and so a scale: scales within 2 units of bfloat16, q bytes
        # equal almost everywhere (all of them in the runs so far) and near where not
        moved = int((got_s != ref_s).sum())
        if not torch.allclose(got_s, ref_s, rtol=2 ** -7, atol=0) or moved > max(1, got_s.numel() // 1000):
            print("SCALES", experts, rows, d, bm, group, ue8m0, (got_s - ref_s).abs().max().item())
            sys.exit(1)
        got_q, ref_q = q[listed].float(), want_q[listed]
        same = (got_q == ref_q).float().mean().item() if got_q.numel() else 1.0
        near = torch.allclose(got_q, ref_q, rtol=2 ** -3, atol=2 ** -9)
        if same < 0.999 or not near:
            print("Q", experts, rows, d, bm, dtype, group, ue8m0, counts.tolist(), nb, same)
            sys.exit(1)
    print("OK", len(cases))
    """
)

# (experts, rows per expert, d, BLOCK_M, dtype); d a multiple of 128 for block groups,
# 768 (Qwen3-30B-A3B) held whole per token with the block's rows over programs, 200 with
# masked columns per token; 4224 (below) past one program's tile.
SHAPES = [
    (4, 16, 256, 16, "bfloat16"),
    (3, 64, 768, 64, "bfloat16"),
    (5, 32, 128, 16, "float16"),
]


def _cases() -> list:
    gen = torch.Generator().manual_seed(2)
    cases = []
    for experts, rows, d, bm, dtype in SHAPES:
        whole = experts * -(-rows // bm)
        for counts in count_kinds(experts, rows, gen):
            for nb in (1, whole):
                for group, ue8m0 in ((128, False), (128, True), (None, False)):
                    case = [experts, rows, d, bm, dtype, counts.tolist(), nb, group, ue8m0]
                    cases += [case + [True], case + [False]]  # intermediate, received rows
    for act in (True, False):
        cases.append([3, 8, 200, 16, "bfloat16", [8, 0, 5], 3, None, False, act])  # masked columns
        # per token past one program's TILE: one row per program, two passes, masked columns
        cases.append([2, 16, 4224, 16, "bfloat16", [16, 3], 2, None, False, act])
        # a row that fills the tile whole: one row per program, one pass, masked columns
        cases.append([2, 16, 3072, 16, "bfloat16", [5, 16], 2, None, False, act])
    return cases


def test_listed_rows_get_vllm_s_activation_and_quantization():
    """Groups of 128 (with and without power-of-two scales) and per token: every listed
    row gets SiLU(gate) x up rounded to 16 bits, then vLLM's dynamic FP8 quantization of
    those values (the floors on an all-zero row included); no unlisted row is written
    (GEMM2 never reads one, and writing them would cost what the block list saves)."""
    _assert_ok_in_the_interpreter(CHILD, [c for c in _cases() if c[-1]])


def test_received_rows_get_vllm_s_quantization():
    """`quantize_rows`, the same kernel without the activation: every listed received row
    gets vLLM's dynamic FP8 quantization of its own 16-bit values; no unlisted row is
    written (GEMM1 reads listed rows only)."""
    _assert_ok_in_the_interpreter(CHILD, [c for c in _cases() if not c[-1]])


def test_shapes_it_does_not_compute_are_refused():
    blocks = block_list.torch_expert_blocks(torch.tensor([2], dtype=torch.int32), 4, 16, 1)
    with pytest.raises(ValueError, match="16-bit"):
        listed_quant.silu_mul_quant(torch.zeros(4, 256), blocks, 128)
    with pytest.raises(ValueError, match="multiple of the group"):
        listed_quant.silu_mul_quant(torch.zeros(4, 400, dtype=torch.bfloat16), blocks, 128)
    assert listed_quant.unlisted_reason(torch.zeros(4, 400, dtype=torch.bfloat16), None) is None
    with pytest.raises(ValueError, match="quantize_rows: d = 200 not a multiple"):
        listed_quant.quantize_rows(torch.zeros(4, 200, dtype=torch.bfloat16), blocks, 128)
    odd = torch.zeros(4, 129, dtype=torch.bfloat16)  # an odd width is a row, not gate | up
    assert listed_quant.unlisted_reason(odd, None, act=False) is None
    assert listed_quant.unlisted_reason(odd, None) is not None


def test_the_input_kernel_is_taken_only_when_on_on_an_fp8_gpu(monkeypatch):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(listed_quant, "INPUT_ENABLED", True)
    assert not listed_quant.takes_input(x, 128)  # CPU tensors: the split path
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not listed_quant.takes_input(x, 128)  # no E4M3 conversion: the split path
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert listed_quant.takes_input(x, 128) and listed_quant.takes_input(x, None)
    assert not listed_quant.takes_input(x.float(), 128)
    assert not listed_quant.takes_input(torch.zeros(4, 200, dtype=torch.bfloat16), 128)
    monkeypatch.setattr(listed_quant, "INPUT_ENABLED", False)
    assert not listed_quant.takes_input(x, 128)  # off: the split path


def test_it_is_taken_only_when_on_for_plain_silu_on_an_fp8_gpu(monkeypatch):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig

    experts = SimpleNamespace(activation_config=ApplyMoEActivationConfig())
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(listed_quant, "ENABLED", True)
    assert not listed_quant.takes(experts, "silu", x, 128)  # CPU tensors: vLLM's ops
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not listed_quant.takes(experts, "silu", x, 128)  # no E4M3 conversion: vLLM's ops
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert listed_quant.takes(experts, "silu", x, 128)
    assert not listed_quant.takes(experts, "gelu", x, 128)
    assert not listed_quant.takes(experts, "silu", x.float(), 128)
    monkeypatch.setattr(listed_quant, "ENABLED", False)
    assert not listed_quant.takes(experts, "silu", x, 128)


# The dynamic per-tensor kernels (`tensor_quant`) against a torch statement of vLLM's
# batched experts' per-tensor quantization of the listed rows: the scale max |y| / 448
# floored at FP32's smallest normal, per expert (eager) or one over every listed row, and
# q = y x (1 / scale) clamped, as vLLM's static kernel multiplies by the inverted scale.
TENSOR_CHILD = CHILD[: CHILD.index("\nfor experts, rows, d, bm, dtype, counts")] + textwrap.dedent(
    """
    tiny = torch.finfo(torch.float32).tiny
    for experts, rows, d, bm, dtype, counts, nb, per_expert, act, poison in cases:
        dtype = getattr(torch, dtype)
        counts = torch.tensor(counts, dtype=torch.int32)
        total = experts * rows
        gen = torch.Generator().manual_seed(len(counts) * d + nb)
        x = (torch.randn(total, 2 * d if act else d, generator=gen) * 3).to(dtype)
        blocks = bl.torch_expert_blocks(counts, rows, bm, nb)
        ids = blocks[0]
        listed = torch.zeros(total, dtype=torch.bool)
        listed[ids[ids < total].long()] = True
        if poison == "nan" and listed.any():  # counts as zero in the max
            x[int(listed.nonzero()[0]), 1] = float("nan")
        if poison == "zeros":  # an expert of all-zero rows (the first): its scale floors
            x[:rows] = 0
        if poison == "unlisted":  # a huge value in a listed expert's unlisted row
            x[int((~listed).nonzero()[-1]), :] = 3e38 if dtype == torch.bfloat16 else 6e4
        q, s = lq.tensor_quant(x, blocks, rows, per_expert, act)
        if act:
            g, u = x[:, :d].float(), x[:, d:].float()
            y = rounded(rounded(g / (1 + torch.exp(-g)), dtype) * u, dtype)
        else:
            y = x.float()
        row_max = torch.where(listed, y.abs().nan_to_num(nan=0.0).amax(dim=1), 0.0)
        if per_expert:
            amax = row_max.view(experts, rows).amax(dim=1).repeat_interleave(rows)
        else:
            amax = row_max.amax().expand(total)
        scale = torch.clamp_min(amax / torch.full_like(amax, 448.0), tiny)[:, None]
        inverted = torch.ones_like(scale) / scale
        want_q = e4m3((y * inverted).clamp(-448.0, 448.0))
        if not (q.view(torch.uint8)[~listed] == 0x55).all() or not s[~listed].isnan().all():
            print("WROTE AN UNLISTED ROW", experts, rows, d, bm, counts.tolist(), nb, act)
            sys.exit(1)
        got_s, ref_s = s[listed], scale[listed]
        if not torch.allclose(got_s, ref_s, rtol=2 ** -7, atol=0):
            print("SCALES", experts, rows, d, bm, per_expert, act, poison, (got_s - ref_s).abs().max().item())
            sys.exit(1)
        if not act and not torch.equal(got_s, ref_s):  # no exp on the way: exact
            print("SCALES NOT EXACT", experts, rows, d, bm, per_expert, poison)
            sys.exit(1)
        got_q, ref_q = q[listed].float(), want_q[listed]
        finite = ~y[listed].isnan()
        same = (got_q[finite] == ref_q[finite]).float().mean().item() if finite.any() else 1.0
        if same < 0.999:
            print("Q", experts, rows, d, bm, dtype, per_expert, act, poison, counts.tolist(), nb, same)
            sys.exit(1)
    print("OK", len(cases))
    """
)


def _tensor_cases() -> list:
    gen = torch.Generator().manual_seed(3)
    cases = []
    for experts, rows, d, bm, dtype in SHAPES:
        whole = experts * -(-rows // bm)
        for counts in count_kinds(experts, rows, gen):
            for nb in (1, whole):
                for per_expert in (True, False):
                    for act in (True, False):
                        case = [experts, rows, d, bm, dtype, counts.tolist(), nb, per_expert, act]
                        cases.append(case + [None])
    for act in (True, False):
        for per_expert in (True, False):
            for poison in ("nan", "unlisted", "zeros"):
                # the last row (expert 2's, 5 of 8 filled) is unlisted
                case = [3, 8, 200, 16, "bfloat16", [8, 0, 5], 3, per_expert, act, poison]
                cases.append(case)
        cases.append([2, 16, 4224, 16, "bfloat16", [16, 3], 2, False, act, None])  # wide rows
    return cases


def test_dynamic_per_tensor_rows_get_vllm_s_scale_and_quantization():
    """`tensor_quant`, input and intermediate: each listed row gets its expert's scale (or
    the one over every listed row) and vLLM's static quantization with it; an expert of
    zeros gets the floor, an unlisted row never reaches the max, and no unlisted row is
    written. (A NaN counts as zero in the max: the interpreter's max and atomic skip NaN
    either way, so only the GPU test can show it.)"""
    _assert_ok_in_the_interpreter(TENSOR_CHILD, _tensor_cases())


def test_the_per_tensor_kernels_are_taken_only_when_on_on_an_fp8_gpu(monkeypatch):
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig

    experts = SimpleNamespace(activation_config=ApplyMoEActivationConfig())
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    monkeypatch.setattr(listed_quant, "TENSOR_ENABLED", True)
    assert not listed_quant.takes_tensor(x, False)  # CPU tensors: the gathered path
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not listed_quant.takes_tensor(x, False)  # no E4M3 conversion
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert listed_quant.takes_tensor(x, False)
    assert listed_quant.takes_tensor(x, True, experts, "silu")
    assert not listed_quant.takes_tensor(x, True, experts, "gelu")
    assert not listed_quant.takes_tensor(x.float(), False)
    assert not listed_quant.takes_tensor(
        torch.zeros(4, 255, dtype=torch.bfloat16), True, experts, "silu"
    )
    monkeypatch.setattr(listed_quant, "TENSOR_ENABLED", False)
    assert not listed_quant.takes_tensor(x, False)  # off: the gathered path
