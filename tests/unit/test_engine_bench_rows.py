"""The engine benchmark keeps the rows an engine measured before it died (tests/engine)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine_run import bench_row, bench_rows_from_log  # noqa: E402

LOG = """\
(MainProcess pid=1) INFO 12-03 10:08:23 [core.py:412] init engine took 7.36 s
engine_run: ready in 32.0s
engine_run: bench warm-up 1.249s
engine_run: bench batch=1 first=0.072s full=4.571s
engine_run: bench batch=8 first=0.103s full=7.981s
INFO noise engine_run: bench batch=99 first=1.0s full=2.0s
engine_run: bench batch=32 first=0.164s full=15.529s
Timeout (0:01:00)!
"""


def test_rows_from_progress_lines():
    rows = bench_rows_from_log(LOG, 128)
    assert [r["batch"] for r in rows] == [1, 8, 32]  # only whole progress lines count
    assert rows[1] == bench_row(8, 128, 0.103, 7.981)


def test_row_arithmetic():
    row = bench_row(8, 128, 0.103, 7.981)
    assert abs(row["decode_seconds"] - 7.878) < 1e-9
    assert abs(row["output_tokens_per_s"] - 8 * 128 / 7.878) < 1e-9
    assert abs(row["ms_per_step"] - 7878 / 128) < 1e-9
