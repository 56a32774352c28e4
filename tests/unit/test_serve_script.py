"""scripts/serve.sh on a stubbed host: the GPU check comes before any install, one message
per outcome, install only when missing or out of date (nothing left in the tree), and
doctor gets the arguments vllm serve gets.

The script runs on a copy of the repository's files it reads, with PATH holding only the
tools it needs and stubs: nvidia-smi (absent, 1 GPU, 2 GPUs), python3 (creates the
virtualenv), and the virtualenv's python (pip), vllm-flashinfer-ep (doctor) and vllm, each
recording its arguments.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = (
    "grep",
    "tr",
    "find",
    "sort",
    "xargs",
    "sha256sum",
    "cut",
    "cat",
    "mktemp",
    "cp",
    "rm",
    "dirname",
    "sed",
)
MODEL = "org/some-moe"
SERVE_FLAGS = [
    "--data-parallel-size",
    "2",
    "--enable-expert-parallel",
    "--all2all-backend",
    "flashinfer_ep_low_latency",
]

# Each stub appends "<name> <args>" to $SERVE_TEST_LOG.
STUB = f"""#!{sys.executable}
import os, sys
with open(os.environ["SERVE_TEST_LOG"], "a") as log:
    log.write(" ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\\n")
"""
VENV_PYTHON = (
    STUB
    + """
import pathlib, shutil
args = sys.argv[1:]
if args[:3] == ["-m", "pip", "install"] and "--upgrade" not in args:
    target = pathlib.Path(args[-1])
    # What a real install needs from the copy it is given.
    assert (target / "pyproject.toml").is_file() and (target / "vllm_flashinfer_ep").is_dir()
    bin_dir = pathlib.Path(sys.argv[0]).parent
    for name in ("vllm", "vllm-flashinfer-ep"):
        shutil.copy(pathlib.Path(os.environ["SERVE_TEST_STUBS"]) / name, bin_dir / name)
"""
)
DOCTOR = (
    STUB
    + """
sys.exit(int(os.environ.get("SERVE_TEST_DOCTOR_RC", "0")))
"""
)
PYTHON3 = (
    STUB
    + """
import pathlib, shutil
assert sys.argv[1:3] == ["-m", "venv"]
bin_dir = pathlib.Path(sys.argv[3]) / "bin"
bin_dir.mkdir(parents=True)
shutil.copy(pathlib.Path(os.environ["SERVE_TEST_STUBS"]) / "python", bin_dir / "python")
"""
)


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def _nvidia_smi(gpus: int) -> str:
    lines = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\\n" for i in range(gpus))
    return STUB + f'sys.stdout.write("{lines}")\n'


@pytest.fixture
def host(tmp_path):
    """A copy of the files serve.sh reads, a tools-only PATH, the stubs and a log."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "serve.sh", repo / "scripts" / "serve.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "README.md").write_text("readme\n")
    (repo / "vllm_flashinfer_ep").mkdir()
    (repo / "vllm_flashinfer_ep" / "__init__.py").write_text("VERSION = 1\n")
    path = tmp_path / "path"
    path.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is needed to run serve.sh"
        (path / tool).symlink_to(found)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    _write(stubs / "python", VENV_PYTHON)
    _write(stubs / "vllm", STUB)
    _write(stubs / "vllm-flashinfer-ep", DOCTOR)
    _write(path / "python3", PYTHON3)
    log = tmp_path / "log"
    log.write_text("")

    class Host:
        def __init__(self):
            self.repo, self.path, self.log, self.venv = repo, path, log, tmp_path / "venv"

        def gpus(self, count: int | None) -> None:
            smi = self.path / "nvidia-smi"
            if smi.exists():
                smi.unlink()
            if count is not None:
                _write(smi, _nvidia_smi(count))

        def serve(self, *args: str, **env: str) -> subprocess.CompletedProcess:
            environ = {
                "PATH": str(self.path),
                "HOME": str(tmp_path),
                "SERVE_VENV": str(self.venv),
                "SERVE_TEST_LOG": str(self.log),
                "SERVE_TEST_STUBS": str(stubs),
                **env,
            }
            return subprocess.run(
                [shutil.which("bash"), str(self.repo / "scripts" / "serve.sh"), *args],
                env=environ,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )

        def calls(self) -> list[str]:
            lines = self.log.read_text().splitlines()
            self.log.write_text("")
            return lines

    return Host()


def _one_message(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("serve.sh: ")
    return lines[0]


def test_without_nvidia_smi_nothing_is_installed(host):
    host.gpus(None)
    result = host.serve(MODEL)
    assert result.returncode == 1
    message = _one_message(result)
    assert "nvidia-smi is not on PATH" in message and "2 or more" in message
    assert "Nothing was installed" in message
    assert host.calls() == [] and not host.venv.exists()


@pytest.mark.parametrize("gpus", [0, 1])
def test_fewer_than_two_gpus_nothing_is_installed(host, gpus):
    host.gpus(gpus)
    result = host.serve(MODEL)
    assert result.returncode == 1
    message = _one_message(result)
    assert f"found {gpus} usable GPU(s)" in message and "needs 2 or more" in message
    assert host.calls() == ["nvidia-smi -L"] and not host.venv.exists()


def test_cuda_visible_devices_limits_the_count(host):
    host.gpus(2)
    result = host.serve(MODEL, CUDA_VISIBLE_DEVICES="1")
    assert result.returncode == 1 and "found 1 usable GPU(s)" in _one_message(result)
    assert not host.venv.exists()


def test_two_gpus_install_once_then_doctor_and_serve_get_the_same_arguments(host):
    host.gpus(2)
    result = host.serve(MODEL, "--max-num-batched-tokens", "512", "--port", "9000")
    assert result.returncode == 0, result.stderr
    calls = host.calls()
    user = ["--max-num-batched-tokens", "512", "--port", "9000"]
    serve_args = " ".join(SERVE_FLAGS + user)
    assert calls[0] == "nvidia-smi -L"
    assert calls[1] == f"python3 -m venv {host.venv}"
    assert calls[2] == "python -m pip install -q --upgrade pip"
    staging = calls[3].split()[-1]
    assert calls[3] == f"python -m pip install -q {staging}"
    # Built from a temporary copy that is gone afterwards: nothing left in the tree.
    assert not Path(staging).exists() and not Path(staging).is_relative_to(host.repo)
    assert sorted(p.name for p in host.repo.iterdir()) == [
        "README.md",
        "pyproject.toml",
        "scripts",
        "vllm_flashinfer_ep",
    ]
    assert calls[4] == f"vllm-flashinfer-ep doctor --model {MODEL} {serve_args}"
    assert calls[5] == f"vllm serve {MODEL} {serve_args}"
    assert len(calls) == 6
    assert result.stderr.strip().splitlines()[-1] == (
        f"serve.sh: starting vllm serve {MODEL} on 2 GPUs: {serve_args}"
    )

    # Up to date: no install at all.
    assert host.serve(MODEL).returncode == 0
    calls = host.calls()
    assert not any("pip" in c or "venv" in c for c in calls)
    assert calls[-1] == f"vllm serve {MODEL} {' '.join(SERVE_FLAGS)}"

    # Sources changed: installed again.
    (host.repo / "vllm_flashinfer_ep" / "__init__.py").write_text("VERSION = 2\n")
    assert host.serve(MODEL).returncode == 0
    assert sum(c.startswith("python -m pip install -q /") for c in host.calls()) == 1


def test_a_failing_doctor_stops_before_serve(host):
    host.gpus(4)
    result = host.serve("--max-model-len", "4096", SERVE_TEST_DOCTOR_RC="1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "serve.sh: doctor found problems (listed above): fix them and run again. "
        "vllm serve was not started."
    )
    calls = host.calls()
    # No model given: the default model, and the flag is passed on, not taken as a model.
    assert calls[-1] == (
        "vllm-flashinfer-ep doctor --model Qwen/Qwen3-30B-A3B --data-parallel-size 4 "
        "--enable-expert-parallel --all2all-backend flashinfer_ep_low_latency --max-model-len 4096"
    )
    assert not any(c.startswith("vllm serve") for c in calls)


def _editable_venv(host, checkout: Path) -> None:
    """A virtualenv holding pip's record of an editable install of `checkout` (what
    scripts/test.sh's `pip install -e` leaves), with the tools serve.sh runs."""
    bin_dir = host.venv / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", VENV_PYTHON), ("vllm", STUB), ("vllm-flashinfer-ep", DOCTOR)):
        _write(bin_dir / name, text)
    info = host.venv / "lib" / "python3.12" / "site-packages" / "vllm_flashinfer_ep-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "direct_url.json").write_text(
        f'{{"dir_info": {{"editable": true}}, "url": "file://{checkout}"}}'
    )


def test_the_editable_install_of_this_checkout_is_used_as_it_is(host):
    """scripts/test.sh installs the checkout editable into .venv: serve.sh serves from it
    without replacing it by a regular install."""
    host.gpus(2)
    _editable_venv(host, host.repo)
    result = host.serve(MODEL)
    assert result.returncode == 0, result.stderr
    calls = host.calls()
    assert not any("pip" in c or "venv" in c for c in calls)
    assert calls[-1] == f"vllm serve {MODEL} {' '.join(SERVE_FLAGS)}"
    assert "using the editable install of this checkout" in result.stderr


def test_an_editable_install_of_another_checkout_is_replaced(host):
    host.gpus(2)
    _editable_venv(host, host.repo.parent / "elsewhere")
    assert host.serve(MODEL).returncode == 0
    assert sum(c.startswith("python -m pip install -q /") for c in host.calls()) == 1


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_usage_and_touches_nothing(host, flag):
    host.gpus(None)
    result = host.serve(flag)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines()[0].startswith("Serve an MoE model with expert parallelism")
    assert "bash scripts/serve.sh [MODEL] [extra vllm serve args...]" in result.stdout
    assert host.calls() == [] and not host.venv.exists()


@pytest.mark.parametrize(
    ("gpus", "extra", "dp_flag"),
    [
        (4, ["-tp", "2"], ["--data-parallel-size", "2"]),  # 2 ranks of 2 GPUs
        (
            8,
            ["--tensor-parallel-size=2", "--pipeline-parallel-size", "2"],
            ["--data-parallel-size", "2"],
        ),
        (4, ["--data-parallel-size", "2"], []),  # the user's own size, used as given
    ],
    ids=["tp2-on-4", "tp2-pp2-on-8", "own-dp"],
)
def test_the_data_parallel_size_leaves_room_for_tp_and_pp(host, gpus, extra, dp_flag):
    # dp = GPUs would start dp x tp x pp ranks on fewer GPUs.
    host.gpus(gpus)
    result = host.serve(MODEL, *extra)
    assert result.returncode == 0, result.stderr
    serve_args = " ".join(
        [
            *dp_flag,
            "--enable-expert-parallel",
            "--all2all-backend",
            "flashinfer_ep_low_latency",
            *extra,
        ]
    )
    calls = host.calls()
    assert calls[-2] == f"vllm-flashinfer-ep doctor --model {MODEL} {serve_args}"
    assert calls[-1] == f"vllm serve {MODEL} {serve_args}"


@pytest.mark.parametrize(
    ("gpus", "extra", "said"),
    [
        (4, ["--tensor-parallel-size", "3"], "4 GPUs do not divide into data-parallel ranks"),
        (2, ["-tp", "2"], "2 GPUs over --tensor-parallel-size 2 leave 1 data-parallel rank"),
        (4, ["-tp", "2", "-dp", "1"], "--data-parallel-size 1: expert parallelism over"),
        (4, ["-tp", "two"], "--tensor-parallel-size two is not a positive integer"),
        (4, ["-pp", "3"], "4 GPUs do not divide into data-parallel ranks of --pipeline"),
    ],
)
def test_sizes_that_leave_no_two_ranks_stop_before_any_install(host, gpus, extra, said):
    host.gpus(gpus)
    result = host.serve(MODEL, *extra)
    assert result.returncode == 1 and said in _one_message(result)
    assert "Nothing was installed" in _one_message(result)
    # A size is named with its value only where the user passed it.
    for flag, short in (
        ("--data-parallel-size", "-dp"),
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
    ):
        if flag not in extra and short not in extra:
            assert not re.search(rf"{flag} \d", _one_message(result)), flag
    assert host.calls() == ["nvidia-smi -L"] and not host.venv.exists()
