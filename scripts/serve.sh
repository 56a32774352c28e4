#!/usr/bin/env bash
# Install vLLM 0.33.0 + vllm-flashinfer-ep in a virtualenv, check the host, and serve an
# MoE model with expert parallelism over all local GPUs through the NCCL-EP low-latency
# backend (CUDA graphs on).
#   bash scripts/serve.sh [MODEL] [extra vllm serve args...]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-Qwen/Qwen3-30B-A3B}"
shift || true
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q .
gpus=$(nvidia-smi -L | wc -l)
.venv/bin/vllm-flashinfer-ep doctor --model "$model"
exec .venv/bin/vllm serve "$model" \
  --data-parallel-size "$gpus" --enable-expert-parallel \
  --all2all-backend flashinfer_ep_low_latency "$@"
