"""GPU side of bench-fp8 (bench/fp8_run.py): the two prepares of a block-FP8 layer on one
runtime, checked against each other, then timed."""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.fp8_modes import modes
from vllm_flashinfer_ep.bench.harness import TimedModes, _Progress
from vllm_flashinfer_ep.bench.results import Row
from vllm_flashinfer_ep.runtime import pool_sizes
from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec


class Fp8Harness(TimedModes):
    def __init__(
        self, args: Any, fleets: FleetCache | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__(args, fleets, device)
        try:
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        except ImportError as exc:  # the BF16 mode quantizes with vLLM's own kernels
            raise SystemExit(
                f"bench-fp8 needs vLLM for its BF16 mode's quantization: {exc}"
            ) from None
        from vllm_flashinfer_ep.vllm import receive_quant

        self.ht = args.backend == "ht"
        self.modes = modes(args.backend)
        capacity = max(args.tokens)
        if self.ht:  # as the HT manager: eager buckets, FP8 by vLLM's quantization
            spec = FleetSpec(Algorithm.HIGH_THROUGHPUT, args.num_experts, capacity, args.hidden)
            sizes = pool_sizes.pool_sizes(Algorithm.HIGH_THROUGHPUT, capacity)
            self.rt = build_runtime(self.fleets, spec, args.top_k, self.device, sizes)
            self.rt.enable_fp8_wire(receive_quant.group_quantize)
        else:  # as the LL manager under graphs: one pooled handle per step size
            spec = FleetSpec(Algorithm.LOW_LATENCY, args.num_experts, capacity, args.hidden)
            self.rt = build_runtime(self.fleets, spec, args.top_k, self.device, list(args.tokens))
            self.rt.enable_fp8_wire()
        self.round = self.rt.round
        one = torch.ones(args.num_experts, dtype=torch.float32, device=self.device)
        self.quant_config = fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])
        rows = self.rt.capacity * self.world_size
        # LL: the experts' output stand-in (BF16 combine in both modes); HT combines its staging.
        shape = (self.rt.num_local_experts, rows, args.hidden)
        self.expert_out = (
            None if self.ht else torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
        )

    def _combine(self, out: torch.Tensor) -> None:
        if self.ht:
            self.round.combine(out)
        else:
            self.round.combine(self.expert_out, out)

    def _bf16_quant_step(self, layers, keep: list | None = None) -> None:
        from vllm_flashinfer_ep.vllm.receive_quant import (
            quantize_expert_buffer,
            quantize_received_rows,
        )

        for x, ids, w, out in layers:
            d = self.round.dispatch(x, ids, w)
            if self.ht:  # the received rows, as the HT prepare quantizes them after receive
                q, s = quantize_received_rows(d.x, self.quant_config, False)
                if keep is not None:  # one "expert": every received row (none: no scales)
                    keep.append(_one_expert(q, s))
            else:
                q, s = quantize_expert_buffer(
                    d.expert_x, d.expert_num_tokens, self.quant_config, False
                )
                if keep is not None:
                    keep.append((q.clone(), s.clone(), d.expert_num_tokens.clone()))
            self._combine(out)

    def _fp8_step(self, layers, keep: list | None = None) -> None:
        for x, ids, w, out in layers:
            d = self.round.dispatch(x, ids, w, fp8=True)
            if keep is not None:
                if self.ht:
                    keep.append(_one_expert(d.x, d.x_scale))
                else:
                    keep.append(
                        (d.expert_x.clone(), d.expert_x_scale.clone(), d.expert_num_tokens.clone())
                    )
            self._combine(out)

    def _check(self, num_tokens: int, layers) -> None:
        """Per expert (HT: all received rows), the dequantized rows' sums agree (order-free)."""
        a: list = []
        b: list = []
        self._bf16_quant_step(layers[:2], a)
        self._fp8_step(layers[:2], b)
        self._sync()
        for (qa, sa, ca), (qb, sb, cb) in zip(a, b):
            if not torch.equal(ca, cb):
                raise SystemExit(f"bench-fp8: received counts differ at T={num_tokens}")
            for e in torch.nonzero(ca).flatten().tolist()[:32]:
                n = int(ca[e])
                rows_a = qa[e, :n].float().view(n, -1, 128) * sa[e, :n, :, None]
                rows_b = qb[e, :n].float().view(n, -1, 128) * sb[e, :n, :, None]
                # E4M3 rounds each element within 2^-4 of it: both sides within 2^-3.
                tol = 0.13 * rows_a.abs().sum(0) + 1e-3
                if bool(((rows_a.sum(0) - rows_b.sum(0)).abs() > tol).any()):
                    raise SystemExit(
                        f"bench-fp8: FP8 wire rows disagree with the BF16 path's at T={num_tokens}, "
                        f"expert {e}; refusing to report timings"
                    )

    def _steps(self, layers) -> dict[str, Any]:
        steps = {
            "bf16_quant_eager": lambda: self._bf16_quant_step(layers),
            "fp8_wire_eager": lambda: self._fp8_step(layers),
        }
        if not self.ht:
            steps["bf16_quant"] = capture_graph(lambda: self._bf16_quant_step(layers)).replay
            steps["fp8_wire"] = capture_graph(lambda: self._fp8_step(layers)).replay
        return steps

    def _run_size(self, num_tokens: int, progress: _Progress) -> Row:
        layers = self._layers(num_tokens, seed=num_tokens, loud=True)
        self._check(num_tokens, layers)
        return self._measure(Row(num_tokens), self.modes, self._steps(layers), progress)

    def close(self) -> None:
        self.rt.destroy()
        self.fleets.destroy()


def _one_expert(
    q: torch.Tensor, s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HT's received rows [rows, hidden] in the check's per-expert layout [1, rows, ...]."""
    rows = q.shape[0]
    if s is None:  # nothing arrived: nothing was quantized
        s = torch.empty(rows, q.shape[1] // 128, dtype=torch.float32, device=q.device)
    return q[None].clone(), s[None].clone(), torch.tensor([rows])
