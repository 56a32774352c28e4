"""Speculative decoding under LL with CUDA graphs, through the real vLLM 0.33.0 engine.

vLLM captures decode graphs at counts the configured capture sizes lack (rounded to
1 + num_speculative_tokens), fixed after model load; the pool learns them from vLLM's
capture (runtime/capture.py). Before that, such an engine died at start-up.

Agreement rule: vLLM's `ngram` speculation keeps greedy outputs in principle, but the
verify step runs other batch shapes, so outputs may drift where BF16 rounding flips a
near-tie. The LL engine with speculation must agree with the same LL engine without it
at least as closely as the engine without EP agrees with itself with and without
speculation (that floor measured in the same run). Agreement: the fraction of decoded
tokens before each sequence's first difference.
"""

from __future__ import annotations

import pytest
from test_engine_world1 import LL, _spec

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SPEC_DECODE = {"num_prompts": 8, "prompt_len": 32, "max_tokens": 48}


def _ngram(k: int) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }


def _run(engines, models, name, backend=None, k=0, env=None):
    spec = _spec(models(2048), backend, decode=SPEC_DECODE)
    if k:
        spec["speculative_config"] = _ngram(k)
    return engines.run(name, spec, env=env)


def _agreement(a: dict, b: dict) -> float:
    total = same = 0
    for x, y in zip(a["decode"]["tokens"], b["decode"]["tokens"]):
        total += len(x)
        for p, q in zip(x, y):
            if p != q:
                break
            same += 1
    return same / total


def _assert_no_handle_after_load(run: dict) -> None:
    [rt] = run["after_load"]["runtimes"]
    load, after = rt["counters"], run["after_decode"]["runtimes"][0]["counters"]
    assert load["created_during_capture"] == 0
    assert after["pooled_created"] == load["pooled_created"] == len(rt["pool_sizes"])
    assert after["fresh_created"] == 0 and after["created_during_capture"] == 0


@pytest.mark.parametrize("k", [2, 4])
def test_ll_graphs_with_ngram_speculation_start_and_agree(engines, models, k):
    no_ep = _run(engines, models, "noep-h2048-nospec")
    no_ep_spec = _run(engines, models, f"noep-h2048-ngram{k}", k=k)
    ll = _run(engines, models, "ll-h2048-nospec", LL)
    ll_spec = _run(engines, models, f"ll-h2048-ngram{k}", LL, k=k)
    load = ll_spec["after_load"]
    assert load["cudagraph_mode"] != "NONE", load
    [rt] = load["runtimes"]
    print(
        f"k={k} runner={load['model_runner']} learned={rt['pool_learned']} pool={rt['pool_sizes']}"
    )
    # vLLM captured counts beyond the configured sizes (multiples of 1 + k) and the pool
    # learned them at capture, so start-up got through capture.
    assert rt["pool_learned"] and all(s % (1 + k) == 0 for s in rt["pool_learned"]), rt
    _assert_no_handle_after_load(ll_spec)
    floor = _agreement(no_ep_spec, no_ep)
    got = _agreement(ll_spec, ll)
    print(f"k={k}: LL spec vs LL {got:.3f}; floor (no EP spec vs no EP) {floor:.3f}")
    assert got >= floor, (got, floor)


def test_ll_graphs_with_ngram_speculation_on_the_v1_runner(engines, models):
    """The V1 runner rewrites the capture sizes after model load (vLLM's
    adjust_cudagraph_sizes_for_spec_decode): the pool learns those too."""
    run = _run(
        engines, models, "ll-h2048-ngram2-v1", LL, k=2, env={"VLLM_USE_V2_MODEL_RUNNER": "0"}
    )
    load = run["after_load"]
    assert load["model_runner"] == "v1" and load["cudagraph_mode"] != "NONE"
    [rt] = load["runtimes"]
    assert set(s for s in load["capture_sizes"] if s <= rt["capacity"]) <= set(rt["pool_sizes"])
    _assert_no_handle_after_load(run)
    assert all(len(t) == SPEC_DECODE["max_tokens"] for t in run["decode"]["tokens"])
