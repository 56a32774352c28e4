#!/usr/bin/env bash
# The GPU checks of the engine work in one command, for the GPU test machine after the
# staging calls of docs/contributing/gpu_runs.md (it sources the staged runtime itself).
#
#   bash tests/engine/device_suite.sh [step ...]
#   steps: doctor tests (= engine-tests kernel-tests; engine-tests = engine-tests-a + -b) received-rows padding fp8-kernels fp8-engine (= fp8-engine-ll fp8-engine-ht)
#          fp8-engine-online-channel fp8-engine-online-block-ll fp8-engine-online-block-ht
#          fp8-engine-select (the FP8 engine tests FP8_K selects, a pytest -k expression),
#          engine-select (the world-1 engine tests ENGINE_K selects)
#          spec-decode-2 spec-decode-4 (one call each; spec-decode = both, over 600 s)
#          profile bench (= bench-tiny bench-30b) kbench htbench memory direct fp8wire fp8bench fp8bench-ht
#          received-rows (the received-rows experts' kernels and classes against vLLM's, and the LL join)
#          fp8-experts (DeepGEMM experts GPU tests + fp8_experts_probe.py)
#          vllm-combinations (vLLM's own modular-kernel combination test over the experts classes)
#          bench-30b-fp8-CONFIG (FP8 engines of bench_engine.CONFIGS, comma-separated: no_ep, ll_graph, ll_graph_deepgemm, ll_graph_triton, ll_graph_deepgemm_only)
#          serve-bench-ll serve-bench-noep (issue 46's runs: FULL_DECODE_ONLY, no torch.compile, budget 256, 256/64)
#          serve-CONFIG-DATASET[-decode-only] (vllm serve + vllm bench serve, one call each; CONFIG noep ll llrounds ht,
#          DATASET 256x64 2048x256 all; vLLM's default compilation unless -decode-only; SERVE_TOKENS=N passes
#          --max-num-batched-tokens N; SERVE_CAPTURE=N passes --max-cudagraph-capture-size N;
#          SERVE_ROUND_TOKENS=N serves llrounds at rounds of N, not 512),
#          serve-warm-CONFIG[-decode-only]
#          (start, one unmeasured wave per dataset, stop: compile and JIT caches for later calls);
#          tests/engine/serve_bench.py --merge joins their serve_*.json into one file and table
#          multigpu-kernels multigpu-ll multigpu-ht multigpu-eplb multigpu-ft-retry multigpu-ft-kill
#          (two or more GPUs; one call each: multi-rank transport and FT, dp=2 engines, FT e2e)
#          models-deepseek-v3 models-qwen3-235b-a22b models-gpt-oss-120b-mxfp4 models-gpt-oss-120b-bf16
#          models-llama-4-scout models-mixtral-8x7b
#          (issue 48's model matrix, tests/engine/test_engine_models_world1.py: LL with graphs
#          and HT against no EP; models-NAME-ll = the no-EP engines and LL, models-NAME-ht = HT
#          with -ll's no-EP engines from the engine cache: one call each, models-NAME both)
#          bench-shape-deepseek-v3 bench-shape-qwen3-235b-a22b (decode throughput at the
#          published shapes, BENCH_CONFIGS default no_ep,ll_graph; one configuration per call:
#          BENCH_CONFIGS=no_ep, then ll_graph, then bench_engine.py --merge the two JSON files)
#          kbench-shapes (the LL transport step at those shapes' MoE layers, for the
#          transport-bound share of their engine decode step)
# `received-rows` = the GPU tests of the LL experts alone (a quick first check);
# BENCH_CONFIGS overrides the engine benchmark's configurations (PROFILE_CONFIGS the
# profile's, e.g. no_ep,ll_graph; PROFILE_ARGS adds arguments to it,
# e.g. "--quantization fp8_per_block", after bench-30b-fp8 on the same machine so that
# FlashInfer's JIT is built); HTBENCH_ARGS adds
# arguments to the HT transport benchmark (e.g. HTBENCH_ARGS=--no-ll).
# One device call may run 600 s: engine-tests alone take about 8 minutes, so give the
# steps to separate calls. Periodic stack dumps of engine processes are opt-in
# (FLASHINFER_EP_TEST_STACK_DUMP_S=60): a 30B-shape engine died while one was written.
#
# Writes everything under $OUT (the device call's output folder; ./device-out otherwise):
# doctor.txt, pytest.txt, engine logs (elogs/), bench JSON. Missing-environment skips fail
# (FLASHINFER_EP_REQUIRE_GPU=1): on this machine every GPU test must run.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$PWD/device-out}"
mkdir -p "$out/elogs"
# shellcheck disable=SC1091
source /tmp/ew/device-engine-env.sh
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/t2 .gpuwheel/*.whl
export NCCL_EP_JIT_CACHE_DIR=/tmp/jitcache FLASHINFER_EP_TEST_ENGINE_LOG_DIR="$out/elogs"
export FLASHINFER_EP_TEST_STACK_DUMP_S="${FLASHINFER_EP_TEST_STACK_DUMP_S:-0}"
export FLASHINFER_EP_REQUIRE_GPU=1
# NVLink multicast stays off in every process (KINDS.md: it can take a shared host's GPUs
# out of service); tests/helpers.NO_MULTICAST sets the same in the processes tests start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Servers run in sessions of their own, which outlive a device call killed at its limit:
# the tests record their process groups here, and each run first stops what is left.
export FLASHINFER_EP_TEST_SERVER_GROUPS=/tmp/flashinfer-ep-server-groups
if [ -s "$FLASHINFER_EP_TEST_SERVER_GROUPS" ]; then
  while read -r group; do
    # Only a group that still runs vLLM or Python (its id may since have been reused).
    if command -v pgrep > /dev/null; then
      pgrep -g "$group" -f "vllm|python" > /dev/null || continue
    fi
    kill -9 -- "-$group" 2>/dev/null && echo "stopped a server group left by an earlier call: $group"
    for _ in $(seq 30); do kill -0 -- "-$group" 2>/dev/null || break; sleep 1; done  # GPU memory freed
  done < "$FLASHINFER_EP_TEST_SERVER_GROUPS"
  : > "$FLASHINFER_EP_TEST_SERVER_GROUPS"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1  # a call cut at its limit keeps every line written so far
# The engine test steps stop 575 s after the suite started (SIGINT, so pytest stops its
# engines and prints its summary; SIGKILL 15 s later), inside the 600 s of one device call.
left() { local l=$((575 - SECONDS)); [ "$l" -lt 30 ] && l=30; echo "$l"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(doctor tests profile bench)
rc=0
for step in "${steps[@]}"; do
  echo "== $step $(date -u +%H:%M:%S)"
  case "$step" in
    doctor) vllm-flashinfer-ep doctor > "$out/doctor.txt" 2>&1 || rc=1; tail -3 "$out/doctor.txt" ;;
    tests|engine-tests|engine-tests-a|engine-tests-b|kernel-tests)
      dirs=(tests/engine tests/kernels)
      [ "$step" = engine-tests ] && dirs=(tests/engine)
      [ "$step" = kernel-tests ] && dirs=(tests/kernels)
      select=(-m "not multigpu")  # the multi-GPU tests have their own steps (multigpu-*)
      # engine-tests in two calls (a fresh machine's first call spends ~150 s unpacking the
      # runtime, and then the whole step passes 575 s): -a the LL engines, -b HT, the
      # hidden-3072 round-up, the planted fault and vllm serve.
      rest="ht_matches or hidden_3072 or planted_fault"
      [ "$step" = engine-tests-a ] && dirs=(tests/engine/test_engine_world1.py) && select+=(-k "not ($rest)")
      [ "$step" = engine-tests-b ] && dirs=(tests/engine/test_engine_world1.py tests/engine/test_serve_world1.py) \
        && select+=(-k "$rest or vllm_serve")
      # -b reads -a's no-EP reference engines from /tmp (keyed by spec and code)
      export FLASHINFER_EP_TEST_ENGINE_CACHE=/tmp/engine-cache FLASHINFER_EP_TEST_MODEL_DIR=/tmp/ep-models
      # The FP8 engine tests (~9 min) have their own step: with them one call would pass 600 s.
      select+=(--ignore tests/engine/test_engine_fp8_world1.py)
      # Speculative decoding (~7 engines, ~100 s each) has its own step too.
      select+=(--ignore tests/engine/test_engine_spec_decode_world1.py)
      # So has the model matrix (models-*: four engines per architecture).
      select+=(--ignore tests/engine/test_engine_models_world1.py)
      timeout -k 15 -s INT "$(left)" python3 -m pytest "${dirs[@]}" "${select[@]}" -p no:cacheprovider -rs -s \
        -o addopts="" -q > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "passed|failed|error" "$out/pytest-$step.txt" | tail -3 ;;
    engine-select)  # chosen world-1 engine tests (ENGINE_K: a pytest -k expression), e.g.
      # "every_moe_layer or ll_with_cuda_graphs_matches_the_engine_without_ep"
      export FLASHINFER_EP_TEST_ENGINE_CACHE=/tmp/engine-cache FLASHINFER_EP_TEST_MODEL_DIR=/tmp/ep-models
      timeout -k 15 -s INT "$(left)" python3 -m pytest tests/engine/test_engine_world1.py \
        -k "${ENGINE_K:?ENGINE_K=<pytest -k expression>}" -m "not multigpu" -p no:cacheprovider -rs -s -q \
        -o addopts="" > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "vs no EP|floor|kept from|passed|failed|Error" "$out/pytest-$step.txt" | tail -12 ;;
    models-*)  # issue 48's model matrix: one architecture's LL and HT cases against no EP
      part=${step#models-}; sel="low_latency or high_throughput or not_flat"
      case $part in
        *-ll) part=${part%-ll}; sel="low_latency or not_flat" ;;
        *-ht) part=${part%-ht}; sel="high_throughput" ;;
      esac
      case $part in  # test_engine_models_world1.GPU_MODELS
        deepseek-v3|qwen3-235b-a22b|gpt-oss-120b-mxfp4|gpt-oss-120b-bf16|llama-4-scout|mixtral-8x7b) ;;
        *) echo "unknown step $step (models-NAME[-ll|-ht], NAME: deepseek-v3 qwen3-235b-a22b gpt-oss-120b-mxfp4 gpt-oss-120b-bf16 llama-4-scout mixtral-8x7b)"; rc=2; continue ;;
      esac
      # -ht reads -ll's no-EP engines from /tmp (keyed by spec and code)
      export FLASHINFER_EP_TEST_ENGINE_CACHE=/tmp/engine-cache FLASHINFER_EP_TEST_MODEL_DIR=/tmp/ep-models
      timeout -k 15 -s INT "$(left)" python3 -m pytest tests/engine/test_engine_models_world1.py \
        -k "$part and ($sel)" -p no:cacheprovider -rs -s -q -o addopts="" > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "floor|vs no EP|logprobs: mean|kept from|passed|failed|Error" "$out/pytest-$step.txt" | tail -12 ;;
    bench-shape-*)  # decode throughput at a published shape (bench_engine.SHAPES), LL and no EP
      shape=${step#bench-shape-}; cfg=${BENCH_CONFIGS:-no_ep,ll_graph}; tag=${cfg//,/-}
      case $shape in
        deepseek-v3|qwen3-235b-a22b) ;;
        *) echo "unknown step $step (bench-shape-deepseek-v3 bench-shape-qwen3-235b-a22b)"; rc=2; continue ;;
      esac
      python3 tests/engine/bench_engine.py --shape "$shape" --configs "$cfg" \
        --out "$out/engine_${shape}_$tag.json" 2>&1 \
        | tee "$out/bench-$shape-$tag.txt" | grep -v "^INFO\|^(EngineCore" | tail -8 || rc=1 ;;
    spec-decode|spec-decode-2|spec-decode-4)  # ngram speculation under LL graphs (the pool learns vLLM's captured counts)
      sel=(-k "agree and 2")
      [ "$step" = spec-decode-4 ] && sel=(-k "agree and 4 or v1_runner")
      [ "$step" = spec-decode ] && sel=()
      python3 -m pytest tests/engine/test_engine_spec_decode_world1.py "${sel[@]}" -p no:cacheprovider \
        -rs -s -q -o addopts="" > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "k=|passed|failed|Error" "$out/pytest-$step.txt" | tail -8 ;;
    received-rows)  # the received-rows experts (kernels and classes) against vLLM's, and the LL join
      python3 -m pytest tests/kernels/test_received_rows_kernels_gpu.py \
        tests/kernels/test_received_rows_experts_gpu.py tests/kernels/test_vllm_join_gpu.py \
        -p no:cacheprovider -rs -s -q -o addopts="" > "$out/pytest-received-rows.txt" 2>&1 || rc=1
      grep -E "passed|failed|Error" "$out/pytest-received-rows.txt" | tail -12 ;;
    vllm-combinations)  # vLLM 0.33.0's own combination test over the experts classes (.vllm-tests carried)
      python3 tests/kernels/vllm_combinations.py > "$out/vllm-combinations.txt" 2>&1 || rc=1
      tail -15 "$out/vllm-combinations.txt" ;;
    fp8-experts)  # DeepGEMM's experts (both sides of the per-forward choice) against vLLM's, then
      # every FP8 LL experts path timed side by side (the received-rows GPU tests are received-rows');
      # PROBE_SCHEMES: which layouts (block channel tensor tensor_static)
      python3 -m pytest tests/kernels/test_deep_gemm_experts_gpu.py \
        -p no:cacheprovider -rs -s -q -o addopts="" \
        > "$out/pytest-fp8-experts.txt" 2>&1 || rc=1
      grep -E "passed|failed|Error" "$out/pytest-fp8-experts.txt" | tail -8
      for scheme in ${PROBE_SCHEMES:-block channel tensor tensor_static}; do
        batches=1,8,32,128,256  # block: the probe's finer default, for the per-forward bound
        [ "$scheme" = block ] && batches=1,2,4,8,16,32,64,128,256
        python3 tests/engine/fp8_experts_probe.py --scheme "$scheme" --batches "$batches" \
          --json "$out/fp8_experts_probe_$scheme.json" > "$out/fp8-experts-probe-$scheme.txt" 2>&1 || rc=1
        grep "^|\|E=\|MISMATCH\|Error\|received rows faster" "$out/fp8-experts-probe-$scheme.txt"
      done ;;
    bench-30b-fp8-*)  # one FP8 engine per call (merge: bench_engine.py --merge a.json b.json --out all.json)
      # BENCH_QUANT: vLLM's online scheme (fp8_per_block by default; fp8_per_channel)
      quant=${BENCH_QUANT:-fp8_per_block}
      cfg=${step#bench-30b-fp8-}; tag=${cfg//,/-}  # no_ep,ll_graph: both, one file name
      [ "$quant" != fp8_per_block ] && tag="${quant}_$tag"
      python3 tests/engine/bench_engine.py --shape qwen3-30b-a3b --quantization "$quant" \
        --configs "$cfg" --out "$out/engine_qwen3-30b-a3b_fp8_$tag.json" 2>&1 \
        | tee "$out/bench-30b-fp8-$tag.txt" | grep -v "^INFO\|^(EngineCore" | tail -6 || rc=1 ;;
    padding)  # eager rounds padded onto pooled handles, and the pool under graphs (real NCCL-EP)
      python3 -m pytest tests/kernels/test_transport_gpu.py -k "pad or pool_cuda_graph or unwarmed" \
        -p no:cacheprovider -rs -s -q -o addopts="" > "$out/pytest-padding.txt" 2>&1 || rc=1
      grep -E "POOL_MEMORY|passed|failed|Error" "$out/pytest-padding.txt" | tail -12 ;;
    memory)  # device-wide memory of the LL fleet + served pool (capture sizes + eager buckets)
      python3 -m vllm_flashinfer_ep.bench.memory --hidden 2048,7168 --capacity 256,512,4096 \
        --json "$out/bench_memory_world1.json" 2>&1 | tee "$out/memory.txt" | tail -12 || rc=1 ;;
    multigpu-*)  # two or more GPUs, one step per device call (each ends by 555 s, servers stopped)
      # kernels: transport and FT across ranks (real NCCL-EP); ll / ht / eplb: dp=2 engines
      # against the engine without EP (DP padding agreement; the no-EP reference engines are
      # kept in /tmp between calls); ft-retry / ft-kill: FT end to end on a generated model.
      part=${step#multigpu-}
      case $part in
        kernels) files=(tests/kernels/test_transport_multigpu.py tests/kernels/test_fault_tolerance_multigpu.py); sel=() ;;
        ll) files=(tests/engine/test_engine_multigpu.py); sel=(-k "ll_dp2_with_graphs") ;;
        ht) files=(tests/engine/test_engine_multigpu.py); sel=(-k "ht_dp2") ;;
        eplb) files=(tests/engine/test_engine_multigpu.py); sel=(-k "eplb") ;;
        ft-retry|ft-kill)
          ft_model=$(python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests/engine')
from engine_models import write_tiny_model; print(write_tiny_model(Path('/tmp/ep-models/ft-h2048'), 2048))")
          export FLASHINFER_EP_TEST_FT_MODEL="$ft_model" FLASHINFER_EP_TEST_FT_STARTUP_S=240
          files=(tests/fault_tolerance); sel=(-k "retry"); [ "$part" = ft-kill ] && sel=(-k "killed") ;;
        *) echo "unknown step $step (multigpu-kernels -ll -ht -eplb -ft-retry -ft-kill)"; rc=2; continue ;;
      esac
      # SIGINT lets pytest tear servers down; what is left of 540 s since the suite started
      # (its set-up included), then SIGKILL 15 s later for a pytest stuck in native code.
      left=$((540 - SECONDS)); [ "$left" -lt 60 ] && left=60
      FLASHINFER_EP_TEST_ENGINE_CACHE=/tmp/engine-cache FLASHINFER_EP_TEST_MODEL_DIR=/tmp/ep-models \
        timeout -k 15 -s INT "$left" python3 -m pytest "${files[@]}" "${sel[@]}" -m multigpu -p no:cacheprovider -rs -s -q \
        -o addopts="" > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "vs no EP|floor|kept from|passed|failed|Error" "$out/pytest-$step.txt" | tail -12 ;;
    serve-*)  # vllm serve + vllm bench serve (tests/engine/serve_bench.py), one call each
      # serve-bench-ll|noep: issue 46's runs (decode-only, 256/64, both at budget 256, no warm wave)
      extra=(--no-warm-wave --max-num-batched-tokens 256); comp=decode-only; ds=256x64; name=${step#serve-bench-}
      suffix=_budget256
      if [ "$step" = "${step#serve-bench-}" ]; then  # serve-[warm-]CONFIG[-DATASET][-decode-only]
        name=${step#serve-}; extra=(); comp=default; suffix=
        # SERVE_TOKENS=N: pass --max-num-batched-tokens N (default: none, each engine's own)
        [ -n "${SERVE_TOKENS:-}" ] && extra=(--max-num-batched-tokens "$SERVE_TOKENS") && suffix=_budget$SERVE_TOKENS
        # SERVE_CAPTURE=N: pass --max-cudagraph-capture-size N (default compilation only)
        [ -n "${SERVE_CAPTURE:-}" ] && extra+=(--max-cudagraph-capture-size "$SERVE_CAPTURE") && suffix=$suffix"_capture$SERVE_CAPTURE"
        # SERVE_ROUND_TOKENS=N (llrounds only): rounds of N tokens instead of 512
        [ -n "${SERVE_ROUND_TOKENS:-}" ] && extra+=(--round-tokens "$SERVE_ROUND_TOKENS") && suffix=$suffix"_rounds$SERVE_ROUND_TOKENS"
        [ "$name" != "${name%-decode-only}" ] && comp=decode-only && name=${name%-decode-only}
        if [ "$name" != "${name#warm-}" ]; then name=${name#warm-}; ds=all; extra=(--warm-only "${extra[@]}")
        else ds=${name#*-}; name=${name%%-*}; fi
      fi
      cfg=$name; [ "$cfg" = noep ] && cfg=no_ep; [ "$cfg" = llrounds ] && cfg=ll_rounds
      [ "$ds" = all ] && ds=256x64,2048x256
      tag="${cfg}_${ds//,/_}_$comp$suffix"; [ ${#extra[@]} -gt 0 ] && [ "${extra[0]}" = --warm-only ] && tag="warm_$tag"
      case "$cfg:$ds" in
        no_ep:256x64|no_ep:2048x256|no_ep:256x64,2048x256|ll:256x64|ll:2048x256|ll:256x64,2048x256) ;;
        ht:256x64|ht:2048x256|ht:256x64,2048x256) ;;
        ll_rounds:256x64|ll_rounds:2048x256|ll_rounds:256x64,2048x256) ;;
        *) echo "unknown step $step (serve-CONFIG-DATASET: CONFIG noep ll llrounds ht, DATASET 256x64 2048x256 all)"; rc=2; continue ;;
      esac
      # the model at a fixed path and vLLM's cache on /tmp: a later call's server finds the
      # compile cache an earlier one (serve-warm-*) filled; stop 550 s after the suite started
      # (the server's stop then fits the call)
      VLLM_CACHE_ROOT=/tmp/vllm-cache python3 tests/engine/serve_bench.py --config "$cfg" \
        --compilation "$comp" --datasets "$ds" --model-dir /tmp/ep-models "${extra[@]}" \
        --deadline-s "$(( SECONDS < 490 ? 550 - SECONDS : 60 ))" --out "$out/serve_$tag.json" \
        --log "$out/elogs/serve-$tag.log" > "$out/serve-$tag.txt" 2>&1 || rc=1
      grep -E "up in|c=|PROBLEM|failed" "$out/serve-$tag.txt" | cut -c1-400 | tail -14 ;;
    fp8-kernels)  # FP8 layers through both backends against vLLM without EP (kernel level)
      python3 -m pytest tests/kernels/test_fp8_join_gpu.py -p no:cacheprovider -rs -s -q \
        -o addopts="" > "$out/pytest-fp8-kernels.txt" 2>&1 || rc=1
      grep -E "vs no-EP|moved by|passed|failed|Error" "$out/pytest-fp8-kernels.txt" | tail -40 ;;
    fp8-engine|fp8-engine-ll|fp8-engine-ht|fp8-engine-online-*|fp8-engine-select)
      # FP8 models (online, block, static) through the engine, against no EP;
      # fp8-engine-online-WORD[-WORD] = the online fp8_per_block / fp8_per_channel
      # schemes whose test ids hold every WORD (block, channel, ll, ht)
      case $step in
        fp8-engine) select=(-k "not online_scheme") ;;
        fp8-engine-online-*) words=${step#fp8-engine-online-}
          select=(-k "online_scheme and ${words//-/ and }") ;;
        fp8-engine-select) select=(-k "${FP8_K:?FP8_K=<pytest -k expression>}") ;;
        *) select=(-k "test_${step#fp8-engine-}_") ;;
      esac
      timeout -k 15 -s INT "$(left)" python3 -m pytest tests/engine/test_engine_fp8_world1.py "${select[@]}" \
        -p no:cacheprovider -rs -s -q \
        -o addopts="" > "$out/pytest-$step.txt" 2>&1 || rc=1
      grep -E "floor|vs no EP|passed|failed|Error" "$out/pytest-$step.txt" | tail -20 ;;
    profile)
      for batch in 1 128; do  # issue 28's breakdown: LL and no EP, batch 1 and 128
        FLASHINFER_EP_TEST_ENGINE_LOG_DIR="$out/elogs/profile-b$batch" \
          python3 tests/engine/bench_engine.py --shape qwen3-30b-a3b --configs "${PROFILE_CONFIGS:-no_ep,ll_graph}" \
          --profile-batch "$batch" --no-bench ${PROFILE_ARGS:-} >> "$out/profile.txt" 2>&1 || rc=1
      done
      for f in "$out"/elogs/profile-b*/engine-bench-qwen3-30b-a3b-*.log; do
        echo "== $f"; grep -h -A16 "engine_run: breakdown" "$f" | head -18
      done ;;
    profile-mixed)  # issue 50's mixed step: what a 2048-token prompt's chunks add to 127 decodes' steps
      # vLLM's default compilation; PROFILE_CONFIGS one per call if two engines' compiles do not fit
      # PROFILE_ARGS="--max-num-batched-tokens 2175": the long prompt in steps of up to 2175 tokens (ll_rounds: rounds of 512)
      FLASHINFER_EP_TEST_ENGINE_LOG_DIR="$out/elogs/profile-mixed" \
        python3 tests/engine/bench_engine.py --shape qwen3-30b-a3b --configs "${PROFILE_CONFIGS:-no_ep,ll_graph}" \
        --profile-mixed 128 --compilation default --no-bench --engine-timeout "$(left)" ${PROFILE_ARGS:-} \
        --out "$out/profile_mixed.json" >> "$out/profile-mixed.txt" 2>&1 || rc=1
      for f in "$out"/elogs/profile-mixed/engine-bench-qwen3-30b-a3b-*.log; do
        echo "== $f"; grep -h -A16 "engine_run: mixed" "$f" | head -18
      done ;;
    bench|bench-tiny|bench-30b)
      shapes=(tiny qwen3-30b-a3b)
      [ "$step" = bench-tiny ] && shapes=(tiny)
      [ "$step" = bench-30b ] && shapes=(qwen3-30b-a3b)
      for shape in "${shapes[@]}"; do
        python3 tests/engine/bench_engine.py --shape "$shape" --out "$out/engine_$shape.json" \
          --configs "${BENCH_CONFIGS:-no_ep,ll_graph,ll_pooloff}" 2>&1 \
          | tee "$out/bench-$shape.txt" | grep -v "^INFO\|^(EngineCore" | tail -8 || rc=1
      done ;;
    kbench-shapes)  # LL transport alone at bench_engine's deepseek-v3 and qwen3-235b-a22b shapes
      # (hidden, experts, top_k, MoE layers as the engines of bench-shape-*), batches 1-128
      for shape in "7168 256 8 4 deepseek-v3" "4096 128 8 10 qwen3-235b-a22b"; do
        read -r hidden experts top_k layers name <<< "$shape"
        vllm-flashinfer-ep bench --hidden "$hidden" --experts "$experts" --top-k "$top_k" \
          --layers "$layers" --tokens 1,8,32,128 --no-progress --json "$out/bench_world1_$name.json" \
          > "$out/kbench_$name.txt" 2>&1 || rc=1
        tail -8 "$out/kbench_$name.txt"
      done ;;
    kbench)  # transport-level benchmark: package modes vs raw FlashInfer (eager, fresh, graph)
      for hidden in 2048 7168; do
        prof=(); [ "$hidden" = 2048 ] && prof=(--host-profile)  # where the eager host time goes
        python3 -m vllm_flashinfer_ep.bench.run --hidden "$hidden" --no-progress "${prof[@]}" \
          --json "$out/bench_world1_h$hidden.json" > "$out/kbench_h$hidden.txt" 2>&1 || rc=1
        tail -17 "$out/kbench_h$hidden.txt"
      done ;;
    fp8bench)  # block-FP8 LL decode step: BF16 wire + vLLM's quantization vs FP8 on the wire
      python3 -m vllm_flashinfer_ep.bench.fp8_run --hidden 7168 --no-progress \
        --json "$out/bench_fp8_world1_h7168.json" 2>&1 | tee "$out/fp8bench.txt" | tail -9 || rc=1 ;;
    fp8bench-ht)  # block-FP8 HT step: BF16 wire + vLLM's quantization after receive vs FP8 on the wire
      python3 -m vllm_flashinfer_ep.bench.fp8_run --backend ht --hidden 7168 --layers 8 \
        --tokens 256,1024,4096 --no-progress --json "$out/bench_fp8_ht_world1_h7168.json" 2>&1 | tail -7 || rc=1 ;;
    direct)  # eager LL rounds as direct nccl.ep calls (runtime/native_handle.py), padding, graphs
      python3 -m pytest tests/kernels/test_transport_gpu.py -k "direct_eager or pad or pool_cuda_graph or unwarmed" \
        -p no:cacheprovider -rs -s -q -o addopts="" > "$out/pytest-direct.txt" 2>&1 || rc=1
      grep -E "DIRECT_EAGER|passed|failed|Error" "$out/pytest-direct.txt" | tail -12 ;;
    fp8wire)  # NCCL-EP's FP8 dispatch (runtime/fp8_wire.py) on the real library
      python3 -m pytest tests/kernels/test_transport_gpu.py -k fp8_dispatch -p no:cacheprovider -rs -s -q \
        -o addopts="" > "$out/pytest-fp8wire.txt" 2>&1 || rc=1
      grep -E "FP8_WIRE|passed|failed|Error" "$out/pytest-fp8wire.txt" | tail -12 ;;
    htbench)  # HT transport benchmark: the package's HT round vs raw FlashInfer, and LL vs HT (eager)
      read -ra htargs <<< "${HTBENCH_ARGS:-}"  # e.g. --ht-pooled (HT on pooled handles)
      for hidden in 4096 7168; do
        python3 -m vllm_flashinfer_ep.bench.ht_run --hidden "$hidden" --no-progress "${htargs[@]}" \
          --json "$out/bench_ht_world1_h$hidden.json" 2>&1 | tail -14 || rc=1
      done ;;
    *) echo "unknown step $step (doctor tests engine-tests engine-tests-a engine-tests-b kernel-tests received-rows vllm-combinations padding fp8-kernels fp8-engine fp8-engine-ll fp8-engine-ht fp8-engine-online-channel fp8-engine-online-block-ll fp8-engine-online-block-ht profile profile-mixed bench bench-tiny bench-30b kbench htbench memory multigpu-kernels multigpu-ll multigpu-ht multigpu-eplb multigpu-ft-retry multigpu-ft-kill serve-bench-ll serve-bench-noep serve-CONFIG-DATASET serve-warm-CONFIG engine-select direct fp8wire fp8bench fp8bench-ht fp8-experts bench-30b-fp8-CONFIG models-NAME[-ll|-ht] bench-shape-NAME kbench-shapes)"; rc=2 ;;
  esac
done
exit "$rc"
