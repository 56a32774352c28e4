"""`vllm serve` with --all2all-backend flashinfer_ep_low_latency answers over HTTP (world 1).

The server runs vLLM's real multi-process layout (API server, engine core process, worker)
with the plugin and the world-1 harness loaded in each through their entry points, and
CUDA graphs on. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from engine_runner import engine_env

from tests.helpers import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STARTUP_S = 480


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def test_vllm_serve_low_latency_answers_a_completion(engines, models, tmp_path):
    model = models(2048)
    port = free_port()
    log_path = tmp_path / "serve.log"
    log_dir = os.environ.get("FLASHINFER_EP_TEST_ENGINE_LOG_DIR")
    if log_dir:
        log_path = os.path.join(log_dir, "engine-serve.log")
    env = engine_env(engines.plugin_root, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    # vLLM's console script through this interpreter: the device's PATH need not hold it.
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-expert-parallel",
        "--all2all-backend",
        "flashinfer_ep_low_latency",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.4",
        "--served-model-name",
        "tiny-moe",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + STARTUP_S
            while _get(f"http://127.0.0.1:{port}/health") != 200:
                assert proc.poll() is None, open(log_path).read()[-4000:]
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(2)
            reply = _post(
                f"http://127.0.0.1:{port}/v1/completions",
                {
                    "model": "tiny-moe",
                    "prompt": "w5 w6 w7 w8",
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            print("completion:", reply)
            assert reply["usage"]["completion_tokens"] == 8
            assert reply["choices"][0]["text"].strip()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    text = open(log_path).read()
    # The manager was built by vLLM's CudaCommunicator inside the engine process, and the
    # CUDA-graph policy kept graphs for LL.
    assert "Using FlashInferEPLowLatencyManager all2all manager" in text
    assert re.search(r"flashinfer_ep_low_latency: cudagraph_mode \w+ kept", text)
    # The runtime ran its first round at load (a BF16 model) and logged its memory.
    assert re.search(
        r"low_latency runtime \(hidden \d+, \d+ tokens per rank\) loaded: [\d.]+ GB", text
    )
