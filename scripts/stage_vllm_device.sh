#!/usr/bin/env bash
# Stage vLLM 0.33.0's Python sources (no compiled extensions) and the few pure
# or cp312 wheels its fused-MoE import chain needs into .gpu5/ (git-ignored),
# small enough for one device call (< 60 MiB; the device carries 64 MiB).
#
# The device image (KINDS.md, "Python packages already there") has torch
# 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, huggingface_hub 1.33.0 ...
# but no vLLM. The vLLM wheel is ~321 MiB, almost all of it .so files,
# vllm-rs, vllm_flash_attn and CUTLASS/DeepGEMM headers; none of that is
# needed for the Python MoE path (FusedMoEKernel, BatchedTritonExperts,
# TritonExperts, prepare/finalize, vllm.config, forward_context).
#
# Usage (from the project root):   bash scripts/stage_vllm_device.sh
# Device side (docs/device_vllm.md):
#   run carry=[".gpu5"] command="source scripts/device_vllm_env.sh && python3 scripts/vllm_device_smoke.py"
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cache=${VLLM_DEVICE_WHEEL_CACHE:-$HOME/.cache/vllm-device-wheels}
out="$root/.gpu5"
py=${PYTHON:-python3}
mkdir -p "$cache"

plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_31_x86_64 --platform any)

# vLLM itself (sources only are kept, see below).
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$cache" vllm==0.33.0

# Distributions that the MoE import chain imports at module level and that the
# device image lacks (found by importing the chain against a site holding only
# the device's distributions; versions = those resolved with vllm 0.33.0).
#   pydantic, pydantic-core, annotated-types, typing-inspection: vllm.config.*
#   cbor2:             vllm.utils.hashing (vllm.config.device)
#   pyzmq:             vllm.utils.network_utils (vllm.distributed.utils)
#   msgspec:           vllm.pooling_params / vllm.v1.request
#   cachetools:        vllm.utils.cache (vllm.multimodal.cache)
#   pybase64:          vllm.multimodal.media.audio
#   openai, sniffio, httpx2, httpcore2, truststore, oss-harmony (openai_harmony):
#                      vllm.config.reasoning -> vllm.reasoning -> entrypoints.mcp
#                      (openai 3.x imports httpx2 at module level; httpcore2
#                      and truststore are httpx2's hard requirements)
#   fastapi, starlette, partial-json-parser:
#                      vllm.parser -> vllm.entrypoints..., vllm.tool_parsers
#   xgrammar, apache-tvm-ffi, llguidance:
#                      vllm.v1.request -> vllm.v1.structured_output
#   typing-extensions: the device has it, version unknown; pydantic-core 2.50
#                      does `from typing_extensions import Sentinel` (>= 4.14).
#                      Staged (it shadows the image's copy; backward compatible).
deps=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
      typing-inspection==0.4.5 cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0
      cachetools==8.0.2 pybase64==1.5.1 openai==3.57.0 sniffio==1.3.1
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
      oss-harmony==0.0.11 fastapi==0.136.3 starlette==1.10.0
      partial-json-parser==0.2.1.1.post7 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
      llguidance==1.7.6 typing_extensions==4.16.0)
"$py" -m pip download -q --no-deps "${plat[@]}" -d "$cache" "${deps[@]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m zipfile -e "$cache"/vllm-0.33.0-*.whl "$work/w"

# Trim: keep Python sources and data (tuned fused-MoE configs are *.json, chat
# templates *.jinja); drop compiled extensions, the Rust binary, C/C++/CUDA
# sources and headers, docs and web assets.
mkdir -p "$work/t"
(cd "$work/w" && find vllm -type f \( -name '*.py' -o -name '*.json' \
   -o -name '*.jinja' -o -name 'py.typed' \) ! -path '*/__pycache__/*' \
   -print > "$work/keep.txt")
(cd "$work/w" && tar -cf - -T "$work/keep.txt") | tar -C "$work/t" -xf -
# dist-info (no RECORD: it lists files we dropped). vLLM's platform detection
# calls importlib.metadata.version("vllm"), so METADATA must be present.
mkdir -p "$work/t/vllm-0.33.0.dist-info"
for f in METADATA WHEEL entry_points.txt top_level.txt; do
  cp "$work/w/vllm-0.33.0.dist-info/$f" "$work/t/vllm-0.33.0.dist-info/"
done
printf 'staged by scripts/stage_vllm_device.sh: Python sources only, no .so\n' \
  > "$work/t/vllm-0.33.0.dist-info/STAGED"

rm -rf "$out"
mkdir -p "$out/wheels"
tar -C "$work/t" -czf "$out/vllm-0.33.0-py.tgz" vllm vllm-0.33.0.dist-info
for d in "${deps[@]}"; do
  n=${d%%==*}; v=${d#*==}
  n=$(printf '%s' "$n" | tr '-' '_')
  f=$(ls "$cache"/"${n}"-"${v}"-*.whl 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "missing wheel for $d in $cache" >&2; exit 1; }
  cp "$f" "$out/wheels/"
done
printf '%s\n' "${deps[@]}" > "$out/wheels/STAGED.txt"
git -C "$root" check-ignore -q .gpu5 || echo "warning: .gpu5 is not git-ignored" >&2

bytes=$(du -sb "$out" | cut -f1)
echo "vllm sources: $(du -h "$out/vllm-0.33.0-py.tgz" | cut -f1) ($(wc -l < "$work/keep.txt") files); wheels: $(ls "$out/wheels"/*.whl | wc -l) ($(du -ch "$out/wheels"/*.whl | tail -1 | cut -f1))"
echo ".gpu5 total: $bytes bytes ($((bytes / 1048576)) MiB)"
[ "$bytes" -lt $((60 * 1048576)) ] || { echo ".gpu5 is over 60 MiB" >&2; exit 1; }
echo "staged .gpu5; device: source scripts/device_vllm_env.sh && python3 scripts/vllm_device_smoke.py"
