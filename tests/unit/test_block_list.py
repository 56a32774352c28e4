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


def _assert_ok_in_the_interpreter(child: str, cases: list) -> None:
    """Run `child` over `cases` in a child process under TRITON_INTERPRET=1 (set before
    Triton compiles anything); it prints OK or what differs."""
    import json

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", child, json.dumps(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.startswith("OK"), (
        result.stdout + result.stderr[-3000:]
    )


def test_the_fused_kernel_equals_the_torch_builder_in_triton_s_interpreter():
    _assert_ok_in_the_interpreter(CHILD, _cases())


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


# The listed-rows activation: (experts, rows per expert, d, BLOCK_M, dtype); widths whose
# tile is wider than d (48, 96, 200: masked columns) and one with several tiles
# (Qwen3-30B-A3B's 768 at BLOCK_M 64: 64-column tiles).
ACT_SHAPES = [
    (8, 16, 48, 16, "bfloat16"),
    (5, 32, 96, 16, "float16"),
    (4, 64, 768, 64, "bfloat16"),
    (3, 8, 200, 32, "bfloat16"),
]

ACT_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from vllm_flashinfer_ep.vllm import block_list as bl
    cases = json.loads(sys.argv[1])

    def rounded(t, dtype):
        # FP32 -> 16 bits as the kernel rounds in the interpreter: Triton 3.8's interpreter
        # truncates to bfloat16 (compiled kernels round to nearest even, the GPU test's
        # case) and rounds to nearest even for float16.
        if dtype == torch.bfloat16:
            t = (t.contiguous().view(torch.int32) & -65536).view(torch.float32)
        return t.to(dtype).float()

    for experts, rows, d, bm, dtype, counts, nb in cases:
        dtype = getattr(torch, dtype)
        counts = torch.tensor(counts, dtype=torch.int32)
        gen = torch.Generator().manual_seed(len(counts) * d + nb)
        x = (torch.randn(experts * rows, 2 * d, generator=gen) * 4).to(dtype)
        out = torch.full((experts * rows, d), float("nan"), dtype=dtype)
        blocks = bl.torch_expert_blocks(counts, rows, bm, nb)
        bl.listed_silu_and_mul(out, x, blocks)
        g, u = x[:, :d].float(), x[:, d:].float()
        silu = rounded(g / (1 + torch.exp(-g)), dtype)  # rounded first, as vLLM's kernels
        want = rounded(silu * u, dtype)
        ids = blocks[0]
        listed = torch.zeros(experts * rows, dtype=torch.bool)
        listed[ids[ids < experts * rows].long()] = True
        if not torch.isnan(out[~listed].float()).all():
            print("WROTE AN UNLISTED ROW", experts, rows, d, bm, counts.tolist(), nb)
            sys.exit(1)
        got = out[listed].float()
        ref = want[listed].float()
        # numpy's and torch's FP32 exp may differ in the last bit, which can move a
        # rounding: within two units of the 16-bit type's precision, and almost all equal
        eps = torch.finfo(dtype).eps
        close = torch.allclose(got, ref, rtol=2 * eps, atol=0)
        if not close or (got != ref).float().mean().item() > 0.01:
            err = (got - ref).abs().max().item()
            print("MISMATCH", experts, rows, d, bm, dtype, counts.tolist(), nb, err)
            sys.exit(1)
    print("OK", len(cases))
    """
)


def count_kinds(experts: int, rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Received rows per expert at the edges (none, every expert full, one expert with
    one row) and one random mix: the counts the listed-rows kernels' tests run."""
    return [
        torch.zeros(experts, dtype=torch.int32),
        torch.full((experts,), rows, dtype=torch.int32),
        torch.nn.functional.one_hot(torch.tensor(experts // 2), experts).int(),
        torch.randint(0, rows + 1, (experts,), generator=gen, dtype=torch.int32),
    ]


def _activation_cases() -> list:
    gen = torch.Generator().manual_seed(1)
    cases = []
    for experts, rows, d, bm, dtype in ACT_SHAPES:
        whole = experts * -(-rows // bm)
        for counts in count_kinds(experts, rows, gen):
            for nb in (1, 3, whole):  # a bound under the blocks in use, and the whole buffer
                cases.append([experts, rows, d, bm, dtype, counts.tolist(), nb])
    return cases


def test_the_listed_activation_equals_silu_and_mul_on_listed_rows_only():
    """In Triton's interpreter: every listed row gets SiLU(gate) x up, the SiLU rounded to
    16 bits before the product as vLLM's kernels round it, and no other row is written."""
    _assert_ok_in_the_interpreter(ACT_CHILD, _activation_cases())


def test_the_listed_activation_refuses_shapes_it_does_not_compute():
    blocks = block_list.torch_expert_blocks(torch.tensor([2], dtype=torch.int32), 4, 16, 1)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out"):
        block_list.listed_silu_and_mul(torch.zeros(4, 3, dtype=torch.bfloat16), x, blocks)
    with pytest.raises(ValueError, match="16-bit"):
        block_list.listed_silu_and_mul(torch.zeros(4, 4), x.float(), blocks)


def test_only_plain_silu_and_mul_takes_the_listed_activation():
    """vLLM's own activation config decides: a clamp, alpha or beta (GPT-OSS's SwiGLU,
    clamped SiLU) or another activation keeps vLLM's masked op."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import (
        ApplyMoEActivationConfig,
        MoEActivation,
    )

    def experts(**config):
        return SimpleNamespace(activation_config=ApplyMoEActivationConfig(**config))

    assert block_list.plain_silu_and_mul(experts(), MoEActivation.SILU)
    assert block_list.plain_silu_and_mul(experts(), "silu")
    assert not block_list.plain_silu_and_mul(experts(), MoEActivation.GELU)
    assert not block_list.plain_silu_and_mul(experts(), MoEActivation.SWIGLUOAI)
    assert not block_list.plain_silu_and_mul(experts(clamp_limit=7.0), MoEActivation.SILU)
    assert not block_list.plain_silu_and_mul(experts(alpha=1.702), MoEActivation.SILU)
    assert not block_list.plain_silu_and_mul(experts(beta=1.0), MoEActivation.SILU)
    assert not block_list.plain_silu_and_mul(SimpleNamespace(), MoEActivation.SILU)


def test_cpu_tensors_and_the_switch_off_keep_vllm_s_activation(monkeypatch):
    calls = []

    class Experts:
        activation_config = None

        def activation(self, name, out, x, valid_token_counts=None):
            calls.append(valid_token_counts)

    from vllm.model_executor.layers.fused_moe.activation import ApplyMoEActivationConfig

    e = Experts()
    e.activation_config = ApplyMoEActivationConfig()
    monkeypatch.setattr(
        block_list, "listed_silu_and_mul", lambda *a: pytest.fail("listed on CPU tensors")
    )
    counts = torch.tensor([1, 0], dtype=torch.int32)
    blocks = block_list.torch_expert_blocks(counts, 4, 16, 2)
    x, out = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 4, 4, dtype=torch.bfloat16)
    for switch in (False, True):
        monkeypatch.setattr(block_list, "LISTED_ACTIVATION", switch)
        block_list.activation(e, "silu", out, x, counts, blocks)
    assert len(calls) == 2 and all(c is counts for c in calls)
