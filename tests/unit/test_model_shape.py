"""One model-shape reader (vllm_flashinfer_ep/model_shape.py) for config validation and
doctor: both go through it and see the same shape, EPLB's redundant experts included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_models import QWEN3_MOE, engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import cli, doctor, model_shape
from vllm_flashinfer_ep.backends import BACKENDS, LOW_LATENCY
from vllm_flashinfer_ep.vllm import config_rules, config_validation

vllm_flashinfer_ep.register()

PACKAGE = Path(vllm_flashinfer_ep.__file__).parent


@pytest.fixture
def eplb_platform(monkeypatch):
    """vLLM refuses --enable-eplb unless the platform is CUDA-like; say it is (config only)."""
    import vllm.config.parallel as parallel

    monkeypatch.setattr(parallel.current_platform, "is_cuda_alike", lambda: True)


@pytest.fixture
def reads(monkeypatch):
    """Every call of the one reader, by caller module."""
    callers: list[str] = []
    real = model_shape.read_shape

    def spy(*args, **kwargs):
        import inspect

        frame = inspect.stack()[1]
        callers.append(Path(frame.filename).name)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_shape, "read_shape", spy)
    return callers


def test_engine_and_doctor_both_read_through_it(tmp_path, reads, monkeypatch):
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: None)
    model = write_model(tmp_path / "m")
    engine_config(model, LOW_LATENCY)
    assert "model_shape.py" in reads  # from_vllm_config, called by config_validation
    reads.clear()
    doctor.model_checks(model)
    assert reads == ["model_verdicts.py"]  # doctor's model checks


def test_no_other_reader_of_hf_config_fields():
    """The HF field names live in model_shape (and limits' top_k keys) only."""
    rules = ("config_validation.py", "config_rules.py", "fp8_experts_choice.py")
    paths = [*(PACKAGE / "doctor").glob("*.py"), *(PACKAGE / "vllm" / name for name in rules)]
    assert len(paths) > len(rules)
    for path in paths:
        text = path.read_text()
        for needle in (
            '"hidden_size"',
            "num_experts_per_tok",
            "EXPERT_COUNT_CONFIG_KEYS)",
            "torch_dtype",
            '"quantization_config"',
            "config_top_k(",
        ):
            assert needle not in text, (path.name, needle)


def test_dict_and_vllm_config_give_the_same_shape(tmp_path):
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = write_model(
        tmp_path / "fp8", quantization_config=quant, num_experts=16, num_experts_per_tok=4
    )
    from_engine = model_shape.from_vllm_config(
        engine_config(path, LOW_LATENCY, moe_backend="triton")
    )
    from_file = model_shape.read_shape(json.loads((Path(path) / "config.json").read_text()))
    assert from_engine == from_file
    assert from_file.hidden_size == 128 and from_file.routed_experts == 16 and from_file.top_k == 4
    assert from_file.dtype == "bfloat16" and from_file.quant_method == "fp8"
    assert from_file.weight_block_size == [128, 128]
    assert from_file.ll_fleet_shape() == (2048, 16, 4)


def test_text_config_and_alternative_keys():
    nested = {
        "model_type": "x",
        "torch_dtype": "float16",
        "text_config": {
            "hidden_size": 4096,
            "n_routed_experts": 64,
            "moe_topk": 6,
            "dtype": "bfloat16",
        },
    }
    shape = model_shape.read_shape(nested)
    # dtype: the root config's first (vLLM reads hf_config.dtype before the text config's)
    assert (shape.hidden_size, shape.routed_experts, shape.top_k, shape.dtype) == (
        4096,
        64,
        6,
        "float16",
    )
    assert model_shape.read_shape({"num_experts": 0, "num_local_experts": 8}).routed_experts == 8
    assert (
        model_shape.read_shape({"hidden_size": 9000, "num_experts": 8, "top_k": 2}).ll_fleet_shape()
        is None
    )


@pytest.mark.usefixtures("eplb_platform")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "serve_args",
    [
        ("--enable-eplb", "--eplb-config", '{"num_redundant_experts": 2}'),
        ("--enable-eplb", "--eplb-config.num_redundant_experts", "2"),
        ("--enable-eplb", "--eplb-config.num_redundant_experts=2"),
    ],
    ids=["json", "dotted", "dotted="],
)
def test_eplb_redundant_experts_agree(tmp_path, monkeypatch, backend, serve_args):
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: None)
    model = write_model(tmp_path / "m", num_experts=8)
    cfg = engine_config(model, backend, enable_eplb=True, eplb_config={"num_redundant_experts": 2})
    engine = model_shape.from_vllm_config(cfg)
    assert (engine.routed_experts, engine.redundant_experts, engine.physical_experts) == (8, 2, 10)
    assert config_validation._ll_fleet_shape(cfg) == (2048, 10, 2)

    seen = {}
    real = model_shape.read_shape
    monkeypatch.setattr(
        model_shape, "read_shape", lambda *a, **k: seen.setdefault("shape", real(*a, **k))
    )
    cli.main(["doctor", "--model", model, "--all2all-backend", LOW_LATENCY, *serve_args])
    assert seen["shape"] == engine


def test_eplb_without_enable_adds_nothing():
    assert model_shape.redundant_experts(False, {"num_redundant_experts": 4}) == 0
    assert model_shape.redundant_experts(True, {"num_redundant_experts": 4}) == 4
    assert model_shape.redundant_experts(True, None) == 0


def test_doctor_memory_line_counts_physical_experts(tmp_path, monkeypatch):
    monkeypatch.setattr(config_rules, "device_memory_bytes", lambda: None)
    model = write_model(
        tmp_path / "m", **dict(QWEN3_MOE, hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    )
    settings = doctor.ServeSettings(enable_eplb=True, eplb_config={"num_redundant_experts": 32})
    [est] = [
        c for c in doctor.model_checks(model, settings=settings) if c.name == "LL memory estimate"
    ]
    assert "160 experts (128 + 32 EPLB redundant), hidden 2048, top_k 8" in est.detail


@pytest.mark.parametrize(
    ("asked", "checkpoint", "served"),
    [
        ("auto", "bfloat16", "bfloat16"),
        ("auto", "float16", "float16"),
        ("auto", "float32", "bfloat16"),
        ("auto", None, None),
        ("half", "bfloat16", "float16"),
        ("float", "bfloat16", "float32"),
        ("bfloat16", "float16", "bfloat16"),
    ],
)
def test_served_dtype_follows_vllm(asked, checkpoint, served):
    assert model_shape.served_dtype(asked, checkpoint) == served
