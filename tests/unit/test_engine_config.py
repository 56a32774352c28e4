"""Engine-config time behaviour with real vLLM 0.33.0 objects (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_models import DEEPSEEK_V3_MTP, QWEN3_MOE, engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPConfigError
from vllm_flashinfer_ep.runtime.limits import MAX_TOPK_HT, MAX_TOPK_LL
from vllm_flashinfer_ep.vllm import cudagraph_policy

vllm_flashinfer_ep.register()


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe"))


def test_low_latency_engine_config(tiny_moe, caplog):
    cudagraph_policy.LAST_DECISION = None
    with caplog.at_level(logging.INFO):
        # 256 sequences, vLLM's for `vllm serve` on an H100: capture sizes to 512
        cfg = engine_config(tiny_moe, LOW_LATENCY, max_num_seqs=256)
    par = cfg.parallel_config
    assert par.all2all_backend == LOW_LATENCY and par.use_all2all
    assert par.use_batched_dp_moe  # patched property
    # --max-num-batched-tokens unset -> LL's default (not vLLM's 256) = LL per-rank capacity
    assert cfg.scheduler_config.max_num_batched_tokens == 512
    assert "LL steps take up to 512 tokens (vLLM chose 256)" in caplog.text
    d = cudagraph_policy.LAST_DECISION
    assert d is not None and d.backend == LOW_LATENCY
    assert d.mode_after == d.mode_before == cfg.compilation_config.cudagraph_mode.name
    assert "updated inside each captured forward" in d.reason
    assert "cudagraph_mode" in caplog.text and LOW_LATENCY in caplog.text


@pytest.mark.parametrize(
    "kwargs, budget, logged",
    [
        ({"max_num_batched_tokens": 256}, 256, False),  # asked: kept, no line
        ({"max_num_batched_tokens": 2048}, 2048, False),
        ({"max_cudagraph_capture_size": 256}, 256, False),  # steps stay within the graphs
        ({"cudagraph_capture_sizes": [1, 2, 4, 384]}, 384, True),
        ({"compilation_config": {"max_cudagraph_capture_size": 128}}, 256, False),  # vLLM's floor
        ({"max_num_seqs": 200}, 400, True),  # vLLM's capture sizes: 2 x max_num_seqs
        ({"max_num_seqs": 64}, 256, False),
        ({"max_num_seqs": 2, "max_model_len": 160, "max_cudagraph_capture_size": 512}, 320, True),
        ({"enforce_eager": True, "max_num_seqs": 256}, 512, True),
        ({}, 256, False),  # vLLM's 128 sequences here (no GPU): capture sizes to 256
    ],
)
def test_ll_default_budget_yields_to_what_the_user_set(tiny_moe, caplog, kwargs, budget, logged):
    """LL's 512 applies only where --max-num-batched-tokens is unset, never above the
    largest CUDA graph capture size (set, or vLLM's from --max-num-seqs) or vLLM's
    max_num_seqs x max_model_len, never below vLLM's 256; every raise is logged. Doctor
    sizes the fleet for the same budget and vLLM's --max-num-seqs."""
    from vllm_flashinfer_ep.doctor.settings import ServeSettings, vllm_defaults

    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, LOW_LATENCY, **kwargs)
    assert cfg.scheduler_config.max_num_batched_tokens == budget
    assert ("LL steps take up to" in caplog.text) is logged
    if set(kwargs) <= {"max_num_batched_tokens", "max_num_seqs"}:  # what doctor reads
        settings = ServeSettings(data_parallel_size=2, enable_expert_parallel=True, **kwargs)
        assert settings.tokens == budget
        assert vllm_defaults(settings)[1] == cfg.scheduler_config.max_num_seqs


def test_ll_default_budget_leaves_other_engines_alone(tiny_moe, caplog):
    """HT, deepep_low_latency (vLLM's own batched DP MoE backend) and an LL engine without
    DP keep vLLM's defaults."""
    from vllm.config import SchedulerConfig

    batched_dp = SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP
    with caplog.at_level(logging.INFO):
        assert (
            engine_config(tiny_moe, "deepep_low_latency").scheduler_config.max_num_batched_tokens
            == batched_dp
        )
        ht = engine_config(tiny_moe, HIGH_THROUGHPUT).scheduler_config.max_num_batched_tokens
        single = engine_config(tiny_moe, LOW_LATENCY, data_parallel_size=1)
    assert ht > 512 and single.scheduler_config.max_num_batched_tokens > 512
    assert "LL steps take up to" not in caplog.text


def test_high_throughput_engine_config(tiny_moe):
    cudagraph_policy.LAST_DECISION = None
    cfg = engine_config(tiny_moe, HIGH_THROUGHPUT)
    assert not cfg.parallel_config.use_batched_dp_moe
    assert cfg.compilation_config.cudagraph_mode.name == "NONE"
    d = cudagraph_policy.LAST_DECISION
    assert d.backend == HIGH_THROUGHPUT and d.mode_after == "NONE"
    assert "received-token count on the host" in d.reason
    # what it means for serving, and the flag that keeps graphs for decodes
    assert "decodes included" in d.reason and f"--all2all-backend {LOW_LATENCY}" in d.reason


# --------------------------------------------------------------- policy table
def _compilation(mode: str):
    from vllm.config import CompilationConfig, CUDAGraphMode

    cc = CompilationConfig()
    cc.cudagraph_mode = CUDAGraphMode[mode]
    return cc


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE", "FULL"])
def test_policy_keeps_ll_mode_and_turns_off_ht(mode, caplog):
    cc = _compilation(mode)
    d = cudagraph_policy.apply(cc, LOW_LATENCY, data_parallel_size=2)
    assert not d.changed and cc.cudagraph_mode.name == mode
    cc = _compilation(mode)
    with caplog.at_level(logging.WARNING):
        d = cudagraph_policy.apply(cc, HIGH_THROUGHPUT, data_parallel_size=2)
    assert d.changed and cc.cudagraph_mode.name == "NONE"
    assert "CUDA graphs turned off" in caplog.text


def test_policy_ll_without_pool_turns_graphs_off(monkeypatch):
    monkeypatch.setenv(envs.HANDLE_POOL, "0")
    cc = _compilation("FULL_AND_PIECEWISE")
    d = cudagraph_policy.apply(cc, LOW_LATENCY, data_parallel_size=2)
    assert cc.cudagraph_mode.name == "NONE" and envs.HANDLE_POOL in d.reason


def test_policy_ll_without_handle_update_turns_graphs_off(monkeypatch):
    from vllm_flashinfer_ep.runtime import pool_sizes

    monkeypatch.setattr(pool_sizes, "handle_supports_update", lambda: False)
    cc = _compilation("PIECEWISE")
    d = cudagraph_policy.apply(cc, LOW_LATENCY, data_parallel_size=2)
    assert cc.cudagraph_mode.name == "NONE" and "Handle.update" in d.reason


def test_policy_ignores_dp1_and_other_backends():
    cc = _compilation("FULL")
    assert cudagraph_policy.apply(cc, HIGH_THROUGHPUT, data_parallel_size=1) is None
    assert cudagraph_policy.apply(cc, "deepep_low_latency", data_parallel_size=2) is None
    assert cc.cudagraph_mode.name == "FULL"


def test_policy_applies_outside_vllm_compile(monkeypatch):
    """The patched set_splitting_ops_for_v1 gates before vLLM's early return."""
    from vllm.config import CompilationConfig, CompilationMode

    cc = _compilation("PIECEWISE")
    cc.mode = CompilationMode.NONE
    CompilationConfig.set_splitting_ops_for_v1(cc, HIGH_THROUGHPUT, 2)
    assert cc.cudagraph_mode.name == "NONE"


# ---------------------------------------------------------------- bad inputs
BAD = [
    (dict(enable_dbo=True), LOW_LATENCY, "Remove --enable-dbo"),
    (dict(dtype="float16"), LOW_LATENCY, "--dtype bfloat16"),
    (
        dict(quantization="int8_per_channel_weight_only"),
        HIGH_THROUGHPUT,
        "Serve a BF16 or FP8 checkpoint",
    ),
    (
        dict(quantization="fp8_per_block", moe_backend="cutlass"),
        LOW_LATENCY,
        "Pass --moe-backend triton",
    ),
    (
        dict(enable_fault_tolerance=True, data_parallel_external_lb=True, data_parallel_rank=0),
        HIGH_THROUGHPUT,
        "--all2all-backend flashinfer_ep_low_latency or remove --enable-fault-tolerance",
    ),
]


@pytest.mark.parametrize("kwargs,backend,message", BAD)
def test_bad_input_is_one_clear_error(tiny_moe, kwargs, backend, message):
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(tiny_moe, backend, **kwargs)
    assert type(info.value) is FlashInferEPConfigError
    assert message in str(info.value)


@pytest.mark.parametrize(
    "backend,top_k,ok",
    [
        (LOW_LATENCY, MAX_TOPK_LL, True),
        (LOW_LATENCY, MAX_TOPK_LL + 1, False),
        (HIGH_THROUGHPUT, MAX_TOPK_HT, True),
        (HIGH_THROUGHPUT, MAX_TOPK_HT + 1, False),
    ],
)
def test_top_k_limit_per_backend(tmp_path, backend, top_k, ok):
    model = write_model(tmp_path / "m", num_experts=64, num_experts_per_tok=top_k)
    if ok:
        engine_config(model, backend)
        return
    with pytest.raises(FlashInferEPConfigError, match=f"routes each token to {top_k} experts"):
        engine_config(model, backend)


def test_hidden_too_large_for_ll(tmp_path):
    model = write_model(
        tmp_path / "wide", hidden_size=8192 + 128, num_attention_heads=4, head_dim=32
    )
    with pytest.raises(FlashInferEPConfigError, match="flashinfer_ep_high_throughput"):
        engine_config(model, LOW_LATENCY)


def test_missing_nccl_ep_names_the_package(tiny_moe, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n.startswith("nccl") else real(n, *a)
    )
    with pytest.raises(FlashInferEPConfigError, match="nccl-extensions>=0.1.0"):
        engine_config(tiny_moe, LOW_LATENCY)


def test_old_torch_cuda_is_refused(tiny_moe, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(FlashInferEPConfigError, match="CUDA >= 13"):
        engine_config(tiny_moe, LOW_LATENCY)


def test_noop_backend_warns(tiny_moe, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = engine_config(tiny_moe, LOW_LATENCY, data_parallel_size=1)
    assert not cfg.parallel_config.use_all2all
    assert "does nothing here" in caplog.text


def test_other_backends_untouched(tiny_moe):
    cfg = engine_config(tiny_moe, "allgather_reducescatter", dtype="float16")
    assert cfg.parallel_config.all2all_backend == "allgather_reducescatter"


# --------------------------------------------- engine configs that start with graphs on
@pytest.fixture()
def graphs_on(monkeypatch):
    """Let vLLM's CPU platform pick a CUDA-graph mode as a GPU platform would.

    On CPU vLLM forces cudagraph_mode NONE before our policy runs, so a policy that
    turned graphs off (or failed to) would be invisible there.
    """
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "support_static_graph_mode", classmethod(lambda cls: True)
    )


def _mode_without_plugin(model: str) -> str:
    return engine_config(model, "allgather_reducescatter").compilation_config.cudagraph_mode.name


@pytest.mark.usefixtures("graphs_on")
def test_ll_engine_config_keeps_vllm_s_graph_mode(tiny_moe):
    vllm_mode = _mode_without_plugin(tiny_moe)
    assert vllm_mode != "NONE"
    cudagraph_policy.LAST_DECISION = None
    cfg = engine_config(tiny_moe, LOW_LATENCY)
    assert cfg.compilation_config.cudagraph_mode.name == vllm_mode
    d = cudagraph_policy.LAST_DECISION
    assert d.mode_before == d.mode_after == vllm_mode and not d.changed


@pytest.mark.usefixtures("graphs_on")
def test_ht_engine_config_turns_graphs_off(tiny_moe):
    vllm_mode = _mode_without_plugin(tiny_moe)
    cudagraph_policy.LAST_DECISION = None
    cfg = engine_config(tiny_moe, HIGH_THROUGHPUT)
    assert cfg.compilation_config.cudagraph_mode.name == "NONE"
    d = cudagraph_policy.LAST_DECISION
    assert d.mode_before == vllm_mode and d.mode_after == "NONE" and d.changed


@pytest.mark.usefixtures("graphs_on")
def test_ll_engine_config_without_pool_turns_graphs_off(tiny_moe, monkeypatch):
    monkeypatch.setenv(envs.HANDLE_POOL, "0")
    cfg = engine_config(tiny_moe, LOW_LATENCY)
    assert cfg.compilation_config.cudagraph_mode.name == "NONE"
    assert cudagraph_policy.LAST_DECISION.changed


@pytest.mark.usefixtures("graphs_on")
@pytest.mark.parametrize("backend", [HIGH_THROUGHPUT, LOW_LATENCY])
def test_context_parallel_runs_the_all2all_at_dp_1_and_gets_the_policy(
    tiny_moe, backend, monkeypatch
):
    # EP with prefill context parallel: vLLM runs the all2all at dp 1 (use_all2all), so HT
    # (and LL without its handle pool) must lose its graphs there too.
    monkeypatch.setenv(envs.HANDLE_POOL, "0")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # vLLM's runner for context parallel
    cfg = engine_config(tiny_moe, backend, data_parallel_size=1, prefill_context_parallel_size=2)
    assert cfg.parallel_config.use_all2all
    assert cfg.compilation_config.cudagraph_mode.name == "NONE"
    assert cudagraph_policy.LAST_DECISION.backend == backend


@pytest.mark.usefixtures("graphs_on")
def test_policy_is_idle_without_expert_parallel(tiny_moe):
    # dp 2 without --enable-expert-parallel: vLLM's naive DP path runs, not this backend.
    vllm_mode = _mode_without_plugin(tiny_moe)
    cfg = engine_config(tiny_moe, HIGH_THROUGHPUT, enable_expert_parallel=False)
    assert cfg.compilation_config.cudagraph_mode.name == vllm_mode


def test_ht_runs_unquantized_experts_on_triton_under_auto(tiny_moe, caplog):
    # vLLM's auto would take FlashInfer's TRT-LLM BF16 experts on Blackwell.
    with caplog.at_level(logging.INFO):
        cfg = engine_config(tiny_moe, HIGH_THROUGHPUT)
    assert cfg.kernel_config.moe_backend == "triton"
    assert "auto -> triton" in caplog.text
    assert engine_config(tiny_moe, LOW_LATENCY).kernel_config.moe_backend == "auto"


@pytest.mark.usefixtures("graphs_on")
def test_policy_is_idle_at_dp_1(tiny_moe):
    vllm_mode = _mode_without_plugin(tiny_moe)
    cfg = engine_config(tiny_moe, HIGH_THROUGHPUT, data_parallel_size=1)
    assert cfg.compilation_config.cudagraph_mode.name == vllm_mode


# ---------------------------------------------------------------- FP8 models
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
@pytest.mark.parametrize("quantization", ["fp8_per_tensor", "fp8_per_block", "fp8_per_channel"])
def test_online_fp8_is_accepted_and_runs_vllm_s_triton_experts(
    tiny_moe, quantization, backend, caplog
):
    with caplog.at_level("INFO"):
        cfg = engine_config(tiny_moe, backend, quantization=quantization)
    assert cfg.model_config.quantization == quantization
    assert cfg.kernel_config.moe_backend == "triton"  # auto was pinned, and it says so
    assert "--moe-backend auto -> triton" in caplog.text


@pytest.mark.parametrize(
    "quant,ok",
    [
        (
            {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            },
            True,
        ),
        ({"quant_method": "fp8", "activation_scheme": "static"}, True),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]},
            False,
        ),
    ],
    ids=["block-128", "per-tensor-static", "block-64"],
)
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_fp8_checkpoints(tmp_path, quant, ok, backend):
    model = write_model(tmp_path / "m", quantization_config=quant)
    if ok:
        cfg = engine_config(model, backend, moe_backend="triton")  # explicit triton is kept
        assert cfg.model_config.quantization == "fp8"
        assert cfg.kernel_config.moe_backend == "triton"
        return
    with pytest.raises(FlashInferEPConfigError, match="weight_block_size is \\[64, 64\\]"):
        engine_config(model, LOW_LATENCY)


def test_bf16_models_keep_the_user_s_moe_backend(tiny_moe):
    assert engine_config(tiny_moe, LOW_LATENCY).kernel_config.moe_backend == "auto"


# ------------------------------------------------------ EPLB and expert placement
@pytest.fixture
def eplb_platform(monkeypatch):
    """vLLM refuses --enable-eplb unless the platform is CUDA-like; say it is (config only)."""
    import vllm.config.parallel as parallel

    monkeypatch.setattr(parallel.current_platform, "is_cuda_alike", lambda: True)


@pytest.mark.usefixtures("eplb_platform")
@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_eplb_with_redundant_experts_is_accepted(tmp_path, backend):
    from vllm_flashinfer_ep.vllm.config_validation import _ll_fleet_shape

    model = write_model(tmp_path / "m", num_experts=8)
    cfg = engine_config(model, backend, enable_eplb=True, eplb_config={"num_redundant_experts": 2})
    assert cfg.parallel_config.enable_eplb
    # The LL buffers are sized for the physical experts (logical + redundant), the count
    # vLLM's MoE layers hand the manager (FusedMoEConfig.num_experts) for the fleet.
    assert _ll_fleet_shape(cfg)[1] == 10


@pytest.mark.parametrize("backend", [LOW_LATENCY, HIGH_THROUGHPUT])
def test_round_robin_expert_placement_is_refused(tiny_moe, backend):
    with pytest.raises(FlashInferEPConfigError, match="--expert-placement-strategy linear"):
        engine_config(tiny_moe, backend, expert_placement_strategy="round_robin")


def test_nccl_ep_s_own_timeout_variable_is_named_when_it_overrides_ours(
    tiny_moe, monkeypatch, caplog
):
    # nccl_ep.h: NCCL_EP_TIMEOUT_MS overrides the group's timeout, so the package's
    # variable would silently stop deciding how long the kernels wait.
    monkeypatch.setenv("NCCL_EP_TIMEOUT_MS", "5000")
    kwargs = dict(enable_fault_tolerance=True, data_parallel_external_lb=True, data_parallel_rank=0)
    with caplog.at_level(logging.WARNING):
        engine_config(tiny_moe, LOW_LATENCY, **kwargs)
    assert "NCCL_EP_TIMEOUT_MS=5000 is set" in caplog.text and envs.FT_TIMEOUT_MS in caplog.text


# ------------------------------------------------------- a speculative draft with MoE layers
def _draft_model(tmp_path, **overrides) -> dict:
    draft = write_model(tmp_path / "draft", **overrides)
    return dict(
        speculative_config=dict(method="draft_model", model=draft, num_speculative_tokens=2)
    )


def test_a_moe_draft_model_draft_is_refused_naming_what_to_serve(tiny_moe, tmp_path):
    # vLLM builds a draft_model draft under its own ParallelConfig (all2all backend
    # allgather_reducescatter); its MoE layers would all-gather through the EP group's
    # manager, which is ours and has no dispatch: the first forward would fail.
    with pytest.raises(FlashInferEPConfigError) as info:
        engine_config(tiny_moe, LOW_LATENCY, **_draft_model(tmp_path))
    text = str(info.value)
    assert "the speculative draft model" in text and "method mtp or eagle" in text


def test_a_dense_draft_model_draft_is_accepted(tiny_moe, tmp_path):
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers")
    dense = {k: v for k, v in QWEN3_MOE.items() if k not in moe_keys and k != "decoder_sparse_step"}
    dense.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    engine_config(tiny_moe, LOW_LATENCY, **_draft_model(tmp_path, base=dense))


@pytest.mark.usefixtures("eplb_platform")
def test_an_mtp_draft_shares_the_target_s_redundant_experts(tmp_path):
    # MTP layers are built under the target's parallel config: 8 experts + 2 redundant
    # split over 5 EP ranks for the draft as for the target (8 alone would not).
    model = write_model(tmp_path / "dsv3", base=DEEPSEEK_V3_MTP)
    cfg = engine_config(
        model,
        LOW_LATENCY,
        data_parallel_size=5,
        enable_eplb=True,
        eplb_config={"num_redundant_experts": 2},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    assert cfg.speculative_config.draft_model_config.is_moe
