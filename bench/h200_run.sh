#!/usr/bin/env bash
# One device call: the CUDA tests, then bench/serve_decode.py for both published configs at
# --gpu-memory 24GiB. If the CUDA tests fail and a BASELINE tree is given (an earlier commit's
# files), the benchmarks run from that tree instead, so a kernel that only ran under the Triton
# interpreter cannot cost the measurements. Everything lands in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
root=$(pwd)
python3 -m pytest -q -p no:cacheprovider -x ${GPU_TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
tail -4 "$OUT/gpu_tests.log"
tree=$root
if [ $tests_rc -ne 0 ] && [ -n "${BASELINE:-}" ] && [ -d "$BASELINE" ]; then
  echo "CUDA tests failed: benchmarks run from $BASELINE"; tree=$root/$BASELINE
fi
cd "$tree"
for m in ${MODELS:-qwen3-30b-a3b qwen3.6-35b-a3b}; do
  timeout "${BENCH_TIMEOUT:-200}" env PYTHONPATH="${PYTHONPATH:-}:$tree" python3 bench/serve_decode.py \
    --model "$root/tests/data/models/$m" --gpu-memory 24GiB --out "$OUT/serve_decode_$m.json" ${BENCH_ARGS:-} \
    > "$OUT/serve_$m.log" 2>&1
  echo "$m rc=$?"; grep -v '^{"event\|^\[\|^20' "$OUT/serve_$m.log" | tail -6
done
