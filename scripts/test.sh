#!/usr/bin/env bash
# Set up a fresh virtualenv with vLLM 0.33.0 and this package, then run lint (ruff check
# and ruff format --check) and the test suite. GPU tests skip with a reason on machines without an sm_90+ GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
export VLLM_TARGET_DEVICE="${VLLM_TARGET_DEVICE:-cpu}"  # vLLM's config needs it without GPUs
.venv/bin/ruff check .
.venv/bin/ruff format --check .
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure for this project" >&2
  exit 1
fi
exit "$rc"
