"""The dp=2 engine tests' commands and log checks (tests/engine/test_engine_multigpu.py),
read on CPU with vLLM 0.33.0's own parser and log format, so the first multi-GPU machine
runs what vLLM accepts and the EPLB check cannot pass on the start-up rearrangement."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import test_engine_multigpu as mg  # noqa: E402

import vllm_flashinfer_ep  # noqa: E402
from tests.helpers import parse_serve_args  # noqa: E402

vllm_flashinfer_ep.register()


@pytest.mark.parametrize("backend", [mg.LL, mg.HT])
def test_dp2_commands_parse(backend):
    args = parse_serve_args(mg.dp2_command("/m", 8000, backend, *mg.eplb_args())[5:])
    assert (args.data_parallel_size, args.enable_expert_parallel) == (2, True)
    assert args.all2all_backend == backend and args.enable_eplb
    assert args.eplb_config.use_async is False  # the rearrangement logs before the logprobs


def test_only_a_rearrangement_while_serving_counts():
    import vllm.distributed.eplb.eplb_state as eplb_state

    source = Path(eplb_state.__file__).read_text()
    fmt = '"Rearranged experts %s in %.2f s."'
    assert fmt in source  # vLLM's own line, with " " or " (profile) " for %s
    line = fmt.strip('"')
    assert mg.REARRANGED.search(line % (" ", 0.02))
    assert not mg.REARRANGED.search(line % (" (profile) ", 0.02))
