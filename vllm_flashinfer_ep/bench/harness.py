"""GPU side of the benchmark: builds fleets/pools, checks equality, times the modes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.bench.results import MODES, PoolMemory, Row, summarize
from vllm_flashinfer_ep.runtime.capture import capture_graph
from vllm_flashinfer_ep.runtime.ep_runtime import build_runtime
from vllm_flashinfer_ep.runtime.fleet import FleetCache, FleetSpec
from vllm_flashinfer_ep.runtime.memory import memory_snapshot
from vllm_flashinfer_ep.runtime.rounds import LowLatencyRound
from vllm_flashinfer_ep.runtime.transport import moe_ep

R = TypeVar("R", bound=Row)


def torchrun_fleets() -> tuple[FleetCache, torch.device]:
    """The fleet cache and GPU of this torchrun rank (world 1 without torchrun)."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return FleetCache(rank, world_size, dist.group.WORLD), device


@contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


class TimedModes:
    """What the harnesses share: rank, GPU, fleets, and the timing (modes in rotated order)."""

    def __init__(
        self, args: Any, fleets: FleetCache | None = None, device: torch.device | None = None
    ) -> None:
        self.args = args
        if fleets is None:
            fleets, device = torchrun_fleets()
        self.fleets, self.device = fleets, torch.device(device)
        self.rank, self.world_size = fleets.rank, fleets.world_size

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _time(self, step) -> tuple[float, float]:
        """(GPU ms by CUDA events, host ms to issue) of one step (all ranks start together)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self.world_size > 1:
            dist.barrier()
        start.record()
        t0 = time.perf_counter()
        step()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        return start.elapsed_time(end), host

    def _measure(self, row: R, modes: tuple[str, ...], steps, progress: _Progress) -> R:
        samples: dict[str, list[float]] = {m: [] for m in modes}
        host: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(self.args.warmup):
            for m in modes:
                steps[m]()
        self._sync()
        n = len(modes)
        for i in range(self.args.steps):
            for m in modes[i % n :] + modes[: i % n]:  # rotate the order
                gpu_ms, host_ms = self._time(steps[m])
                samples[m].append(gpu_ms)
                host[m].append(host_ms)
        for _ in modes:
            progress.update()
        for m in modes:
            row.median_ms[m], row.min_ms[m], row.max_ms[m] = summarize(samples[m])
            row.host_ms[m] = summarize(host[m])[0]
        return row

    def _layers(self, num_tokens: int, seed: int, loud: bool = False, outputs: bool = True):
        """`args.layers` layers of (x, ids, weights[, output]) for one step; `loud`: rows of
        very different magnitude (1-21x), where per-row FP8 scales differ."""
        gen = torch.Generator(device=self.device).manual_seed(seed * 1000 + self.rank)
        layers = []
        for _ in range(self.args.layers):
            scale = None
            if loud:
                scale = 1 + 20 * torch.rand(num_tokens, 1, device=self.device, generator=gen)
            x = torch.randn(num_tokens, self.args.hidden, device=self.device, generator=gen)
            x = (x if scale is None else x * scale).to(torch.bfloat16)
            ids, w = random_routing(
                num_tokens, self.args.num_experts, self.args.top_k, self.device, gen
            )
            layers.append((x, ids, w, torch.empty_like(x)) if outputs else (x, ids, w))
        return layers

    def run(self) -> list:
        progress = _Progress(
            len(self.args.tokens) * len(self.modes), self.rank == 0 and not self.args.no_progress
        )
        rows = [self._run_size(num_tokens, progress) for num_tokens in self.args.tokens]
        progress.close()
        return rows

    def host_profile(self, steps, modes: tuple[str, ...], repeats: int = 20, top: int = 14) -> str:
        import cProfile
        import io
        import pstats

        report = []
        for m in modes:
            steps[m]()
            self._sync()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(repeats):
                steps[m]()
            prof.disable()
            self._sync()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
            report.append(f"=== host profile: {m}, {repeats} steps ===\n{buf.getvalue()}")
        return "\n".join(report)


class Harness(TimedModes):
    def __init__(
        self, args: Any, fleets: FleetCache | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__(args, fleets, device)
        self.modes = MODES
        capacity = max(args.tokens)
        spec = FleetSpec(Algorithm.LOW_LATENCY, args.num_experts, capacity, args.hidden)
        # Memory before the fleet, after the first pooled handle (lazy LL buffers), after all.
        before = memory_snapshot(self.device)
        self.fresh_rt = build_runtime(self.fleets, spec, args.top_k, self.device, [])
        self.pool_rt = build_runtime(self.fleets, spec, args.top_k, self.device, [])
        with _env(envs.NATIVE_EAGER, "0"):  # the pool through FlashInfer's handle methods
            self.fi_rt = build_runtime(self.fleets, spec, args.top_k, self.device, [])
        pool = self.pool_rt.pool
        pool.warm([min(args.tokens)])
        after_first = memory_snapshot(self.device)
        pool.warm(args.tokens)
        after_all = memory_snapshot(self.device)
        self.fi_rt.pool.warm(args.tokens)
        self.memory = PoolMemory.from_snapshots(
            before,
            after_first,
            after_all,
            handles=len(pool.sizes),
            median_handle_bytes=pool.per_handle_bytes,
            first_handle_bytes=pool.first_handle_bytes,
        )
        self.fleet = self.fleets.get(spec)
        self.scales = [torch.ones(args.num_experts, device=self.device) for _ in range(args.layers)]
        if args.expert_compute:
            gen = torch.Generator(device=self.device).manual_seed(1)
            self.scales = [
                torch.rand(args.num_experts, device=self.device, generator=gen) + 0.5
                for _ in range(args.layers)
            ]
        self._raw_handles: dict[int, Any] = {}
        self._raw_ids = torch.zeros(capacity, args.top_k, dtype=torch.int64, device=self.device)
        self._raw_w = torch.zeros(capacity, args.top_k, dtype=torch.float32, device=self.device)

    def _expert(self, expert_x: torch.Tensor, counts: torch.Tensor, layer: int) -> torch.Tensor:
        if not self.args.expert_compute:
            return expert_x
        from vllm_flashinfer_ep.bench.expert_kernel import scale_valid_rows_

        return scale_valid_rows_(expert_x, counts, self.scales[layer])

    def _package_step(self, rnd: LowLatencyRound, layers) -> None:
        for i, (x, ids, w, out) in enumerate(layers):
            d = rnd.dispatch(x, ids, w)
            rnd.combine(self._expert(d.expert_x, d.expert_num_tokens, i), out)

    def _raw_handle(self, num_tokens: int) -> Any:
        handle = self._raw_handles.get(num_tokens)
        if handle is None:
            fi = moe_ep()
            ids = self._raw_ids[:num_tokens]
            rows = torch.arange(num_tokens, device=self.device).unsqueeze(1) * self.args.top_k
            ids.copy_(
                (rows + torch.arange(self.args.top_k, device=self.device)) % self.args.num_experts
            )
            self._raw_w[:num_tokens].fill_(1.0 / self.args.top_k)
            handle = self.fleet.create_handle(
                fi.HandleParams(topk_ids=ids),
                algo_knobs=[fi.HandleAlgoKnobTopKWeights(weights=self._raw_w[:num_tokens])],
            )
            handle.update(fi.HandleParams(topk_ids=ids))
            self._sync()
            self._raw_handles[num_tokens] = handle
        return handle

    def _raw_step(self, layers, bind: bool) -> None:
        fi = moe_ep()
        num_tokens = layers[0][0].shape[0]
        handle = self._raw_handle(num_tokens)
        ids_buf, w_buf = self._raw_ids[:num_tokens], self._raw_w[:num_tokens]
        for i, (x, ids, w, out) in enumerate(layers):
            w_buf.copy_(w)
            if bind:
                handle.update(fi.HandleParams(topk_ids=ids))
            else:
                ids_buf.copy_(ids)
                handle.update(fi.HandleParams(topk_ids=ids_buf))
            d = handle.dispatch(fi.DispatchInputParams(x=[x]))
            handle.combine(
                fi.CombineInputParams(
                    x=[self._expert(d.expert_tensors, d.expert_counts, i)], out=out
                )
            )

    def _raw_fresh_step(self, layers) -> None:
        """FlashInfer's own per-forward path: a handle per layer, dispatch, combine, destroy."""
        fi = moe_ep()
        for i, (x, ids, w, out) in enumerate(layers):
            knobs = [fi.HandleAlgoKnobTopKWeights(weights=w)]
            if self.device.type == "cuda":
                knobs.append(
                    fi.HandleAlgoKnobUserStream(stream=torch.cuda.current_stream().cuda_stream)
                )
            handle = self.fleet.create_handle(fi.HandleParams(topk_ids=ids), algo_knobs=knobs)
            try:
                d = handle.dispatch(fi.DispatchInputParams(x=[x]))
                handle.combine(
                    fi.CombineInputParams(
                        x=[self._expert(d.expert_tensors, d.expert_counts, i)], out=out
                    )
                )
            finally:
                handle.destroy()

    def _steps(self, num_tokens: int):
        fresh, pooled, pooled_fi = self.fresh_rt.round, self.pool_rt.round, self.fi_rt.round
        # The same inputs in every mode: FlashInfer memoizes descriptors by address in a
        # bounded cache, which separate inputs would make the modes evict, unlike a served step.
        inputs = self._layers(num_tokens, seed=num_tokens)
        sets = {m: [(x, ids, w, torch.empty_like(x)) for x, ids, w, _ in inputs] for m in MODES}
        steps = {
            "fresh": lambda: self._package_step(fresh, sets["fresh"]),
            "pooled": lambda: self._package_step(pooled, sets["pooled"]),
            "pooled_fi": lambda: self._package_step(pooled_fi, sets["pooled_fi"]),
            "raw_fresh": lambda: self._raw_fresh_step(sets["raw_fresh"]),
            # Eager raw_bind: the same calls as the pool's eager round (ids bound, weights copied).
            "raw_eager": lambda: self._raw_step(sets["raw_eager"], bind=True),
        }
        graphs = {
            "graph": capture_graph(lambda: self._package_step(pooled, sets["graph"])),
            "raw": capture_graph(lambda: self._raw_step(sets["raw"], bind=False)),
            "raw_bind": capture_graph(lambda: self._raw_step(sets["raw_bind"], bind=True)),
        }
        for name, graph in graphs.items():
            steps[name] = graph.replay
        return sets, steps

    def _run_size(self, num_tokens: int, progress: _Progress) -> Row:
        sets, steps = self._steps(num_tokens)
        self._check_equal(num_tokens, sets, steps)
        row = self._measure(Row(num_tokens), MODES, steps, progress)
        if (
            getattr(self.args, "host_profile", False)
            and num_tokens == self.args.tokens[0]
            and self.rank == 0
        ):
            print(self.host_profile(steps, ("pooled", "pooled_fi", "raw_eager")), file=sys.stderr)
        return row

    def _check_equal(self, num_tokens: int, sets, steps) -> None:
        for m in MODES:
            for *_, out in sets[m]:
                out.zero_()
            steps[m]()
        self._sync()
        for li in range(self.args.layers):
            x, ids, w, _ = sets["fresh"][li]
            want = (
                reference_moe(x, ids, w, self.scales[li])
                if self.world_size == 1
                else sets["fresh"][li][3]
            )
            for m in MODES:
                got = sets[m][li][3]
                if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
                    err = (got.float() - want.float()).abs().max().item()
                    raise SystemExit(
                        f"bench: mode {m!r} disagrees at T={num_tokens}, layer {li} (max abs err "
                        f"{err:.3g}); refusing to report timings"
                    )

    def close(self) -> None:
        for handle in self._raw_handles.values():
            handle.destroy()
        self.fresh_rt.destroy()
        self.pool_rt.destroy()
        self.fi_rt.destroy()
        self.fleets.destroy()


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._draw()

    def update(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
