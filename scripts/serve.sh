#!/usr/bin/env bash
# Serve an MoE model with expert parallelism over all local GPUs through the NCCL-EP
# low-latency backend (CUDA graphs on), from a virtualenv with vLLM 0.33.0 and this package.
#   bash scripts/serve.sh [MODEL] [extra vllm serve args...]
# In order, each step ending the script with one message when it fails:
#   1. two or more GPUs (nvidia-smi; CUDA_VISIBLE_DEVICES if set), before anything is installed;
#   2. the virtualenv (SERVE_VENV, default .venv): created if missing; the package installed
#      only when missing or its sources changed since the last install here (built from a
#      temporary copy: nothing is left in the source tree), and left alone when it is the
#      editable install of this checkout that scripts/test.sh makes;
#   3. `vllm-flashinfer-ep doctor` with the same serve arguments vllm serve gets;
#   4. vllm serve --data-parallel-size <GPUs / (TP x PP)> --enable-expert-parallel
#      --all2all-backend flashinfer_ep_low_latency [extra args] (later arguments win;
#      a --data-parallel-size among them is used as given, and TP x PP from them
#      divides the GPUs among the data-parallel ranks).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p;}' "$0"
  exit 0
fi
model="Qwen/Qwen3-30B-A3B"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  model="$1"
  shift
fi
venv="${SERVE_VENV:-$repo/.venv}"

fail() {
  echo "serve.sh: $*" >&2
  exit 1
}

# 1. GPUs, before anything is installed.
if ! command -v nvidia-smi >/dev/null 2>&1; then
  fail "no NVIDIA GPU found (nvidia-smi is not on PATH): the flashinfer_ep backends need 2 or more sm_90+ GPUs on this host. Nothing was installed."
fi
listing="$(nvidia-smi -L 2>/dev/null)" || listing=""
gpus="$(printf '%s\n' "$listing" | grep -c '^GPU ' || true)"
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
  visible="$(printf '%s' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]' || true)"
  if [ "$visible" -lt "$gpus" ]; then gpus="$visible"; fi
fi
if [ "$gpus" -lt 2 ]; then
  fail "found $gpus usable GPU(s); expert parallelism over NCCL-EP needs 2 or more (with one, --data-parallel-size 1 leaves the backend idle). Nothing was installed."
fi

# The data-parallel size: the extra arguments' own, or the GPUs over TP x PP.
arg_value() { # arg_value LONG SHORT ARGS...: the last value given for a flag, or nothing
  local long="$1" short="$2" value="" prev=""
  shift 2
  for arg in "$@"; do
    case "$prev" in "$long" | "$short") value="$arg" ;; esac
    case "$arg" in "$long="* | "$short="*) value="${arg#*=}" ;; esac
    prev="$arg"
  done
  printf '%s' "$value"
}
positive() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }
tp="$(arg_value --tensor-parallel-size -tp "$@")"
pp="$(arg_value --pipeline-parallel-size -pp "$@")"
dp="$(arg_value --data-parallel-size -dp "$@")"
for pair in "tensor-parallel-size:${tp:-1}" "pipeline-parallel-size:${pp:-1}" "data-parallel-size:${dp:-1}"; do
  positive "${pair#*:}" || fail "--${pair%%:*} ${pair#*:} is not a positive integer. Nothing was installed."
done
per_rank=$((${tp:-1} * ${pp:-1}))
# The sizes the user passed, as the messages below name them (never a flag not given).
given=()
[ -n "$tp" ] && given+=("--tensor-parallel-size $tp")
[ -n "$pp" ] && given+=("--pipeline-parallel-size $pp")
given_text="$(printf '%s x ' "${given[@]}")"
given_text="${given_text% x }"
if [ -z "$dp" ]; then
  if [ $((gpus % per_rank)) -ne 0 ]; then
    fail "$gpus GPUs do not divide into data-parallel ranks of $given_text; pass sizes whose product divides $gpus, or --data-parallel-size. Nothing was installed."
  fi
  dp=$((gpus / per_rank))
  dp_args=(--data-parallel-size "$dp")
  if [ "$dp" -lt 2 ]; then
    fail "$gpus GPUs over $given_text leave $dp data-parallel rank: expert parallelism over NCCL-EP needs 2 or more (with one, the backend is idle); pass smaller sizes or use more GPUs. Nothing was installed."
  fi
else
  dp_args=()  # the user's own, among the extra arguments
fi
if [ "$dp" -lt 2 ]; then
  fail "--data-parallel-size $dp: expert parallelism over NCCL-EP needs 2 or more data-parallel ranks (with one, the backend is idle). Nothing was installed."
fi

# 2. The virtualenv and the package, only when missing or out of date.
stamp_file="$venv/.vllm-flashinfer-ep-sources"
sources_digest() {
  { find pyproject.toml README.md vllm_flashinfer_ep -type f ! -name '*.pyc' -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1
}
# The editable install scripts/test.sh makes reads this checkout's sources directly.
editable_here() {
  local record
  for record in "$venv"/lib/python*/site-packages/vllm_flashinfer_ep-*.dist-info/direct_url.json; do
    if [ -f "$record" ] && grep -q '"editable": *true' "$record" &&
      grep -q "\"file://$repo\"" "$record"; then
      return 0
    fi
  done
  return 1
}
digest="$(sources_digest)"
if [ -x "$venv/bin/vllm" ] && [ -x "$venv/bin/vllm-flashinfer-ep" ] && editable_here; then
  echo "serve.sh: using the editable install of this checkout in $venv (made by scripts/test.sh)" >&2
else
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || fail "could not create the virtualenv $venv (python3 -m venv)."
  fi
  if [ ! -x "$venv/bin/vllm" ] || [ ! -x "$venv/bin/vllm-flashinfer-ep" ] ||
    [ "$(cat "$stamp_file" 2>/dev/null || true)" != "$digest" ]; then
    echo "serve.sh: installing vllm-flashinfer-ep and vLLM 0.33.0 into $venv" >&2
    staging="$(mktemp -d)"
    trap 'rm -rf "$staging"' EXIT
    cp -R pyproject.toml README.md vllm_flashinfer_ep "$staging/"
    "$venv/bin/python" -m pip install -q --upgrade pip &&
      "$venv/bin/python" -m pip install -q "$staging" ||
      fail "pip install failed (output above); nothing was started."
    rm -rf "$staging"
    trap - EXIT
    printf '%s\n' "$digest" >"$stamp_file"
  fi
fi

# 3. doctor with the arguments vllm serve gets.
serve_args=("${dp_args[@]}" --enable-expert-parallel
  --all2all-backend flashinfer_ep_low_latency "$@")
if ! "$venv/bin/vllm-flashinfer-ep" doctor --model "$model" "${serve_args[@]}"; then
  fail "doctor found problems (listed above): fix them and run again. vllm serve was not started."
fi

# 4. Serve.
echo "serve.sh: starting vllm serve $model on $((dp * per_rank)) GPUs: ${serve_args[*]}" >&2
exec "$venv/bin/vllm" serve "$model" "${serve_args[@]}"
