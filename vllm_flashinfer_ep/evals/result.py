"""The outcome of one eval run, judged and written as JSON.

The JSON is the record a CI job or a person keeps: which config, what command, which
scores against which bound, and why a run did not pass or was skipped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from vllm_flashinfer_ep.evals.config import Gsm8kConfig
from vllm_flashinfer_ep.evals.lm_eval_client import FILTERS, Gsm8kScores

SCHEMA_VERSION = 1


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"  # scored below the bound
    SKIPPED = "skipped"  # a requirement (GPUs, model, transport) is missing
    ERROR = "error"  # the server or the eval broke

    @property
    def exit_code(self) -> int:
        return {"passed": 0, "failed": 1, "error": 2, "skipped": 3}[self.value]


METRIC_CHOICES: tuple[str, ...] = ("both", *FILTERS)


def judge(scores: Gsm8kScores, config: Gsm8kConfig, metric: str = "both") -> tuple[Status, str]:
    """Pass iff the chosen filter(s) reach accuracy_threshold - tolerance."""
    if metric not in METRIC_CHOICES:
        raise ValueError(f"metric must be one of {METRIC_CHOICES}, got {metric!r}")
    names = FILTERS if metric == "both" else (metric,)
    bound = config.pass_bound
    values = scores.by_filter()
    low = [f"{n} {values[n]:.4f}" for n in names if values[n] < bound]
    if low:
        return Status.FAILED, (
            f"{', '.join(low)} < {config.accuracy_threshold:.4f} - {config.tolerance:.4f} "
            f"= {bound:.4f}"
        )
    shown = ", ".join(f"{n} {values[n]:.4f}" for n in names)
    return Status.PASSED, f"{shown} >= {bound:.4f}"


@dataclass
class EvalResult:
    """Everything worth keeping about one run."""

    config: str
    model_name: str
    all2all_backend: str
    status: Status
    reason: str
    accuracy_threshold: float
    tolerance: float
    pass_bound: float
    metric: str
    num_fewshot: int
    limit: int | None
    serve_command: list[str]
    env: dict[str, str]
    scores: dict[str, float] = field(default_factory=dict)
    num_questions_scored: int = 0
    task: str | None = None
    startup_seconds: float | None = None
    eval_seconds: float | None = None
    server_exit_code: int | None = None
    server_log: str | None = None
    finished_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        data["schema_version"] = SCHEMA_VERSION
        return data

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
