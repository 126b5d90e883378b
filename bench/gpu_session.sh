#!/usr/bin/env bash
# One device call = one run of this script. Stages (any order, any subset):
#   tests     GPU kernel tests at real shapes + whole-model parity with transformers
#   profile   cProfile of the 1B offline run (host overhead per step)
#   micro     kernel micro timings (bench/studies/kernel_micro.py)
#   latency   batch-1 decode ms/token vs the bandwidth floor, both shapes
#   offline   the reference workload, both shapes, + the transformers peer (OFFLINE_ARGS to override)
#   serving   8B-shape server (random weights) + bench/serving.py at 16 req/s (SERVER_MODEL: another dummy dir,
#             e.g. llama-3-8b-gptq with DUMMY_VARIANTS=bf16,gptq; SERVER_ENV, RATE, NUM_PROMPTS, DATASET)
# Logs and JSON land in $OUT (default /tmp/gpu_out); a summary table prints last.
# Needs in carry: .whl (flask, gunicorn wheels: the GPU image has neither) and
# .bench_models/tokenizer (SmolLM2 tokenizer files for the dummy model dirs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
STAGES=${*:-tests latency offline serving}
MODELS=/tmp/open-lmi-bench-models
TOK=.bench_models/tokenizer
summary=()

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
python3 tests/support/dummy_model.py "$MODELS" "$TOK" "${DUMMY_VARIANTS:-bf16}" >/dev/null

for stage in $STAGES; do
  t0=$(date +%s)
  case $stage in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels >"$OUT/tests.log" 2>&1
      summary+=("tests: $(tail -1 "$OUT/tests.log")") ;;
    profile)
      timeout 120 python3 bench/studies/profile_offline.py --model-root "$MODELS" >"$OUT/profile.log" 2>&1
      summary+=("profile: $(head -1 "$OUT/profile.log")") ;;
    micro)
      timeout 120 python3 bench/studies/kernel_micro.py >"$OUT/micro.log" 2>&1
      summary+=("micro: see micro.log") ;;
    latency)
      timeout 300 python3 bench/latency.py --model-root "$MODELS" --tokenizer-dir "$TOK" ${LATENCY_ARGS:-} \
        --out "$OUT/latency.json" >"$OUT/latency.log" 2>&1
      summary+=("latency:" "$(grep -A3 '^shape' "$OUT/latency.log")") ;;
    offline)
      timeout ${OFFLINE_TIMEOUT:-480} python3 bench/offline.py --model-root "$MODELS" --tokenizer-dir "$TOK" \
        ${OFFLINE_ARGS:---peer} --out "$OUT/offline.json" >"$OUT/offline.log" 2>&1
      summary+=("offline:" "$(grep -A3 '^shape' "$OUT/offline.log")") ;;
    serving)
      for w in .whl/*.whl; do  # one at a time: a wheel built for another Python fails alone
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"; done \
        >"$OUT/pip.log" 2>&1
      export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
      t_start=$(date +%s.%N)
      # `env`: SERVER_ENV's words (VAR=value ...) are assignments only as env's arguments (an expanded
      # variable before a command is not an assignment to the shell)
      env HF_MODEL_ID=$MODELS/${SERVER_MODEL:-llama-3-8b} OPTION_LOAD_FORMAT=dummy OPTION_DTYPE=bf16 \
        OPTION_MAX_MODEL_LEN=4096 OPTION_MAX_ROLLING_BATCH_SIZE=256 SERVING_PORT=8080 ${SERVER_ENV:-} \
        setsid python3 container/serve serve >"$OUT/server.log" 2>&1 &
      spid=$!
      ok=0
      for _ in $(seq 1 120); do
        if [ "$(curl -s -o /dev/null -w '%{http_code}' localhost:8080/ping)" = 200 ]; then ok=1; break; fi
        kill -0 "$spid" 2>/dev/null || break  # the server exited: no point polling on
        sleep 2
      done
      if [ $ok = 1 ]; then
        summary+=("serving: ${SERVER_MODEL:-llama-3-8b} ${SERVER_ENV:-}: /ping 200 after $(python3 -c "import time; print(round(time.time() - $t_start, 1))") s (polled every 2 s)")
        timeout 200 python3 bench/serving.py --url http://127.0.0.1:8080 --rate ${RATE:-16} \
          --num-prompts ${NUM_PROMPTS:-320} --dataset ${DATASET:-synthetic} --out "$OUT/serving.json" \
          >"$OUT/serving.log" 2>&1
        summary+=("$(grep -A5 '^rate' "$OUT/serving.log")")
      else
        summary+=("serving: server never became ready (see server.log)")
      fi
      kill -- -"$spid" 2>/dev/null; sleep 1 ;;
  esac
  for f in tests latency offline serving server micro; do
    [ -f "$OUT/$f.log" ] && grep -q -E "Traceback|Error|FAILED" "$OUT/$f.log" && [ ! -f "$OUT/.$f.shown" ] && {
      touch "$OUT/.$f.shown"; summary+=("--- $f.log (errors; tail):" "$(grep -E -A2 'Error|FAILED' "$OUT/$f.log" | tail -25)"); }
  done
  summary+=("  [$stage took $(( $(date +%s) - t0 )) s]")
done
echo "================ summary ================"
cat "$OUT/device.txt"
printf '%s\n' "${summary[@]}"
