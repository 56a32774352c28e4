"""`vllm serve` with --all2all-backend flashinfer_ep_low_latency answers over HTTP (world 1).

The server runs vLLM's real multi-process layout (API server, engine core process, worker)
with the plugin and the world-1 harness loaded in each through their entry points, and
CUDA graphs on. It listens on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from engine_runner import engine_env
from serve_process import post, serve_command, served

from tests.helpers import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STARTUP_S = 480


def test_vllm_serve_low_latency_answers_a_completion(engines, models, tmp_path):
    model = models(2048)
    port = free_port()
    log_path = tmp_path / "serve.log"
    log_dir = os.environ.get("FLASHINFER_EP_TEST_ENGINE_LOG_DIR")
    if log_dir:
        log_path = Path(log_dir) / "engine-serve.log"
    env = engine_env(engines.plugin_root, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    cmd = serve_command(
        model,
        port,
        "--enable-expert-parallel",
        "--all2all-backend",
        "flashinfer_ep_low_latency",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.4",
        "--served-model-name",
        "tiny-moe",
    )
    with served(cmd, env, log_path, port, STARTUP_S):
        reply = post(
            port,
            "/v1/completions",
            {
                "model": "tiny-moe",
                "prompt": "w5 w6 w7 w8",
                "max_tokens": 8,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        print("completion:", reply)
        assert reply["usage"]["completion_tokens"] == 8
        assert reply["choices"][0]["text"].strip()
    text = open(log_path).read()
    # The manager was built by vLLM's CudaCommunicator inside the engine process, and the
    # CUDA-graph policy kept graphs for LL.
    assert "Using FlashInferEPLowLatencyManager all2all manager" in text
    assert re.search(r"flashinfer_ep_low_latency: cudagraph_mode \w+ kept", text)
    # The runtime ran its first round at load (a BF16 model) and logged its memory.
    assert re.search(
        r"low_latency runtime \(hidden \d+, \d+ tokens per rank\) loaded: [\d.]+ GB", text
    )
