"""The received-rows LL experts (vllm/compact_experts.py) against vLLM's batched kernel (GPU).

Same expert-major buffer, counts and weights through vLLM 0.33.0's
`BatchedTritonExperts.apply` as vLLM ships it and through the same class with the
package's wrapper; the received rows must agree. Counts include the buffer's edges (an
expert filled to the last row, experts with none), and the wrapper is captured in a CUDA
graph and replayed with other counts (the block list is rebuilt on the device).
Needs the real vLLM runtime on the GPU (docs/contributing/gpu_runs.md).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_vllm_join_gpu import INTERMEDIATE as INTER
from tests.kernels.test_vllm_join_gpu import (
    TOP_K,
    _modules,
    _moe_config,
    vllm_env,  # noqa: F401 - fixture
)
from vllm_flashinfer_ep.runtime.capture import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("listed_activation")]


EXPERTS, HIDDEN, ROWS = 64, 2048, 256  # INTER 512, TOP_K 8: the join test's


def _experts(compact: bool, sent_per_rank=None):
    cfg, _, _, batched_experts, *_ = _modules()
    from vllm_flashinfer_ep.vllm import compact_experts

    moe = _moe_config(HIDDEN, ROWS, num_experts=EXPERTS)
    experts = batched_experts(
        moe_config=moe,
        quant_config=cfg.FUSED_MOE_UNQUANTIZED_CONFIG,
        max_num_tokens=ROWS,
        num_dispatchers=1,
    )
    if compact:
        assert compact_experts.install(experts, sent_per_rank)
    return experts


class Problem:
    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        dev = torch.device("cuda", 0)
        self.w1 = (
            torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, generator=gen) / HIDDEN**0.5
        ).bfloat16()
        self.w2 = (
            torch.randn(EXPERTS, HIDDEN, INTER, device=dev, generator=gen) / INTER**0.5
        ).bfloat16()
        self.hidden = torch.randn(EXPERTS, ROWS, HIDDEN, device=dev, generator=gen).bfloat16()
        self.counts = torch.zeros(EXPERTS, dtype=torch.int32, device=dev)
        self.ws13 = torch.empty(
            EXPERTS * ROWS * max(2 * INTER, HIDDEN), device=dev, dtype=torch.bfloat16
        )
        self.ws2 = torch.empty(EXPERTS * ROWS * 2 * INTER, device=dev, dtype=torch.bfloat16)

    def run(self, experts, tokens: int, output: torch.Tensor) -> None:
        _, mk, act, *_ = _modules()
        experts.apply(
            output=output,
            hidden_states=self.hidden,
            w1=self.w1,
            w2=self.w2,
            topk_weights=torch.ones(tokens, TOP_K, device="cuda"),
            topk_ids=torch.zeros(tokens, TOP_K, dtype=torch.int64, device="cuda"),
            activation=act.SILU,
            global_num_experts=EXPERTS,
            expert_map=None,
            a1q_scale=None,
            a2_scale=None,
            workspace13=self.ws13,
            workspace2=self.ws2,
            expert_tokens_meta=mk.ExpertTokensMetadata(
                expert_num_tokens=self.counts, expert_num_tokens_cpu=None
            ),
            apply_router_weight_on_input=False,
        )


def _routed_counts(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return torch.bincount(ids.flatten(), minlength=EXPERTS).to(torch.int32)


def _edge_counts() -> torch.Tensor:
    counts = torch.zeros(EXPERTS, dtype=torch.int32)
    counts[0], counts[1], counts[EXPERTS - 1] = ROWS, ROWS - 1, 17  # full, one short, odd
    counts[2:TOP_K] = 1
    return counts


def _assert_rows_close(counts: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> None:
    valid = torch.arange(ROWS, device="cuda")[None, :] < counts.cuda()[:, None]
    g, w = got[valid].float(), want[valid].float()
    assert torch.isfinite(g).all()
    rel = float((g - w).norm() / w.norm().clamp_min(1e-9))
    assert rel < 1e-2, f"relative L2 error {rel:.3g} over {int(valid.sum())} rows"


@pytest.mark.parametrize(
    ("tokens", "counts"),
    [
        pytest.param(1, _routed_counts(1, 1), id="decode-1"),
        pytest.param(13, _routed_counts(13, 2), id="decode-13"),
        pytest.param(200, _routed_counts(200, 3), id="batch-200"),
        pytest.param(ROWS, _edge_counts(), id="buffer-edges"),
    ],
)
def test_received_rows_match_vllm_s_batched_kernel(vllm_env, tokens, counts):  # noqa: F811
    p = Problem(seed=tokens)
    p.counts.copy_(counts)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(compact=False), tokens, want)
    p.run(_experts(compact=True), tokens, got)
    torch.cuda.synchronize()
    _assert_rows_close(counts, got, want)


def test_captured_block_list_follows_new_counts(vllm_env):  # noqa: F811
    p = Problem(seed=5)
    tokens = 32
    compact, batched = _experts(compact=True), _experts(compact=False)
    got = torch.zeros(EXPERTS, ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    p.counts.copy_(_routed_counts(tokens, 10))
    p.run(compact, tokens, got)  # eager first: Triton compiles outside the capture
    graph = capture_graph(lambda: p.run(compact, tokens, got))
    for seed in (11, 12):
        counts = _routed_counts(tokens, seed)
        p.counts.copy_(counts)
        graph.replay()
        want = torch.zeros_like(got)
        p.run(batched, tokens, want)
        torch.cuda.synchronize()
        _assert_rows_close(counts, got, want)
    del graph


def test_a_padded_round_computes_every_received_row(vllm_env):  # noqa: F811
    """One real token on a 256-token pooled handle: 256 x top_k rows arrive (the pad rows
    too). With the pool's `sent_per_rank` the block list covers them all."""
    p = Problem(seed=7)
    counts = _routed_counts(ROWS, 13)  # what 256 sent tokens bring
    p.counts.copy_(counts)
    want = torch.full((EXPERTS, ROWS, HIDDEN), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = want.clone()
    p.run(_experts(compact=False), 1, want)
    p.run(_experts(compact=True, sent_per_rank=lambda: ROWS), 1, got)
    torch.cuda.synchronize()
    _assert_rows_close(counts, got, want)
