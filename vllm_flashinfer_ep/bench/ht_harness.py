"""GPU side of the HT benchmark: builds the runtimes, checks equality, times the modes."""

from __future__ import annotations

import sys
from typing import Any

import torch

from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.harness import TimedModes, _Progress
from vllm_flashinfer_ep.bench.ht_results import HtRow, modes
from vllm_flashinfer_ep.bench.reference import reference_moe
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.runtime.limits import (
    MAX_TOPK_LL,
    SUPPORTED_HIDDEN_SIZES,
    unsupported_hidden_size_reason,
)
from vllm_flashinfer_ep.runtime.transport import moe_ep

# (activations, topk_ids, topk_weights) of one layer; shared by every mode.
Layer = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class HtHarness(TimedModes):
    def __init__(
        self, args: Any, fleets: FleetCache | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__(args, fleets, device)
        capacity = max(args.tokens)
        spec = FleetSpec(Algorithm.HIGH_THROUGHPUT, args.num_experts, capacity, args.hidden)
        # No pool sizes: fresh handles, the HT manager's path where no pooled size fits.
        self.ht_rt = build_runtime(self.fleets, spec, args.top_k, self.device, [])
        self.fleet = self.ht_rt.fleet  # raw_ht_fresh creates its handles on the same fleet
        rows = self.ht_rt.capacity * self.world_size
        self._raw_received = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._raw_combine_in = torch.zeros(
            rows, args.hidden, dtype=torch.bfloat16, device=self.device
        )
        self._ones = torch.ones(args.num_experts, device=self.device)
        self.ll_rt = None
        self.ll_skipped = self._ll_skip_reason()
        if self.ll_skipped is None:
            ll_spec = FleetSpec(Algorithm.LOW_LATENCY, args.num_experts, capacity, args.hidden)
            self.ll_rt = build_runtime(
                self.fleets, ll_spec, args.top_k, self.device, list(args.tokens)
            )
        elif not args.no_ll and self.rank == 0:
            print(f"bench-ht: ll_pooled skipped: {self.ll_skipped}", file=sys.stderr)
        self.pooled_rt = None
        if getattr(args, "ht_pooled", False):
            self.pooled_rt = build_runtime(
                self.fleets, spec, args.top_k, self.device, list(args.tokens)
            )
        self.modes = modes(self.ll_rt is not None, self.pooled_rt is not None)

    def _ll_skip_reason(self) -> str | None:
        if self.args.no_ll:
            return "--no-ll"
        if self.args.hidden not in SUPPORTED_HIDDEN_SIZES:
            return (
                f"{unsupported_hidden_size_reason(self.args.hidden)} "
                f"(NCCL-EP LL sizes: {list(SUPPORTED_HIDDEN_SIZES)})"
            )
        if self.args.top_k > MAX_TOPK_LL:
            return f"top_k {self.args.top_k} is above the LL limit of {MAX_TOPK_LL}"
        return None

    def _expert(
        self, mode: str, x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Identity experts, weighted and reduced per received row: out = x * sum_k w[k].
        `mode` names the caller so a test can break one mode alone."""
        return torch.mul(x, weights.sum(dim=1, keepdim=True), out=out)

    def _ht_step(self, layers: list[Layer], outs: list[torch.Tensor], pooled: bool = False) -> None:
        """The package's HT path, as the HT prepare/finalize drives it."""
        rnd = self.pooled_rt.round if pooled and self.pooled_rt is not None else self.ht_rt.round
        for (x, ids, w), out in zip(layers, outs, strict=True):
            d = rnd.dispatch(x, ids, w)
            received = d.x.shape[0]
            if received:
                self._expert("ht", d.x, d.topk_weights, rnd.combine_buffer(received))
            rnd.combine(out)

    def _raw_ht_fresh_step(self, layers: list[Layer], outs: list[torch.Tensor]) -> None:
        """FlashInfer's own per-forward path: a handle per layer, destroyed after its combine."""
        fi = moe_ep()
        hidden = self.args.hidden
        for (x, ids, w), out in zip(layers, outs, strict=True):
            knobs = [
                fi.HandleAlgoKnobTopKWeights(weights=w),
                fi.HandleAlgoKnobNumReceivedTokens(target=self._raw_received),
            ]
            if self.device.type == "cuda":
                knobs.insert(
                    0, fi.HandleAlgoKnobUserStream(stream=torch.cuda.current_stream().cuda_stream)
                )
            handle = self.fleet.create_handle(fi.HandleParams(topk_ids=ids), algo_knobs=knobs)
            try:
                d = handle.dispatch(fi.DispatchInputParams(x=[x]))
                received = int(self._raw_received.item())
                if received:
                    local = d.recv_topk_idx[:received] >= 0
                    weights = torch.where(local, d.recv_topk_weights[:received], 0.0)
                    recv_x = d.expert_tensors.reshape(-1, hidden)[:received]
                    self._expert("raw_ht_fresh", recv_x, weights, self._raw_combine_in[:received])
                handle.combine(fi.CombineInputParams(x=[self._raw_combine_in], out=out))
            finally:
                handle.complete()
                handle.destroy()

    def _ll_step(self, layers: list[Layer], outs: list[torch.Tensor]) -> None:
        """The package's LL eager round on its pool (identity experts: the received rows)."""
        assert self.ll_rt is not None
        rnd = self.ll_rt.round
        for (x, ids, w), out in zip(layers, outs, strict=True):
            d = rnd.dispatch(x, ids, w)
            rnd.combine(d.expert_x, out)

    def _steps(self, num_tokens: int):
        layers: list[Layer] = self._layers(num_tokens, seed=num_tokens, outputs=False)
        outs = {m: [torch.empty_like(x) for x, _, _ in layers] for m in self.modes}
        step_fns = {
            "ht": self._ht_step,
            "raw_ht_fresh": self._raw_ht_fresh_step,
            "ll_pooled": self._ll_step,
            "ht_pooled": lambda lay, o: self._ht_step(lay, o, pooled=True),
        }
        steps = {m: (lambda fn=step_fns[m], o=outs[m]: fn(layers, o)) for m in self.modes}
        return layers, outs, steps

    def _run_size(self, num_tokens: int, progress: _Progress) -> HtRow:
        layers, outs, steps = self._steps(num_tokens)
        self._check_equal(num_tokens, layers, outs, steps)
        return self._measure(HtRow(num_tokens), self.modes, steps, progress)

    def _check_equal(self, num_tokens: int, layers: list[Layer], outs, steps) -> None:
        """Every mode must give every token back as itself, at any EP world size."""
        for m in self.modes:
            for out in outs[m]:
                out.zero_()
            steps[m]()
        self._sync()
        for li, (x, ids, w) in enumerate(layers):
            want = reference_moe(x, ids, w, self._ones).float()
            for m in self.modes:
                got = outs[m][li].float()
                if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
                    err = (got - want).abs().max().item()
                    raise SystemExit(
                        f"bench-ht: mode {m!r} disagrees at T={num_tokens}, layer {li} (max abs err "
                        f"{err:.3g}); refusing to report timings"
                    )

    def close(self) -> None:
        self.ht_rt.destroy()
        if self.pooled_rt is not None:
            self.pooled_rt.destroy()
        if self.ll_rt is not None:
            self.ll_rt.destroy()
        self.fleets.destroy()
