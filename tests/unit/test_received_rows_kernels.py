"""The received rows' activation and FP8 quantization kernels (experts/kernels/quantize.py,
activation.py) against a torch statement of vLLM 0.33.0's rounding.

The kernels run in Triton's interpreter (tests/unit/interpreter.py), all cases in one
child. Their outputs start as a sentinel, so a write to a row the block list does not
name shows: GEMM2 never reads one, and writing them would cost what the list saves. Two
interpreter quirks are stated in the reference instead of loosening it: Triton 3.8's
interpreter truncates FP32 to bfloat16 (compiled kernels round to nearest even) and
converts to E4M3 its own way (ties away from zero, some carries and subnormals off), so
the reference converts through the interpreter too. The GPU tests (tests/kernels/)
compare the compiled kernels with vLLM's own ops.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests.unit.interpreter import count_kinds, failures, received_mask, run_cases  # noqa: E402
from vllm_flashinfer_ep import fp8_numerics as num  # noqa: E402
from vllm_flashinfer_ep.experts.kernels import activation, quantize  # noqa: E402
from vllm_flashinfer_ep.experts.kernels.row_blocks import torch_row_blocks  # noqa: E402

FP8_SENTINEL = 0x55  # a finite E4M3 byte no quantization of these inputs writes by chance

# (experts, rows per expert, d, BLOCK_M, dtype); d a multiple of 128 for block groups,
# 768 (Qwen3-30B-A3B) held whole per token with the block's rows over programs.
SHAPES = [
    (4, 16, 256, 16, "bfloat16"),
    (3, 64, 768, 64, "bfloat16"),
    (5, 32, 128, 16, "float16"),
]
# Per token: 200 with masked columns; 4224 past one program's tile (one row per program,
# two passes); 3072 filling the tile whole (one row per program, one pass).
TOKEN_TILINGS = [
    (3, 8, 200, 16, "bfloat16", [8, 0, 5], 3),
    (2, 16, 4224, 16, "bfloat16", [16, 3], 2),
    (2, 16, 3072, 16, "bfloat16", [5, 16], 2),
]
# SiLU-and-mul: widths whose tile is wider than d (48, 96, 200: masked columns) and one
# with several tiles (768 at BLOCK_M 64: 64-column tiles).
ACT_SHAPES = [
    (8, 16, 48, 16, "bfloat16"),
    (5, 32, 96, 16, "float16"),
    (4, 64, 768, 64, "bfloat16"),
    (3, 8, 200, 32, "bfloat16"),
]
STATIC_SCALE = 0.01  # below max |y| / 448 of these inputs: the largest values clamp


def _case(kind, experts, rows, d, bm, dtype, counts, nb, **kw) -> dict:
    return dict(
        kind=kind, experts=experts, rows=rows, d=d, bm=bm, dtype=dtype, counts=counts, nb=nb, **kw
    )


def _cases() -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    cases = []
    for experts, rows, d, bm, dtype in SHAPES:
        whole = experts * -(-rows // bm)
        for counts in count_kinds(experts, rows, gen):
            for nb in (1, whole):  # a list shorter than the blocks in use, and the buffer's
                shape = (experts, rows, d, bm, dtype, counts, nb)
                for act in (True, False):
                    tag = "-act" if act else ""
                    for ue8m0 in (False, True):
                        cases.append(
                            _case("group" + tag, *shape, group=num.GROUP, ue8m0=ue8m0, act=act)
                        )
                    cases.append(_case("token" + tag, *shape, group=None, ue8m0=False, act=act))
                    for per_expert in (True, False):
                        cases.append(_case("tensor", *shape, per_expert=per_expert, act=act))
                    # per_expert is moot under a static scale: both values run
                    cases.append(_case("static", *shape, per_expert=nb == 1, act=act))
    for shape in TOKEN_TILINGS:
        for act in (True, False):
            tag = "-act" if act else ""
            cases.append(_case("token" + tag, *shape, group=None, ue8m0=False, act=act))
    for act in (True, False):
        # the last row (expert 2's, 5 of 8 filled) is not received
        shape = (3, 8, 200, 16, "bfloat16", [8, 0, 5], 3)
        for per_expert in (True, False):
            for poison in ("nan", "unlisted", "zeros"):
                cases.append(_case("tensor", *shape, per_expert=per_expert, act=act, poison=poison))
        cases.append(_case("static", *shape, per_expert=False, act=act, poison="unlisted"))
        cases.append(_case("static", *shape, per_expert=True, act=act, zero_dim=True))
        cases.append(_case("tensor", *TOKEN_TILINGS[1], per_expert=False, act=act))  # wide
    gen = torch.Generator().manual_seed(1)
    for experts, rows, d, bm, dtype in ACT_SHAPES:
        whole = experts * -(-rows // bm)
        for counts in count_kinds(experts, rows, gen):
            for nb in (1, 3, whole):
                cases.append(_case("silu", experts, rows, d, bm, dtype, counts, nb, act=True))
                cases.append(_case("swiglu", experts, rows, d, bm, dtype, counts, nb, act=True))
    return cases


CASES = _cases()
KINDS = ["group", "group-act", "token", "token-act", "tensor", "static", "silu", "swiglu"]
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # vLLM 0.33.0's swigluoai


# ------------------------------------------------------------------ the child's side
@contextlib.contextmanager
def sentinel_outputs():
    """What the kernels allocate starts as a sentinel (NaN, or the E4M3 sentinel byte)."""
    empty = torch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype == num.FP8:
            t.view(torch.uint8).fill_(FP8_SENTINEL)
        else:
            t.fill_(float("nan"))
        return t

    torch.empty = filled
    try:
        yield
    finally:
        torch.empty = empty


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP32 -> 16 bits as the interpreter rounds (bfloat16 truncated), back in FP32."""
    if dtype == torch.bfloat16:
        t = (t.contiguous().view(torch.int32) & -65536).view(torch.float32)
    return t.to(dtype).float()


@triton.jit
def _to_e4m3_kernel(src, dst, n, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src + at, mask=at < n)
    tl.store(dst + at, v.to(dst.dtype.element_ty), mask=at < n)


def e4m3(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 through the interpreter's own conversion (the kernel's q goes so), in
    FP32: the comparison is of the kernel's arithmetic, not of Triton's conversion."""
    v = v.contiguous()
    out = torch.empty(v.shape, dtype=num.FP8)
    _to_e4m3_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    return out.float()


def over_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 as a true division, as vLLM's CUDA kernels divide."""
    return amax / torch.full_like(amax, num.FP8_MAX)


def _problem(case: dict, seed: int):
    dtype = getattr(torch, case["dtype"])
    experts, rows, d = case["experts"], case["rows"], case["d"]
    total = experts * rows
    counts = torch.tensor(case["counts"], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + len(case["counts"]) * d + case["nb"])
    x = (torch.randn(total, 2 * d if case.get("act") else d, generator=gen) * 3).to(dtype)
    blocks = torch_row_blocks(counts, rows, case["bm"], case["nb"])
    return x, blocks, received_mask(blocks.sorted_ids, total), dtype


def _values(x: torch.Tensor, d: int, act: bool, dtype: torch.dtype) -> torch.Tensor:
    """What the kernel quantizes, FP32: SiLU(gate) rounded to 16 bits, times up, rounded
    (vLLM's activation), or the rows themselves."""
    if not act:
        return x.float()
    g, u = x[:, :d].float(), x[:, d:].float()
    return rounded(rounded(g / (1 + torch.exp(-g)), dtype) * u, dtype)


def _unlisted_written(q, s, listed) -> bool:
    return not (q.view(torch.uint8)[~listed] == FP8_SENTINEL).all() or not s[~listed].isnan().all()


def _compare(q, s, want_q, want_s, listed, act: bool, finite=None) -> str | None:
    """Scales: exact without the activation (no exp on the way), else within 2 units of
    bfloat16 and almost all equal (numpy's and torch's exp may differ in the last bit,
    which can move a 16-bit rounding and so an amax); q bytes equal almost everywhere."""
    got_s, ref_s = s[listed], want_s[listed]
    moved = int((got_s != ref_s).sum())
    if not act and moved:
        return f"scales not exact: {moved} differ, {(got_s - ref_s).abs().max().item()}"
    few = max(1, ref_s.numel() // 1000)
    if not torch.allclose(got_s, ref_s, rtol=2**-7, atol=0) or moved > few:
        return f"scales: {moved} differ, {(got_s - ref_s).abs().max().item()}"
    got_q, ref_q = q[listed].float(), want_q[listed]
    if finite is not None:
        got_q, ref_q = got_q[finite], ref_q[finite]
    same = (got_q == ref_q).float().mean().item() if got_q.numel() else 1.0
    if same < 0.999 or not torch.allclose(got_q, ref_q, rtol=2**-3, atol=2**-9):
        return f"q: {same} equal"
    return None


def check(case: dict) -> str | None:
    """One case in the interpreter's child: None, or what differs."""
    if case["kind"] == "silu":
        return _check_silu(case)
    if case["kind"] == "swiglu":
        return _check_swiglu(case)
    if case["kind"] in ("tensor", "static"):
        return _check_tensor(case)
    return _check_rows(case)


def _check_rows(case: dict) -> str | None:
    """`quantize_rows`: vLLM's dynamic group (`per_token_group_fp8_quant`, power-of-two
    scales under UE8M0) or per-token quantization of each received row's values."""
    x, blocks, listed, dtype = _problem(case, 0)
    d, group, act = case["d"], case["group"], case["act"]
    x[0, :d] = 0  # a row (or group) of zeros: the scale floors
    with sentinel_outputs():
        q, s = quantize.quantize_rows(x, blocks, group, case["ue8m0"], act)
    y = _values(x, d, act, dtype)
    if group is None:
        scale = over_max(y.abs().amax(dim=1, keepdim=True)).clamp_min(num.TOKEN_SCALE_FLOOR)
        wide = scale
    else:
        amax = y.view(len(y), d // group, group).abs().amax(dim=2)
        scale = over_max(amax.clamp_min(num.GROUP_AMAX_FLOOR))
        if case["ue8m0"]:  # vLLM floors the scale at the group floor before rounding it up
            scale = torch.exp2(torch.ceil(torch.log2(scale.clamp_min(num.GROUP_AMAX_FLOOR))))
        wide = scale.repeat_interleave(group, dim=1)
    if q.shape != (len(y), d) or s.shape != scale.shape or s.dtype != torch.float32:
        return f"shapes {tuple(q.shape)} {tuple(s.shape)} {s.dtype}"
    if _unlisted_written(q, s, listed):
        return "wrote a row that was not received"
    want_q = e4m3((y / wide).clamp(-num.FP8_MAX, num.FP8_MAX))
    return _compare(q, s, want_q, scale, listed, act)


def _check_tensor(case: dict) -> str | None:
    """`tensor_quant`: the scale max(max |y| / 448, floor) over the received rows, per
    expert or one over all, or the static scale given; then vLLM's static quantization
    with it (y times the inverted scale, clamped)."""
    x, blocks, listed, dtype = _problem(case, 1)
    experts, rows, d, act = case["experts"], case["rows"], case["d"], case["act"]
    poison = case.get("poison")
    if poison == "nan" and listed.any():  # counts as zero in the max
        x[int(listed.nonzero()[0]), 1] = float("nan")
    if poison == "zeros":  # an expert of all-zero rows (the first): its scale floors
        x[:rows] = 0
    if poison == "unlisted":  # a huge value in a received expert's row that did not arrive
        x[int((~listed).nonzero()[-1]), :] = 3e38 if dtype == torch.bfloat16 else 6e4
    static = None
    if case["kind"] == "static":
        static = torch.tensor(STATIC_SCALE if case.get("zero_dim") else [STATIC_SCALE])
    with sentinel_outputs():
        q, s = quantize.tensor_quant(x, blocks, rows, case["per_expert"], act, static)
    y = _values(x, d, act, dtype)
    if static is not None:
        scale = torch.full((len(y), 1), STATIC_SCALE)
    else:
        row_max = torch.where(listed, y.abs().nan_to_num(nan=0.0).amax(dim=1), 0.0)
        if case["per_expert"]:
            amax = row_max.view(experts, rows).amax(dim=1).repeat_interleave(rows)
        else:
            amax = row_max.amax().expand(len(y))
        scale = over_max(amax).clamp_min(num.TENSOR_SCALE_FLOOR)[:, None]
    if q.shape != (len(y), d) or s.shape != (len(y), 1) or s.dtype != torch.float32:
        return f"shapes {tuple(q.shape)} {tuple(s.shape)} {s.dtype}"
    if _unlisted_written(q, s, listed):
        return "wrote a row that was not received"
    inverted = torch.ones_like(scale) / scale
    want_q = e4m3((y * inverted).clamp(-num.FP8_MAX, num.FP8_MAX))
    if static is not None and listed.any() and not (q[listed].float().abs() == num.FP8_MAX).any():
        return "no value clamped: the static case tests nothing beyond the scale"
    return _compare(q, s, want_q, scale, listed, act, finite=~y[listed].isnan())


def _check_silu(case: dict) -> str | None:
    """`silu_and_mul`: every received row gets SiLU(gate) x up, the SiLU rounded to 16 bits
    before the product as vLLM's kernels round it; no other row is written."""
    x, blocks, listed, dtype = _problem(case, 2)
    out = torch.full((len(x), case["d"]), float("nan"), dtype=dtype)
    activation.silu_and_mul(out, x, blocks)
    want = _values(x, case["d"], True, dtype)
    if not torch.isnan(out[~listed].float()).all():
        return "wrote a row that was not received"
    got, ref = out[listed].float(), want[listed]
    # numpy's and torch's FP32 exp may differ in the last bit, which can move a rounding:
    # within two units of the 16-bit type's precision, and almost all equal
    close = torch.allclose(got, ref, rtol=2 * torch.finfo(dtype).eps, atol=0)
    if not close or (got != ref).float().mean().item() > 0.01:
        return f"values differ by up to {(got - ref).abs().max().item()}"
    return None


def swiglu_oai_reference(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """vLLM's `swigluoai` of rows [n, 2d] as its CUDA kernel computes it: gate x[2j] and up
    x[2j + 1] (interleaved) in FP32, gate <= limit, -limit <= up <= limit,
    (up + 1) * gate * sigmoid(alpha * gate), FP32 (rounded once by the caller)."""
    gate = x[:, 0::2].float().clamp(max=limit)
    up = x[:, 1::2].float().clamp(-limit, limit)
    return (up + 1) * (gate / (1 + torch.exp(-gate * alpha)))


def _check_swiglu(case: dict) -> str | None:
    """`swiglu_oai`: every received row gets gpt-oss's clamped SwiGLU, FP32 throughout and
    rounded once to 16 bits; no other row is written. Inputs loud enough (|x| up to ~40)
    that both clamps bite on many elements."""
    x, blocks, listed, dtype = _problem(case, 3)
    x = (x.float() * 3).to(dtype)
    d = case["d"]
    out = torch.full((len(x), d), float("nan"), dtype=dtype)
    activation.swiglu_oai(out, x, blocks, SWIGLU_ALPHA, SWIGLU_LIMIT)
    want = rounded(swiglu_oai_reference(x, SWIGLU_ALPHA, SWIGLU_LIMIT), dtype)
    if not torch.isnan(out[~listed].float()).all():
        return "wrote a row that was not received"
    got, ref = out[listed].float(), want[listed]
    close = torch.allclose(got, ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    if not close or (got != ref).float().mean().item() > 0.01:
        return f"values differ by up to {(got - ref).abs().max().item()}"
    return None


# ------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def outcomes() -> list:
    return run_cases(__file__, "check", CASES)


@pytest.mark.parametrize("kind", KINDS)
def test_received_rows_get_vllm_s_numbers_and_no_other_row_is_written(outcomes, kind):
    """group / token: `quantize_rows` (the floors on an all-zero row included), `-act` with
    SiLU-and-mul fused (GEMM1's output); tensor: dynamic per-tensor, per expert or one
    over every received row (an expert of zeros gets the floor, a row that did not arrive
    never reaches the max; a NaN counts as zero, which only the GPU can show: the
    interpreter's max skips NaN either way); static: the checkpoint's scale, the dynamic
    max skipped; silu: the activation alone; swiglu: gpt-oss's clamped SwiGLU alone."""
    assert failures(CASES, outcomes, kind) == []


def test_token_tiling_holds_whole_rows_and_spreads_the_block_over_programs():
    """A row that fits the tile is read once and the block's rows shared by programs (a
    decode step lists few blocks); a wider row takes a program of its own. The launch
    needs: both powers of two, the rows per program dividing BLOCK_M, one tile each."""
    assert quantize.token_tiling(768, 64) == (1024, 4)
    assert quantize.token_tiling(200, 16) == (256, 16)
    assert quantize.token_tiling(3072, 16) == (quantize.TILE, 1)
    assert quantize.token_tiling(4224, 16) == (quantize.TILE, 1)
    for d in [*range(1, 300), 767, 768, 2048, 4095, 4096, 4097, 7168]:
        for block_m in (16, 32, 64, 128):
            width, sub_m = quantize.token_tiling(d, block_m)
            assert width & (width - 1) == 0 and sub_m & (sub_m - 1) == 0
            assert block_m % sub_m == 0 and width * sub_m <= quantize.TILE
            assert (width >= d) == (triton.next_power_of_2(d) <= quantize.TILE)
            if width < d:
                assert sub_m == 1


def test_the_cases_cover_both_token_passes():
    """The interpreter's token cases reach both branches of the kernel (a whole row read
    once, and a wide row read twice), with and without the activation."""
    whole = {c["act"] for c in CASES if c["kind"].startswith("token") and c["d"] <= quantize.TILE}
    wide = {c["act"] for c in CASES if c["kind"].startswith("token") and c["d"] > quantize.TILE}
    assert whole == wide == {True, False}


def _blocks():
    return torch_row_blocks(torch.tensor([2], dtype=torch.int32), 4, 16, 1)


def test_inputs_the_quantization_kernels_do_not_compute_are_refused():
    bf16 = torch.bfloat16
    blocks = _blocks()
    with pytest.raises(ValueError, match="quantize_rows: 16-bit x"):
        quantize.quantize_rows(torch.zeros(4, 256), blocks, num.GROUP, False, True)
    with pytest.raises(ValueError, match="d = 200 not a multiple of the group 128"):
        quantize.quantize_rows(torch.zeros(4, 400, dtype=bf16), blocks, num.GROUP, False, True)
    with pytest.raises(ValueError, match="quantize_rows: d = 200 not a multiple"):
        quantize.quantize_rows(torch.zeros(4, 200, dtype=bf16), blocks, num.GROUP, False, False)
    with pytest.raises(ValueError, match="tensor_quant: 16-bit x"):
        quantize.tensor_quant(torch.zeros(4, 256), blocks, 4, True, False)
    with pytest.raises(ValueError, match=r"tensor_quant: contiguous \[rows, 2d\]"):
        quantize.tensor_quant(torch.zeros(4, 255, dtype=bf16), blocks, 4, True, True)
    assert quantize.rows_reason(torch.zeros(4, 400, dtype=bf16), None, True) is None
    odd = torch.zeros(4, 129, dtype=bf16)  # an odd width is a row, not gate | up
    assert quantize.rows_reason(odd, None, act=False) is None
    assert "2d" in quantize.rows_reason(odd, None, act=True)
    assert "contiguous" in quantize.rows_reason(torch.zeros(256, 4, dtype=bf16).t(), None, False)
    assert "contiguous" in quantize.rows_reason(torch.zeros(2, 4, 256, dtype=bf16), None, False)


def test_buffers_the_activation_kernel_does_not_compute_are_refused():
    bf16 = torch.bfloat16
    blocks, x = _blocks(), torch.zeros(4, 8, dtype=bf16)
    with pytest.raises(ValueError, match="silu_and_mul: .*out"):
        activation.silu_and_mul(torch.zeros(4, 3, dtype=bf16), x, blocks)
    with pytest.raises(ValueError, match="silu_and_mul: 16-bit"):
        activation.silu_and_mul(torch.zeros(4, 4), x.float(), blocks)
    with pytest.raises(ValueError, match="silu_and_mul: 16-bit"):
        activation.silu_and_mul(torch.zeros(4, 4, dtype=torch.float16), x, blocks)
    with pytest.raises(ValueError, match="silu_and_mul: .*contiguous"):
        activation.silu_and_mul(
            torch.zeros(4, 4, dtype=bf16), torch.zeros(8, 4, dtype=bf16).t(), blocks
        )
    assert activation.buffers_reason(torch.zeros(4, 4, dtype=bf16), x) is None


def test_the_swiglu_reference_is_vllm_s_own():
    """The torch statement the swiglu cases check against is vLLM 0.33.0's
    `SwigluOAIAndMul.forward_native` (its reference, which runs on CPU) on FP32 rows, with
    its default alpha and limit; on loud rows where the clamp bites."""
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 2 * 96, generator=gen) * 9
    defaults = inspect.signature(SwigluOAIAndMul.__init__).parameters
    assert (defaults["alpha"].default, defaults["limit"].default) == (SWIGLU_ALPHA, SWIGLU_LIMIT)
    # its method on the defaults (the op itself needs a vLLM config to be built)
    op = SimpleNamespace(alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)
    want = SwigluOAIAndMul.forward_native(op, x)
    got = swiglu_oai_reference(x, SWIGLU_ALPHA, SWIGLU_LIMIT)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    # The clamps bite: without them the numbers differ; swapped halves differ too.
    assert not torch.allclose(swiglu_oai_reference(x, SWIGLU_ALPHA, float("inf")), want)
    swapped = torch.stack([x[:, 1::2], x[:, 0::2]], dim=-1).reshape(x.shape)
    assert not torch.allclose(swiglu_oai_reference(swapped, SWIGLU_ALPHA, SWIGLU_LIMIT), want)


def test_buffers_the_swiglu_kernel_does_not_compute_are_refused():
    bf16 = torch.bfloat16
    blocks, x = _blocks(), torch.zeros(4, 8, dtype=bf16)
    with pytest.raises(ValueError, match="swiglu_oai: .*out"):
        activation.swiglu_oai(torch.zeros(4, 3, dtype=bf16), x, blocks, 1.702, 7.0)
    with pytest.raises(ValueError, match="swiglu_oai: 16-bit"):
        activation.swiglu_oai(torch.zeros(4, 4), x.float(), blocks, 1.702, 7.0)


def test_an_empty_list_launches_nothing_and_keeps_the_output_shapes():
    """No block (a list of length 0): no launch, which a CPU tensor would refuse."""
    blocks = torch_row_blocks(torch.zeros(2, dtype=torch.int32), 4, 16, 0)
    x = torch.zeros(8, 512, dtype=torch.bfloat16)
    q, s = quantize.quantize_rows(x, blocks, num.GROUP, False, True)
    assert q.shape == (8, 256) and q.dtype == num.FP8 and s.shape == (8, 2)
    q, s = quantize.tensor_quant(x, blocks, 4, True, False)
    assert q.shape == (8, 512) and s.shape == (8, 1) and s.dtype == torch.float32


def test_the_numbers_are_vllm_s():
    """fp8_numerics (the reference above reads it) holds vLLM 0.33.0's constants."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8Dynamic128Sym,
        kFp8Static128BlockSym,
    )

    eps = inspect.signature(fp8_utils.per_token_group_quant_fp8).parameters["eps"].default
    assert num.GROUP_AMAX_FLOOR == eps
    assert num.FP8_MAX == torch.finfo(num.FP8).max
    assert num.TOKEN_SCALE_FLOOR == 1.0 / (torch.finfo(num.FP8).max * 512.0)  # csrc's
    assert num.TENSOR_SCALE_FLOOR == torch.finfo(torch.float32).tiny
    assert (1, num.GROUP) == tuple(kFp8Dynamic128Sym.scale.group_shape)
    assert num.BLOCK_SHAPE == tuple(kFp8Static128BlockSym.scale.group_shape)


def test_only_plain_silu_and_mul_takes_the_fused_activation():
    """vLLM's own activation config decides: a clamp, alpha or beta (GPT-OSS's SwiGLU,
    clamped SiLU) or another activation keeps vLLM's masked op."""
    from vllm.model_executor.layers.fused_moe.activation import (
        ApplyMoEActivationConfig as Config,
    )
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from vllm_flashinfer_ep.experts.activations import plain_silu_and_mul

    assert plain_silu_and_mul(MoEActivation.SILU, Config())
    assert plain_silu_and_mul("silu", Config())
    assert not plain_silu_and_mul(MoEActivation.GELU, Config())
    assert not plain_silu_and_mul(MoEActivation.SWIGLUOAI, Config())
    assert not plain_silu_and_mul(MoEActivation.SILU, Config(clamp_limit=7.0))
    assert not plain_silu_and_mul(MoEActivation.SILU, Config(alpha=1.702))
    assert not plain_silu_and_mul(MoEActivation.SILU, Config(beta=1.0))
    assert not plain_silu_and_mul(MoEActivation.SILU, None)


def test_the_activation_kernel_runs_only_where_it_computes_vllm_s(monkeypatch):
    """The received-rows experts launch `silu_and_mul` for plain SiLU on buffers it takes,
    `swiglu_oai` for vLLM's swigluoai (with the layer's constants); anything else keeps
    vLLM's masked activation with the received counts."""
    from vllm_flashinfer_ep.experts.activations import Kind, RowActivation
    from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts

    launched, masked, swiglu = [], [], []
    monkeypatch.setattr(activation, "silu_and_mul", lambda out, x, b: launched.append(b))
    monkeypatch.setattr(
        activation, "swiglu_oai", lambda out, x, b, alpha, limit: swiglu.append((alpha, limit))
    )
    counts, blocks = torch.tensor([1, 0], dtype=torch.int32), _blocks()

    def run(fused: bool, dtype=torch.bfloat16, row=None) -> None:
        row = row or RowActivation(Kind.SILU if fused else Kind.VLLM_MASKED)
        experts = SimpleNamespace(
            _row_activation=row,
            _fused_activation=fused,
            activation=lambda name, out, x, valid_token_counts: masked.append(
                (out.shape, x.shape, valid_token_counts)
            ),
        )
        x, out = torch.zeros(8, 16, dtype=dtype), torch.zeros(8, 8, dtype=dtype)
        ReceivedRowsExperts._activation(experts, "silu", out, x, counts, blocks, 2)

    run(True)
    assert launched == [blocks] and masked == []
    run(False)
    run(True, torch.float32)  # a buffer the kernel refuses
    assert len(launched) == 1
    assert masked == [((2, 4, 8), (2, 4, 16), counts)] * 2
    run(False, row=RowActivation(Kind.SWIGLU_OAI, 1.702, 7.0))
    assert swiglu == [(1.702, 7.0)] and len(masked) == 2 and len(launched) == 1
