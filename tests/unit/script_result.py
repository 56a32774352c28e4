"""Run a test script in a fresh interpreter and read the one JSON result it prints.

The config-time tests build vLLM configs in a subprocess (the harness and the plugin patch
vLLM classes for the whole process); each script prints one line `RESULT<json>`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def script_result(script: str, args: list[str], env: dict[str, str], timeout: int) -> Any:
    """The JSON after `RESULT` on the script's stdout; its output tails if it has none."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[len("RESULT") :])
