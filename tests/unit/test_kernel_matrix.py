"""(backend x hidden size) matrix on the fake transport: LL skips what NCCL-EP lacks.

The skip list comes from tests/fakes/matrix.py, which the GPU tests can share: LL cases
with an unsupported hidden size are skipped with exactly
`limits.unsupported_hidden_size_reason(K)`; HT runs every size.
"""

from __future__ import annotations

import pytest
import torch

from tests.fakes import fake_moe_ep
from tests.fakes.matrix import (
    ALGORITHM,
    MATRIX_HIDDEN_SIZES,
    backend_hidden_params,
    skip_reason,
)
from tests.fakes.runtime import build_fake_runtime
from tests.helpers import reduce_received_rows, scale_expert_rows
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY, Algorithm
from vllm_flashinfer_ep.bench.reference import random_routing, reference_moe
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime import fleet, limits

NUM_EXPERTS = 8
TOP_K = 2
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("fake")


def _round_trip(backend: str, hidden: int, num_tokens: int, seed: int):
    rt, f = build_fake_runtime(
        ALGORITHM[backend],
        hidden=hidden,
        num_experts=NUM_EXPERTS,
        capacity=16,
        top_k=TOP_K,
        sizes=[num_tokens],
    )
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, NUM_EXPERTS, TOP_K, CPU, gen)
    scales = torch.rand(NUM_EXPERTS, generator=gen) + 0.5
    out = torch.empty_like(x)
    if backend == LOW_LATENCY:
        rnd = rt.round
        d = rnd.dispatch(x, ids, weights)
        rnd.combine(scale_expert_rows(d.expert_x, scales), out)
    else:
        rnd = rt.round
        d = rnd.dispatch(x, ids, weights)
        n = d.x.shape[0]
        reduce_received_rows(d.x, d.topk_ids, d.topk_weights, scales, rnd.combine_buffer(n))
        rnd.combine(out)
    assert f.params.token_hidden_size == hidden
    return out, reference_moe(x, ids, weights, scales)


@pytest.mark.parametrize(("backend", "hidden"), backend_hidden_params())
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_round_trip_matrix(backend, hidden, num_tokens):
    out, expected = _round_trip(backend, hidden, num_tokens, seed=hidden + num_tokens)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_matrix_skips_exactly_the_unsupported_ll_sizes():
    params = {p.id: p for p in backend_hidden_params()}
    assert set(params) == {
        f"{b}-h{h}" for b in (LOW_LATENCY, HIGH_THROUGHPUT) for h in MATRIX_HIDDEN_SIZES
    }
    for hidden in (256, 3072):
        (mark,) = params[f"{LOW_LATENCY}-h{hidden}"].marks
        assert mark.name == "skip"
        assert (
            mark.kwargs["reason"]
            == f"unsupported hidden size {hidden} for flashinfer_ep_low_latency"
        )
        assert mark.kwargs["reason"] == limits.unsupported_hidden_size_reason(hidden)
        assert params[f"{HIGH_THROUGHPUT}-h{hidden}"].marks == []
    for hidden in (2048, 7168):
        assert params[f"{LOW_LATENCY}-h{hidden}"].marks == []
        assert skip_reason(LOW_LATENCY, hidden) is None
    assert all(skip_reason(HIGH_THROUGHPUT, h) is None for h in (1, 256, 3072, 9000))


@pytest.mark.parametrize("hidden", [256, 3072])
def test_unsupported_ll_sizes_are_refused_by_the_runtime_with_the_same_reason(hidden):
    with pytest.raises(FlashInferEPConfigError) as exc:
        fleet.FleetSpec(Algorithm.LOW_LATENCY, NUM_EXPERTS, 16, hidden)
    assert str(exc.value).startswith(limits.unsupported_hidden_size_reason(hidden))
    # ... and by the transport itself (what a skip protects the GPU tests from).
    boot = fake_moe_ep.BootstrapConfig(world_size=1, rank=0)
    with pytest.raises(fake_moe_ep.MoEEpConfigError, match=f"token_hidden_size={hidden}"):
        fake_moe_ep.create_fleet(boot, fake_moe_ep.FleetParams(NUM_EXPERTS, 16, hidden))


def test_supported_sizes_agree_with_flashinfer():
    common = pytest.importorskip("flashinfer.moe_ep.core.validation.common")
    assert tuple(limits.SUPPORTED_HIDDEN_SIZES) == tuple(common._NCCL_EP_LL_HIDDEN_SIZES)
    assert fake_moe_ep.NCCL_EP_LL_HIDDEN_SIZES == tuple(common._NCCL_EP_LL_HIDDEN_SIZES)
