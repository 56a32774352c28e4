"""Issue 48's model matrix through the real vLLM 0.33.0 engine at EP world 1.

The published architectures of model_matrix.py (layers reduced, `--load-format dummy`),
each accepted one under LL with CUDA graphs and under HT, through the world-1 harness
(world1_harness.py) and engine_runner like test_engine_world1.py. gpt-oss-120b runs twice:
as published (gpt-oss-120b-mxfp4: vLLM's MXFP4 experts, BatchedMarlinExperts under LL) and
with BF16 experts (gpt-oss-120b-bf16: the received-rows experts with its biases and
clamped SwiGLU); under LL its hidden 2880 is padded to 4096.

Weights: vLLM's dummy loader fills every tensor from its own generator seeded 1234
(`initialize_single_dummy_weight`), so two engines whose parameters have the same shapes
hold the same weights; at EP world 1 every expert is local, so the EP engines' shapes are
the no-EP engine's (under LL's padded hidden size the harness gives the padded expert
tensors the unpadded engine's values: world1_harness.unpad_dummy_experts). Its values (uniform +-1e-3, norms 1) would make every block's output
~1e-3 of its input, and a wrong MoE output would move prompt logprobs by far less than
the tolerance; every engine here therefore runs with the harness's DUMMY_SCALE_ENV, which
rescales them deterministically to std 1/sqrt(fan_in) (world1_harness.scale_dummy_weights).
test_the_reference_is_not_flat checks that the logprobs then spread.

Tolerance: test_engine_world1.py's rule: mean and p95 |delta logprob| of the EP engine vs
the engine without EP (CUDA graphs) within 1.5x vLLM's own graphs-vs-eager difference
without EP on the same model (the floor, per architecture). DeepSeek-V3 runs as published,
block FP8: its no-EP engines on vLLM's Triton experts and both with FP8 start-up switches
(no DeepGEMM warm-up of every shape, no FlashInfer autotuning), as test_engine_fp8_world1
and bench_engine run block FP8.

Weights as model_matrix writes them (parameters counted on the meta device; BF16 but
DeepSeek-V3's FP8 linears), one engine at a time on one 80 GB H100, each at
gpu_memory_utilization 0.5 (40 GiB) like the other world-1 engine tests:
    deepseek-v3      4 layers (3 dense + 1 MoE): 15.1 B params, 1.85 B BF16 embedding and
                     head + 13.3 B FP8 (11.3 B routed experts)  ~ 17.0 GB
    qwen3-235b-a22b  2 MoE layers: 6.2 B (4.8 B experts) BF16   ~ 12.4 GB
    llama-4-scout    4 MoE layers: 10.9 B (8.1 B experts) BF16  ~ 21.8 GB
    mixtral-8x7b     2 MoE layers: 3.2 B (2.8 B experts) BF16   ~  6.3 GB
    gpt-oss-120b-bf16  2 MoE layers, BF16 experts (LL: padded to hidden 4096)
    gpt-oss-120b-mxfp4  2 MoE layers, MXFP4 experts: ~5.8 GB
Time: four engines per architecture (no EP with graphs and eager, LL with graphs, HT),
~60-100 s each with torch.compile at these sizes, DeepSeek-V3's first FP8 engine about
two minutes more in JIT builds: more than one 600 s device call with the ~150 s a fresh
machine spends unpacking. device_suite.sh's `models-NAME-ll` (the no-EP engines and LL)
and `models-NAME-ht` (HT; the no-EP engines read from the engine cache) split each
architecture in two calls; `models-NAME` runs both on a warm machine.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
from bench_engine import FP8_STARTUP_ENV, FP8_STARTUP_SPEC
from engine_models import token_sequences
from model_matrix import MODELS, moe_layer_count, write_model
from test_engine_fp8_world1 import _fp8_spec
from test_engine_world1 import DECODE, HT, LL, _assert_close, _diff, _spec, assert_switches
from world1_harness import DUMMY_SCALE_ENV

from vllm_flashinfer_ep.model_shape import read_shape

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU_MODELS = list(MODELS)  # every one accepted on both backends (test_model_matrix_configs)
GPU_MEMORY_UTILIZATION = 0.5
REFERENCE_SPREAD = 0.25  # nats: the reference's prompt logprobs vary (rescaled weights)


def _sequences(name: str) -> list[list[int]]:
    return token_sequences(16, MODELS[name].writer()["vocab_size"])


def model_spec(name: str, path: str, backend: str | None, **kw) -> dict:
    """The engine spec of `name` (written at `path`): the world-1 tests' spec with dummy
    weights and the model's vocabulary; block FP8 as the FP8 engine tests run it."""
    vocab = MODELS[name].writer()["vocab_size"]
    kw.update(
        load_format="dummy",
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        sequences=_sequences(name),
        vocab=vocab,
    )
    if MODELS[name].quantization == "fp8":
        return _fp8_spec(path, backend, **FP8_STARTUP_SPEC, **kw)
    return _spec(path, backend, **kw)


def model_env(name: str) -> dict[str, str]:
    env = {DUMMY_SCALE_ENV: "1"}
    if MODELS[name].quantization == "fp8":
        env.update(FP8_STARTUP_ENV)
    return env


@pytest.fixture(scope="session")
def matrix_models(tmp_path_factory):
    """model_matrix's configs by name; FLASHINFER_EP_TEST_MODEL_DIR keeps their paths
    fixed across device calls, so kept engine results (the no-EP references) match."""
    fixed = os.environ.get("FLASHINFER_EP_TEST_MODEL_DIR")
    root = Path(fixed) / "matrix" if fixed else tmp_path_factory.mktemp("matrix")
    return lambda name: write_model(root, name)


def _run(engines, matrix_models, name: str, backend: str | None, eager: bool = False):
    tag = {None: "noep", LL: "ll", HT: "ht"}[backend] + ("-eager" if eager else "-graph")
    spec = model_spec(name, matrix_models(name), backend, enforce_eager=eager)
    return engines.run(f"models-{name}-{tag}", spec, env=model_env(name))


def _floor(engines, matrix_models, name: str) -> dict[str, float]:
    graphs = _run(engines, matrix_models, name, None)
    eager = _run(engines, matrix_models, name, None, eager=True)
    stats = _diff(graphs["prompt_logprobs"], eager["prompt_logprobs"])
    print(f"{name} floor (no EP, graphs vs eager): {stats}")
    return stats


def _check_layers(load: dict, name: str, backend: str) -> dict:
    """Every MoE layer of the model through the package's prepare/finalize, on one
    runtime of the model's shape (LL: NCCL-EP's hidden size for it)."""
    config = MODELS[name].writer()
    shape = read_shape(config)
    algorithm = "low_latency" if backend == LL else "high_throughput"
    prefix = "FlashInferEPLowLatency" if backend == LL else "FlashInferEPHighThroughput"
    assert load["manager"] == f"{prefix}Manager", load["manager"]
    assert load["kernels"], load
    assert all(k.startswith(f"{prefix}PrepareAndFinalize+") for k in load["kernels"]), load
    assert load["num_kernels"] == moe_layer_count(config)
    assert load["kernel_runtimes"] == 1
    [rt] = load["runtimes"]
    hidden = shape.ll_fleet_shape()[0] if backend == LL else shape.hidden_size
    assert (rt["algorithm"], rt["hidden_size"], rt["num_experts"], rt["top_k"]) == (
        algorithm,
        hidden,
        shape.routed_experts,
        shape.top_k,
    )
    assert rt["world_size"] == 1
    return rt


def _no_handle_after_load(run: dict) -> None:
    """The pool holds every handle from load on: none created during capture, by a
    prefill or by a decode step (the counters test_engine_world1.py checks)."""
    [rt] = run["after_load"]["runtimes"]
    created = rt["counters"]["pooled_created"]
    assert created == len(rt["pool_sizes"]) and rt["counters"]["created_during_capture"] == 0
    for phase in ("after_prefill", "after_decode"):
        counters = run[phase]["runtimes"][0]["counters"]
        assert counters["fresh_created"] == 0, (phase, counters)
        assert counters["pooled_created"] == created, (phase, counters)
    tokens = run["decode"]["tokens"]
    assert len(tokens) == DECODE["num_prompts"]
    assert all(len(t) == DECODE["max_tokens"] for t in tokens)


@pytest.mark.parametrize("name", GPU_MODELS)
def test_the_reference_is_not_flat(engines, matrix_models, name):
    """The rescaled dummy weights give prompt logprobs that vary by position: the
    tolerance below compares something a wrong MoE output would move."""
    reference = _run(engines, matrix_models, name, None)
    values = [x for row in reference["prompt_logprobs"] for x in row]
    spread = statistics.pstdev(values)
    print(f"{name} no-EP prompt logprobs: mean {statistics.fmean(values):.3f} sd {spread:.3f}")
    assert spread > REFERENCE_SPREAD, spread


@pytest.mark.parametrize("name", GPU_MODELS)
def test_low_latency_with_cuda_graphs_matches_the_engine_without_ep(engines, matrix_models, name):
    floor = _floor(engines, matrix_models, name)
    reference = _run(engines, matrix_models, name, None)
    run = _run(engines, matrix_models, name, LL)
    load = run["after_load"]
    assert load["cudagraph_mode"] == reference["after_load"]["cudagraph_mode"]
    assert load["cudagraph_mode"] != "NONE"  # vLLM's mode for the model (Llama-4: PIECEWISE)
    rt = _check_layers(load, name, LL)
    assert load["max_num_batched_tokens"] == rt["capacity"] == 512  # a dp=2 LL rank's
    if MODELS[name].quantization == "mxfp4":  # vLLM's batched MXFP4 experts, kept
        # (BatchedHummingGroupedExperts where VLLM_HUMMING_MOE_GEMM_TYPE=grouped_masked)
        kept = ("+BatchedMarlinExperts", "+BatchedHummingGroupedExperts")
        assert all(k.endswith(kept) for k in load["kernels"]), load
    else:
        assert_switches(load)  # received-rows experts (DeepSeek-V3: or DeepGEMM's, its bound)
    _no_handle_after_load(run)
    # eager rounds during decode (0 when every decode step replays a full graph, as for the
    # tiny model); printed, not required: the decode prompts' prefill may run piecewise
    before = run["after_prefill"]["runtimes"][0]["counters"]
    after = run["after_decode"]["runtimes"][0]["counters"]
    print(
        f"{name} LL eager rounds during decode: {after['pooled_rounds'] - before['pooled_rounds']}"
    )
    _assert_close(
        run["prompt_logprobs"], reference["prompt_logprobs"], floor, f"{name} LL graphs vs no EP"
    )


@pytest.mark.parametrize("name", GPU_MODELS)
def test_high_throughput_matches_the_engine_without_ep(engines, matrix_models, name):
    floor = _floor(engines, matrix_models, name)
    reference = _run(engines, matrix_models, name, None)
    run = _run(engines, matrix_models, name, HT)
    load = run["after_load"]
    assert load["cudagraph_mode"] == "NONE"  # the package's policy for HT
    rt = _check_layers(load, name, HT)
    assert load["max_num_batched_tokens"] <= 8192
    assert rt["capacity"] == load["max_num_batched_tokens"]
    _no_handle_after_load(run)
    _assert_close(
        run["prompt_logprobs"], reference["prompt_logprobs"], floor, f"{name} HT vs no EP"
    )
