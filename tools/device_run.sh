#!/usr/bin/env bash
# The device calls: each PART one measurement that fits a device call's 600 s, run from the tree's root with the
# device's python3; everything lands in $OUT, packed into one archive at the end (the device returns a few files a
# call). PART=a,b runs several parts in one call (one machine start), in that order. Set FERRY_COMMIT to the tree's
# commit where the device's copy has no git history (the results record it).
#
# What a call carries: `.whl` always (the wheels the device lacks, installed here into /tmp/site, which goes on
# PYTHONPATH after the tree), `.peer` for PART=peer and peercuts, `.cmp` for PART=suite when the device's copy has no git
# history. `bash tools/device_wheels.sh` makes .whl/ (and .cmp/suite_base with BASE_COMMIT=<commit>); for .peer:
# `mkdir -p .peer && cp ../shared/peers/freetoken/*.whl .peer/ && echo /.peer/ >> .git/info/exclude`.
#
#   PART=check   make gpu-check: the CUDA tests, then `ferry serve` with the openai client (tools/gpu_check.py;
#                gpu_check.json, gpu_check.log; GPU_CHECK_WORKERS test processes, default 2)          ~4-7 min
#   PART=suite   bench/decode_suite.py's SUITE_WORKLOADS (default hybrid8,hybrid8_nvfp4,12layer) at the tree and at
#                BASE_COMMIT (required, e.g. 49d0524) in one call, each into $OUT/tree and $OUT/base, then both
#                side by side with the tree's ratio to the base. The base is a `git worktree add` of BASE_COMMIT
#                into /tmp where the device's copy has the history, else .cmp/suite_base (carried; made by
#                `BASE_COMMIT=... bash tools/device_wheels.sh`); each tree's host kernel is built in place  ~8-9 min
#                (SUITE_SIDES=tree or base runs one side, e.g. one a call on a fresh machine, where the cold Triton
#                cache makes each boot ~100 s; SUITE_SIDE_S, default 270, bounds each side; SUITE_VARIANT=gpu runs
#                both sides with one expert backend, so that auto's boot calibration does not pick differently)
#   PART=peer    Ferry against the peer FreeToken 0.1.2 (bench/peer_compare.py): one random NVFP4 checkpoint of the
#                full-size 35B, the same client, each engine's whole process under 24 GiB by nvidia-smi
#                (peer_compare_<card>.json). FreeToken's wheels come in .peer/, installed into /tmp/ft, its
#                PYTHONPATH alone. PEER_ARGS passes more flags (e.g. "--ferry-load-format auto"); the checkpoint
#                (~20 GB in $TMPDIR) is reused by a second call on the same warm machine                ~9 min
#   PART=peercuts a cut at 12 GiB beside FreeToken with the same slots: TTFT-2k and one stream (PEERCUTS_STREAMS=1,8
#                adds 8; peer_compare_<card>_<N>layers_<format>.json); PEER_CUTS=12layer (default) or hybrid8 (the
#                suite's bf16 cuts, their slots) or gptoss12 (gpt-oss-120b's first 12 layers in mxfp4, 512 of 1,536
#                slots, as openai publishes the experts) or glm12 (GLM-4.5-Air's first 12 layers in NVFP4, 469 of
#                1,408 slots) or hybrid8_q4km (Ferry's Q4_K_M-style GGUF of the hybrid cut
#                beside FreeToken's NVFP4 one, 640 slots: FreeToken 0.1.2 serves no Qwen GGUF), one a call:
#                a cut's checkpoint, Ferry's boot and FreeToken's (90-120 s, its graphs and warm-up) take ~5-6 min;
#                .peer as for PART=peer; PEERCUTS_BUDGET_S (default 540) bounds a cut, for a call with less time left
#   PART=long    the 262k-token TTFT (decode_suite's long_context_36b; LONG_VARIANTS picks its variants)  ~4-5 min a variant
#   PART=ttft    the 12-layer and hybrid cuts' served TTFT-2k phase by phase (bench/ttft_path.py), with the
#                arrival hold and without (TTFT_CUTS, TTFT_HOLDS: which cuts and holds, e.g. "12layer", "default";
#                TTFT_BACKENDS: expert backends, "default" for none given, e.g. "default gpu")
#                                                                                                        ~6 min
#   PART=profcut the hybrid cut's decode step at 640 slots, 12 GiB, 8 and 1 streams, profiled kernel by kernel with the
#                expert cache's counters (bench/profile_decode.py), the GPU alone, in each of PROFCUT_FORMATS (default
#                "gguf-q4_k_m nvfp4"; PROFCUT_FLAGS adds worker flags, e.g. --no-expert-prefetch),
#                profile_decode_hybrid8_<format>_<card>.json                                           ~1.5 min a format
#   PART=prefillcmp one 2k prefill of the hybrid8 NVFP4 cut (640 slots, 12 GiB) profiled at the tree and at BASE_COMMIT
#                (default 49d0524; its tree as for PART=suite), profile_prefill_hybrid8_nvfp4_<side>_<card>.json  ~3 min
#   PART=oracle  speculative decoding with an oracle draft at set acceptance rates (bench/speculation_oracle.py): each of
#                ORACLE_WORKLOADS (default hybrid8_resident_mtp) served with speculation off and at each of ORACLE_ALPHAS
#                (default 0,0.8) with ORACLE_METHOD (default mtp: the MTP layer runs for real); a boot (~45 s) and
#                its decodes per run, <workload>/spec_oracle_<workload>.json; ORACLE_PINNED=k[,k...] adds a run
#                an alpha with every drafting row given k (the bench's FERRY_BENCH_PINNED_DRAFTS); ORACLE_DRAFT_VOCAB=N
#                serves the speculative runs with --speculative-draft-vocab N; ORACLE_WORKLOAD_S
#                bounds a workload (default 90 s a run and 60)                                          ~1.5 min a run
#   PART=prof    the full-size 35B NVFP4's decode at 24 GiB profiled at 1 and 8 streams (bench/profile_decode.py),
#                then one 2k-token prefill of each cut (bench/profile_prefill.py)                      ~5 min
#
# CALL_BUDGET_S=N: a part starts only while its usual seconds (part_cost) still fit in the N seconds since this
# script began, so that a call of several parts returns its archive inside the device's 600 s (a call killed at its
# limit never writes it) rather than losing the part it was in.
#
#   OUT=out PART=check bash tools/device_run.sh
#   OUT=out PART=suite BASE_COMMIT=49d0524 bash tools/device_run.sh
#   OUT=out PART=peer PEER_ARGS="--ferry-load-format auto" bash tools/device_run.sh
#   OUT=out PART=peercuts bash tools/device_run.sh
#   OUT=out PART=ttft,prof CALL_BUDGET_S=560 bash tools/device_run.sh
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); PART=${PART:-check}
ROOT=$PWD
# the card, lower case, in the names of what a part measures on it (h100, h200): a plain call gets either
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
GPU=$(grep -oiE 'h[0-9]{3}' <<< "$CARD" | tr 'A-Z' 'a-z'); GPU=${GPU:-gpu}; echo "device: $CARD ($GPU)"
export PYTHONUNBUFFERED=1 TMPDIR=${TMPDIR:-/tmp}
# the carried wheels (the clients the serve steps need, the shared ones the device lacks), installed once a machine
if ls .whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUT/whl_install.log" 2>&1 \
    || echo "the .whl/ wheels did not install (whl_install.log)"
fi
export PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# the host's C expert kernel built in place in tree $1 (default this one), as `pip install` builds it (the tree sent
# here is not installed)
build_host_kernel() {
  local log=$OUT/host_kernel_build${1:+_$(basename "$1")}.log
  (cd "${1:-$ROOT}" && python3 -c "import sys; from setuptools import setup; sys.argv = ['setup.py', 'build_ext', '--inplace', '-q']; setup()") \
    > "$log" 2>&1 || echo "host kernel build failed in ${1:-$ROOT} (see $(basename "$log"))"
}
LONG_VARIANTS=${LONG_VARIANTS:-default}
PROFCUT_FORMATS=${PROFCUT_FORMATS:-gguf-q4_k_m nvfp4}
TTFT_CUTS=${TTFT_CUTS:-12layer hybrid8} TTFT_HOLDS=${TTFT_HOLDS:-default 0} TTFT_BACKENDS=${TTFT_BACKENDS:-default}
SUITE_WORKLOADS=${SUITE_WORKLOADS:-hybrid8,hybrid8_nvfp4,12layer}
n_variants() { local v=${1//[^,]/}; echo $(( ${#v} + 1 )); }
# PART=oracle's runs a workload besides speculation off: each alpha with the controller and with each pinned k
oracle_pinned=0; [ -n "${ORACLE_PINNED:-}" ] && oracle_pinned=$(n_variants "$ORACLE_PINNED")
oracle_runs=$(( $(n_variants "${ORACLE_ALPHAS:-0,0.8}") * (1 + oracle_pinned) ))
part_cost() {
  case "$1" in
    check) echo 420 ;;  # two test processes: ~410 s on a fresh machine, 200-220 s warm
    suite) echo 540 ;;  # six boots (~45 s each) and their 128-token decodes
    long) echo $(( 180 * $(n_variants "$LONG_VARIANTS") )) ;;  # ~165 s a variant, with two repeats of each decode
    peer) echo 570 ;;  # a 20 GB checkpoint written, two engines booted and measured (peer_compare's --budget-s 500)
    peercuts) echo 560 ;;  # a cut's checkpoint, served by both engines (--budget-s 540)
    prof) echo 330 ;;
    profcut) echo $(( 90 * $(n_variants "${PROFCUT_FORMATS// /,}") )) ;;  # a cut written, a boot, 24 steps a format
    oracle) echo $(( 90 * $(n_variants "${ORACLE_WORKLOADS:-hybrid8_resident_mtp}") * (oracle_runs + 1) )) ;;
    prefillcmp) echo 200 ;;  # a cut written, two boots (~45 s each) and their profiled prefills  # three boots (the full-size 35B ~100 s, each cut ~40 s) and their profiled steps
    ttft) echo $(( 90 * $(n_variants "${TTFT_CUTS// /,}") * $(n_variants "${TTFT_HOLDS// /,}") * $(n_variants "${TTFT_BACKENDS// /,}") )) ;;  # a boot (~45 s) and its prompts each
    *) echo 240 ;;
  esac
}
# PART=suite's base tree: a git worktree of BASE_COMMIT where the history is here, else the carried .cmp/suite_base
suite_base_tree() {
  local dir=/tmp/suite_base_$1
  if [ -d "$dir" ]; then echo "$dir"; return; fi
  if git cat-file -e "$1^{commit}" 2>/dev/null && git worktree add -f --detach "$dir" "$1" > "$OUT/suite_worktree.log" 2>&1; then
    echo "$dir"
  elif [ -d .cmp/suite_base ]; then
    cp -r .cmp/suite_base "$dir" && echo "$dir"
  fi
}
for part in ${PART//,/ }; do
if [ -n "${CALL_BUDGET_S:-}" ] && (( SECONDS + $(part_cost "$part") > CALL_BUDGET_S )); then
  echo "PART=$part skipped: ${SECONDS} s gone, it takes ~$(part_cost "$part") s of CALL_BUDGET_S=$CALL_BUDGET_S"; continue
fi
case "$part" in
  check)
    # straight into $OUT: what a run cut short wrote (gpu_tests.log, test by test) still comes back; under the call's
    # 600 s so that a hang still returns the logs so far
    timeout 570 make gpu-check OUT="$OUT" GPU_PYTHON=python3 GPU_CHECK_ARGS="--workers ${GPU_CHECK_WORKERS:-2}" \
      > "$OUT/gpu_check_stdout.log" 2>&1; echo "gpu-check rc=$?"
    tail -3 "$OUT/gpu_check_stdout.log" ;;
  suite)
    if [ -z "${BASE_COMMIT:-}" ]; then
      echo "PART=suite needs BASE_COMMIT, the commit to compare the tree against (e.g. BASE_COMMIT=49d0524)"; continue
    fi
    base=$(suite_base_tree "$BASE_COMMIT")
    if [ -z "$base" ]; then
      echo "PART=suite: no tree of $BASE_COMMIT: this copy has no git history and carries no .cmp/suite_base" \
        "(BASE_COMMIT=$BASE_COMMIT bash tools/device_wheels.sh makes it; carry [\".whl\", \".cmp\"])"; continue
    fi
    build_host_kernel; build_host_kernel "$base"
    for side in ${SUITE_SIDES:-tree base}; do
      dir=$([ $side = tree ] && echo "$ROOT" || echo "$base")
      commit=$([ $side = tree ] && echo "${FERRY_COMMIT:-}" || echo "$BASE_COMMIT")
      mkdir -p "$OUT/$side"
      # the base's own bench and package: its tree first on PYTHONPATH, its decode_suite run from its root
      (cd "$dir" && FERRY_COMMIT=$commit PYTHONPATH="$dir:/tmp/site" timeout "${SUITE_SIDE_S:-270}" python3 bench/decode_suite.py \
        --out "$OUT/$side" --workloads "$SUITE_WORKLOADS" --variants "${SUITE_VARIANT:-default}" --max-tokens 128 \
        > "$OUT/suite_$side.log" 2>&1)
      echo "suite $side ($dir) rc=$?"; tail -2 "$OUT/suite_$side.log"
    done
    python3 - "$OUT" "$SUITE_WORKLOADS" "${SUITE_VARIANT:-default}" <<'PY'  # both sides' figures, the tree's ratio to the base
import json, pathlib, sys
out, workloads, variant = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
keys = ("single_stream_tok_s", "streams8_tok_s", "ttft_2k_s")
def figures(side, w):
    f = out / side / (f"decode_{w}.json" if variant == "default" else f"decode_{w}_{variant}.json")
    return json.loads(f.read_text()) if f.exists() else {}
for w in workloads:
    tree, base = figures("tree", w), figures("base", w)
    print(f"{w}: tree {tree.get('commit', '?')} against base {base.get('commit', '?')}")
    for k in keys:
        t, b = tree.get(k), base.get(k)
        ratio = f"{t / b:.3f}x" if isinstance(t, (int, float)) and isinstance(b, (int, float)) and b else "n/a"
        print(f"  {k:22s} tree {t}  base {b}  tree/base {ratio}")
PY
    ;;
  prof)  # the full-size 35B NVFP4's decode at 24 GiB, its defaults, 1 and 8 streams, then one 2k prefill of each cut
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
  profcut)  # the hybrid cut's decode at 640 slots, 12 GiB, 8 and 1 streams, in each of PROFCUT_FORMATS, the GPU alone
    for fmt in $PROFCUT_FORMATS; do
      weights=$([[ $fmt == gguf-* ]] && echo "--weights random" || echo "")  # a GGUF file is its weights
      load=$([[ $fmt == gguf-* ]] && echo "" || echo "--load-format dummy")
      python3 -m ferry.services.cli make-bench-model "$TMPDIR/profcut_$fmt" --num-layers 8 --format "$fmt" $weights \
        --config tests/data/models/qwen3.6-35b-a3b/config.json > /dev/null
      timeout 150 python3 bench/profile_decode.py --model "$TMPDIR/profcut_$fmt" $load --moe-cache-size 640 \
        --gpu-memory 12GiB --max-running-requests 8 --streams 8,1 --steps 12 --expert-backend gpu ${PROFCUT_FLAGS:-} \
        --out "$OUT/profile_decode_hybrid8_${fmt}_$GPU.json" > "$OUT/profile_decode_hybrid8_$fmt.log" 2>&1
      echo "profile_decode hybrid8 $fmt rc=$?"
      grep -h 'ms/step\|expert cache per step\|device time per step' "$OUT/profile_decode_hybrid8_$fmt.log"
      grep -hE '^ +_[a-z0-9_]*(pair|copy)[a-z0-9_]*kernel ' "$OUT/profile_decode_hybrid8_$fmt.log" | awk '{print $1, $(NF-1), $NF}'
    done ;;
  prefillcmp)  # one 2k prefill of the hybrid8 NVFP4 cut profiled at the tree and at BASE_COMMIT, kernel by kernel
    base=$(suite_base_tree "${BASE_COMMIT:-49d0524}")
    build_host_kernel; [ -n "$base" ] && build_host_kernel "$base"
    python3 -m ferry.services.cli make-bench-model "$TMPDIR/prof_hybrid8_nvfp4" \
      --config tests/data/models/qwen3.6-35b-a3b/config.json --format nvfp4 --num-layers 8 > /dev/null
    for side in tree base; do
      dir=$([ $side = tree ] && echo "$ROOT" || echo "$base"); [ -n "$dir" ] || continue
      (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 150 python3 bench/profile_prefill.py \
        --model "$TMPDIR/prof_hybrid8_nvfp4" --load-format dummy --moe-cache-size 640 --gpu-memory 12GiB --max-running-requests 8 \
        --prompt-len 2000 --out "$OUT/profile_prefill_hybrid8_nvfp4_${side}_$GPU.json" \
        > "$OUT/profile_prefill_hybrid8_nvfp4_$side.log" 2>&1); echo "profile_prefill nvfp4 $side rc=$?"
      grep -h '"median_wall_s"\|"kernel_busy_ms"\|"copy_busy_ms"' "$OUT/profile_prefill_hybrid8_nvfp4_${side}_$GPU.json" 2>/dev/null
    done ;;
  ttft)  # the cuts' served TTFT-2k phase by phase, with the arrival hold (the default) and without it
    for cut in $TTFT_CUTS; do
      for hold in $TTFT_HOLDS; do
        for backend in $TTFT_BACKENDS; do
          flags=$([ $hold = 0 ] && echo "--prefill-coalesce-ms 0" || echo "")
          flags+=$([ $backend = default ] && echo "" || echo " --expert-backend $backend")
          tag=${cut}_hold-${hold}$([ $backend = default ] || echo "_backend-$backend")
          timeout 170 python3 bench/ttft_path.py --workload $cut --extra-flags "$flags" \
            --out "$OUT/ttft_path_${tag}_$GPU.json" > "$OUT/ttft_path_${tag}.log" 2>&1
          echo "ttft_path $tag rc=$?"; tail -3 "$OUT/ttft_path_${tag}.log"
        done
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
  peercuts)  # the decode suite's two cuts (bf16, 12 GiB, their slots) side by side with FreeToken: TTFT-2k, 1 stream
    if ! ls .peer/freetoken-*.whl > /dev/null 2>&1; then
      echo "PART=peercuts needs FreeToken's wheels in .peer/, carried (carry [\".whl\", \".peer\"])"
    else
      build_host_kernel
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/ft .peer/*.whl \
        > "$OUT/peer_install.log" 2>&1 || echo "FreeToken's wheels did not install (peer_install.log)"
      for cut in ${PEER_CUTS:-12layer}; do
        case "$cut" in  # config folder, layers, slots (a third of the cut's experts or the suite's), experts' format
          12layer) set -- qwen3-30b-a3b 12 512 bf16 ;;
          hybrid8) set -- qwen3.6-35b-a3b 8 640 bf16 ;;
          gptoss12) set -- gpt-oss-120b 12 512 mxfp4 ;;
          # GLM-4.5-Air's first 12 layers (1 dense, 11 MoE of 128 experts) in NVFP4, its dense MLP and shared experts
          # too (FreeToken 0.1.2 reads GLM no other way), a third of the experts in slots
          glm12) set -- glm-4.5-air 12 469 nvfp4 ;;
          # Ferry's Q4_K_M-style GGUF of the hybrid cut beside FreeToken's NVFP4 one (it serves no Qwen GGUF)
          hybrid8_q4km) set -- qwen3.6-35b-a3b 8 640 nvfp4 gguf-q4_k_m ;;
          *) echo "PEER_CUTS: $cut is not 12layer, hybrid8, gptoss12, glm12 or hybrid8_q4km"; continue ;;
        esac
        timeout $(( ${PEERCUTS_BUDGET_S:-540} + 20 )) python3 bench/peer_compare.py --out "$OUT" --freetoken-site /tmp/ft \
          --budget-s "${PEERCUTS_BUDGET_S:-540}" \
          --config "tests/data/models/$1/config.json" --num-layers "$2" --format "$4" --memory-line 12GiB \
          --streams "${PEERCUTS_STREAMS:-1}" --repeats 2 --ferry-args "--moe-cache-size $3 --max-running-requests 8" \
          --freetoken-args "--moe-cache-size $3" ${5:+--ferry-format "$5"} > "$OUT/peer_compare_$1_$2.log" 2>&1
        echo "peer $1 $2 rc=$?"; tail -6 "$OUT/peer_compare_$1_$2.log"
        rm -rf /tmp/peer_ckpt_"$4_$1_$2"layers*  # the disk holds one cut's checkpoints at a time
      done
    fi ;;
  oracle)  # speculation's decode tok/s at set acceptance rates against speculation off, one workload after another
    build_host_kernel
    workloads=${ORACLE_WORKLOADS:-hybrid8_resident_mtp} alphas=${ORACLE_ALPHAS:-0,0.8}
    for w in ${workloads//,/ }; do  # each in its own folder (its serve logs are named by alpha alone)
      timeout "${ORACLE_WORKLOAD_S:-$(( 90 * (oracle_runs + 1) + 60 ))}" python3 -m bench spec-oracle \
        --workload "$w" --alphas "$alphas" --speculative-method "${ORACLE_METHOD:-mtp}" --out "$OUT/$w" \
        --pinned-drafts "${ORACLE_PINNED:-}" --draft-vocab "${ORACLE_DRAFT_VOCAB:-0}" \
        --ready-timeout 240 > "$OUT/spec_oracle_$w.log" 2>&1
      echo "spec-oracle $w rc=$?"; grep -h 'oracle alpha' "$OUT/spec_oracle_$w.log"
    done ;;
  long)  # the 262k-token TTFT alone; LONG_VARIANTS=default,plain also runs it on plain bf16 banks
    timeout 560 python3 bench/decode_suite.py --out "$OUT" --workloads long_context_36b --variants "$LONG_VARIANTS" \
      --ready-timeout 240 --run-timeout 300 > "$OUT/long_context.log" 2>&1
    echo "long_context rc=$?"; tail -3 "$OUT/long_context.log"; grep -h 'ttft\|error\|Error' "$OUT"/serve_long*.log 2>/dev/null | tail -5 ;;
  *) echo "PART=$part is none of the parts this script's header lists (check, suite, peer, peercuts, long, ttft, prof, prefillcmp, oracle)" >&2; exit 2 ;;
esac
done
# the device returns a few files a call: one archive
NAME=${PART//,/_}; tar -czf "/tmp/${NAME:-check}_out.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/${NAME:-check}_out.tgz" "$OUT/"
