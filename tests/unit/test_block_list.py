"""The fused block-list kernel writes what the torch builder writes, value for value.

The kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1, set before Triton
compiles anything, so in a child process); on the GPU it runs compiled in
tests/kernels/test_block_list_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_flashinfer_ep.vllm import block_list

pytest.importorskip("triton")

# (experts, rows per expert, BLOCK_M): powers of two and not, one expert, a real model's
# local experts at world 1.
SHAPES = [(8, 16, 16), (5, 32, 16), (1, 64, 64), (3, 8, 32), (128, 256, 64), (256, 64, 16)]

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from vllm_flashinfer_ep.vllm import block_list as bl
    cases = json.loads(sys.argv[1])
    for experts, rows, bm, counts, nb in cases:
        counts = torch.tensor(counts, dtype=torch.int32)
        want = bl.torch_expert_blocks(counts, rows, bm, nb)
        got = bl.fused_expert_blocks(counts, rows, bm, nb)
        for name, w, g in zip(("sorted_ids", "expert_ids", "blocks_rows"), want, got):
            if w.dtype != g.dtype or not torch.equal(w, g):
                print("MISMATCH", name, experts, rows, bm, counts.tolist(), nb)
                sys.exit(1)
    print("OK", len(cases))
    """
)


def _cases() -> list:
    gen = torch.Generator().manual_seed(0)
    cases = []
    for experts, rows, bm in SHAPES:
        kinds = {
            "empty": torch.zeros(experts, dtype=torch.int32),
            "full": torch.full((experts,), rows, dtype=torch.int32),
            "one row": torch.nn.functional.one_hot(torch.tensor(experts // 2), experts).int(),
            "random": torch.randint(0, rows + 1, (experts,), generator=gen, dtype=torch.int32),
            "sparse": torch.randint(0, 3, (experts,), generator=gen, dtype=torch.int32),
        }
        whole = experts * -(-rows // bm)
        for counts in kinds.values():
            # bounds: tighter than the blocks in use, one program, several, the whole buffer
            for nb in (1, 7, block_list.BLOCKS_PER_PROGRAM + 1, whole):
                cases.append([experts, rows, bm, counts.tolist(), nb])
    return cases


def test_the_fused_kernel_equals_the_torch_builder_in_triton_s_interpreter():
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(_cases())],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.startswith("OK"), (
        result.stdout + result.stderr[-3000:]
    )


def test_cpu_tensors_always_take_the_torch_builder(monkeypatch):
    monkeypatch.setattr(block_list, "FUSED", True)
    monkeypatch.setattr(
        block_list, "fused_expert_blocks", lambda *a: pytest.fail("the kernel got CPU tensors")
    )
    counts = torch.tensor([3, 0, 17], dtype=torch.int32)
    got = block_list.expert_blocks(counts, 32, 16, 4)
    want = block_list.torch_expert_blocks(counts, 32, 16, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_row_ids_beyond_int32_are_refused():
    with pytest.raises(ValueError, match="int32"):
        block_list.fused_expert_blocks(torch.zeros(2**16, dtype=torch.int32), 2**15, 16, 4)
