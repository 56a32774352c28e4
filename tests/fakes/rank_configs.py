"""vLLM configs and helpers shared by the fake-world tests of ranks that must agree
(tests/unit/test_rank_disagreement.py, tests/unit/test_capture_agreement.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from vllm_flashinfer_ep import backends, envs
from vllm_flashinfer_ep.runtime.rank_agreement import RankMismatchError

LL = backends.LOW_LATENCY
SIZES = [1, 2, 4, 8, 16]


def make_base_config():
    """A real VllmConfig with CUDA graphs as a GPU host resolves them (the CPU platform
    turns them off), 32 tokens per step, 16 sequences."""
    from vllm.config import CUDAGraphMode, SchedulerConfig, VllmConfig

    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=32, max_model_len=32, is_encoder_decoder=False
        )
    )
    comp = config.compilation_config
    comp.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    comp.cudagraph_capture_sizes = list(SIZES)
    comp.max_cudagraph_capture_size = max(SIZES)
    return config


def clean_env(monkeypatch) -> None:
    """No package variable set, the V2 runner (the default on GPUs), a 5 s deadline."""
    for var in envs.VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv(envs.EXCHANGE_TIMEOUT_S, "5")


def configs(base, world: int, change=None, rank: int | None = None) -> list:
    """`world` copies of `base`; `change(config)` applied to `rank`'s (default: the last)."""
    out = [copy.deepcopy(base) for _ in range(world)]
    if change is not None:
        change(out[world - 1 if rank is None else rank])
    return out


def speculate(num: int):
    def change(config):
        config.speculative_config = SimpleNamespace(
            num_speculative_tokens=num, uses_dynamic_speculative_decoding=lambda: False
        )

    return change


def moe(hidden: int = 2048, tokens: int = 32):
    return SimpleNamespace(
        num_experts=8, max_num_tokens=tokens, hidden_dim=hidden, experts_per_token=2
    )


def block_fp8():
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    one = torch.ones(8, dtype=torch.float32)
    return fp8_w8a8_moe_quant_config(one, one, block_shape=[128, 128])


def load(rank, manager, layer=None, quant=None):
    return manager.make_prepare_finalize(layer or moe(), quant)


def assert_named_everywhere(outcomes, item: str, fix: str) -> None:
    """Every rank raised the same RankMismatchError naming `item` and what sets it."""
    assert all(isinstance(o, RankMismatchError) for o in outcomes), outcomes
    messages = {str(o) for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert f"disagree on the {item} (" in message, message
    assert fix in message, message
