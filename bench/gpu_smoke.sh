#!/usr/bin/env bash
# One device call's worth of GPU checks: the CUDA tests, then Qwen3-30B-A3B at full size with
# dummy weights and every expert resident through `ferry generate`. Logs land in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-}:. PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1; tail -8 "$OUT/gpu_tests.log"
for model in ${GENERATE_MODELS-qwen3-30b-a3b}; do
  /usr/bin/time -v python3 -m ferry.services.cli generate --model tests/data/models/$model --load-format dummy \
    --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 32 --ignore-eos --max-model-len 4096 --json \
    > "$OUT/generate_$model.json" 2> "$OUT/generate_$model.err"
  echo "generate $model rc=$?"; tail -5 "$OUT/generate_$model.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('token_ids','finish_reason')}); print(json.dumps(d['plan'])[:600])" "$OUT/generate_$model.json"
done
