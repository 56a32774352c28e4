"""Triton kernels run on CPU in Triton's interpreter, in a child process.

TRITON_INTERPRET=1 must be set before Triton is imported, so the kernels run in a child
started with it. The child imports a test module and calls one of its functions on each
case (a JSON object), so the checks are plain, linted Python shared with the tests; it
batches every case of a module into one process (each start imports torch and Triton).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository this file is in, scratch copies too
MARK = "INTERPRETER RESULTS "


def run_cases(file: str, function: str, cases: list[dict], timeout: float = 600) -> list:
    """`function(case)` of the module at `file` (a test's __file__: pytest may import it
    under another name) for each case in a child under TRITON_INTERPRET=1: per case, None
    (it passed) or what the check said (or the exception it raised)."""
    module = ".".join(Path(file).resolve().relative_to(ROOT).with_suffix("").parts)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    code = f"from tests.unit.interpreter import child_main; child_main({module!r}, {function!r})"
    result = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(cases),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARK)]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    outcomes = json.loads(lines[-1][len(MARK) :])
    assert len(outcomes) == len(cases)
    return outcomes


def failures(cases: list[dict], outcomes: list, kind: str) -> list[str]:
    """The failures among the cases of one kind (asserting some ran)."""
    ran = [(case, out) for case, out in zip(cases, outcomes) if case["kind"] == kind]
    assert ran, f"no {kind} case ran"
    failed = [f"{case}: {out}" for case, out in ran if out is not None]
    return [f"{len(failed)} of {len(ran)} failed", *failed[:5]] if failed else []


def child_main(module: str, function: str) -> None:
    """The child's side: the cases from stdin, one line of outcomes on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    check = getattr(importlib.import_module(module), function)
    outcomes = []
    for case in json.loads(sys.stdin.read()):
        try:
            outcomes.append(check(case))
        except Exception:  # reported as the case's failure, the next case runs
            outcomes.append(traceback.format_exc(limit=4))
    print(MARK + json.dumps(outcomes), flush=True)


def count_kinds(experts: int, rows: int, gen: torch.Generator) -> list[list[int]]:
    """Received rows per expert at the edges (none, every expert full, one expert with one
    row) and one random mix: the counts the kernels' tests run."""
    return [
        [0] * experts,
        [rows] * experts,
        [1 if e == experts // 2 else 0 for e in range(experts)],
        torch.randint(0, rows + 1, (experts,), generator=gen).tolist(),
    ]


def received_mask(sorted_ids: torch.Tensor, total: int) -> torch.Tensor:
    """The rows a block list names (bool [total])."""
    listed = torch.zeros(total, dtype=torch.bool)
    listed[sorted_ids[sorted_ids < total].long()] = True
    return listed
