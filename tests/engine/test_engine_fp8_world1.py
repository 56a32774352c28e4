"""FP8 MoE models through the real vLLM 0.33.0 engine with the plugin (world 1).

Three FP8 forms of the tiny Qwen3-MoE of test_engine_world1.py (hidden 2048, 4 MoE
layers, 64 experts, top_k 8):
- online: the BF16 checkpoint with `--quantization fp8_per_tensor` (per-tensor weights,
  dynamic per-tensor activations; vLLM 0.33.0's `fp8` method no longer quantizes online);
  BF16 on the wire, quantized after receive. The other two online shorthands the package
  accepts: `fp8_per_block` (128x128 weight blocks, 128-element activation groups: FP8 on
  the wire) and `fp8_per_channel` (per-channel weights, dynamic per-token activations:
  BF16 on the wire, quantized per row after receive);
- block: an FP8 checkpoint with 128x128 block scales (dynamic 128-element activation
  groups, as DeepSeek-V3 and the Qwen3 FP8 checkpoints); FP8 on the wire on both
  backends (LL: NCCL-EP quantizes; HT: vLLM's group quantization before dispatch);
- static: an FP8 checkpoint with per-tensor weight scales and static input scales.
The engines without EP run vLLM's Triton experts (`--moe-backend triton`); under LL,
`--moe-backend auto` gives 128x128 block-FP8 layers vLLM's DeepGEMM batched experts on
this GPU (fp8_experts_choice.auto_fp8_experts) and the others vLLM's Triton experts, so a
block run also differs by the experts kernel (and DeepGEMM's weight scales).
Tolerance: the rule of test_engine_world1.py, with the floor measured on the FP8 model
itself (no-EP, CUDA graphs vs --enforce-eager).
"""

from __future__ import annotations

import pytest
from test_engine_world1 import HT, LAYERS, LL, _assert_close, _diff, _spec, assert_switches

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ONLINE = "fp8_per_tensor"
LL_KERNELS = ["FlashInferEPLowLatencyPrepareAndFinalize+ReceivedRowsExperts"]
LL_DEEP_GEMM_KERNELS = ["FlashInferEPLowLatencyPrepareAndFinalize+ReceivedRowsOrDeepGemmExperts"]
FP8_LAYERS = ["torch.float8_e4m3fn"]  # every MoE layer's activations, EP or not


@pytest.fixture(scope="module")
def fp8_models(models, tmp_path_factory):
    from engine_models import write_fp8_model

    root = tmp_path_factory.mktemp("fp8-models")
    return {
        "online": models(2048),
        "block": write_fp8_model(root / "block", 2048, "block"),
        "static": write_fp8_model(root / "static", 2048, "static"),
    }


def _fp8_spec(model: str, backend: str | None = None, online: str | None = None, **kw) -> dict:
    """`online`: the --quantization shorthand that quantizes the BF16 checkpoint."""
    extra = {"moe_backend": "triton"} if backend is None else {}
    if online:
        extra["quantization"] = online
    return _spec(model, backend, **extra, **kw)


def _assert_wire(run: dict, fp8: bool) -> None:
    """FP8 dispatches were counted during decode exactly when the layers carry FP8 on
    the wire (None: the runtime never dispatched FP8)."""
    count = run["after_decode"]["runtimes"][0]["fp8_dispatches"]
    assert (count is not None and count > 0) if fp8 else count is None, count


@pytest.fixture(scope="module")
def online_no_ep(engines, fp8_models):
    run = engines.run("noep-fp8online-graph", _fp8_spec(fp8_models["online"], online=ONLINE))
    assert run["after_load"]["quant_dtypes"] == FP8_LAYERS
    return run


@pytest.fixture(scope="module")
def fp8_floor(engines, fp8_models, online_no_ep):
    eager = engines.run(
        "noep-fp8online-eager", _fp8_spec(fp8_models["online"], online=ONLINE, enforce_eager=True)
    )
    stats = _diff(online_no_ep["prompt_logprobs"], eager["prompt_logprobs"])
    print(f"FP8 floor (no EP, graphs vs eager): {stats}")
    return stats


def _check_ll(run: dict, block: bool = False) -> None:
    """`block`: a 128x128 block-FP8 model, whose LL experts `--moe-backend auto` makes
    vLLM's DeepGEMM batched experts on this GPU (fp8_experts_choice.auto_fp8_experts)."""
    load = run["after_load"]
    kernels = LL_DEEP_GEMM_KERNELS if block else LL_KERNELS
    assert load["kernels"] == kernels and load["num_kernels"] == LAYERS
    assert load["quant_dtypes"] == FP8_LAYERS
    assert_switches(load)
    assert load["cudagraph_mode"] == "FULL_AND_PIECEWISE"  # FP8 LL stays capturable
    [rt] = load["runtimes"]
    assert rt["hidden_size"] == 2048 and rt["counters"]["created_during_capture"] == 0
    after = run["after_decode"]["runtimes"][0]["counters"]
    before = run["after_prefill"]["runtimes"][0]["counters"]
    assert after["fresh_created"] == before["fresh_created"]  # decode replays the graphs


def test_ll_online_fp8_with_cuda_graphs_matches_the_engine_without_ep(
    engines, fp8_models, online_no_ep, fp8_floor
):
    run = engines.run("ll-fp8online-graph", _fp8_spec(fp8_models["online"], LL, online=ONLINE))
    _check_ll(run)
    _assert_close(
        run["prompt_logprobs"],
        online_no_ep["prompt_logprobs"],
        fp8_floor,
        "LL FP8 (online) graphs vs no EP",
    )


def _check_ht(run: dict) -> None:
    load = run["after_load"]
    assert load["kernels"] == ["FlashInferEPHighThroughputPrepareAndFinalize+TritonExperts"]
    assert load["num_kernels"] == LAYERS and load["quant_dtypes"] == FP8_LAYERS
    assert load["cudagraph_mode"] == "NONE" and load["max_num_batched_tokens"] == 8192


def test_ht_block_checkpoint_matches_the_engine_without_ep(engines, fp8_models, fp8_floor):
    reference = engines.run("noep-block-graph", _fp8_spec(fp8_models["block"]))
    run = engines.run("ht-block", _fp8_spec(fp8_models["block"], HT))
    _check_ht(run)
    # 128x128 blocks travel as E4M3 + scales (quantized before dispatch, NCCL-EP's
    # forward recipe), on by default
    _assert_wire(run, fp8=True)
    _assert_close(
        run["prompt_logprobs"],
        reference["prompt_logprobs"],
        fp8_floor,
        "HT FP8 (block checkpoint, FP8 on the wire) vs no EP",
    )


def test_ht_online_fp8_matches_the_engine_without_ep(engines, fp8_models, online_no_ep, fp8_floor):
    """Online per-tensor FP8 under HT: BF16 on the wire, the received rows quantized with
    a dynamic per-tensor scale taken over them (receive_quant.py). Refused at config time
    until this ran (a CUDA "invalid argument" at warm-up in earlier runs, which later
    runs did not reproduce)."""
    run = engines.run("ht-fp8online", _fp8_spec(fp8_models["online"], HT, online=ONLINE))
    _check_ht(run)
    _assert_wire(run, fp8=False)
    _assert_close(
        run["prompt_logprobs"],
        online_no_ep["prompt_logprobs"],
        fp8_floor,
        "HT FP8 (online per tensor) vs no EP",
    )


@pytest.mark.parametrize("scheme", ["block", "static"])
def test_ll_fp8_checkpoint_matches_the_engine_without_ep(engines, fp8_models, fp8_floor, scheme):
    reference = engines.run(f"noep-{scheme}-graph", _fp8_spec(fp8_models[scheme]))
    assert reference["after_load"]["quant_dtypes"] == FP8_LAYERS
    run = engines.run(f"ll-{scheme}-graph", _fp8_spec(fp8_models[scheme], LL))
    _check_ll(run, block=scheme == "block")
    # 128x128 blocks travel as E4M3 + scales (NCCL-EP's FP8 dispatch, on by default);
    # per-tensor scales stay BF16 on the wire, quantized after receive.
    _assert_wire(run, fp8=scheme == "block")
    _assert_close(
        run["prompt_logprobs"],
        reference["prompt_logprobs"],
        fp8_floor,
        f"LL FP8 ({scheme} checkpoint) graphs vs no EP",
    )


@pytest.mark.parametrize("backend", [LL, HT], ids=["ll", "ht"])
@pytest.mark.parametrize("scheme", ["fp8_per_block", "fp8_per_channel"])
def test_online_scheme_matches_the_engine_without_ep(
    engines, fp8_models, fp8_floor, scheme, backend
):
    """The online shorthands besides fp8_per_tensor, which config validation accepts on
    both backends: fp8_per_block layers dispatch E4M3 + scales, fp8_per_channel layers
    dispatch BF16 and quantize each received row."""
    model = fp8_models["online"]
    reference = engines.run(f"noep-{scheme}-graph", _fp8_spec(model, online=scheme))
    assert reference["after_load"]["quant_dtypes"] == FP8_LAYERS
    name = "ll" if backend == LL else "ht"
    run = engines.run(f"{name}-{scheme}", _fp8_spec(model, backend, online=scheme))
    if backend == LL:
        _check_ll(run, block=scheme == "fp8_per_block")
    else:
        _check_ht(run)
    _assert_wire(run, fp8=scheme == "fp8_per_block")
    _assert_close(
        run["prompt_logprobs"],
        reference["prompt_logprobs"],
        fp8_floor,
        f"{name.upper()} FP8 (online {scheme}) vs no EP",
    )


def test_ll_block_checkpoint_on_deep_gemm_matches_the_engine_without_ep(
    engines, fp8_models, fp8_floor
):
    """`--moe-backend deep_gemm` (experts/deep_gemm.py): vLLM's batched DeepGEMM
    experts over the LL buffer (scales re-laid MN-major by the package's wrapper), against the
    engine without EP on vLLM's DeepGEMM experts, which read the weights as prepared for
    DeepGEMM too. What differs: the transport, and the activation scales (NCCL-EP's
    amax/448 against vLLM's, which its E8M0 setting may round to powers of two)."""
    model = fp8_models["block"]
    reference = engines.run("noep-block-deepgemm", _spec(model, None, moe_backend="deep_gemm"))
    assert reference["after_load"]["quant_dtypes"] == FP8_LAYERS
    run = engines.run("ll-block-deepgemm", _spec(model, LL, moe_backend="deep_gemm"))
    _check_ll(run, block=True)
    _assert_wire(run, fp8=True)
    _assert_close(
        run["prompt_logprobs"],
        reference["prompt_logprobs"],
        fp8_floor,
        "LL FP8 (block checkpoint, DeepGEMM experts) graphs vs no EP (DeepGEMM)",
    )
