# Source ON THE DEVICE from the project root, after .gpu5 arrived as a carried
# folder (scripts/stage_vllm_device.sh builds it):
#   source scripts/device_vllm_env.sh
# Unpacks vLLM 0.33.0's Python sources and the staged wheels into /tmp/vsite
# (once per machine; later calls on a warm machine need not carry .gpu5) and
# exports the environment that imports them with the image's torch 2.11.
# Kernels from vllm's compiled extensions (torch.ops._C / _moe_C) are NOT
# there: harnesses apply tests/kernels/vllm_device_shim.py for the few the MoE
# path calls.
_vsite=${VLLM_DEVICE_SITE:-/tmp/vsite}
_vpy=${PYTHON:-python3}
_vsrc=${VLLM_DEVICE_STAGE:-.gpu5}
_vok=1
if [ ! -f "$_vsite/.vllm-device-ready" ]; then
  if [ ! -f "$_vsrc/vllm-0.33.0-py.tgz" ]; then
    echo "device_vllm_env: $_vsrc/vllm-0.33.0-py.tgz not found and $_vsite not ready; carry .gpu5" >&2
    _vok=0
  else
    rm -rf "$_vsite" && mkdir -p "$_vsite"
    tar -C "$_vsite" -xzf "$_vsrc/vllm-0.33.0-py.tgz" || _vok=0
    for _w in "$_vsrc"/wheels/*.whl; do
      "$_vpy" -m zipfile -e "$_w" "$_vsite" || { echo "device_vllm_env: cannot unpack $_w" >&2; _vok=0; }
    done
    # vllm/platforms/cuda.py does an unconditional `import vllm._C_stable_libtorch`
    # (the 89 MiB compiled op library, built for torch 2.14). An empty module
    # lets the CUDA platform import; every torch.ops._C.* / torch.ops._moe_C.*
    # op is then missing until the shim registers a torch fallback for it.
    cat > "$_vsite/vllm/_C_stable_libtorch.py" <<'EOF'
"""Placeholder written by scripts/device_vllm_env.sh: the compiled vLLM op
library is not staged. Ops the MoE tests need are registered by
tests/kernels/vllm_device_shim.py (torch fallbacks)."""
STAGED_PLACEHOLDER = True
EOF
    [ "$_vok" = 1 ] && cp "$_vsrc/wheels/STAGED.txt" "$_vsite/.vllm-device-ready"
  fi
fi
if [ "$_vok" = 1 ]; then
  case ":${PYTHONPATH:-}:" in
    *":$_vsite:"*) ;;
    *) export PYTHONPATH="$_vsite${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
  export VLLM_TARGET_DEVICE=cuda
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  export VLLM_DEVICE_SITE="$_vsite"
  export PYTHONUNBUFFERED=1
  echo "device_vllm_env: vLLM 0.33.0 (Python sources, no .so) + $(wc -l < "$_vsite/.vllm-device-ready") wheels in $_vsite; PYTHONPATH=$PYTHONPATH VLLM_TARGET_DEVICE=cuda; apply tests/kernels/vllm_device_shim.py before using vLLM ops"
fi
unset _vsite _vpy _vsrc _vok _w
