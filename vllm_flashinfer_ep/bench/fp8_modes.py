"""The modes bench-fp8 times, for its command and its GPU side (imported only to run)."""

from __future__ import annotations

MODES = ("bf16_quant", "fp8_wire", "bf16_quant_eager", "fp8_wire_eager")
HT_MODES = ("bf16_quant_eager", "fp8_wire_eager")  # HT is never captured


def modes(backend: str) -> tuple[str, ...]:
    return HT_MODES if backend == "ht" else MODES
