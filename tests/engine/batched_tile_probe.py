"""Time vLLM's batched Triton experts kernel with the tiles the LL path can get (GPU).

    python tests/engine/batched_tile_probe.py [--experts 128 --hidden 2048 --inter 768]

For each batch (tokens on the rank, world 1, top_k 8, random routing) both GEMMs of
vLLM 0.33.0's `BatchedTritonExperts` (`invoke_moe_batched_triton_kernel`, the buffer of
256 rows per expert the LL path hands it) run with:
  vllm_256   : what vLLM looks up (fused-MoE tables at M = 256 buffer rows)
  package    : the package's choice (vllm/batched_tiles.py: vLLM's generic rule at the
               rows an expert can receive in the forward)
  table_rows : the fused-MoE tables at M = those rows (an alternative considered)
and, for the same buffer and counts:
  compact    : the package's received-rows experts (vllm/compact_experts.py: vLLM's
               fused-MoE kernel over a block list built from the counts; block-list
               build included); its output is checked against the batched kernel's
  no_ep      : vLLM's `fused_experts` on the tokens themselves (routing, both GEMMs,
               activation, weighted sum): what the engine without EP runs per layer
Median GPU time per call, from CUDA-event timings of a CUDA graph holding 10 calls
(as vLLM replays decode steps; host launch cost excluded); the per-step cost is x
layers. Also the registers and spills Triton reports for each compiled variant.
Diagnosis for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def _time(fn, reps: int = 20, inner: int = 10) -> float:
    """Median GPU microseconds per call of `fn`, replayed from a CUDA graph of `inner` calls
    (captured the way vLLM captures, runtime/capture.py: one eager warm-up first)."""
    from vllm_flashinfer_ep.runtime.capture import capture_graph

    for _ in range(3):
        fn()
    g = capture_graph(lambda: [fn() for _ in range(inner)])
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / inner)
    del g
    return statistics.median(times)


def _compiled() -> dict[int, object]:
    """Compiled variants of vLLM's batched kernel so far (Triton internals; best effort)."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe as fbm

    try:
        return {
            id(k): k
            for cache in fbm.batched_triton_kernel.device_caches.values()
            for k in cache[0].values()
        }
    except Exception:  # noqa: BLE001 - a diagnosis aid, never the measurement
        return {}


def _regs_spills(kernels) -> str:
    parts = []
    for k in kernels:
        try:
            k._init_handles()
            parts.append(f"{k.n_regs} regs/{k.n_spills} spills")
        except Exception as e:  # noqa: BLE001
            parts.append(f"? ({type(e).__name__})")
    return ", ".join(parts) or "-"


def _sweep() -> dict[str, dict]:
    """Tiles that differ in grid size (buffer rows / BLOCK_M x N / BLOCK_N programs)."""
    return {
        f"sweep_{m}x{n}": {
            "BLOCK_SIZE_M": m,
            "BLOCK_SIZE_N": n,
            "BLOCK_SIZE_K": 64,
            "GROUP_SIZE_M": 1,
            "num_warps": 4,
            "num_stages": 3,
        }
        for m in (16, 32, 64, 128)
        for n in (64, 128)
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256, help="buffer rows per expert")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="instead: BLOCK_M 16-128 x BLOCK_N 64/128 (K 64, 4 warps, 3 stages) per batch",
    )
    args = ap.parse_args()

    import triton.language as tl
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        invoke_moe_batched_triton_kernel,
    )
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    from vllm_flashinfer_ep.vllm.batched_tiles import tile_for_rows

    dev = torch.device("cuda")
    E, K, N, R = args.experts, args.hidden, args.inter, args.rows
    torch.manual_seed(0)
    w1 = torch.randn(E, 2 * N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    w2 = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) / N**0.5
    a1 = torch.randn(E, R, K, device=dev, dtype=torch.bfloat16)
    c1 = torch.empty(E, R, 2 * N, device=dev, dtype=torch.bfloat16)
    a2 = torch.randn(E, R, N, device=dev, dtype=torch.bfloat16)
    c2 = torch.empty(E, R, K, device=dev, dtype=torch.bfloat16)

    def run(tile: dict, counts: torch.Tensor) -> float:
        def both() -> None:
            for a, b, c in ((a1, w1, c1), (a2, w2, c2)):
                invoke_moe_batched_triton_kernel(
                    A=a,
                    B=b,
                    C=c,
                    expert_num_tokens=counts,
                    compute_type=tl.bfloat16,
                    A_scale=None,
                    B_scale=None,
                    B_zp=None,
                    use_fp8_w8a8=False,
                    use_int8_w8a16=False,
                    use_int4_w4a16=False,
                    config=tile,
                    per_act_token_quant=False,
                    block_shape=None,
                )

        return _time(both)

    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    from vllm_flashinfer_ep.vllm.compact_experts import _gemm, expert_blocks, max_blocks

    def compact(tokens: int, counts: torch.Tensor, out1, out2) -> float:
        cfg = try_get_optimal_moe_config(w1.size(), w2.size(), args.top_k, None, tokens)
        bm = cfg["BLOCK_SIZE_M"]
        bound = max_blocks(tokens * args.top_k, E, R, bm)

        def both() -> None:
            blocks = expert_blocks(counts, R, bm, bound)
            for a, b, c in ((a1, w1, out1), (a2, w2, out2)):
                _gemm(a.view(E * R, -1), b, c.view(E * R, 1, -1), blocks, cfg, tl.bfloat16)

        return _time(both), cfg, bound

    def max_diff(counts: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
        valid = torch.arange(R, device=dev)[None, :] < counts[:, None]
        return float((x[valid].float() - y[valid].float()).abs().max())

    print(
        f"E={E} hidden={K} inter={N} top_k={args.top_k} buffer rows={R} "
        f"({torch.cuda.get_device_name()})"
    )
    print(
        "| tokens | active experts | tile | BLOCK MxNxK, warps, stages | us per layer | "
        f"ms per step (x{args.layers}) | registers/spills (new variants) |"
    )
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(b) for b in args.batches.split(",")):
        ids = torch.stack([torch.randperm(E, device=dev)[: args.top_k] for _ in range(tokens)])
        counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
        tiles = (
            _sweep()
            if args.sweep
            else {
                "vllm_256": try_get_optimal_moe_config(w1.size(), w2.size(), args.top_k, None, R),
                "package": tile_for_rows(
                    tokens, tuple(w1.shape), tuple(w2.shape), args.top_k, None, None
                ),
                "table_rows": try_get_optimal_moe_config(
                    w1.size(), w2.size(), args.top_k, None, tokens
                ),
            }
        )
        for name, tile in tiles.items():
            before = _compiled()
            us = run(tile, counts)
            new = [k for i, k in _compiled().items() if i not in before]
            shape = (
                f"{tile['BLOCK_SIZE_M']}x{tile['BLOCK_SIZE_N']}x{tile['BLOCK_SIZE_K']}, "
                f"{tile.get('num_warps', 4)}, {tile.get('num_stages', 3)}"
            )
            print(
                f"| {tokens} | {int((counts > 0).sum())} | {name} | {shape} | {us:.1f} | "
                f"{us * args.layers / 1000:.2f} | {_regs_spills(new)} |",
                flush=True,
            )
            if name == "package":
                ref1, ref2 = c1.clone(), c2.clone()
        if args.sweep:
            continue
        o1, o2 = torch.empty_like(c1), torch.empty_like(c2)
        us, cfg, bound = compact(tokens, counts, o1, o2)
        diff = max(max_diff(counts, ref1, o1), max_diff(counts, ref2, o2))
        scale = float(ref2.float().abs().max())
        shape = (
            f"{cfg['BLOCK_SIZE_M']}x{cfg['BLOCK_SIZE_N']}x{cfg['BLOCK_SIZE_K']}, "
            f"{cfg.get('num_warps', 4)}, {cfg.get('num_stages', 3)}"
        )
        print(
            f"| {tokens} | {int((counts > 0).sum())} | compact ({bound} blocks; max diff vs "
            f"package {diff:.3g} of {scale:.3g}) | {shape} | {us:.1f} | "
            f"{us * args.layers / 1000:.2f} | - |",
            flush=True,
        )
        x = torch.randn(tokens, K, device=dev, dtype=torch.bfloat16)
        weights = torch.rand(tokens, args.top_k, device=dev, dtype=torch.float32)
        ids32 = ids.to(torch.int32)
        us = _time(lambda x=x, wt=weights, i=ids32: fused_experts(x, w1, w2, wt, i))
        print(
            f"| {tokens} | {int((counts > 0).sum())} | no_ep (fused_experts, whole MoE) | "
            f"vLLM's lookup at M={tokens} | {us:.1f} | {us * args.layers / 1000:.2f} | - |",
            flush=True,
        )
        if diff > 0.02 * scale + 1e-3:
            print(f"MISMATCH at {tokens} tokens: compact differs from the batched kernel by {diff}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
