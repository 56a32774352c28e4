"""Fault tolerance end to end: two external-LB DP ranks, a fault, detection, recovery.

Parameterized over the FT-capable all2all backends installed here: this package's
flashinfer_ep_low_latency always, vLLM's nixl_ep when its package is importable.
Needs 2 GPUs and the model (FLASHINFER_EP_TEST_FT_MODEL, default
ibm-research/PowerMoE-3b) local or in the Hugging Face cache; nothing is downloaded
unless FLASHINFER_EP_TEST_ALLOW_DOWNLOADS=1. Otherwise every test skips with the reason.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from ft_utils import (
    DP_SIZE,
    FAULT_DETECTION_DEADLINE_S,
    FAULT_STEP,
    MODEL,
    RECOVERY_DEADLINE_S,
    ExternalLBCluster,
    apply_ft,
    complete,
    driving_requests,
    find_worker_pids,
    ft_backends,
    wait_for_engine_status,
    write_fault_injection_sitecustomize,
)

from tests.environment_gate import missing
from tests.helpers import model_is_local, visible_gpu_count

ALLOW_DOWNLOADS = os.environ.get("FLASHINFER_EP_TEST_ALLOW_DOWNLOADS") == "1"

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.slow]


@pytest.fixture(autouse=True)
def _requirements(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = visible_gpu_count()
    if gpus < DP_SIZE:
        missing(f"needs {DP_SIZE} GPUs (one per DP rank), {gpus} visible")
    if not ALLOW_DOWNLOADS:
        if not model_is_local(MODEL):
            missing(
                f"model {MODEL} not local/cached; set FLASHINFER_EP_TEST_ALLOW_DOWNLOADS=1 "
                "to download it"
            )
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _healthy_outputs(cluster: ExternalLBCluster) -> list[str]:
    """Wait for every rank to be healthy; return each rank's greedy completion."""
    healthy = wait_for_engine_status(cluster.ports, "status", {"healthy"}, RECOVERY_DEADLINE_S)
    assert all(healthy), f"not all ranks healthy: {healthy}"
    outputs = [complete(port, cluster.model) for port in cluster.ports]
    assert all(text.strip() for text in outputs), outputs
    return outputs


@pytest.mark.parametrize("backend", ft_backends())
def test_injected_fault_then_retry_recovers_all_ranks(backend: str, tmp_path: Path) -> None:
    site_dir = tmp_path / "inject"
    write_fault_injection_sitecustomize(site_dir, rank=1, step=FAULT_STEP)
    with ExternalLBCluster(backend, tmp_path / "logs", site_dir=site_dir) as cluster:
        before = _healthy_outputs(cluster)

        with driving_requests(cluster.ports, cluster.model):
            faulted = wait_for_engine_status(
                cluster.ports, "status", {"unhealthy"}, FAULT_DETECTION_DEADLINE_S
            )
        for rank, engine in enumerate(faulted):
            assert engine is not None, (
                f"rank {rank} not unhealthy within {FAULT_DETECTION_DEADLINE_S:.0f}s "
                f"(likely hung); logs in {tmp_path / 'logs'}"
            )
        assert faulted[1] is not None and faulted[1].get("fault_info"), faulted[1]

        for port in cluster.ports:  # every rank: the recovery collective needs them all
            code, body = apply_ft(port, "retry")
            assert code == 202, body
            assert body.get("request_id"), body

        # Recovered ranks serve again, and (greedy, same prompt, all experts re-admitted)
        # give the same text as before the fault.
        assert _healthy_outputs(cluster) == before


@pytest.mark.parametrize("backend", ft_backends())
def test_killed_worker_survivor_unhealthy_victim_dead(backend: str, tmp_path: Path) -> None:
    with ExternalLBCluster(backend, tmp_path / "logs") as cluster:
        _healthy_outputs(cluster)
        victim_pid = cluster.servers[1].pid
        assert victim_pid is not None
        workers = find_worker_pids(victim_pid)
        assert len(workers) == 1, f"expected one worker under rank 1, found {workers}"
        os.kill(workers[0], signal.SIGKILL)

        with driving_requests(cluster.ports, cluster.model):
            survivor, victim = wait_for_engine_status(
                cluster.ports, "status", {"unhealthy", "dead"}, FAULT_DETECTION_DEADLINE_S
            )
        assert survivor is not None, (
            f"survivor not unhealthy within {FAULT_DETECTION_DEADLINE_S:.0f}s (likely hung)"
        )
        assert survivor["status"] == "unhealthy" and survivor.get("fault_info"), survivor
        assert victim is not None and victim["status"] == "dead", victim

        code, body = apply_ft(cluster.ports[1], "retry")
        assert code == 202, body
        (outcome,) = wait_for_engine_status(
            [cluster.ports[1]], "last_ft_request_id", {body["request_id"]}, RECOVERY_DEADLINE_S
        )
        assert outcome is not None, "the retry's outcome never showed in /fault_tolerance/status"
        assert "status is DEAD" in (outcome.get("ft_error") or ""), outcome
