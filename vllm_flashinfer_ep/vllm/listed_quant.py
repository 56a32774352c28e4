"""The FP8 received-rows experts' activation and the intermediate's quantization in one
kernel, over the block list's rows.

Why: between the two GEMMs of vllm/compact_experts_fp8.py the intermediate is activated
(block_list.activation), then its listed rows are gathered, quantized with vLLM's op and
scattered back: five launches per layer whose cost does not shrink with the batch, in the
path `--moe-backend auto` gives per-channel layers (and block layers off Hopper). Here one
launch over the block list's fixed grid reads GEMM1's output and writes E4M3 and FP32
scales to the rows GEMM2 reads. The same kernel without the activation (`quantize_rows`,
`INPUT_ENABLED`) quantizes BF16 received rows for GEMM1.

It rounds as vLLM does: SiLU to the 16-bit type, the product to the 16-bit type (what
vLLM's activation writes), then vLLM's dynamic quantization of those 16-bit values:
- groups of 128 (block layers, vLLM's `per_token_group_fp8_quant`): scale = max(amax,
  1e-10) / 448, rounded up to a power of two where vLLM's DeepGEMM E8M0 setting is on;
- per token (`dynamic_per_token_scaled_fp8_quant`): scale = max(amax / 448, 1 / (448 x
  512)), the row's amax gathered over column chunks;
- q = clamp(x / scale, -448, 448) as E4M3, true divisions as vLLM's CUDA kernels divide.
Both on (`ENABLED`, `INPUT_ENABLED`) since their GPU tests against vLLM's ops passed and
the engine benchmark measured per-channel LL faster with each at every batch, the engine
test's prompt logprobs within the floor (docs/benchmarks.md); off gives the listed
activation and vLLM's quantization of gathered rows back.

A dynamic per-tensor scale (online `fp8_per_tensor`) spans rows, so `tensor_quant` takes
two launches over the block list: the max |y| of the listed rows (atomic, per expert when
vLLM's eager kernel takes it per expert, else one), then vLLM's static per-tensor
quantization with it (y x (1 / scale), as vLLM's kernel multiplies by the inverted
scale). It replaces about ten launches (the max's masks and reductions, the gather, vLLM's
quantization, the scatters); on (`TENSOR_ENABLED`) since its GPU test against vLLM's ops
passed and the engine benchmark measured it faster at every batch, the engine test's
prompt logprobs within the floor (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Triton comes with vLLM's CUDA builds
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None

from vllm_flashinfer_ep.vllm import block_list

ENABLED = True
# The received rows' own quantization (BF16 arrivals) in one launch.
INPUT_ENABLED = True
# Dynamic per-tensor layers' input and intermediate in two launches each (`tensor_quant`).
TENSOR_ENABLED = True
GROUP = 128  # elements per scale of block layers (vLLM's block_shape[1])
FP8_MAX = 448.0
EPS = 1e-10  # vLLM's group quantization floor on amax
TENSOR_FLOOR = torch.finfo(torch.float32).tiny  # the per-tensor scale's floor (receive_quant)
MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's per-token floor on the scale
TILE = 4096  # elements one program holds at a time: BLOCK_M x BLOCK_N


def unlisted_reason(x: torch.Tensor, group: int | None, act: bool = True) -> str | None:
    """Why `silu_mul_quant` (`act`) or `quantize_rows` does not take `x` ([rows, 2d]
    GEMM1's output, or [rows, d] the received rows) (None: it does)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit x, got {x.dtype}"
    if not x.is_contiguous() or x.dim() != 2 or (act and x.shape[1] % 2):
        return f"contiguous [rows, {'2d' if act else 'd'}], got {tuple(x.shape)}"
    d = x.shape[1] // 2 if act else x.shape[1]
    if group is not None and d % group:
        return f"d = {d} not a multiple of the group {group}"
    return None


def silu_mul_quant(
    x: torch.Tensor, blocks: tuple, group: int | None, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2d] (GEMM1's output, 16-bit) -> (E4M3 [rows, d], FP32 scales [rows, d /
    group] or [rows, 1] when `group` is None: per token). Only the rows in the block list
    (`blocks` from block_list.expert_blocks over these rows) are written; the others are
    undefined, and GEMM2 reads listed rows only. `ue8m0`: block scales rounded up to a
    power of two (vLLM's `is_deep_gemm_e8m0_used()` decides it for vLLM's op)."""
    return _listed_quant(x, blocks, group, ue8m0, act=True)


def quantize_rows(
    x: torch.Tensor, blocks: tuple, group: int | None, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, d] (the received rows, 16-bit) -> (E4M3 [rows, d], FP32 scales) as
    `silu_mul_quant` without the activation: vLLM's dynamic quantization of the listed rows
    in one launch, where compact_experts_fp8.quantize_listed_rows gathers every entry of the
    block list (sentinels included: a partial block per expert with rows), quantizes
    and scatters back (`INPUT_ENABLED`)."""
    return _listed_quant(x, blocks, group, ue8m0, act=False)


def _listed_quant(
    x: torch.Tensor, blocks: tuple, group: int | None, ue8m0: bool, act: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    name = "silu_mul_quant" if act else "quantize_rows"
    if triton is None:
        raise RuntimeError(f"{name} needs Triton")
    why = unlisted_reason(x, group, act)
    if why is not None:
        raise ValueError(f"{name}: {why}")
    sorted_ids, expert_ids, blocks_rows = blocks
    rows, d = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    groups = 1 if group is None else d // group
    q = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    num_blocks = expert_ids.numel()
    if num_blocks == 0 or d == 0:
        return q, scales
    block_m = sorted_ids.numel() // num_blocks
    if group is None:
        block_n, sub_m = token_tiling(d, block_m)  # both powers of two: sub_m divides
        grid = (num_blocks, block_m // sub_m)
    else:
        block_n, sub_m, grid = group, block_m, (num_blocks, groups)
    _silu_mul_quant_kernel[grid](
        x,
        q,
        scales,
        sorted_ids,
        blocks_rows,
        rows,
        d,
        BLOCK_M=block_m,
        SUB_M=sub_m,
        BLOCK_N=block_n,
        WHOLE_ROW=block_n >= d,
        PER_TOKEN=group is None,
        UE8M0=bool(ue8m0),
        ACT=act,
    )
    return q, scales


def _runs_on(x: torch.Tensor) -> bool:
    """Whether these kernels can run on x's device: Triton, a CUDA buffer, and a GPU that
    converts to E4M3 in-kernel (sm_89 and newer)."""
    return triton is not None and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def tensor_quant(
    x: torch.Tensor, blocks: tuple, rows_per_expert: int, per_expert: bool, act: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2d] (`act`: GEMM1's output, activated as `silu_mul_quant` does) or [rows, d]
    (the received rows), 16-bit -> (E4M3 [rows, d], FP32 [rows, 1]) for a dynamic
    per-tensor layer: scale = max(max |y| / 448, FP32's smallest normal) over the listed
    rows (NaN counting as zero, an infinity kept), each expert's own when `per_expert`
    (vLLM's eager loop over experts) else one over them all (its captured path, and the
    prepare's input scale); every listed row gets its scale and vLLM's static per-tensor
    quantization with it. Rows not listed are left undefined."""
    if triton is None:
        raise RuntimeError("tensor_quant needs Triton")
    why = unlisted_reason(x, None, act)
    if why is not None:
        raise ValueError(f"tensor_quant: {why}")
    sorted_ids, expert_ids, blocks_rows = blocks
    rows, d = x.shape[0], x.shape[1] // 2 if act else x.shape[1]
    q = torch.empty(rows, d, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    num_blocks = expert_ids.numel()
    if num_blocks == 0 or d == 0:
        return q, scales
    block_m = sorted_ids.numel() // num_blocks
    block_n = min(triton.next_power_of_2(d), max(16, TILE // block_m))
    slots = rows // rows_per_expert if per_expert else 1
    amax = torch.zeros(slots, dtype=torch.float32, device=x.device)
    grid = (num_blocks, triton.cdiv(d, block_n))
    args = (sorted_ids, expert_ids, blocks_rows, rows, d, int(per_expert))
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "ACT": act}
    _listed_amax_kernel[grid](x, amax, *args, **meta)
    _tensor_quant_kernel[grid](x, q, scales, amax, *args, FLOOR=TENSOR_FLOOR, **meta)
    return q, scales


def takes_tensor(
    x: torch.Tensor, act: bool, fused_experts: Any = None, activation: Any = None
) -> bool:
    """Whether a dynamic per-tensor layer's input (`act` False, x [rows, d]) or
    intermediate (GEMM1's output [rows, 2d] of a plain SiLU-and-mul layer) goes through
    `tensor_quant`: on, CUDA buffers it takes on a GPU that converts to E4M3."""
    return (
        TENSOR_ENABLED
        and _runs_on(x)
        and (not act or block_list.plain_silu_and_mul(fused_experts, activation))
        and unlisted_reason(x, None, act) is None
    )


def token_tiling(d: int, block_m: int) -> tuple[int, int]:
    """Per token: (columns a program holds, rows a program takes). A row that fits TILE
    is held whole, read once, and the block's rows are spread over programs (a decode
    step lists a few blocks; one program walking each block's rows serially would set
    the time); a wider row takes one row per program, read twice (amax, then quantize)."""
    width = triton.next_power_of_2(d)
    if width <= TILE:
        return width, max(1, min(block_m, TILE // width))
    return TILE, 1


def takes_input(x: torch.Tensor, group: int | None) -> bool:
    """Whether BF16 received rows `x` [rows, d] are quantized by `quantize_rows`: on, CUDA
    buffers it takes on a GPU that converts to E4M3 (sm_89 and newer)."""
    return INPUT_ENABLED and _runs_on(x) and unlisted_reason(x, group, act=False) is None


def takes(fused_experts: Any, activation: Any, x: torch.Tensor, group: int | None) -> bool:
    """Whether this layer's intermediate goes through `silu_mul_quant`: on, a plain
    SiLU-and-mul layer (block_list.plain_silu_and_mul), CUDA buffers it takes on a GPU
    that converts to E4M3 (sm_89 and newer)."""
    return (
        ENABLED
        and _runs_on(x)
        and block_list.plain_silu_and_mul(fused_experts, activation)
        and unlisted_reason(x, group) is None
    )


if triton is not None:
    silu_mul_rows = block_list.silu_mul_rows  # the activation, as the listed one computes it
    block_tile = block_list.block_tile  # a block's rows and a column chunk, as it reads them

    @triton.jit
    def _rows(x_ptr, ids, cols, mask, d, ACT: tl.constexpr):
        """The values to quantize, FP32: SiLU(gate) x up of GEMM1's output [rows, 2d]
        rounded as vLLM's activation rounds it (`ACT`), or the rows of x [rows, d]."""
        if ACT:
            y = silu_mul_rows(x_ptr, ids, cols, mask, d)
        else:
            y = tl.load(x_ptr + ids[:, None] * d + cols[None, :], mask=mask, other=0.0)
            y = y.to(tl.float32)
        return y

    @triton.jit
    def _store_q(q_ptr, y, scale, ids, cols, mask, d):
        q = tl.clamp(tl.math.div_rn(y, scale[:, None]), -448.0, 448.0)
        tl.store(q_ptr + ids[:, None] * d + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        sorted_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        BLOCK_M: tl.constexpr,
        SUB_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        WHOLE_ROW: tl.constexpr,
        PER_TOKEN: tl.constexpr,
        UE8M0: tl.constexpr,
        ACT: tl.constexpr,
    ):
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        span = tl.arange(0, BLOCK_N)
        if PER_TOKEN:  # SUB_M of the block's rows, each row's one scale
            first = b * BLOCK_M + tl.program_id(1) * SUB_M
            ids = tl.load(sorted_ids_ptr + first + tl.arange(0, SUB_M)).to(tl.int64)
            listed = ids < rows
            if WHOLE_ROW:  # BLOCK_N >= d: read once
                mask = listed[:, None] & (span < d)[None, :]
                y = _rows(x_ptr, ids, span, mask, d, ACT)
                amax = tl.max(tl.abs(y), axis=1)
                scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
                tl.store(s_ptr + ids, scale, mask=listed)
                _store_q(q_ptr, y, scale, ids, span, mask, d)
            else:  # wider rows: the amax over the chunks, then each chunk quantized
                amax = tl.zeros([SUB_M], dtype=tl.float32)
                for c0 in range(0, d, BLOCK_N):
                    cols = c0 + span
                    mask = listed[:, None] & (cols < d)[None, :]
                    y = _rows(x_ptr, ids, cols, mask, d, ACT)
                    amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
                scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))
                tl.store(s_ptr + ids, scale, mask=listed)
                for c0 in range(0, d, BLOCK_N):
                    cols = c0 + span
                    mask = listed[:, None] & (cols < d)[None, :]
                    y = _rows(x_ptr, ids, cols, mask, d, ACT)
                    _store_q(q_ptr, y, scale, ids, cols, mask, d)
        else:
            ids = tl.load(sorted_ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            listed = ids < rows
            g = tl.program_id(1)
            cols = g * BLOCK_N + span
            mask = listed[:, None] & (cols < d)[None, :]
            y = _rows(x_ptr, ids, cols, mask, d, ACT)
            amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-10)
            scale = tl.math.div_rn(amax, 448.0)
            if UE8M0:
                scale = tl.math.exp2(tl.math.ceil(tl.math.log2(tl.maximum(scale, 1e-10))))
            tl.store(s_ptr + ids * (d // BLOCK_N) + g, scale, mask=listed)
            _store_q(q_ptr, y, scale, ids, cols, mask, d)

    # per_expert is a runtime 0 / 1, not specialized: the eager call (per expert) and the
    # captured one (one scale) run one compiled kernel, so none compiles during a capture.
    @triton.jit(do_not_specialize=["per_expert"])
    def _listed_amax_kernel(
        x_ptr,
        amax_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        per_expert,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
    ):
        """max |y| of one block's listed rows over one column chunk, into its expert's
        slot (or the one slot): NaN counts as zero, as vLLM's fmaxf skips it."""
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        a = tl.abs(_rows(x_ptr, ids, cols, mask, d, ACT))
        a = tl.where(a == a, a, 0.0)
        slot = tl.load(expert_ids_ptr + b) * per_expert  # a live block's expert, or slot 0
        tl.atomic_max(amax_ptr + slot, tl.max(tl.max(a, axis=1), axis=0))

    @triton.jit(do_not_specialize=["per_expert"])
    def _tensor_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        amax_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        per_expert,
        FLOOR: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
    ):
        """One block's listed rows over one column chunk quantized with their slot's
        scale, as vLLM's static per-tensor kernel does (times the inverted scale); the
        first chunk writes each row's scale."""
        b = tl.program_id(0)
        if b * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        slot = tl.load(expert_ids_ptr + b) * per_expert  # a live block's expert, or slot 0
        scale = tl.maximum(tl.math.div_rn(tl.load(amax_ptr + slot), 448.0), FLOOR)
        inverted = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), scale)
        y = _rows(x_ptr, ids, cols, mask, d, ACT)
        q = tl.clamp(y * inverted[:, None], -448.0, 448.0)
        tl.store(q_ptr + ids[:, None] * d + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        if tl.program_id(1) == 0:
            tl.store(s_ptr + ids, tl.full([BLOCK_M], 0.0, tl.float32) + scale, mask=ids < rows)
