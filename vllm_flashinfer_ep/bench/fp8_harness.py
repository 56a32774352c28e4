"""GPU side of bench-fp8 (bench/fp8_run.py): one LL runtime with its FP8 wire, the two
prepares of a block-FP8 layer, checked against each other, then timed."""

from __future__ import annotations

from typing import Any

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.fp8_run import MODES
from vllm_flashinfer_ep.bench.harness import TimedModes, _Progress
from vllm_flashinfer_ep.bench.results import Row
from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetSpec
from vllm_flashinfer_ep.runtime.rounds import LowLatencyRound


class Fp8Harness(TimedModes):
    def __init__(self, args: Any) -> None:
        super().__init__(args)
        try:
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
        except ImportError as exc:  # the BF16 mode quantizes with vLLM's own kernels
            raise SystemExit(f"bench-fp8 needs vLLM for its BF16 mode's quantization: {exc}") from None
        spec = FleetSpec(Algorithm.LOW_LATENCY, args.num_experts, max(args.tokens), args.hidden)
        self.rt = build_runtime(self.fleets, spec, args.top_k, self.device, list(args.tokens))
        self.rt.enable_fp8_wire()
        self.round = LowLatencyRound(self.rt)
        one = torch.ones(args.num_experts, dtype=torch.float32, device=self.device)
        self.quant_config = fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])
        rows = self.rt.capacity * self.world_size
        # The experts' output stand-in, the same in both modes (combine is BF16 in both).
        self.expert_out = torch.zeros(
            self.rt.num_local_experts, rows, args.hidden, dtype=torch.bfloat16, device=self.device
        )

    def _bf16_quant_step(self, layers, keep: list | None = None) -> None:
        from vllm_flashinfer_ep.vllm.receive_quant import quantize_expert_buffer

        for x, ids, w, out in layers:
            d = self.round.dispatch(x, ids, w)
            q, s = quantize_expert_buffer(d.expert_x, d.expert_num_tokens, self.quant_config, False)
            if keep is not None:
                keep.append((q.clone(), s.clone(), d.expert_num_tokens.clone()))
            self.round.combine(self.expert_out, out)

    def _fp8_step(self, layers, keep: list | None = None) -> None:
        for x, ids, w, out in layers:
            d = self.round.dispatch(x, ids, w, fp8=True)
            if keep is not None:
                keep.append((d.expert_x.clone(), d.expert_x_scale.clone(), d.expert_num_tokens.clone()))
            self.round.combine(self.expert_out, out)

    def _check(self, num_tokens: int, layers) -> None:
        """Per expert, the sum of the dequantized received rows agrees (order-free)."""
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
        return {
            "bf16_quant_eager": lambda: self._bf16_quant_step(layers),
            "fp8_wire_eager": lambda: self._fp8_step(layers),
            "bf16_quant": capture_graph(lambda: self._bf16_quant_step(layers)).replay,
            "fp8_wire": capture_graph(lambda: self._fp8_step(layers)).replay,
        }

    def run(self) -> list[Row]:
        rows = []
        progress = _Progress(len(self.args.tokens) * len(MODES), self.rank == 0 and not self.args.no_progress)
        for num_tokens in self.args.tokens:
            layers = self._layers(num_tokens, seed=num_tokens, loud=True)
            self._check(num_tokens, layers)
            rows.append(self._measure(Row(num_tokens), MODES, self._steps(layers), progress))
        progress.close()
        return rows

    def close(self) -> None:
        self.rt.destroy()
        self.fleets.destroy()
