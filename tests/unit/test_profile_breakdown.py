"""The profile breakdown (tests/engine/profile_breakdown.py): kernels by kind, per MoE layer
and decode step, unknown names kept visible."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import profile_breakdown as pb  # noqa: E402


@pytest.mark.parametrize(
    ("kernel", "kind"),
    [
        ("ncclEpLowLatencyDispatchKernel<__nv_bfloat16, 8>", "transport"),
        ("fused_moe_kernel", "experts GEMMs"),
        ("batched_triton_kernel", "experts GEMMs"),
        ("_row_blocks_kernel", "row blocks"),
        ("_amax_kernel", "quantization"),
        ("_quantize_rows_kernel", "quantization"),
        ("_silu_and_mul_kernel", "activation"),
        ("void at::native::searchsorted_cuda_kernel<long>", "row blocks"),
        ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "activation"),
        ("_per_token_group_quant_fp8", "quantization"),
        ("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_TNT", "dense GEMMs"),
        (  # DeepGEMM's masked grouped GEMM (LL's block-FP8 experts)
            "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 1536u, 2048u, "
            "128u, 64u, 128u, 128u, 128u, 128u, 5u, 128u, 256u, 1u, false, 132u, "
            "(deep_gemm::GemmType)2, deep_gemm::EpilogueIdentity>(float*, int*)",
            "experts GEMMs",
        ),
        (  # the same kernel for a dense layer (GemmType Normal)
            "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 4096u, 2048u, "
            "1u, 64u, 128u, 128u, 128u, 128u, 5u, 128u, 256u, 1u, false, 132u, "
            "(deep_gemm::GemmType)0, deep_gemm::EpilogueIdentity>(float*, int*)",
            "dense GEMMs",
        ),
        ("void vllm::rms_norm_kernel<c10::BFloat16>", "norms and rotary"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "small torch kernels"),
        ("something_new_kernel", "other"),
    ],
)
def test_kernels_are_filed_by_kind(kernel, kind):
    assert pb.category(kernel) == kind


def test_per_layer_step_figures_and_shares():
    kernels = [("fused_moe_kernel", 960.0, 96), ("ncclEpCombine", 480.0, 48), ("mystery", 480.0, 1)]
    parts = pb.breakdown(kernels, layers=48, steps=2)
    assert list(parts) == ["experts GEMMs", "transport", "other"]  # by time
    assert parts["experts GEMMs"]["us_per_layer_step"] == pytest.approx(10.0)
    assert parts["transport"]["share"] == pytest.approx(0.25)
    text = pb.table(parts, 48, 2)
    assert "| other | 5.0 | 25.0 % | mystery (5.0) |" in text


def test_only_gpu_kernels_are_read_from_the_profiler():
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    events = [
        SimpleNamespace(
            key="fused_moe_kernel",
            self_device_time_total=50.0,
            count=4,
            device_type=DeviceType.CUDA,
        ),
        SimpleNamespace(
            key="aten::mm", self_device_time_total=70.0, count=4, device_type=DeviceType.CPU
        ),
        SimpleNamespace(
            key="idle", self_device_time_total=0.0, count=1, device_type=DeviceType.CUDA
        ),
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert pb.from_profiler(prof) == [("fused_moe_kernel", 50.0, 4)]


def test_decode_steps_are_the_longer_run_less_the_prefill():
    """Prefill + 8 decode steps less the prefill alone: only the decode steps are counted."""
    prefill = [("fused_moe_kernel", 500.0, 48), ("flash_fwd_prefill", 300.0, 48)]
    longer = [
        ("fused_moe_kernel", 900.0, 432),  # 48 in the prefill + 8 x 48
        ("flash_fwd_prefill", 300.0, 48),  # the prefill's own kernel: gone
        ("ncclEpCombine", 80.0, 384),  # only in the longer run: kept whole
    ]
    decode = pb.difference(longer, prefill)
    assert decode == [("fused_moe_kernel", 400.0, 384), ("ncclEpCombine", 80.0, 384)]
    parts = pb.breakdown(decode, layers=48, steps=8)
    assert parts["experts GEMMs"]["us_per_layer_step"] == pytest.approx(400.0 / 384)


def test_a_decode_kernel_is_kept_when_noise_puts_its_time_below_the_prefill_s():
    prefill = [("ncclEpDispatch", 30.0, 48), ("ncclEpDispatch", 20.0, 48)]  # rows of one name
    longer = [("ncclEpDispatch", 45.0, 480)]  # more calls, less time: noise, not no kernel
    assert pb.difference(longer, prefill) == [("ncclEpDispatch", 0.0, 384)]


def test_added_counts_longer_kernels_of_as_many_calls_and_lets_noise_cancel():
    """A long prompt's chunks ride in decode steps: the same kernels, as many calls,
    longer. `added` keeps those (difference() would drop them) and signs the rest."""
    plain = [("fused_moe_kernel", 100.0, 10), ("rms_norm_kernel", 50.0, 20)]
    mixed = [("fused_moe_kernel", 160.0, 10), ("rms_norm_kernel", 49.0, 20), ("new", 5.0, 1)]
    rows = dict((name, (us, calls)) for name, us, calls in pb.added(mixed, plain))
    assert rows == {"fused_moe_kernel": (60.0, 0), "new": (5.0, 1), "rms_norm_kernel": (-1.0, 0)}
    assert pb.difference(mixed, plain) == [("new", 5.0, 1)]  # the decode-step rule
    parts = pb.breakdown(pb.added(mixed, plain), layers=2, steps=3)
    assert parts["experts GEMMs"]["us_per_layer_step"] == 10.0
    assert "per chunk step" in pb.table(parts, 2, 3, what="chunk step")
