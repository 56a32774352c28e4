"""The modes bench-fp8 times, named once for its command (bench/fp8_run.py) and its GPU
side (bench/fp8_harness.py), which the command imports only when it runs."""

from __future__ import annotations

MODES = ("bf16_quant", "fp8_wire", "bf16_quant_eager", "fp8_wire_eager")
HT_MODES = ("bf16_quant_eager", "fp8_wire_eager")  # HT is never captured


def modes(backend: str) -> tuple[str, ...]:
    return HT_MODES if backend == "ht" else MODES
