"""Issue 48's GPU model matrix, checked on CPU: what the GPU session will run exists and
builds.

- every architecture model_matrix.py writes is a GPU case of
  tests/engine/test_engine_models_world1.py (LL with graphs and HT) with device_suite.sh
  steps (all are accepted at config time: test_model_matrix_configs.py);
- the engine specs those tests and bench_engine's published shapes hand to `vllm.LLM`
  (engine_run.engine_kwargs) build a vLLM 0.33.0 config on CPU through the world-1
  harness, as the GPU run will build it (GPU memory read as an H100's 80 GiB, as in
  test_model_matrix_configs.py), with the plugin's CUDA-graph policy as expected;
- every model's weights, counted on the meta device, fit the memory its engines get.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.script_result import script_result
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.vllm import cudagraph_policy

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "tests" / "engine"
SUITE = ENGINE / "device_suite.sh"
LL, HT = "flashinfer_ep_low_latency", "flashinfer_ep_high_throughput"
H100_BYTES = 80 << 30
BENCH_SHAPES = ("deepseek-v3", "qwen3-235b-a22b")


@pytest.fixture(scope="module")
def engine_modules(monkeypatch_module):
    monkeypatch_module.syspath_prepend(str(ENGINE))
    import bench_engine
    import model_matrix
    import test_engine_models_world1

    return model_matrix, test_engine_models_world1, bench_engine


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_every_model_has_gpu_cases(engine_modules):
    from tests.unit.test_model_matrix_configs import ACCEPTED

    matrix, gpu, _ = engine_modules
    assert gpu.GPU_MODELS == [n for n in matrix.MODELS if n in ACCEPTED]
    for test in (
        gpu.test_low_latency_with_cuda_graphs_matches_the_engine_without_ep,
        gpu.test_high_throughput_matches_the_engine_without_ep,
        gpu.test_the_reference_is_not_flat,
    ):
        [mark] = [m for m in test.pytestmark if m.name == "parametrize"]
        assert list(mark.args[1]) == gpu.GPU_MODELS, test.__name__


def _case_names(step_glob: str) -> list[str]:
    """The names a device_suite.sh step pattern (`models-*)`) accepts: its inner case list."""
    text = SUITE.read_text()
    start = text.index(f"    {step_glob})")
    inner = re.search(r"\n\s+([a-z0-9.|-]+)\) ;;", text[start:])
    assert inner, step_glob
    return inner[1].split("|")


def _header() -> str:
    return "".join(line for line in SUITE.read_text().splitlines(True) if line.startswith("#"))


def test_device_suite_has_a_step_per_gpu_model_and_bench_shape(engine_modules):
    _, gpu, bench = engine_modules
    assert _case_names("models-*") == gpu.GPU_MODELS
    assert _case_names("bench-shape-*") == list(BENCH_SHAPES)
    assert set(BENCH_SHAPES) <= set(bench.SHAPES)
    header = _header()
    for name in gpu.GPU_MODELS:
        assert f"models-{name} " in header or f"models-{name}\n" in header, name
    for name in BENCH_SHAPES:
        assert f"bench-shape-{name}" in header, name


def test_the_models_steps_select_the_right_tests(engine_modules):
    """Each step's -k expression (as the suite builds it) against the GPU file's ids."""
    _, gpu, _ = engine_modules
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(ENGINE / "test_engine_models_world1.py")]
        + ["--collect-only", "-q", "-p", "no:cacheprovider", "-o", "addopts="],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=_env(),
    )
    ids = [line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line]
    assert len(ids) == 3 * len(gpu.GPU_MODELS), proc.stdout[-2000:] + proc.stderr[-2000:]
    text = SUITE.read_text()
    assert 'sel="low_latency or not_flat"' in text and 'sel="high_throughput"' in text
    for name in gpu.GPU_MODELS:
        mine = [i for i in ids if f"[{name}]" in i]
        assert sorted(i.split("[")[0] for i in mine) == [
            "test_high_throughput_matches_the_engine_without_ep",
            "test_low_latency_with_cuda_graphs_matches_the_engine_without_ep",
            "test_the_reference_is_not_flat",
        ]
        others = [n for n in gpu.GPU_MODELS if n != name]
        assert not any(name in o for o in others)  # -k NAME picks this model only


def test_device_suite_parses():
    subprocess.run(["bash", "-n", str(SUITE)], check=True)


SCRIPT = r"""
import json, logging, sys
from pathlib import Path

import world1_harness
world1_harness.install()
import bench_engine
import test_engine_models_world1 as gpu
from engine_run import engine_kwargs
from vllm import EngineArgs
from vllm.config import CompilationConfig
from vllm.usage.usage_lib import UsageContext
from model_matrix import config_verdict
from vllm_flashinfer_ep.vllm import config_rules

work = Path(sys.argv[1])
config_rules.device_memory_bytes = lambda: int(sys.argv[2])
logging.getLogger("vllm").setLevel(logging.ERROR)


def build(spec):
    kwargs = engine_kwargs(spec)
    if isinstance(kwargs.get("compilation_config"), dict):  # as vllm.LLM converts it
        kwargs["compilation_config"] = CompilationConfig(**kwargs["compilation_config"])
    return config_verdict(
        lambda: EngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    )


result = {}
for name in gpu.GPU_MODELS:
    path = gpu.write_model(work / "matrix", name)
    for backend in (None, gpu.LL, gpu.HT):
        result[f"models {name} {backend}"] = build(gpu.model_spec(name, path, backend))
for shape in bench_engine.SHAPES:
    args = bench_engine.build_parser().parse_args(["--shape", shape])
    model, extra = bench_engine._model(shape, work / "bench")
    for config in ("no_ep", "ll_graph"):
        spec, _ = bench_engine.engine_spec(args, config, model, extra)
        result[f"bench {shape} {config}"] = build(spec)
print("RESULT" + json.dumps(result))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ENGINE), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    for var in envs.VARIABLES:  # the package's defaults, whatever this shell sets
        env.pop(var.name, None)
    return env


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-models")
    return script_result(SCRIPT, [str(work), str(H100_BYTES)], _env(), timeout=900)


GPU_NAMES = ("deepseek-v3", "qwen3-235b-a22b", "llama-4-scout", "mixtral-8x7b")


@pytest.mark.parametrize("backend", [None, LL, HT])
@pytest.mark.parametrize("name", GPU_NAMES)
def test_the_gpu_cases_build_their_engine_configs(built, name, backend):
    verdict = built[f"models {name} {backend}"]
    assert verdict["accepted"], verdict
    assert verdict["load_format"] == "dummy"
    if name == "deepseek-v3":  # block FP8 as published; no EP on vLLM's Triton experts
        assert verdict["quantization"] == "fp8", verdict
        if backend is None:
            assert verdict["moe_backend"] == "triton", verdict
    if backend is None:
        assert not verdict["use_all2all"] and verdict["max_num_batched_tokens"] == 512
        assert verdict["cudagraphs"] is None  # the plugin's policy did not run
    elif backend == LL:
        assert verdict["use_all2all"] and verdict["max_num_batched_tokens"] == 512, verdict
        assert verdict["cudagraphs"] == cudagraph_policy.KEEP_REASON, verdict
    else:
        assert verdict["use_all2all"] and verdict["max_num_batched_tokens"] <= 8192, verdict
        assert verdict["cudagraphs"] == cudagraph_policy.HT_REASON, verdict


@pytest.mark.parametrize("config", ["no_ep", "ll_graph"])
@pytest.mark.parametrize("shape", BENCH_SHAPES)
def test_the_bench_shapes_build_their_engine_configs(built, shape, config):
    verdict = built[f"bench {shape} {config}"]
    assert verdict["accepted"], verdict
    assert verdict["load_format"] == "dummy"
    assert verdict["quantization"] == ("fp8" if shape == "deepseek-v3" else None), verdict
    assert verdict["max_num_batched_tokens"] == 256
    assert verdict["use_all2all"] == (config == "ll_graph")
    if config == "ll_graph":  # CPU has no CUDA graphs: the plugin's policy is what is checked
        assert verdict["cudagraphs"] == cudagraph_policy.KEEP_REASON, verdict


# name -> (hidden, routed experts, top_k, moe intermediate, attention heads, KV heads)
PUBLISHED = {
    "deepseek-v3": (7168, 256, 8, 2048, 128, 128),
    "qwen3-235b-a22b": (4096, 128, 8, 1536, 64, 4),
}


@pytest.mark.parametrize("shape", BENCH_SHAPES)
def test_the_bench_shapes_are_the_published_ones(engine_modules, shape):
    from vllm_flashinfer_ep.model_shape import read_shape

    matrix, _, bench = engine_modules
    config = bench.SHAPES[shape]
    published = matrix.MODELS[shape].writer()
    got = read_shape(config)
    hidden, experts, top_k, inter, heads, kv_heads = PUBLISHED[shape]
    assert (got.hidden_size, got.routed_experts, got.top_k) == (hidden, experts, top_k)
    assert config["moe_intermediate_size"] == inter
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (heads, kv_heads)
    # only the layers differ from the published config (DeepSeek-V3: and its dense ones)
    differs = {k for k in published if published[k] != config.get(k)}
    assert differs <= {"num_hidden_layers", "first_k_dense_replace"}, differs
    assert bench.checkpoint_fp8(shape) == (shape == "deepseek-v3")
    assert matrix.moe_layer_count(config) == {"deepseek-v3": 4, "qwen3-235b-a22b": 10}[shape]


def test_the_bench_refuses_quantizing_an_fp8_checkpoint(engine_modules, capsys):
    _, _, bench = engine_modules
    with pytest.raises(SystemExit):
        bench.main(["--shape", "deepseek-v3", "--quantization", "fp8_per_block"])
    assert "FP8 checkpoint already" in capsys.readouterr().err


def _weight_bytes(config: dict) -> int:
    """Parameters counted on the meta device (transformers' class of the architecture),
    at 1 byte for an FP8 checkpoint's linears and 2 for BF16 (embedding and head: BF16)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    fp8 = (config.pop("quantization_config", None) or {}).get("quant_method") == "fp8"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    total = 0
    for name, param in model.named_parameters():
        bf16 = not fp8 or "embed" in name or "lm_head" in name or param.dim() < 2
        total += param.numel() * (2 if bf16 else 1)
    return total


# GB (1e9 bytes) each model's weights take, as the GPU file's docstring states them
MATRIX_GB = {
    "deepseek-v3": 17.0,
    "qwen3-235b-a22b": 12.4,
    "llama-4-scout": 21.8,
    "mixtral-8x7b": 6.3,
}
BENCH_GB = {"deepseek-v3": 50.3, "qwen3-235b-a22b": 52.3}


@pytest.mark.parametrize("name", GPU_NAMES)
def test_each_matrix_model_fits_its_engine_s_memory(engine_modules, name):
    matrix, gpu, _ = engine_modules
    weights = _weight_bytes(matrix.MODELS[name].writer())
    assert abs(weights / 1e9 - MATRIX_GB[name]) < 0.2, weights / 1e9
    # the weights, with 8 GiB left for activations, KV cache, NCCL-EP's buffers and pool
    assert weights + (8 << 30) < gpu.GPU_MEMORY_UTILIZATION * H100_BYTES


@pytest.mark.parametrize("shape", BENCH_SHAPES)
def test_each_bench_shape_fits_an_h100(engine_modules, shape):
    _, _, bench = engine_modules
    weights = _weight_bytes(bench.SHAPES[shape])
    assert abs(weights / 1e9 - BENCH_GB[shape]) < 0.3, weights / 1e9
    assert weights + (8 << 30) < 0.85 * H100_BYTES


def test_kbench_shapes_step_times_the_bench_shapes_transport(engine_modules):
    """kbench-shapes runs the LL transport at each bench shape's hidden size, experts,
    top_k and MoE layers: its step is the transport share of that engine's decode step."""
    from vllm_flashinfer_ep.model_shape import read_shape

    matrix, _, bench = engine_modules
    text = SUITE.read_text()
    start = text.index("    kbench-shapes)")
    line = next(x for x in text[start:].splitlines() if x.strip().startswith("for shape in"))
    rows = [r.split() for r in re.findall(r'"([^"]+)"', line)]
    assert [r[4] for r in rows] == list(BENCH_SHAPES)
    for hidden, experts, top_k, layers, name in rows:
        config = bench.SHAPES[name]
        shape = read_shape(config)
        assert (int(hidden), int(experts), int(top_k)) == shape.ll_fleet_shape()
        assert int(layers) == matrix.moe_layer_count(config)
