"""The console script: doctor and bench on a machine without GPUs."""

from __future__ import annotations

import pytest
from tiny_models import write_model

from vllm_flashinfer_ep import cli, doctor
from vllm_flashinfer_ep.bench import results
from vllm_flashinfer_ep.bench import run as bench


def test_doctor_reports_and_fails_without_gpu(tmp_path, capsys):
    model = write_model(tmp_path / "m")
    rc = cli.main(["doctor", "--model", model])
    out = capsys.readouterr().out
    assert "vllm: 0.33.0" in out and "flashinfer-python: 0.7.2.post1" in out
    assert "128 -> rounded up to 2048" in out and "top_k: 2" in out
    if "[FAIL]" in out:
        assert rc == 1 and "problem(s)" in out
    else:
        assert rc == 0


def test_doctor_model_checks(tmp_path):
    wide = doctor.model_checks(write_model(tmp_path / "w", hidden_size=9000))
    assert not next(c for c in wide if c.name == "LL hidden size").ok
    many = doctor.model_checks(write_model(tmp_path / "k", num_experts_per_tok=20))
    topk = next(c for c in many if c.name == "top_k")
    # The engine's reason (config_rules.top_k_reason), which names the backend that fits.
    assert not topk.ok and "Try --all2all-backend flashinfer_ep_high_throughput" in topk.fix

    def precision(name, quant):
        checks = doctor.model_checks(write_model(tmp_path / name, quantization_config=quant))
        return next(c for c in checks if c.name == "checkpoint precision").ok

    assert precision("fp8", {"quant_method": "fp8"})
    assert precision("block", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert not precision("block64", {"quant_method": "fp8", "weight_block_size": [64, 64]})
    assert not precision("awq", {"quant_method": "awq"})
    assert not doctor.model_checks(str(tmp_path / "missing"))[0].ok


def test_doctor_names_a_missing_path_and_a_file(tmp_path):
    missing = doctor.model_checks(str(tmp_path / "nope"))[0]
    assert not missing.ok and f"no such directory: {tmp_path / 'nope'}" in missing.detail
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    as_file = doctor.model_checks(str(weights))[0]
    assert not as_file.ok and "is a file; pass the model directory" in as_file.detail


def test_doctor_without_driver_gives_the_driver_first(tmp_path, capsys, monkeypatch):
    from vllm_flashinfer_ep.runtime import env_checks

    real_cdll = env_checks.ctypes.CDLL

    def no_driver(name, *args, **kwargs):
        if "libcuda" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(env_checks.ctypes, "CDLL", no_driver)
    assert cli.main(["doctor", "--model", str(tmp_path / "nope")]) == 1
    out = capsys.readouterr().out
    first_check = next(line for line in out.splitlines() if line.startswith("  ["))
    first_problem = out.split("problem(s)")[1].splitlines()[1]
    assert "[FAIL] CUDA driver" in first_check
    assert first_problem.startswith("  - CUDA driver: run on a host with the NVIDIA driver")
    assert "no such directory" in out


DLOPEN_NO_DRIVER = (
    "Failed to dlopen libnccl_ep (libcuda.so.1: cannot open shared object file: No such file "
    "or directory); tried path '/site-packages/nccl/ep/lib/cu13/libnccl_ep.so'"
)


def _gpu_stack(monkeypatch, driver: bool, nccl_ep_error: str | None):
    """Doctor's GPU stack with the driver present or not and libnccl_ep failing as given."""
    import nccl.ep

    from vllm_flashinfer_ep.runtime import env_checks

    real_cdll = env_checks.ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if "libcuda" in str(name):
            if not driver:
                raise OSError(f"{name}: cannot open shared object file")
            return object()
        return real_cdll(name, *args, **kwargs)

    def lib_version():
        if nccl_ep_error is not None:
            raise RuntimeError(nccl_ep_error)
        return "0.1.0"

    monkeypatch.setattr(env_checks.ctypes, "CDLL", cdll)
    monkeypatch.setattr(nccl.ep, "get_lib_version", lib_version)


def test_libnccl_ep_without_driver_is_the_driver_problem_not_a_reinstall(monkeypatch, capsys):
    """One problem, one fix: the dlopen failure a missing libcuda.so.1 causes is no second
    [FAIL] with a reinstall hint."""
    _gpu_stack(monkeypatch, driver=False, nccl_ep_error=DLOPEN_NO_DRIVER)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (
        "  [warn] libnccl_ep: not checked: loading it needs the CUDA driver (libcuda.so.1), "
        "which does not load here (see CUDA driver)  -> fix the CUDA driver, then run doctor "
        "again"
    ) in out
    problems = out.split("problem(s)")[1]
    assert "  - CUDA driver: run on a host with the NVIDIA driver" in problems
    assert "libnccl_ep" not in problems and "reinstall" not in out


def test_libnccl_ep_failing_for_another_reason_stays_a_failure(monkeypatch, capsys):
    _gpu_stack(monkeypatch, driver=False, nccl_ep_error="undefined symbol: ncclEpCreateGroup")
    cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "[FAIL] libnccl_ep: cannot load: undefined symbol" in out
    assert "  - libnccl_ep: reinstall 'nccl-extensions>=0.1.0'" in out


def test_libnccl_ep_with_the_driver_present_stays_a_failure(monkeypatch, capsys):
    _gpu_stack(monkeypatch, driver=True, nccl_ep_error=DLOPEN_NO_DRIVER)
    cli.main(["doctor"])
    out = capsys.readouterr().out
    assert "[FAIL] libnccl_ep: cannot load: Failed to dlopen libnccl_ep" in out
    assert "  - libnccl_ep: reinstall" in out


def test_bench_refuses_without_gpu(capsys):
    assert cli.main(["bench", "--tokens", "1,8"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_arguments():
    parser = cli.build_parser()
    args = parser.parse_args(
        ["bench", "--layers", "4", "--tokens", "1,2,4", "--hidden", "4096", "--top-k", "8"]
    )
    assert args.layers == 4 and args.tokens == [1, 2, 4] and args.hidden == 4096
    bench.validate_arguments(args)
    for bad in (["--hidden", "3072"], ["--steps", "10"], ["--top-k", "17"]):
        with pytest.raises(SystemExit):
            bench.validate_arguments(parser.parse_args(["bench", *bad]))


def test_bench_table_and_json(tmp_path):
    import json

    row = results.Row(
        8,
        median_ms={m: 1.0 for m in results.MODES},
        min_ms={m: 0.9 for m in results.MODES},
        max_ms={m: 1.1 for m in results.MODES},
    )
    row.median_ms["fresh"] = 3.0
    memory = results.PoolMemory.from_snapshots(
        (0, 0),
        (100, 300e6),
        (100 + 4 * 11e6, 300e6 + 4 * 12e6),
        handles=5,
        median_handle_bytes=10e6,
        first_handle_bytes=291.5e6,
    )
    args = cli.build_parser().parse_args(["bench"])
    table = results.format_table([row], args, 1, memory)
    assert "3.00x" in table and "avg 12.000 MB device-wide / 11.000 MB torch" in table
    assert "median 10.000 MB" in table and "1st handle 291.5 MB" in table
    path = tmp_path / "b.json"
    results.write_json([row], args, 1, memory, str(path))
    data = json.loads(path.read_text())
    assert data["rows"][0]["fresh_over_graph"] == 3.0 and data["world_size"] == 1
    assert (
        data["memory"]["total_device_bytes"] == 348e6
        and data["memory"]["avg_handle_torch_bytes"] == 11e6
    )


def test_doctor_estimates_ll_memory_for_a_model(tmp_path):
    path = write_model(tmp_path / "m", hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    [est] = [c for c in doctor.model_checks(path, 256) if c.name == "LL memory estimate"]
    # 0.64 fixed + 0.27 buffers + 0.12 receive buffer (runtime/buffer_sizes.py); 35 handles:
    # vLLM's default capture sizes up to 256, no eager bucket above them.
    assert est.ok and "about 1.04 GiB per GPU at --max-num-batched-tokens 256" in est.detail
    assert (
        "receive buffer 0.12" in est.detail
        and "35 pooled handles" in est.detail
        and "128 experts, hidden 2048, top_k 8" in est.detail
    )
    bigger = [c for c in doctor.model_checks(path, 4096) if c.name == "LL memory estimate"][0]
    assert (
        "at --max-num-batched-tokens 4096" in bigger.detail and "57 pooled handles" in bigger.detail
    )
    rounded = doctor.model_checks(write_model(tmp_path / "r", hidden_size=3072), 256)
    assert "hidden 4096" in next(c for c in rounded if c.name == "LL memory estimate").detail


def test_doctor_says_what_ll_s_default_step_budget_means_for_serving(tmp_path, monkeypatch):
    """With no --max-num-batched-tokens, LL steps take the package's 512 tokens: doctor
    says so, and what a larger budget costs per GPU and did when served
    (docs/benchmarks.md); a budget passed gets no such line."""
    from vllm_flashinfer_ep.doctor import model_verdicts

    path = write_model(tmp_path / "m", hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    # vLLM's 128 sequences on this machine (no GPU): capture sizes to 256, LL keeps 256
    [line] = [c for c in doctor.model_checks(path) if c.name == "LL step budget"]
    assert "LL steps take at most 256 tokens (the package's default for LL" in line.detail
    assert "about 2.24 GiB per GPU against 1.04" in line.detail
    from vllm_flashinfer_ep.doctor import settings as doctor_settings

    real = doctor_settings.vllm_defaults
    monkeypatch.setattr(  # `vllm serve` on an H100: 256 sequences, capture sizes to 512
        doctor_settings, "vllm_defaults", lambda s: (real(s)[0], 256, real(s)[2])
    )
    [line] = [c for c in doctor.model_checks(path) if c.name == "LL step budget"]
    assert line.ok and "LL steps take at most 512 tokens (the package's default" in line.detail
    assert (
        "--max-num-batched-tokens 1024 runs steps above the capture size without graphs for "
        "about 2.24 GiB per GPU against 1.44" in line.detail
    )
    assert "served slower than the default" in line.detail
    assert not [c for c in doctor.model_checks(path, 2048) if c.name == "LL step budget"]
    monkeypatch.setattr(model_verdicts, "vllm_default_tokens", lambda settings: 8192)
    [line] = [c for c in doctor.model_checks(path) if c.name == "LL step budget"]
    assert "without EP vLLM gives 8192 on this GPU" in line.detail


def test_doctor_sizes_the_fleet_for_one_round_where_rounds_split(tmp_path, monkeypatch):
    """VLLM_FLASHINFER_EP_LL_ROUND_TOKENS=512 under a budget of 8192: the estimate is the
    fleet of one 512-token round, a line says how many rounds a full step takes, and no
    budget line; at or above the budget nothing splits."""
    path = write_model(tmp_path / "m", hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    monkeypatch.setenv("VLLM_FLASHINFER_EP_LL_ROUND_TOKENS", "512")
    checks = {c.name: c for c in doctor.model_checks(path, 8192)}
    assert "about 1.44 GiB per GPU for rounds of 512 tokens" in checks["LL memory estimate"].detail
    assert "runs each MoE layer as up to 16 rounds" in checks["LL rounds"].detail
    assert "LL step budget" not in checks
    checks = {c.name: c for c in doctor.model_checks(path, 512)}
    assert checks["LL rounds"].warn and "no forward splits" in checks["LL rounds"].detail
    assert "at --max-num-batched-tokens 512" in checks["LL memory estimate"].detail
    assert "LL step budget" not in checks  # that line is about LL's default budget
