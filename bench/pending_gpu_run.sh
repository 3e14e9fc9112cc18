#!/usr/bin/env bash
# The device calls that check a pending branch and measure the open issues (23, 24, 25), one
# part a call (each fits the device's 600 s), run from the tree with the device's python3 and the .whl/
# site on PYTHONPATH; everything lands in $OUT. Set FERRY_COMMIT to the tree's commit. PART=a,b runs several
# parts in one call (one device start), e.g. PART=eight,ahead (~7 min). .whl/ holds the shared wheels
# (../shared/wheels) and the clients the serve steps need: openai 1.109.1, anthropic 0.69.0, pydantic 2.11.7,
# pydantic-core 2.33.2, typing-inspection, annotated-types, jiter, distro, sniffio, docstring-parser, py-spy 0.4.2 (the
# newest openai/anthropic need httpx2 and opentelemetry, which the device lacks; without openai the
# gpu-check's serve step dies after its CUDA tests).
# The next session (a call's 600 s and a machine's start each; combine what fits; carry [".whl", ".cmp"], ".peer"
# for PART=peer). `make gpu-check` passed on 44420b1 (2026-12-06, H100); side by side there Ferry ran 1.61x FreeToken
# single-stream and 2.25x at 8 streams (bench/NOTES.md). Left of issue 56 on the device:
# 1. The cuts' TTFT-2k beside FreeToken in one call (0.181 / 0.172 s served at 44420b1, 20 ms of it the arrival hold):
#    PART=ttft, and FreeToken on the same cuts.
# 2. The 262k scenario (`--num-tokens 262144`) on the new defaults: PART=long.
# 3. Issue 58's must-show: the decode suite's hybrid8, hybrid8_nvfp4 and 12layer at the tip against 49d0524 in one call.
#   PART=check   make gpu-check (the release check, which builds the host's C kernel; gpu_check.json)  ~4-7 min
#   PART=prof    the full-size 35B NVFP4's decode at 24 GiB profiled at 1 and 8 streams, and the cuts' 2k prefill ~5 min
#   PART=ttft    the cuts' served TTFT-2k phase by phase (bench/ttft_path.py), with the arrival hold and without ~6 min
#   PART=peer    Ferry against the peer FreeToken 0.1.2 (bench/peer_compare.py): one random NVFP4 checkpoint of the
#                full-size 35B, the same client, each engine's whole process under 24 GiB by nvidia-smi
#                (peer_compare_<card>.json). FreeToken's wheels come in .peer/, which the call must carry
#                (carry [".whl", ".peer"]), made here with `mkdir -p .peer && cp ../shared/peers/freetoken/*.whl .peer/`
#                and `echo /.peer/ >> .git/info/exclude`; they are installed into /tmp/ft, its PYTHONPATH alone  ~9 min
#                (the checkpoint, ~20 GB in $TMPDIR, is reused by a second call on the same warm machine; PEER_ARGS
#                passes more flags, e.g. "--ferry-load-format auto" to have Ferry read it too)
#   PART=defaults the full-size 35B NVFP4 at 24 GiB at the issue's flags and at Ferry's defaults, nvidia-smi's
#                process memory beside them, then the 12-layer and hybrid cuts' TTFT-2k                   ~9 min
#   PART=prefill bench/prefill_attention.py on the 35B's attention shapes, then the 262k-token TTFT  ~6-8 min
#   PART=three   issue 23's three turns (32k first turn) on the full-size 35B with NVFP4 experts, openai and anthropic
#                clients (prefix_hybrid_three.json)                                              ~3 min
#   PART=resident the resident cuts served (12layer_resident, hybrid8_resident: issue 24's decode targets) ~2 min
#   PART=gemv    the decode projections' GEMV against cuBLAS (bench/dense_gemv_sweep.py), then the resident
#                cuts served with the sweep's choices and with FERRY_DENSE_GEMV=0 (cuBLAS; GEMV_WORKLOADS)   ~8 min
#   PART=warmstep issue 23's warm step (8 rows x 156 tokens after a cached 4k prefix) profiled beside a baseline chunk,
#                the 8-layer hybrid cut at 640 slots (WARMSTEP_FORMAT=bf16|nvfp4|fp8), at ring chunks of 12 (the
#                default), 24 and 48 (WARMSTEP_RING); if a larger one wins, EIGHT_FLAGS="--prefill-ring-chunk N"
#                runs the must-show with it; WARMSTEP_HOST_PROFILE=N warm steps under cProfile (2)   ~3-4 min
#   PART=contention the host kernel's calls (12 threads pinned) beside busy processes on two of its cores, claimed
#                items against main's static split (.cmp/static_pool, carried: carry [".whl", ".cmp"])   ~2 min
#   PART=split   the hybrid and 12-layer cuts' decode step under the host's share swept by hand: the price scaled
#                (0.8-2.0), µs added to the hand-off's price, and off (bench/host_split_sweep.py; SPLIT_SETTINGS),
#                with the pool spinning 50 µs and 1 ms (SPLIT_SPIN)                                  ~5 min
#   PART=handoff a decode layer's hand-off: a host node (cuLaunchHostFunc) against the GPU writing a word a spinning
#                host thread answers (cuStreamWriteValue32/WaitValue32 in the graph), with and without the copies,
#                alone and beside a full host-to-device link (the served unpacking kernel; the plain copy kernel;
#                the copy engine: bench/link_load.py)                                              ~1-2 min
#   PART=hostgemm the host's C kernel against torch's GEMM at 1-128 tokens an expert, 12 threads      ~2 min
#   PART=hostprefetch the host kernel's rows prefetching the weights 0-4096 bytes ahead (bf16, packed, nvfp4;
#                1-15 threads): a server core's prefetcher stops at each 4 KiB page, a bf16 row's size;
#                if a distance wins, FERRY_HOST_KERNEL_PREFETCH=N DECODE12_VARIANTS=default PART=decode12   ~2 min
#   PART=wsslices the workspace (as boot profiles it, in expert slots) of 8k and 16k steps, mixers sliced at 8k/4k/2k,
#                35B and 30B: which MIXER_SLICE_TOKENS, and whether 16k steps can be a default  ~3-4 min
#   PART=window  a streamed layer's expert GEMMs over all its blocks against each chunk's own (bench/expert_window.py) ~1 min
#   PART=flashtest the attention dispatch's CUDA tests (FlashAttention for long queries)               ~1 min
#   PART=long    the 262k-token TTFT alone (LONG_VARIANTS picks decode_suite variants)                 ~4-5 min a variant
#   PART=longprof one chunk of the 262k prompt profiled deep into the context: the copies' overlap with
#                compute, each stream's kernels by family (profile_long_chunk.json; LONGPROF_FLAGS; LONGPROF_AT,
#                LONGPROF_LEN: where and how far; LONGPROF_RING=0,48: one chunk a staging-ring chunk size;
#                the device events come back, for --summarize here)                                 ~4-5 min
#   PART=overlap does a long attention chunk hide the ring's copies (bench/ring_overlap.py)         ~2 min
#   PART=share   hybrid8 decode GPU-only and under auto (HYBRID8_VARIANTS; 1,536 tokens settled first: the
#                hybrid cut's decode_hybrid8_hybrid_cpu.json, issue 25) ~4 min; SHARE_THREE=1 then runs issue 23's
#                three turns in bf16 with the host's share (~4 min more)
#   PART=decode12 the 12-layer cut GPU-only, with the host's share, with it but no prefetch, and the
#                default (auto): decode_12layer_hybrid_cpu.json (issue 25's must-show); each server first
#                decodes DECODE12_SETTLE (1536) untimed tokens, over which auto's guard sizes the share ~3-4 min
#                (DECODE12_VARIANTS picks fewer)
#   PART=serveprof the 12-layer cut's single stream served under auto and GPU-only: the step intervals' median,
#                mean, p90 and longest, and py-spy over the three processes (issue 25's 1 ms a token past the
#                guard's medians)                                                                   ~6 min
#   PART=decode30 the full-size Qwen3-30B at 24 GiB, GPU-only and with the host's share, its host nodes' time ~5 min
#   PART=ahead   the resident hybrid cut with --schedule-ahead-steps 1 and 2 (issue 24)                ~4 min
#   PART=hostpages the host kernel's time an expert on 4 KiB against transparent huge pages, alternated   ~2 min
#   PART=pin     the host kernel's threads unpinned against pinned (--host-expert-cpus auto), alternated ~2 min
#   PART=eight   issue 23's 8 streams sharing a 4k system prompt on the 8-layer hybrid cut, 640 slots  ~3-4 min
#                a variant (EIGHT_VARIANTS="flags|flags", e.g. "|--expert-backend gpu": one run each, in v<i>/;
#                EIGHT_FLAGS for one); the servers' logs and step traces come back (v<i>/trace, v<i>/pytest);
#                EIGHT_FORMAT=nvfp4|fp8 writes the cut's experts in that checkpoint format (bf16 by default)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; PART=${PART:-check}
# the card, lower case, in the names of what a part measures on it (h100, h200): a plain call gets either
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
GPU=$(grep -oiE 'h[0-9]{3}' <<< "$CARD" | tr 'A-Z' 'a-z'); GPU=${GPU:-gpu}; echo "device: $CARD ($GPU)"
export PYTHONUNBUFFERED=1 TMPDIR=${TMPDIR:-/tmp}
# the host's C expert kernel built in place, as `pip install` builds it (the tree sent here is not installed)
build_host_kernel() {
  python3 -c "import sys; from setuptools import setup; sys.argv = ['setup.py', 'build_ext', '--inplace', '-q']; setup()" \
    > "$OUT/host_kernel_build.log" 2>&1 || echo "host kernel build failed (see host_kernel_build.log)"
}
# CALL_BUDGET_S=N: a part starts only while its usual seconds (part_cost, from the runs of 2026-12-05) still
# fit in the N seconds since this script began: a call that holds several parts returns its files inside the device's
# 600 s (a call killed at its limit never writes the archive below) rather than losing the part it was in.
# The parts' variant lists, named once: part_cost counts what the part will run.
DECODE12_VARIANTS=${DECODE12_VARIANTS:-gpu,host-share,host-share-no-prefetch,default}
HYBRID8_VARIANTS=${HYBRID8_VARIANTS:-gpu,default}
LONG_VARIANTS=${LONG_VARIANTS:-default}
SPLIT_SPIN=${SPLIT_SPIN:-50,1000}
n_variants() { local v=${1//[^,]/}; echo $(( ${#v} + 1 )); }
part_cost() {
  case "$1" in
    check) echo 420 ;;  # two test processes: 410 s on a fresh H100 (a663c35's day), 200-220 s warm, 281 s at 7f97462
    decode12) echo $(( 20 + 70 * $(n_variants "$DECODE12_VARIANTS") )) ;;
    share) echo $(( 20 + 120 * $(n_variants "$HYBRID8_VARIANTS") )) ;;
    long) echo $(( 180 * $(n_variants "$LONG_VARIANTS") )) ;;  # 165 s a variant at a663c35, + 2 repeats of each decode
    resident) echo 210 ;;
    defaults) echo 540 ;;  # two cuts served (its timeout 200 s)
    peer) echo 570 ;;
    prof) echo 330 ;;
    ttft) echo 360 ;;  # four boots of a cut (~45 s each) and their lone prompts  # three boots (the full-size 35B ~100 s, each cut ~40 s) and their profiled steps  # a 20 GB checkpoint written, two engines booted and measured (peer_compare's --budget-s 500)
    handoff) echo 90 ;;  # five rounds' kinds alone, then beside two loads of ~1.2 s each (under 1 min on the H200 alone)
    split) echo $(( 75 * 2 * $(n_variants "$SPLIT_SPIN") )) ;;  # two cuts a spin, each a boot (~45 s) and 17-28 s of steps
    *) echo 240 ;;
  esac
}
for part in ${PART//,/ }; do  # PART=eight,ahead runs both, in that order, in one call
if [ -n "${CALL_BUDGET_S:-}" ] && (( SECONDS + $(part_cost "$part") > CALL_BUDGET_S )); then
  echo "PART=$part skipped: ${SECONDS} s gone, it takes ~$(part_cost "$part") s of CALL_BUDGET_S=$CALL_BUDGET_S"; continue
fi
case "${part:-check}" in
  check)
    # under the call's 600 s: should anything hang, the call still returns with the logs so far
    # straight into $OUT: what a run cut short wrote (gpu_tests.log, test by test) still comes back
    # the CUDA tests in GPU_CHECK_WORKERS processes (default 2, a file to each: 217 took 428 s in one at 6dd9cdd,
    # 12 s under gpu_check's limit); GPU_CHECK_WORKERS=1 runs them in one, as before
    timeout 570 make gpu-check OUT="$OUT" GPU_PYTHON=python3 GPU_CHECK_ARGS="--workers ${GPU_CHECK_WORKERS:-2}" \
      > "$OUT/gpu_check_stdout.log" 2>&1; echo "gpu-check rc=$?"
    tail -3 "$OUT/gpu_check_stdout.log" ;;
  defaults)  # issue 56: the full-size 35B NVFP4 at --gpu-memory 24GiB, the issue's flags and Ferry's defaults, the
    # process's device memory sampled by nvidia-smi (it must stay under 24 GiB), then the two cuts' TTFT-2k
    build_host_kernel
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 500 > "$OUT/smi_apps.csv" 2>&1 &
    SMI=$!
    timeout 420 python3 bench/decode_suite.py --out "$OUT" --workloads 36b_nvfp4_defaults,36b_nvfp4 --max-tokens 128 \
      --ready-timeout 240 --run-timeout 200 > "$OUT/defaults.log" 2>&1; echo "defaults rc=$?"
    kill $SMI; tail -4 "$OUT/defaults.log"
    echo "largest process by nvidia-smi (MiB): $(sort -t, -k2 -n "$OUT/smi_apps.csv" | tail -1)"
    grep -h '"device_memory"\|device_memory ' "$OUT"/serve_36b*.log | cut -c1-400
    timeout 300 python3 bench/decode_suite.py --out "$OUT" --workloads 12layer,hybrid8 --max-tokens 64 \
      > "$OUT/ttft.log" 2>&1; echo "ttft rc=$?"; grep -h ttft "$OUT"/decode_12layer*.json "$OUT"/decode_hybrid8*.json | head -8 ;;
  prof)  # where the time goes (issue 56): the full-size 35B NVFP4's decode at 24 GiB, its defaults, 1 and 8 streams
    # (bench/profile_decode.py), then one 2k-token prefill of each cut (bench/profile_prefill.py), with device traces
    build_host_kernel
    for m in 36b_nvfp4:qwen3.6-35b-a3b::nvfp4 12layer:qwen3-30b-a3b:12:bf16 hybrid8:qwen3.6-35b-a3b:8:bf16; do
      IFS=: read -r tag cfg layers fmt <<< "$m"
      python3 -m ferry.services.cli make-bench-model "$TMPDIR/prof_$tag" --config "tests/data/models/$cfg/config.json" \
        --format "$fmt" ${layers:+--num-layers $layers} > /dev/null
    done
    timeout 240 python3 bench/profile_decode.py --model "$TMPDIR/prof_36b_nvfp4" --load-format dummy --gpu-memory 24GiB \
      --streams 1,8 --out "$OUT/profile_decode_36b_nvfp4_$GPU.json" > "$OUT/profile_decode_36b.log" 2>&1
    echo "profile_decode rc=$?"; grep -h 'ms/step\|device time per step' "$OUT/profile_decode_36b.log"
    for cut in 12layer hybrid8; do
      cache=$([ $cut = 12layer ] && echo 512 || echo 640)
      timeout 120 python3 bench/profile_prefill.py --model "$TMPDIR/prof_$cut" --load-format dummy --moe-cache-size $cache \
        --gpu-memory 12GiB --max-running-requests 8 --prompt-len 2000 --out "$OUT/profile_prefill_${cut}_$GPU.json" \
        > "$OUT/profile_prefill_$cut.log" 2>&1; echo "profile_prefill $cut rc=$?"
    done ;;
  ttft)  # issue 56: the cuts' served TTFT-2k phase by phase (bench/ttft_path.py), with and without the arrival hold
    for cut in 12layer hybrid8; do
      for hold in default 0; do
        flags=$([ $hold = 0 ] && echo "--prefill-coalesce-ms 0" || echo "")
        timeout 170 python3 bench/ttft_path.py --workload $cut --extra-flags "$flags" \
          --out "$OUT/ttft_path_${cut}_hold-${hold}_$GPU.json" > "$OUT/ttft_path_${cut}_hold-${hold}.log" 2>&1
        echo "ttft_path $cut hold=$hold rc=$?"; tail -3 "$OUT/ttft_path_${cut}_hold-${hold}.log"
      done
    done ;;
  peer)  # Ferry and FreeToken 0.1.2 side by side under one device-memory line (bench/peer_compare.py's docstring)
    if ! ls .peer/freetoken-*.whl > /dev/null 2>&1; then
      echo "PART=peer needs FreeToken's wheels in .peer/, carried (carry [\".whl\", \".peer\"]; this header says how)"
    else
      build_host_kernel  # Ferry at its defaults: its host kernel built as pip builds it
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ft .peer/*.whl \
        > "$OUT/peer_install.log" 2>&1 || echo "FreeToken's wheels did not install (peer_install.log)"
      timeout 530 python3 bench/peer_compare.py --out "$OUT" --freetoken-site /tmp/ft --budget-s 500 ${PEER_ARGS:-} \
        > "$OUT/peer_compare.log" 2>&1; echo "peer rc=$?"
      tail -7 "$OUT/peer_compare.log"
    fi ;;
  prefill)
    timeout 150 python3 bench/prefill_attention.py --contexts 0,65536,131072,253952 --whole-prompt 261988 \
      --tiles "32,32,8;64,16,4" --out "$OUT/prefill_attention_$GPU.json" > "$OUT/prefill_attention.log" 2>&1
    echo "prefill_attention rc=$?"; tail -6 "$OUT/prefill_attention.log"
    timeout 400 python3 bench/decode_suite.py --out "$OUT" --workloads long_context_36b --ready-timeout 240 \
      --run-timeout 300 > "$OUT/long_context.log" 2>&1
    echo "long_context rc=$?"; tail -3 "$OUT/long_context.log" ;;
  three)  # issue 23: three turns of a 32k conversation through both clients, NVFP4 experts at 24 GiB
    python3 -m ferry.services.cli make-bench-model /tmp/m36q --config tests/data/models/qwen3.6-35b-a3b/config.json \
      --format nvfp4 > /dev/null
    FERRY_MUST_SHOW_MODEL=/tmp/m36q FERRY_MUST_SHOW_FLAGS="--load-format dummy --gpu-memory 24GiB --max-running-requests 8" \
      FERRY_MUST_SHOW_OUT="$OUT/prefix_hybrid_three.json" timeout 280 python3 -m pytest -q -s -p no:cacheprovider \
      tests/gpu/test_prefix_cache_must_show.py -k three > "$OUT/three.log" 2>&1
    echo "three turns rc=$?"; grep -A2 '_turn_[23]' "$OUT/three.log" | grep ttft | head -4; tail -2 "$OUT/three.log" ;;
  gemv)  # issue 24: the projections' GEMV swept against cuBLAS, then served with the sweep's choices against cuBLAS
    timeout 240 python3 bench/dense_gemv_sweep.py --out "$OUT" > "$OUT/dense_gemv_sweep.log" 2>&1
    echo "dense_gemv_sweep rc=$?"; grep -h "one decode layer" "$OUT/dense_gemv_sweep.log"
    for impl in gemv cublas; do
      if [ $impl = gemv ]; then export FERRY_DENSE_GEMV=1 FERRY_DENSE_GEMV_TILES="$OUT/dense_gemv_sweep.json"; else export FERRY_DENSE_GEMV=0; fi
      timeout 170 python3 bench/decode_suite.py --out "$OUT/$impl" --workloads "${GEMV_WORKLOADS:-12layer_resident,hybrid8_resident}" \
        --max-tokens 256 > "$OUT/suite_$impl.log" 2>&1
      echo "$impl rc=$?"; grep -h '^\[.*1 stream' "$OUT/suite_$impl.log" | cut -c1-200
    done; unset FERRY_DENSE_GEMV FERRY_DENSE_GEMV_TILES ;;
  resident)  # issue 24's all-resident decode: the 12-layer 30B cut and the hybrid cut, one stream and eight
    timeout 200 python3 bench/decode_suite.py --out "$OUT" --workloads 12layer_resident,hybrid8_resident --max-tokens 256 \
      > "$OUT/suite_resident.log" 2>&1
    echo "resident rc=$?"; grep -h '^\[.*1 stream' "$OUT/suite_resident.log" | cut -c1-260 ;;
  warmstep)  # issue 23: the warm round's step (8 rows of 156 tokens after a cached 3,952) profiled, and a baseline chunk
    python3 -m ferry.services.cli make-bench-model /tmp/m8w --config tests/data/models/qwen3.6-35b-a3b/config.json \
      --num-layers 8 --format "${WARMSTEP_FORMAT:-bf16}" > /dev/null
    timeout 300 python3 bench/profile_shared_prefix_step.py --model /tmp/m8w --load-format dummy --moe-cache-size 640 \
      --gpu-memory 12GiB --max-running-requests 8 --out "$OUT/profile_shared_prefix_${WARMSTEP_FORMAT:-bf16}.json" \
      --ring-chunks "${WARMSTEP_RING:-0,24,48}" --repeats 2 --host-profile "${WARMSTEP_HOST_PROFILE:-2}" --events-dir "$OUT" \
      > "$OUT/warmstep.log" 2>&1
    echo "warmstep rc=$?"; grep '"step"' "$OUT/warmstep.log" | cut -c1-400; grep -A25 host_profile_wall "$OUT/warmstep.log" ;;
  hostgemm)  # issue 25/23: the host's C kernel against torch's GEMM (oneDNN, AMX on this host) by tokens an expert
    build_host_kernel
    for b in c torch; do
      timeout 120 python3 bench/host_price_tokens.py --threads 12 --format bf16 --backend $b --tokens 1,8,16,39,64,128 \
        --points 16 --experts 64 --repeats 10 --out "$OUT/host_price_tokens_${GPU}_bf16_$b.json" 2>&1 | grep tokens
    done ;;
  hostprefetch)  # issue 25: the host kernel's rows with the weights prefetched 0-4096 bytes ahead, alternated call by call
    build_host_kernel
    timeout 300 python3 bench/cpu_expert_bw.py --threads 1,8,12,15 --format bf16,packed,nvfp4 --backend c \
      --prefetch 0,512,1024,2048,4096 --repeats 60 --out "$OUT/cpu_expert_prefetch_$GPU.json" 2>&1 | grep prefetch ;;
  contention)  # issue 25: the host kernel's calls beside busy processes on its pinned cores, claimed items against
    # the static split of main 0eefdb5 (its sources carried in .cmp/static_pool, built here as pip builds the tree's)
    build_host_kernel
    cmp=()
    if [ -d .cmp/static_pool ]; then
      gcc -O3 -std=gnu11 -ffp-contract=off -pthread -fPIC -shared -o /tmp/static_pool.so .cmp/static_pool/*.c -lm \
        && cmp=(--compare-library /tmp/static_pool.so)
    fi
    for tok in 1 8; do
      timeout 250 python3 bench/host_pool_contention.py --threads 12 --pin --tokens $tok --experts $((tok == 1 ? 3 : 6)) \
        --hog none,100/0,1/1,0.3/0.7 --hog-cpus 3,7 --gap-us 400 --rounds 10 --spin-us 50,1000 "${cmp[@]}" \
        --json "$OUT/host_pool_contention_${GPU}_${tok}tok.json" 2>&1 | grep -v Warn
    done ;;
  handoff)  # issue 25: a decode layer's hand-off to the host, a host node against a polled round trip (stream memory ops)
    timeout 240 python3 bench/host_handoff_latency.py --link-load none,packed,plain,ce --out "$OUT/host_handoff_latency_$GPU.json" 2>&1 | tail -18 ;;
  window)  # a streamed layer's expert GEMMs launched over every block against over each chunk's own (expert_window.py)
    timeout 200 python3 bench/expert_window.py --out "$OUT/expert_window.json" > "$OUT/expert_window.log" 2>&1
    echo "expert_window rc=$?"; cat "$OUT/expert_window.log" | tail -8 ;;
  wsslices)  # the workspace of 8k and 16k steps with the mixers in slices of 8k, 4k, 2k (bench/workspace_slices.py)
    for m in qwen3.6-35b-a3b qwen3-30b-a3b; do
      timeout 240 python3 bench/workspace_slices.py --model tests/data/models/$m --tokens 8192,16384 \
        --slices 8192,4096,2048 --out "$OUT/workspace_slices_$m.json" > "$OUT/workspace_slices_$m.log" 2>&1
      echo "workspace_slices $m rc=$?"; tail -6 "$OUT/workspace_slices_$m.log"
    done ;;
  flashtest)  # the attention dispatch (FlashAttention for long queries, the paged kernel for the rest) on CUDA
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_cuda.py -k "dispatch or triton_paged" \
      > "$OUT/flash_test.log" 2>&1; echo "flash test rc=$?"; tail -3 "$OUT/flash_test.log" ;;
  long)  # the 262k-token TTFT alone (issue 24); LONG_VARIANTS=default,plain also runs it on plain bf16 banks
    timeout 560 python3 bench/decode_suite.py --out "$OUT" --workloads long_context_36b --variants "$LONG_VARIANTS" --ready-timeout 240 \
      --run-timeout 300 > "$OUT/long_context.log" 2>&1
    echo "long_context rc=$?"; tail -3 "$OUT/long_context.log"; grep -h 'ttft\|error\|Error' "$OUT"/serve_long*.log 2>/dev/null | tail -5 ;;
  longprof)  # issue 24: one chunk of the 262k prompt profiled at 32k, 128k and 248k keys (bench/profile_long_chunk.py)
    python3 -m ferry.services.cli make-bench-model /tmp/m36 --config tests/data/models/qwen3.6-35b-a3b/config.json > /dev/null
    timeout ${LONGPROF_TIMEOUT:-420} python3 bench/profile_long_chunk.py --model /tmp/m36 --load-format dummy --gpu-memory 24GiB \
      --num-tokens 262144 --max-running-requests 8 --at ${LONGPROF_AT:-32768,131072,253952} --prompt-len ${LONGPROF_LEN:-261988} \
      ${LONGPROF_RING:+--ring-chunks $LONGPROF_RING} \
      ${LONGPROF_FLAGS:-} --out "$OUT/profile_long_chunk${LONGPROF_TAG:-}.json" --trace-dir /tmp/long_traces --events-dir "$OUT" > "$OUT/profile_long_chunk${LONGPROF_TAG:-}.log" 2>&1
    echo "profile_long_chunk rc=$?"; grep -h '^{"context"\|^prefill of' "$OUT/profile_long_chunk${LONGPROF_TAG:-}.log" | cut -c1-1200 ;;
  overlap)  # issue 24: a long attention chunk beside one layer's ring copies, per bank format, programs, priority
    for ctx in 32768 131072; do
      timeout 200 python3 bench/ring_overlap.py --context $ctx --out "$OUT/ring_overlap_$ctx.json" > "$OUT/ring_overlap_$ctx.log" 2>&1
      echo "ring_overlap $ctx rc=$?"; cat "$OUT/ring_overlap_$ctx.log" | tail -8
    done ;;
  share)
    build_host_kernel
    timeout $(( 60 + 120 * $(n_variants "$HYBRID8_VARIANTS") )) python3 bench/decode_suite.py --out "$OUT" \
      --workloads hybrid8 --variants "$HYBRID8_VARIANTS" \
      --max-tokens 128 --settle-tokens 1536 > "$OUT/suite_share.log" 2>&1
    echo "hybrid8 rc=$?"; grep '^\[hybrid8' "$OUT/suite_share.log" | tail -4
    if [ "${SHARE_THREE:-0}" = 1 ]; then  # issue 23's three turns with the host's share (~4 min more)
      python3 -m ferry.services.cli make-bench-model /tmp/m36 --config tests/data/models/qwen3.6-35b-a3b/config.json > /dev/null
      FERRY_MUST_SHOW_MODEL=/tmp/m36 FERRY_MUST_SHOW_FLAGS="--load-format dummy --gpu-memory 24GiB --expert-backend hybrid --host-expert-threads 12" \
        FERRY_MUST_SHOW_OUT="$OUT/prefix_hybrid_bf16_host_share.json" timeout 250 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_prefix_cache_must_show.py -k three > "$OUT/three_share.log" 2>&1
      echo "three turns rc=$?"; tail -3 "$OUT/three_share.log"
    fi ;;
  decode12)
    build_host_kernel
    timeout 560 python3 bench/decode_suite.py --out "$OUT" --workloads 12layer \
      --variants "$DECODE12_VARIANTS" --max-tokens 128 \
      --settle-tokens "${DECODE12_SETTLE:-1536}" \
      > "$OUT/suite_decode12.log" 2>&1
    echo "12layer rc=$?"; grep '^\[12layer' "$OUT/suite_decode12.log" | tail -6
    timeout 150 python3 bench/host_price_tokens.py --threads 12 --experts 64 --link-load none,packed \
      --out "$OUT/host_price_tokens_$GPU.json" 2>&1 | tail -10  # the host's time against its tokens, alone and beside a full link
    grep -h '"host_decode"\|"host_share"\|expert_prefetch_off' "$OUT"/serve_12layer*.log | cut -c1-400
    python3 -c "import json,sys; [print(f, json.load(open(f)).get('host_share')) for f in sys.argv[1:]]" "$OUT"/decode_12layer*.json ;;
  split)  # issue 25: each cut's decode step under the host's share swept by hand (bench/host_split_sweep.py): the price
    # scaled, µs added to the hand-off's price, and off; SPLIT_SPIN lists the host pool's spins (FERRY_HOST_POOL_SPIN_US)
    build_host_kernel
    python3 -m ferry.services.cli make-bench-model /tmp/m8 --config tests/data/models/qwen3.6-35b-a3b/config.json --num-layers 8 > /dev/null
    python3 -m ferry.services.cli make-bench-model /tmp/m12 --config tests/data/models/qwen3-30b-a3b/config.json --num-layers 12 > /dev/null
    for spin in ${SPLIT_SPIN//,/ }; do
      for w in "hybrid8 m8 640" "12layer m12 512"; do
        set -- $w
        FERRY_HOST_POOL_SPIN_US=$spin timeout 140 python3 bench/host_split_sweep.py --model /tmp/$2 --load-format dummy \
          --moe-cache-size $3 --gpu-memory 12GiB --max-running-requests 8 --expert-backend hybrid \
          ${SPLIT_SETTINGS:+--settings "$SPLIT_SETTINGS"} \
          --out "$OUT/host_split_sweep_$1_spin${spin}_$GPU.json" > "$OUT/host_split_sweep_$1_spin$spin.log" 2>&1
        echo "split $1 spin $spin rc=$?"; grep -E "^ *[a-z0-9.+]+: median" "$OUT/host_split_sweep_$1_spin$spin.log"
      done
    done ;;
  serveprof)  # issue 25: the served single stream's step intervals (mean, p90, longest: the guard's windows are
    # medians) and its three processes under py-spy (its wheel in .whl/), auto against GPU-only, guard settled first
    build_host_kernel
    for v in "default|" "gpu|--expert-backend gpu"; do
      name=${v%%|*}; flags=${v#*|}
      timeout 170 python3 bench/profile_serve.py --workload 12layer --extra-flags "$flags" --streams 1 --seconds 8 \
        --settle-seconds "${SERVEPROF_SETTLE:-15}" --py-spy /tmp/site/bin/py-spy --out "$OUT/profile_serve_12layer_$name.json" \
        > "$OUT/profile_serve_$name.log" 2>&1
      echo "profile_serve $name rc=$?"; grep '"timeline"' "$OUT/profile_serve_$name.log" | cut -c1-1400
    done ;;
  decode30)  # the full-size Qwen3-30B at 24 GiB, GPU-only against the host's share (which lost in its gpu-check serve)
    build_host_kernel
    timeout 560 python3 bench/decode_suite.py --out "$OUT" --workloads 30b --variants gpu,host-share --max-tokens 128 \
      > "$OUT/suite_decode30.log" 2>&1
    echo "30b rc=$?"; grep '^\[30b' "$OUT/suite_decode30.log" | tail -4
    python3 -c "import json,sys; [print(f, json.load(open(f)).get('host_share')) for f in sys.argv[1:]]" "$OUT"/decode_30b*.json ;;
  hostpages)  # issue 25: the host kernel on banks left on 4 KiB pages against advised ones (offload/host_memory/huge_pages.py)
    build_host_kernel
    for round in 1 2; do for fmt in packed bf16; do for pages in off on; do
      timeout 150 python3 bench/host_price_tokens.py --threads 12 --experts 256 --format $fmt --tokens 1,4,8,16 \
        --points 16 --huge-pages $pages --out "$OUT/host_pages_${fmt}_${pages}_$round.json" 2>&1 | sed -n 1,3p | tr '\n' ' '; echo  # sed reads it all: head would close the pipe before the JSON is written
    done; done; done ;;
  pin)  # issue 25: the host kernel's threads unpinned against pinned one a core to the last cores (auto)
    build_host_kernel
    for round in 1 2 3; do for cpus in none auto; do
      timeout 150 python3 bench/host_price_tokens.py --threads 12 --experts 256 --format bf16 --tokens 1,4,8,16 \
        --points 16 --cpus $cpus --out "$OUT/host_pin_bf16_${cpus}_$round.json" 2>&1 | sed -n 1,3p | tr '\n' ' '; echo  # sed reads it all: head would close the pipe before the JSON is written
    done; done ;;
  ahead)  # issue 24's resident hybrid cut with one and two (the default since c7b6274) decode steps scheduled ahead
    timeout 560 python3 bench/decode_suite.py --out "$OUT" --workloads hybrid8_resident --variants ahead1,default \
      --max-tokens 256 > "$OUT/suite_ahead.log" 2>&1
    echo "hybrid8_resident rc=$?"; grep '^\[hybrid8_resident' "$OUT/suite_ahead.log" | tail -4 ;;
  eight)  # EIGHT_VARIANTS="flags a|flags b" runs the must-show once per variant, each in $OUT/v<i>/
    build_host_kernel
    python3 -m ferry.services.cli make-bench-model /tmp/m8 --config tests/data/models/qwen3.6-35b-a3b/config.json \
      --num-layers 8 --format "${EIGHT_FORMAT:-bf16}" > /dev/null
    IFS='|' read -r -a variants <<< "${EIGHT_VARIANTS:-${EIGHT_FLAGS:-}}"
    [ ${#variants[@]} -eq 0 ] && variants=("")
    for i in "${!variants[@]}"; do
      V="$OUT/v$i"; mkdir -p "$V"; echo "== variant $i: ${variants[$i]}" | tee "$V/flags.txt"
      FERRY_MUST_SHOW_MODEL=/tmp/m8 FERRY_MUST_SHOW_FLAGS="--load-format dummy --moe-cache-size 640 --gpu-memory 12GiB --max-running-requests 8 ${variants[$i]}" \
        FERRY_MUST_SHOW_OUT="$V/prefix_hybrid_eight.json" FERRY_STEP_TRACE="$V/trace" timeout "${EIGHT_TIMEOUT:-280}" \
        python3 -m pytest -q -s -p no:cacheprovider --basetemp "$V/pytest" \
        tests/gpu/test_prefix_cache_must_show.py -k eight > "$V/eight.log" 2>&1
      echo "eight streams rc=$?"
      find "$V/pytest" -type s -delete 2>/dev/null  # the servers' sockets: the logs and traces stay
      python3 - "$V/trace" <<'PY'  # per server: the prefill steps (more than 64 tokens), the arrival bursts
import json, pathlib, sys
for d in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    rows = [json.loads(x) for f in d.glob("worker-*.jsonl") for x in f.read_text().splitlines()]
    steps = [f"{r['rows']}r/{r['tokens']}t {r['answered'] - r['recv']:.3f}s" for r in rows if r["tokens"] > 64]
    print(d.name, "prefill steps:", ", ".join(steps[-24:]))
    arrived = sorted(json.loads(x)["arrived"] for f in d.glob("scheduler-*.jsonl")
                     for x in f.read_text().splitlines() if "arrived" in x)
    bursts, burst = [], []
    for t in arrived:  # a round: prompts less than 0.25 s apart
        if burst and t - burst[-1] > 0.25:
            bursts.append(burst)
            burst = []
        burst.append(t)
    for b in bursts + ([burst] if burst else []):
        print(d.name, f"{len(b)} prompts over {(b[-1] - b[0]) * 1e3:.1f} ms")
PY
      # kernels compiled after the worker was ready (services/worker/compile_watch.py)
      grep -rh --include=serve.log kernel_compiled_in_service "$V/pytest" | cut -c1-300 | head -5
      grep -A3 '_speedup' "$V/eight.log" | head -12; tail -2 "$V/eight.log"
    done ;;
  *) echo "PART=$part is none of the parts this script's header lists (PART=a,b runs several)" >&2; exit 2 ;;
esac
done
# the device returns a few files a call (more are dropped, as the first decode12 run's logs were): one archive
NAME=${PART//,/_}; tar -czf "/tmp/${NAME:-check}_out.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/${NAME:-check}_out.tgz" "$OUT/"
