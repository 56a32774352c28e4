"""The package's environment variables: validated at engine-config time, known to vLLM.

Each bad value must fail when the engine config is built (one error naming the variable
and the accepted values), never be read as something else later in a worker.
"""

from __future__ import annotations

import logging

import pytest
from tiny_models import engine_config, write_model

import vllm_flashinfer_ep
from vllm_flashinfer_ep import envs
from vllm_flashinfer_ep.backends import HIGH_THROUGHPUT, LOW_LATENCY
from vllm_flashinfer_ep.errors import FlashInferEPEnvVarError

vllm_flashinfer_ep.register()

BAD = [
    (envs.HANDLE_POOL, "maybe", "1/true/yes/on"),
    (
        envs.RDMA_BUFFER_BYTES,
        "-5",
        "0 (NCCL-EP sizes the buffer) or an integer number of bytes from",
    ),
    (
        envs.RDMA_BUFFER_BYTES,
        "abc",
        "0 (NCCL-EP sizes the buffer) or an integer number of bytes from",
    ),
    (
        envs.RDMA_BUFFER_BYTES,
        "1.5e9",
        "0 (NCCL-EP sizes the buffer) or an integer number of bytes from",
    ),
    (envs.TRANSPORT, "foo", "nccl_ep or nixl_ep"),
    (envs.SKIP_ENV_CHECKS, "2", "0/false/no/off"),
    (envs.FT_TIMEOUT_MS, "0", "from 1 to 3600000"),
    (envs.FT_TIMEOUT_MS, "soon", "from 1 to 3600000"),
    (envs.DEEP_GEMM_RECEIVED_ROWS, "-1", "a number of rows per expert >= 0"),
    (envs.DEEP_GEMM_RECEIVED_ROWS, "nan", "a number of rows per expert >= 0"),
    (envs.EXCHANGE_TIMEOUT_S, "0", "integer number of seconds from 1 to 3600"),
    (envs.EXCHANGE_TIMEOUT_S, "2.5", "integer number of seconds from 1 to 3600"),
    (envs.EXCHANGE_TIMEOUT_S, "3601", "integer number of seconds from 1 to 3600"),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-qwen3-moe-env"))


@pytest.mark.parametrize(("name", "raw", "accepted"), BAD)
def test_bad_value_fails_theengine_config(tiny_moe, monkeypatch, name, raw, accepted):
    monkeypatch.setenv(name, raw)
    with pytest.raises(FlashInferEPEnvVarError) as info:
        engine_config(tiny_moe, LOW_LATENCY)
    assert name in str(info.value) and repr(raw) in str(info.value)
    assert accepted in str(info.value)


def test_bad_value_fails_ht_too_and_every_bad_variable_is_named(tiny_moe, monkeypatch):
    monkeypatch.setenv(envs.TRANSPORT, "foo")
    monkeypatch.setenv(envs.HANDLE_POOL, "maybe")
    with pytest.raises(FlashInferEPEnvVarError) as info:
        engine_config(tiny_moe, HIGH_THROUGHPUT)
    assert envs.TRANSPORT in str(info.value) and envs.HANDLE_POOL in str(info.value)


def test_misspelt_variable_fails_theengine_config(tiny_moe, monkeypatch):
    typo = "VLLM_FLASHINFER_EP_HANDLE_POOLS"
    monkeypatch.setenv(typo, "0")  # the user meant HANDLE_POOL; silently keeping 1 is wrong
    with pytest.raises(FlashInferEPEnvVarError) as info:
        engine_config(tiny_moe, LOW_LATENCY)
    assert typo in str(info.value) and envs.HANDLE_POOL in str(info.value)


def test_other_backends_ignore_our_variables(tiny_moe, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv(envs.TRANSPORT, "foo")
    EngineArgs(model=tiny_moe, skip_tokenizer_init=True).create_engine_config()


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        (envs.HANDLE_POOL, "off", False),
        (envs.HANDLE_POOL, "TRUE", True),
        (envs.HANDLE_POOL, "", True),
        (envs.SKIP_ENV_CHECKS, "true", True),
        (envs.SKIP_ENV_CHECKS, "1", True),
        (envs.SKIP_ENV_CHECKS, "no", False),
        (envs.RDMA_BUFFER_BYTES, " 1073741824 ", 1 << 30),
        (envs.RDMA_BUFFER_BYTES, "0", 0),
        (envs.TRANSPORT, "nixl_ep", "nixl_ep"),
        (envs.FT_TIMEOUT_MS, "1234", 1234),
        (envs.EXCHANGE_TIMEOUT_S, " 5 ", 5),
    ],
)
def test_accepted_values_parse(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert envs.BY_NAME[name].value() == value
    envs.validate_all()


def test_defaults_when_unset():
    assert envs.transport() == "nccl_ep"
    assert envs.handle_pool_enabled() is True
    assert envs.ft_timeout_ms() == envs.DEFAULT_FT_TIMEOUT_MS
    assert envs.rdma_buffer_bytes() == 0
    assert envs.skip_env_checks() is False
    assert envs.deep_gemm_received_rows() == 4.0
    assert envs.exchange_timeout_s() == envs.DEFAULT_EXCHANGE_TIMEOUT_S < 60


@pytest.mark.parametrize(("name", "raw", "accepted"), BAD)
def test_worker_side_readers_refuse_too(monkeypatch, name, raw, accepted):
    """A worker started without the config check (e.g. a spawned kernel test) fails the same."""
    monkeypatch.setenv(name, raw)
    reader = {
        envs.HANDLE_POOL: envs.handle_pool_enabled,
        envs.RDMA_BUFFER_BYTES: envs.rdma_buffer_bytes,
        envs.TRANSPORT: envs.transport,
        envs.SKIP_ENV_CHECKS: envs.skip_env_checks,
        envs.FT_TIMEOUT_MS: envs.ft_timeout_ms,
        envs.DEEP_GEMM_RECEIVED_ROWS: envs.deep_gemm_received_rows,
        envs.EXCHANGE_TIMEOUT_S: envs.exchange_timeout_s,
    }[name]
    with pytest.raises(FlashInferEPEnvVarError, match=name):
        reader()


def test_readme_documents_every_variable_and_only_those():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    import re

    documented = set(re.findall(r"`(VLLM_FLASHINFER_EP_[A-Z0-9_]+)`", readme))
    assert documented == set(envs.BY_NAME)


def test_vllm_knows_our_variables(monkeypatch, caplog):
    from vllm.platforms import current_platform

    for var in envs.VARIABLES:
        monkeypatch.setenv(var.name, var.default)
    with caplog.at_level(logging.WARNING):
        current_platform.validate_environ(hard_fail=True)  # raises on an unknown VLLM_ name
    assert "Unknown vLLM environment variable" not in caplog.text
    # A misspelt name is still reported by vLLM.
    monkeypatch.setenv("VLLM_FLASHINFER_EP_HANDLEPOOL", "1")
    with pytest.raises(ValueError, match="VLLM_FLASHINFER_EP_HANDLEPOOL"):
        current_platform.validate_environ(hard_fail=True)


def test_vllm_envs_getters_return_raw_strings_and_never_raise(monkeypatch):
    import vllm.envs as vllm_envs

    monkeypatch.setenv(envs.RDMA_BUFFER_BYTES, "abc")
    assert vllm_envs.environment_variables[envs.RDMA_BUFFER_BYTES]() == "abc"
    monkeypatch.delenv(envs.RDMA_BUFFER_BYTES)
    assert vllm_envs.environment_variables[envs.RDMA_BUFFER_BYTES]() == "0"


def test_nixl_ep_transport_needs_a_flashinfer_built_with_it(tiny_moe, monkeypatch):
    import flashinfer.moe_ep as fi

    monkeypatch.setenv(envs.TRANSPORT, "nixl_ep")
    monkeypatch.setattr(fi, "have_nixl_ep", lambda: False)
    with pytest.raises(FlashInferEPEnvVarError, match="have_nixl_ep"):
        engine_config(tiny_moe, LOW_LATENCY)
    monkeypatch.setattr(fi, "have_nixl_ep", lambda: True)
    engine_config(tiny_moe, LOW_LATENCY)


def test_the_project_names_no_variable_the_engine_would_refuse():
    """Every VLLM_FLASHINFER_EP_* name in the repo is a package variable (test-only knobs
    use FLASHINFER_EP_TEST_*): the engine refuses unknown names under the prefix, so a
    documented test knob there would stop every server it starts."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    deliberate_typos = {"VLLM_FLASHINFER_EP_HANDLEPOOL", "VLLM_FLASHINFER_EP_HANDLE_POOLS"}
    found: dict[str, set[str]] = {}
    for sub in ("vllm_flashinfer_ep", "tests", "docs", "configs", "docker", "scripts"):
        for path in (root / sub).rglob("*"):
            if path.suffix not in {".py", ".md", ".yaml", ".sh", ".toml", ""} or not path.is_file():
                continue
            for name in re.findall(
                r"\bVLLM_FLASHINFER_EP_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="ignore")
            ):
                found.setdefault(name, set()).add(str(path.relative_to(root)))
    unknown = {
        n: sorted(p)
        for n, p in found.items()
        if n not in envs.BY_NAME and n not in deliberate_typos
    }
    assert not unknown, unknown


def test_the_small_forwards_bound_is_rank_local(monkeypatch):
    """Each rank's experts choice is its own (no collective in it): ranks may differ."""
    monkeypatch.setenv(envs.DEEP_GEMM_RECEIVED_ROWS, "0")
    assert envs.DEEP_GEMM_RECEIVED_ROWS not in envs.settings()
