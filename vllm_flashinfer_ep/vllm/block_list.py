"""The (expert, BLOCK_M rows) block list of the received-rows experts, from the counts.

Why: the received-rows experts (vllm/compact_experts.py) build, per MoE layer and per
forward, the list of blocks vLLM's fused-MoE kernel reads. Built from torch ops it is
about fifteen small kernels per layer (a cumsum, a searchsorted, gathers, compares,
casts); inside a captured decode step each is a kernel node of its own, launched for
every MoE layer, and launches, not bytes, are their cost. `fused_expert_blocks` builds the
same three tensors in one Triton kernel. `listed_gemm` is what reads them: vLLM's kernel,
the one call for 16-bit and FP8 weights alike. `listed_silu_and_mul` is the activation
between the two GEMMs on the listed rows only: vLLM's masked activation runs a grid over
every expert's whole buffer slot, which a decode step pays in every MoE layer whatever the
batch (the profile in docs/benchmarks.md).

Both builders write exactly the same values (tests/unit/test_block_list.py compares them
in Triton's interpreter on CPU; tests/kernels/test_compact_experts_gpu.py on the GPU);
`expert_blocks` takes the fused one on CUDA tensors when `FUSED` is on (the default since
its GPU test passed on the H200, 2026-12-05: 2.3 against 44 captured us per layer at
Qwen3-30B-A3B's shape, docs/benchmarks.md), the torch one otherwise.
"""

from __future__ import annotations

import torch

try:  # Triton comes with vLLM's CUDA builds; the torch builder serves without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs without Triton
    triton = None

FUSED = True
BLOCKS_PER_PROGRAM = 16  # blocks one program writes: [16, experts] compares fit registers
# The listed-rows activation, on since the engine benchmark measured it faster than vLLM's
# masked activation at every batch (docs/benchmarks.md); off gives vLLM's op back.
LISTED_ACTIVATION = True
ACTIVATION_TILE = 4096  # elements one activation program handles: BLOCK_M x BLOCK_N


def expert_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block list vLLM's fused-MoE kernel reads, from the received counts.

    Row r of expert e's buffer slot is flat row e * rows_per_expert + r. Returns
    (sorted_ids int32 [num_blocks * block_m]: flat rows block by block, the sentinel
    experts * rows_per_expert where a block has no row; expert_ids int32 [num_blocks]:
    the expert of each block, -1 past the last; blocks_rows int32 [1]: used blocks x
    block_m, past which the kernel's programs return). Fixed shapes, no host sync."""
    if FUSED and counts.is_cuda and triton is not None:
        return fused_expert_blocks(counts, rows_per_expert, block_m, num_blocks)
    return torch_expert_blocks(counts, rows_per_expert, block_m, num_blocks)


def torch_expert_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_blocks` from torch ops (any device)."""
    experts = counts.numel()
    dev = counts.device
    counts = counts.to(torch.int64)
    blocks = (counts + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)
    index = torch.arange(num_blocks, device=dev, dtype=torch.int64)
    owner = torch.searchsorted(ends, index, right=True)
    live = owner < experts
    expert = owner.clamp(max=experts - 1)
    first_block = (ends - blocks)[expert]
    row = (index - first_block)[:, None] * block_m + torch.arange(block_m, device=dev)
    valid = live[:, None] & (row < counts[expert][:, None])
    sentinel = experts * rows_per_expert
    sorted_ids = torch.where(valid, expert[:, None] * rows_per_expert + row, sentinel)
    expert_ids = torch.where(live, expert, -1)
    blocks_rows = (ends[-1:] * block_m).clamp(max=num_blocks * block_m)
    return (
        sorted_ids.reshape(-1).to(torch.int32),
        expert_ids.to(torch.int32),
        blocks_rows.to(torch.int32),
    )


def fused_expert_blocks(
    counts: torch.Tensor, rows_per_expert: int, block_m: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_blocks` in one Triton kernel launch (CUDA tensors, or any tensors under
    Triton's interpreter)."""
    if triton is None:
        raise RuntimeError("fused_expert_blocks needs Triton")
    experts = counts.numel()
    if experts * rows_per_expert >= 2**31:
        raise ValueError("the block list's row ids are int32")
    dev = counts.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    blocks_rows = torch.empty(1, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(num_blocks, BLOCKS_PER_PROGRAM),)
    _block_list_kernel[grid](
        counts,
        sorted_ids,
        expert_ids,
        blocks_rows,
        experts,
        rows_per_expert,
        num_blocks,
        BLOCK_M=block_m,
        EXPERTS=triton.next_power_of_2(experts),
        BLOCKS=BLOCKS_PER_PROGRAM,
    )
    return sorted_ids, expert_ids, blocks_rows


if triton is not None:

    @triton.jit
    def _block_list_kernel(
        counts_ptr,
        sorted_ids_ptr,
        expert_ids_ptr,
        blocks_rows_ptr,
        num_experts,
        rows_per_expert,
        num_blocks,
        BLOCK_M: tl.constexpr,
        EXPERTS: tl.constexpr,
        BLOCKS: tl.constexpr,
    ):
        # Every program reads all counts (a few hundred at most) and writes BLOCKS blocks.
        e = tl.arange(0, EXPERTS)
        in_range = e < num_experts
        counts = tl.load(counts_ptr + e, mask=in_range, other=0).to(tl.int32)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, axis=0)
        total = tl.sum(blocks, axis=0)
        b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
        # The owner of block b: the experts whose blocks all end at or before it.
        done = (ends[None, :] <= b[:, None]) & in_range[None, :]
        owner = tl.sum(done.to(tl.int32), axis=1)
        live = b < total
        first = tl.sum(tl.where(e[None, :] < owner[:, None], blocks[None, :], 0), axis=1)
        owned = tl.sum(tl.where(e[None, :] == owner[:, None], counts[None, :], 0), axis=1)
        r = tl.arange(0, BLOCK_M)
        row = (b - first)[:, None] * BLOCK_M + r[None, :]
        valid = live[:, None] & (row < owned[:, None])
        ids = tl.where(valid, owner[:, None] * rows_per_expert + row, num_experts * rows_per_expert)
        writes = b < num_blocks
        tl.store(sorted_ids_ptr + b[:, None] * BLOCK_M + r[None, :], ids, mask=writes[:, None])
        tl.store(expert_ids_ptr + b, tl.where(live, owner, -1), mask=writes)
        if tl.program_id(0) == 0:
            tl.store(blocks_rows_ptr, tl.minimum(total * BLOCK_M, num_blocks * BLOCK_M))


def listed_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    blocks: tuple,
    config: dict,
    compute_type,
    fp8: tuple | None = None,
) -> None:
    """c[row] = a[row] @ w[expert].T for the listed rows, through vLLM's fused-MoE kernel
    (`invoke_fused_moe_triton_kernel`, top_k 1, no routing weights): a [rows, K], w
    [E, N, K], c [rows, 1, N]. `fp8`: (a_scale, w_scale, per_channel, block_shape) for E4M3
    a and w (vllm/compact_experts_fp8.py says which scales), None for 16-bit ones."""
    from vllm.model_executor.layers.fused_moe.fused_moe import invoke_fused_moe_triton_kernel

    a_scale, w_scale, per_channel, block_shape = fp8 if fp8 is not None else (None,) * 4
    sorted_ids, expert_ids, blocks_rows = blocks
    invoke_fused_moe_triton_kernel(
        a,
        w,
        c,
        a_scale,
        w_scale,
        None,
        sorted_ids,
        expert_ids,
        blocks_rows,
        mul_routed_weight=False,
        top_k=1,
        config=config,
        compute_type=compute_type,
        use_fp8_w8a8=fp8 is not None,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=bool(per_channel),
        block_shape=block_shape,
    )


def activation(
    fused_experts, name, out: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, blocks: tuple
) -> None:
    """The activation between the two GEMMs of the received-rows experts: x [E, rows, 2d]
    (GEMM1's output) -> out [E, rows, d'] on every received row. The listed rows only
    (`listed_silu_and_mul`) when LISTED_ACTIVATION is on, the layer's is plain
    SiLU-and-mul and the buffers are the 16-bit CUDA tensors it takes; vLLM's masked
    activation (`fused_experts.activation`, as its config asks) otherwise."""
    if (
        LISTED_ACTIVATION
        and plain_silu_and_mul(fused_experts, name)
        and x.is_cuda
        and _unlisted_buffers(out, x) is None
    ):
        rows = x.shape[0] * x.shape[1]
        listed_silu_and_mul(out.view(rows, out.shape[-1]), x.view(rows, x.shape[-1]), blocks)
        return
    fused_experts.activation(name, out, x, valid_token_counts=counts)


def plain_silu_and_mul(fused_experts, name) -> bool:
    """SiLU(gate) x up with vLLM's defaults: no clamp, alpha 1, beta 0 (what
    `listed_silu_and_mul` computes); a layer with anything else keeps vLLM's op."""
    if getattr(name, "value", name) != "silu":
        return False
    config = getattr(fused_experts, "activation_config", None)
    return (
        config is not None
        and config.clamp_limit is None
        and config.alpha == 1.0
        and config.beta == 0.0
    )


def _unlisted_buffers(out: torch.Tensor, x: torch.Tensor) -> str | None:
    """Why `listed_silu_and_mul` does not take these buffers (None: it does)."""
    if x.dtype != out.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        return f"16-bit x and out, got {x.dtype}, {out.dtype}"
    if not (x.is_contiguous() and out.is_contiguous()):
        return "x and out must be contiguous"
    return None


def listed_silu_and_mul(out: torch.Tensor, x: torch.Tensor, blocks: tuple) -> None:
    """out[row] = silu(x[row, :d]) * x[row, d:] for the rows in the block list only.

    x [rows, 2d] and out [rows, d], contiguous, one 16-bit dtype; `blocks` from
    `expert_blocks` over these rows (the sentinel `rows` where a block has none). Rows
    that are not listed are left as they were: the GEMM after reads listed rows only.
    Rounds as vLLM's SiLU-and-mul kernels do (the SiLU to the 16-bit type, then the
    product), so a listed row gets what vLLM's masked activation writes there, up to
    where Triton's exp and CUDA's differ in the last bit.
    One launch with the block list's fixed grid; programs past the used blocks return."""
    if triton is None:
        raise RuntimeError("listed_silu_and_mul needs Triton")
    sorted_ids, expert_ids, blocks_rows = blocks
    rows, width = x.shape
    d = width // 2
    if width != 2 * d or out.shape != (rows, d):
        raise ValueError(f"listed_silu_and_mul: x {tuple(x.shape)} and out {tuple(out.shape)}")
    unlisted = _unlisted_buffers(out, x)
    if unlisted is not None:
        raise ValueError(f"listed_silu_and_mul: {unlisted}")
    num_blocks = expert_ids.numel()
    block_m = sorted_ids.numel() // max(num_blocks, 1)
    if num_blocks == 0 or d == 0:
        return
    block_n = max(16, min(triton.next_power_of_2(d), ACTIVATION_TILE // block_m))
    grid = (num_blocks, triton.cdiv(d, block_n))
    _listed_silu_and_mul_kernel[grid](
        x, out, sorted_ids, blocks_rows, rows, d, BLOCK_M=block_m, BLOCK_N=block_n
    )


if triton is not None:

    @triton.jit
    def silu_mul_rows(x_ptr, ids, cols, mask, d):
        """SiLU(gate) x up of x [rows, 2d] on these rows and columns, rounded as vLLM's
        activation rounds it (the SiLU, then the product, to x's 16-bit type); returned in
        FP32 holding those 16-bit values. Shared with vllm/listed_quant.py's kernel."""
        gate_at = x_ptr + ids[:, None] * (2 * d) + cols[None, :]
        gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_at + d, mask=mask, other=0.0).to(tl.float32)
        ty = x_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(ty)
        return (act.to(tl.float32) * up).to(ty).to(tl.float32)

    @triton.jit
    def block_tile(sorted_ids_ptr, rows, d, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The rows of block program_id(0) (flat ids; the sentinel `rows` where the block
        has none) and the columns of chunk program_id(1): (ids, cols, the mask of listed
        rows x columns below d). Shared with vllm/listed_quant.py's kernels."""
        ids = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
        ids = ids.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return ids, cols, (ids < rows)[:, None] & (cols < d)[None, :]

    @triton.jit
    def _listed_silu_and_mul_kernel(
        x_ptr,
        out_ptr,
        sorted_ids_ptr,
        blocks_rows_ptr,
        rows,
        d,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        if tl.program_id(0) * BLOCK_M >= tl.load(blocks_rows_ptr):
            return
        ids, cols, mask = block_tile(sorted_ids_ptr, rows, d, BLOCK_M, BLOCK_N)
        y = silu_mul_rows(x_ptr, ids, cols, mask, d)  # out has x's type (_unlisted_buffers)
        tl.store(
            out_ptr + ids[:, None] * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )
