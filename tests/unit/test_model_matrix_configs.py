"""Issue 48's model matrix at config time: each published architecture
(tests/engine/model_matrix.py) x {LL, HT}, built as `vllm serve DIR --enable-expert-parallel
--all2all-backend B --load-format dummy` builds it (vLLM's serve parser, then
`validate_parsed_serve_args` and `AsyncEngineArgs.create_engine_config`, as
doctor/engine_config.py does, whose `VllmConfig.__post_init__` runs the plugin's
validation), and the verdict the product gives today: accepted, or a refusal naming the
model's property, the flag and what to use instead (none is refused today).

Two routes, each in a subprocess (the harness patches vLLM classes for the whole process):
"serve", stock `vllm serve` at dp=1 (vLLM runs no all2all, only the model rules apply; also
without EP, the baseline vLLM must build for a refusal to be the plugin's), and
"world1", with the engine tests' world-1 harness (tests/engine/world1_harness.py), the
configs the GPU session serves at EP world 1, where every rule runs (LL capacity, HT step
budget, FP8 experts). The one stand-in: GPU memory reads as an H100's 80 GiB, what the
LL memory rule checks against on the GPU (on CPU it would skip that rule). CUDA graphs:
the platform has none on CPU, so what is checked is the plugin's policy (LL keeps the
mode, HT turns it off).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.unit.script_result import script_result
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.vllm import cudagraph_policy

REPO = Path(__file__).resolve().parents[2]
LL, HT = "flashinfer_ep_low_latency", "flashinfer_ep_high_throughput"
H100_BYTES = 80 << 30

SCRIPT = r"""
import json, logging, sys
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "world1":
    import world1_harness
    world1_harness.install()
else:
    import vllm_flashinfer_ep
    vllm_flashinfer_ep.register()
import vllm
from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
from vllm.usage.usage_lib import UsageContext
from engine_models import write_config_only
from model_matrix import MODELS, config_verdict, llama4_scout, write_model
from vllm_flashinfer_ep.doctor.engine_config import parse_serve_args
from vllm_flashinfer_ep.vllm import config_rules

config_rules.device_memory_bytes = lambda: int(sys.argv[3])
logging.getLogger("vllm").setLevel(logging.ERROR)


def build(path, args):
    def make():
        parsed = parse_serve_args(path, [*args, "--load-format", "dummy"])
        validate_parsed_serve_args(parsed)
        parsed.model = parsed.model_tag
        return vllm.AsyncEngineArgs.from_cli_args(parsed).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=bool(parsed.headless)
        )

    return config_verdict(make)


result = {}
for name in MODELS:
    path = write_model(out, name)
    for backend in sys.argv[4:]:
        args = ["--enable-expert-parallel", "--all2all-backend", backend]
        result[f"{name} {backend}"] = build(path, args)
    if mode == "serve":  # the baseline the GPU session compares against
        result[f"{name} no EP"] = build(path, [])
if mode == "serve":  # Llama-4-Scout's published attn_temperature_tuning, no backend named
    published = llama4_scout() | {"attn_temperature_tuning": 4}
    result["scout as published"] = build(write_config_only(out / "scout-4", published), [])
print("RESULT" + json.dumps(result))
"""


def _run(tmp_path_factory, mode: str) -> dict:
    work = tmp_path_factory.mktemp(f"matrix-{mode}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "tests" / "engine"), str(REPO)]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env["VLLM_CONFIGURE_LOGGING"] = "0"
    for var in envs.VARIABLES:  # the package's defaults, whatever this shell sets
        env.pop(var.name, None)
    return script_result(SCRIPT, [str(work), mode, str(H100_BYTES), LL, HT], env, timeout=900)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    return _run(tmp_path_factory, "serve")


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return _run(tmp_path_factory, "world1")


ACCEPTED = (
    "deepseek-v3",
    "qwen3-235b-a22b",
    "gpt-oss-120b-mxfp4",
    "gpt-oss-120b-bf16",
    "llama-4-scout",
    "mixtral-8x7b",
)


# name -> (hidden size, routed experts, top_k, LL fleet hidden size) of the published model
SHAPES = {
    "deepseek-v3": (7168, 256, 8, 7168),
    "qwen3-235b-a22b": (4096, 128, 8, 4096),
    "gpt-oss-120b-mxfp4": (2880, 128, 4, 4096),
    "gpt-oss-120b-bf16": (2880, 128, 4, 4096),
    "llama-4-scout": (5120, 16, 1, 5120),
    "mixtral-8x7b": (4096, 8, 2, 4096),
}
PER_LAYER = ("layer_types", "moe_layers", "no_rope_layers")  # lists cut with the layers


@pytest.fixture(scope="module")
def matrix():
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    try:
        import model_matrix
    finally:
        sys.path.remove(str(REPO / "tests" / "engine"))
    return model_matrix


def test_the_matrix_covers_every_model(matrix):
    assert set(matrix.MODELS) == set(ACCEPTED) == set(SHAPES)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_plugin_reads_each_published_shape(matrix, name):
    """The shape every rule works on, read from the written config.json as doctor and the
    engine read it (model_shape), with its layers reduced consistently."""
    from vllm_flashinfer_ep.model_shape import read_shape

    entry = matrix.MODELS[name]
    config = entry.writer()
    shape = read_shape(config)
    hidden, experts, top_k, ll_hidden = SHAPES[name]
    assert (shape.hidden_size, shape.routed_experts, shape.top_k) == (hidden, experts, top_k)
    assert shape.ll_fleet_shape() == (ll_hidden, experts, top_k)
    assert shape.quant_method == entry.quantization
    layers = config["num_hidden_layers"]
    assert 2 <= layers <= 4
    for key in PER_LAYER:
        assert len(config.get(key, [None] * layers)) == layers, key


@pytest.mark.parametrize("backend", [LL, HT])
@pytest.mark.parametrize("route", ["serve", "world1"])
@pytest.mark.parametrize("name", ACCEPTED)
def test_accepted(request, route, name, backend):
    verdict = request.getfixturevalue(route)[f"{name} {backend}"]
    assert verdict["accepted"], verdict
    if route == "world1":  # the rules of an all2all engine ran on this config
        assert verdict["use_all2all"]
        if backend == LL:  # the LL capacity (LL's default budget), not lowered; vLLM
            # gives 128 sequences here (no GPU): capture sizes to 256, LL keeps 256
            assert verdict["max_num_batched_tokens"] == 256, verdict
            assert verdict["cudagraphs"] == cudagraph_policy.KEEP_REASON, verdict
        else:  # within NCCL-EP HT's tokens per rank
            assert verdict["max_num_batched_tokens"] <= 8192, verdict
            assert verdict["cudagraphs"] == cudagraph_policy.HT_REASON, verdict


@pytest.mark.parametrize("name", list(SHAPES))
def test_vllm_builds_every_model_without_ep(serve, name):
    """The no-EP baseline exists for every model: a refusal above is the plugin's."""
    assert serve[f"{name} no EP"]["accepted"], serve[f"{name} no EP"]


def test_deepseek_v3_is_served_block_fp8_as_published(world1):
    for backend in (LL, HT):
        verdict = world1[f"deepseek-v3 {backend}"]
        assert verdict["quantization"] == "fp8", verdict
        assert verdict["moe_backend"] != "auto", verdict  # FP8 experts pinned at config time


def test_gpt_oss_is_served_mxfp4_as_published_on_vllm_s_experts(world1):
    for backend in (LL, HT):
        verdict = world1[f"gpt-oss-120b-mxfp4 {backend}"]
        assert verdict["quantization"] == "gpt_oss_mxfp4", verdict
        assert verdict["moe_backend"] == "auto", verdict  # vLLM's MXFP4 pick, not pinned


def test_scout_s_published_attn_temperature_tuning_is_refused_by_vllm_itself(serve):
    """Why model_matrix writes True for Scout's published 4: vLLM 0.33.0's transformers
    refuses the int with no backend named, before the plugin reads anything."""
    verdict = serve["scout as published"]
    assert not verdict["accepted"]
    assert "attn_temperature_tuning" in verdict["message"], verdict
