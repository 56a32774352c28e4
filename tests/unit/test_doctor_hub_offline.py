"""doctor --model ORG/NAME without network: no ~25 s of Hugging Face retries, and an error
that names a local path and HF_HUB_OFFLINE=1; the cache is used where it has the config.

The Hub is a local port nothing listens on (connection refused, as with no network),
the cache a temporary directory; huggingface_hub's own code runs."""

from __future__ import annotations

import json
import socket
import time

import pytest
from huggingface_hub import constants

from vllm_flashinfer_ep import doctor
from vllm_flashinfer_ep.doctor import model_config

MODEL = "org/model"


@pytest.fixture()
def no_network(monkeypatch, tmp_path):
    with socket.socket() as sock:  # a free port; closed, so connecting is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        endpoint + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    return endpoint


def _cache(tmp_path, config: dict) -> None:
    """config.json of MODEL in the Hugging Face cache layout."""
    repo = tmp_path / "hub" / "models--org--model"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


def test_no_network_fails_fast_naming_a_local_path_and_hf_hub_offline(no_network):
    start = time.monotonic()
    [check] = doctor.model_checks(MODEL)
    assert time.monotonic() - start < 10  # huggingface_hub's retries alone take ~25 s
    assert not check.ok
    assert check.detail == (
        f"{MODEL}: cannot connect to {no_network} (no network?) and its config.json is not "
        "in the Hugging Face cache"
    )
    assert "pass a local model dir (--model /path/to/model)" in check.fix
    assert "HF_HUB_OFFLINE=1" in check.fix


def test_no_network_reads_the_cache(no_network, tmp_path):
    _cache(tmp_path, {"hidden_size": 2048, "num_experts_per_tok": 8, "torch_dtype": "bfloat16"})
    checks = {c.name: c for c in doctor.model_checks(MODEL)}
    assert "model config" not in checks
    assert checks["top_k"].ok and checks["top_k"].detail.startswith("8 ")


def test_hf_hub_offline_names_the_variable(no_network, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_config, "_hub_unreachable", lambda model: pytest.fail("went online"))
    [check] = doctor.model_checks(MODEL)
    assert not check.ok and "HF_HUB_OFFLINE=1 forbids downloading it" in check.detail
    assert "pass a local model dir" in check.fix and "unset HF_HUB_OFFLINE" in check.fix


def test_online_the_download_is_unchanged(monkeypatch, tmp_path):
    """Where the Hub answers, hf_hub_download is called as before (no local_files_only)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_experts_per_tok": 4}))
    calls = []

    def download(repo, name, **kwargs):
        calls.append((repo, name, kwargs))
        return str(config)

    import huggingface_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_config, "_hub_unreachable", lambda model: False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert doctor.load_model_config(MODEL) == {"num_experts_per_tok": 4}
    assert calls == [(MODEL, "config.json", {})]


def test_an_answer_from_the_hub_is_not_offline(monkeypatch):
    """Any HTTP answer (401, 404, ...) or other error: the normal download decides."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(url, **kwargs):
        raise RepositoryNotFoundError("404", response=None)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", not_found)
    assert model_config._hub_unreachable(MODEL) is False
