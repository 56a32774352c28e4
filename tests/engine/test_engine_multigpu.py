"""dp=2 engines on two GPUs: what EP world 1 cannot show (no harness here).

`vllm serve --data-parallel-size 2 --enable-expert-parallel` with either backend, on a
generated tiny Qwen3-MoE checkpoint (tests/engine/engine_models.py), real NCCL-EP between
the two ranks:
- concurrent requests of different lengths land on the two DP ranks with different loads,
  so every step pads to the count the ranks agreed on (and an idle rank runs dummy
  steps); teacher-forced prompt logprobs must match the same model without EP (dp=1,
  `vllm.LLM`) within the tolerance of tests/engine/test_engine_world1.py, whose noise floor
  (vLLM's own graphs-vs-eager difference without EP) is measured here too;
- LL with CUDA graphs, HT eager, and LL with EPLB rearranging experts while it serves;
- no server log line says a round ran off the handles made at load.
Fault tolerance across ranks: tests/fault_tolerance/. Transport-level multi-rank tests:
tests/kernels/test_*_multigpu.py. Device suite step: `multigpu`.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
from engine_models import qwen3_moe_config, token_sequences
from engine_runner import engine_env
from serve_process import off_the_pool, post, serve_command, served
from test_engine_world1 import MEAN_MIN, P95_MIN, _assert_close, _diff

from tests.helpers import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow]

LL = "flashinfer_ep_low_latency"
HT = "flashinfer_ep_high_throughput"
VOCAB = qwen3_moe_config(2048)["vocab_size"]
SEQUENCES = token_sequences(16, VOCAB)
# Within one 600 s device call: a tiny model's server starts in well under STARTUP_S, and
# a request that takes REQUEST_TIMEOUT_S is a hang.
STARTUP_S = 300
REQUEST_TIMEOUT_S = 120
# vLLM logs this on EP rank 0 once a rearrangement is done; its profile-run rearrangement
# (at start-up, always) says "(profile)" and does not count.
REARRANGED = re.compile(r"Rearranged experts\s+in [0-9.]+ s")
assert MEAN_MIN and P95_MIN  # the world-1 tolerance, shared


def _log_path(tmp_path: Path, name: str) -> Path:
    folder = os.environ.get("FLASHINFER_EP_TEST_ENGINE_LOG_DIR")
    return Path(folder) / f"engine-{name}.log" if folder else tmp_path / f"{name}.log"


def _prompt_logprobs(port: int, sequences: list[list[int]]) -> list[list[float]]:
    """Teacher-forced logprob of each prompt token, all sequences sent at once (vLLM's DP
    coordinator spreads them over both ranks: different loads per rank and step)."""
    rows: list[list[float] | None] = [None] * len(sequences)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        seq = sequences[i]
        try:
            reply = post(
                port,
                "/v1/completions",
                {
                    "model": "moe",
                    "prompt": seq,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "prompt_logprobs": 0,
                },
                timeout=REQUEST_TIMEOUT_S,
            )
            entries = reply["choices"][0]["prompt_logprobs"]
            rows[i] = [float(entries[p][str(seq[p])]["logprob"]) for p in range(1, len(seq))]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(sequences))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(r is not None for r in rows)
    return rows  # type: ignore[return-value]


def _decode_uneven(port: int) -> None:
    """Requests of very different lengths at once: ranks go idle at different steps."""
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            reply = post(
                port,
                "/v1/completions",
                {
                    "model": "moe",
                    "prompt": SEQUENCES[n % len(SEQUENCES)][:8],
                    "max_tokens": 4 + 20 * (n % 4),
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
                timeout=REQUEST_TIMEOUT_S,
            )
            assert reply["usage"]["completion_tokens"] == 4 + 20 * (n % 4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.fixture(scope="module")
def reference(engines, models):
    """The same model without EP (dp=1), compiled with CUDA graphs and eager: the
    reference and vLLM's own noise floor."""
    spec = {"model": models(2048), "backend": None, "sequences": SEQUENCES, "vocab": VOCAB}
    graphs = engines.run("mg-noep-graph", {**spec, "max_num_batched_tokens": 256})
    eager = engines.run("mg-noep-eager", {**spec, "enforce_eager": True})
    floor = _diff(graphs["prompt_logprobs"], eager["prompt_logprobs"])
    print(f"floor (no EP, graphs vs eager): {floor}")
    return {"graphs": graphs["prompt_logprobs"], "eager": eager["prompt_logprobs"], "floor": floor}


def dp2_command(model: str, port: int, backend: str, *extra: str) -> list[str]:
    return serve_command(
        model,
        port,
        "--served-model-name",
        "moe",
        "--data-parallel-size",
        "2",
        "--enable-expert-parallel",
        "--all2all-backend",
        backend,
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.5",
        *extra,
    )


def eplb_args() -> list[str]:
    # Synchronous EPLB: a rearrangement is done (and logged) within the step that starts it,
    # so the prompt logprobs after the uneven decodes run on rearranged experts.
    eplb = {"window_size": 8, "step_interval": 16, "log_balancedness": True, "use_async": False}
    return ["--enable-eplb", "--eplb-config", json.dumps(eplb)]


def _run_dp2(tmp_path, models, name: str, backend: str, *extra: str) -> tuple[list, str]:
    port = free_port()
    log = _log_path(tmp_path, name)
    cmd = dp2_command(models(2048), port, backend, *extra)
    env = engine_env(None, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # no harness: dp=2
    with served(cmd, env, log, port, STARTUP_S):
        _decode_uneven(port)
        rows = _prompt_logprobs(port, SEQUENCES)
        _decode_uneven(port)
    text = log.read_text(errors="replace")
    off = off_the_pool(text)
    assert not off, off[:3]
    return rows, text


def test_ll_dp2_with_graphs_matches_the_engine_without_ep(tmp_path, models, reference):
    rows, text = _run_dp2(tmp_path, models, "mg-ll-dp2", LL)
    assert "low_latency runtime" in text and "loaded:" in text
    _assert_close(rows, reference["graphs"], reference["floor"], "LL dp=2 graphs vs no EP")


def test_ht_dp2_matches_the_engine_without_ep(tmp_path, models, reference):
    rows, _ = _run_dp2(tmp_path, models, "mg-ht-dp2", HT)
    _assert_close(rows, reference["eager"], reference["floor"], "HT dp=2 vs no EP eager")


def test_ll_dp2_with_eplb_rearranges_and_still_matches(tmp_path, models, reference):
    rows, text = _run_dp2(tmp_path, models, "mg-ll-dp2-eplb", LL, *eplb_args())
    assert REARRANGED.search(text), "EPLB never rearranged while serving (only at profile)"
    _assert_close(rows, reference["graphs"], reference["floor"], "LL dp=2 EPLB vs no EP")
