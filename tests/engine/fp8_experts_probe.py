"""Time the FP8 LL experts side by side at a real model's shape (GPU).

    python tests/engine/fp8_experts_probe.py [--scheme block|channel|tensor|tensor_static]
        [--experts 128 --hidden 2048 --inter 768] [--json out.json]

For each batch (tokens on the rank, world 1, random routing over `--experts` local
experts) one FP8 MoE layer's experts run over the LL receive buffer (256 rows per expert)
as the engine hands it to them: vLLM 0.33.0 experts objects, whole `apply` calls. The
buffer: for `block` (128x128 weight blocks) what the FP8 wire delivers (E4M3 rows, FP32
scales per 128, row-major); for `channel` (per-channel weights, per-token activations)
and `tensor` (one weight scale per expert, a dynamic per-tensor activation scale) or
`tensor_static` (static input scales, as per-tensor checkpoints carry) what the LL
prepare quantizes after receive (vllm/receive_quant.py).
  batched_triton : vLLM's BatchedTritonExperts as vLLM ships them
  received_rows  : the package's ReceivedRowsExperts (experts/received_rows.py), what LL
                   runs in their place
  deep_gemm      : block only: the package's DeepGemmExperts (vLLM's
                   BatchedDeepGemmExperts, --moe-backend deep_gemm, with the MN-major copy
                   of the filled rows' scales); at world 1 vLLM hands DeepGEMM expected_m
                   = the buffer's rows per expert (no DP metadata)
  deep_gemm_dp   : the same call with the expected_m vLLM estimates when data parallel
                   ranks give it DP metadata (tokens x top_k / experts, rounded up to 16,
                   clamped to [16, rows]): what world 1 cannot show in the engine; left
                   out of "fastest LL path", which names what a world-1 engine can run
  no_ep          : vLLM's fused_experts on the tokens themselves with the same FP8
                   weights (Triton; routing, both GEMMs, activation, weighted sum): what
                   the engine without EP runs per layer with --moe-backend triton
For `block` all four read the weights vLLM prepares for DeepGEMM (on sm90 the block scales
may be rounded to powers of two). Outputs are compared on the received rows (relative L2
against batched_triton, printed). Median GPU microseconds per call from CUDA-event timings
of a CUDA graph holding 10 calls (`_time`). Which path `--moe-backend auto` should take is
read from these tables (docs/benchmarks.md); for `block` the last line names the bound of
ReceivedRowsOrDeepGemmExperts they give (`received_rows_bound`).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

PATHS = ("batched_triton", "received_rows", "deep_gemm", "deep_gemm_dp", "no_ep")


def received_rows_bound(rows: list[dict], top_k: int, experts: int) -> float:
    """VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS as these rows measure it: the rows per
    expert (tokens x top_k / experts) of the largest batch up to which the received rows
    were faster than DeepGEMM at data parallel ranks' `expected_m` at every measured
    batch (0: not even at the smallest; rows without both timings end the run)."""
    bound = 0.0
    for row in sorted(rows, key=lambda r: r["tokens"]):
        ours, theirs = row["us"].get("received_rows"), row["us"].get("deep_gemm_dp")
        if ours is None or theirs is None or ours >= theirs:
            break
        bound = row["tokens"] * top_k / experts
    return bound


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


# probe scheme -> the weight layout of tests/kernels/test_fp8_join_gpu.py::_quantize_weight
WEIGHTS = {"block": "block", "channel": "token", "tensor": "tensor", "tensor_static": "tensor"}


def _layer(scheme: str, experts: int, hidden: int, inter: int):
    """(w1, w2, quant config the Triton paths read, quant config DeepGEMM reads or None)."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    from tests.kernels.test_fp8_join_gpu import _quantize_weight

    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    (q1, s1), (q2, s2) = (_quantize_weight(w.bfloat16(), WEIGHTS[scheme]) for w in (w1, w2))
    if scheme == "channel":
        qc = fp8_w8a8_moe_quant_config(s1, s2, per_act_token_quant=True, per_out_ch_quant=True)
        return q1, q2, qc, None
    if scheme == "tensor":  # dynamic activation scales
        return q1, q2, fp8_w8a8_moe_quant_config(s1, s2), None
    if scheme == "tensor_static":  # a static checkpoint's input scales: received rows
        static = torch.tensor([0.02], device="cuda")
        return q1, q2, fp8_w8a8_moe_quant_config(s1, s2, a1_scale=static, a2_scale=static), None
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        prepare_fp8_moe_layer_for_deepgemm,
    )

    q1, q2, s1, s2 = prepare_fp8_moe_layer_for_deepgemm(q1, q2, s1, s2, (128, 128))
    qc = fp8_w8a8_moe_quant_config(s1.contiguous(), s2.contiguous(), block_shape=[128, 128])
    return q1, q2, qc, fp8_w8a8_moe_quant_config(s1, s2, block_shape=[128, 128])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scheme", choices=sorted(WEIGHTS), default="block")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rows", type=int, default=256, help="buffer rows per expert")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--json", default=None, help="write the table here")
    args = ap.parse_args()

    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        BatchedTritonExperts,
    )
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    from tests.helpers import moe_config
    from vllm_flashinfer_ep.experts.deep_gemm import DeepGemmExperts, dp_estimate
    from vllm_flashinfer_ep.experts.received_rows import ReceivedRowsExperts
    from vllm_flashinfer_ep.runtime import fp8_wire
    from vllm_flashinfer_ep.vllm import receive_quant

    E, K, N, R, top_k = args.experts, args.hidden, args.inter, args.rows, args.top_k

    dev = torch.device("cuda")
    torch.manual_seed(0)
    q1, q2, qc, dg_qc = _layer(args.scheme, E, K, N)
    moe = moe_config(experts=E, top_k=top_k, hidden=K, inter=N, max_num_tokens=R, device=dev)

    triton_experts = BatchedTritonExperts(moe, qc, max_num_tokens=R, num_dispatchers=1)
    rows_experts = ReceivedRowsExperts(moe, qc, max_num_tokens=R, num_dispatchers=1)
    dg_experts = sent = None
    if dg_qc is not None and is_deep_gemm_supported():
        # the MN-major copy covers the rows the forward's senders fill
        dg_experts = DeepGemmExperts(moe, dg_qc, R, 1, sent_per_rank=lambda: sent)
    elif dg_qc is not None:
        print("deep_gemm: not supported in this runtime (VLLM_USE_DEEP_GEMM?); column left out")

    x_bf16 = torch.randn(E, R, K, device=dev).bfloat16()
    ws13 = torch.empty(E * R * max(2 * N, K), device=dev, dtype=torch.bfloat16)
    ws2 = torch.empty(E * R * 2 * N, device=dev, dtype=torch.bfloat16)
    outputs = {p: torch.zeros(E, R, K, device=dev, dtype=torch.bfloat16) for p in PATHS[:4]}
    counts = torch.zeros(E, dtype=torch.int32, device=dev)

    def apply(experts, out, tokens: int, hidden, scales) -> None:
        experts.apply(
            output=out,
            hidden_states=hidden,
            w1=q1,
            w2=q2,
            topk_weights=torch.ones(tokens, top_k, device=dev),
            topk_ids=torch.zeros(tokens, top_k, dtype=torch.int64, device=dev),
            activation=MoEActivation.SILU,
            global_num_experts=E,
            expert_map=None,
            a1q_scale=scales,
            a2_scale=experts.a2_scale,
            workspace13=ws13,
            workspace2=ws2,
            expert_tokens_meta=mk.ExpertTokensMetadata(
                expert_num_tokens=counts, expert_num_tokens_cpu=None
            ),
            apply_router_weight_on_input=False,
        )

    print(
        f"{args.scheme}-FP8 experts: E={E} hidden={K} inter={N} top_k={top_k} buffer rows={R} "
        f"({torch.cuda.get_device_name()})"
    )
    head = " | ".join(f"{p} us" for p in PATHS)
    print(f"| tokens | active experts | {head} | fastest LL path | rel L2 vs batched_triton |")
    print("|---|---|" + "---|" * len(PATHS) + "---|---|")
    rows_out = []
    for tokens in (int(b) for b in args.batches.split(",")):
        ids = torch.stack([torch.randperm(E, device=dev)[:top_k] for _ in range(tokens)])
        counts.copy_(torch.bincount(ids.flatten(), minlength=E).to(torch.int32))
        if args.scheme == "block":  # the FP8 wire's rows and scales
            xq, xs = fp8_wire.group_quantize(x_bf16.view(E * R, K))
            xq, xs = xq.view(E, R, K), xs.view(E, R, K // 128)
        else:  # what the LL prepare quantizes after receive
            xq, xs = receive_quant.quantize_expert_buffer(x_bf16, counts, qc, False)
        times: dict[str, float | None] = dict.fromkeys(PATHS)
        for name, experts in (("batched_triton", triton_experts), ("received_rows", rows_experts)):
            times[name] = _time(
                lambda e=experts, o=outputs[name], t=tokens, a=xq, s=xs: apply(e, o, t, a, s)
            )
        if dg_experts is not None:
            # world 1: vLLM's own estimate (no DP metadata); _dp: what it gives with DP ranks
            sent = tokens
            for name, fixed in (("deep_gemm", None), ("deep_gemm_dp", dp_estimate(tokens, top_k, E, R))):  # fmt: skip
                dg_experts._fixed_m = fixed
                times[name] = _time(
                    lambda t=tokens, a=xq, s=xs, o=outputs[name]: apply(dg_experts, o, t, a, s)
                )
            dg_experts._fixed_m = None
        x = torch.randn(tokens, K, device=dev, dtype=torch.bfloat16)
        weights = torch.rand(tokens, top_k, device=dev, dtype=torch.float32)
        ids32 = ids.to(torch.int32)
        times["no_ep"] = _time(
            lambda x=x, wt=weights, i=ids32: fused_experts(x, q1, q2, wt, i, quant_config=qc)
        )
        valid = torch.arange(R, device=dev)[None, :] < counts[:, None]
        ref = outputs["batched_triton"][valid].float()
        rel = {
            p: float((outputs[p][valid].float() - ref).norm() / ref.norm())
            for p in ("received_rows", "deep_gemm", "deep_gemm_dp")
            if times[p] is not None
        }
        ll = {
            p: t for p, t in times.items() if p not in ("no_ep", "deep_gemm_dp") and t is not None
        }
        fastest = min(ll, key=ll.get)
        cells = " | ".join("-" if times[p] is None else f"{times[p]:.1f}" for p in PATHS)
        rels = ", ".join(f"{p} {v:.2g}" for p, v in rel.items())
        print(
            f"| {tokens} | {int((counts > 0).sum())} | {cells} | {fastest} | {rels} |",
            flush=True,
        )
        rows_out.append(dict(tokens=tokens, us=times, fastest=fastest, rel_l2=rel))
        if any(v > 5e-2 for v in rel.values()):
            print(f"MISMATCH at {tokens} tokens: {rels}")
            return 1
    doc = dict(gpu=torch.cuda.get_device_name(), rows=rows_out)
    if dg_experts is not None:
        doc["received_rows_bound"] = bound = received_rows_bound(rows_out, top_k, E)
        print(
            f"received rows faster than deep_gemm_dp up to {bound:g} rows per expert "
            f"(VLLM_FLASHINFER_EP_DEEP_GEMM_RECEIVED_ROWS={bound:g})"
        )
    if args.json:
        with open(args.json, "w") as f:
            # the arguments less --json: no machine path in the results
            shape = {k: v for k, v in vars(args).items() if k != "json"}
            json.dump(dict(shape=shape, **doc), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
