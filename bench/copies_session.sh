#!/usr/bin/env bash
# Model copies, HTTP frontends and overload through the real server (issue 24), one device call.
# 8B shape, random bf16 weights, ShareGPT-like streaming LMI load from bench/serving.py (/ping probed
# every 0.1 s). Servers, each fresh. The issue's checks, on a 4-GPU machine (about 6 minutes):
#   one      1 copy (SERVING_MAX_WORKERS=1): saturated, 64 req/s x 768
#   four     4 copies of TP=1 (engine cores + frontends=auto: 4 HTTP processes): 256 req/s x 3,072
#   tp2      2 copies of TP=2: 128 req/s x 1,536
#   over     1 copy offered ~4x its capacity: 192 req/s x 2,304 (/ping max, 503s, lost)
# Earlier stages (runs 22-23, 2 GPUs): two noaff threads profile onefull twomp.
# Needs in carry: .whl (flask, gunicorn, werkzeug, itsdangerous, blinker, click, prometheus-client
# wheels) and .bench_models/tokenizer. Logs and JSON land in $OUT; a summary and one table print last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/copies_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=${*:-one four tp2 over}
PROCS=${PROCS:-8}  # client processes (4 copies stream ~30k JSON lines/s)
MODELS=/tmp/open-lmi-bench-models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for w in .whl/*.whl; do  # one at a time: a wheel built for another Python fails alone
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"; done \
  >"$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 tests/support/dummy_model.py "$MODELS" .bench_models/tokenizer >/dev/null
summary=()
rows=()  # label|load arguments, for the table
PORT=8080

start_server() {  # name, env assignments...: start, wait for /ping 200, record the start-up time
  local name=$1; shift
  local t0; t0=$(date +%s%N)
  env HF_MODEL_ID=$MODELS/llama-3-8b OPTION_LOAD_FORMAT=dummy OPTION_DTYPE=bf16 OPTION_MAX_MODEL_LEN=4096 \
    OPTION_MAX_ROLLING_BATCH_SIZE=256 TENSOR_PARALLEL_DEGREE=1 SAGEMAKER_BIND_TO_PORT=$PORT "$@" \
    setsid python3 container/serve serve >"$OUT/server_$name.log" 2>&1 &
  SPID=$!
  for _ in $(seq 1 150); do
    if [ "$(curl -s -o /dev/null -m 2 -w '%{http_code}' localhost:$PORT/ping)" = 200 ]; then
      summary+=("$name: /ping 200 after $(( ($(date +%s%N) - t0) / 1000000 )) ms ($*)")
      return 0
    fi
    kill -0 $SPID 2>/dev/null || break
    sleep 1
  done
  summary+=("$name: never ready (exit $(wait $SPID; echo $?)); tail: $(tail -3 "$OUT/server_$name.log")")
  return 1
}

stop_server() {
  kill -TERM -- -"$SPID" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$SPID" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$SPID" 2>/dev/null
  sleep 2
  summary+=("  left after stop: $(pgrep -fc 'serving.server.wsgi|multiprocessing.spawn' || true) processes")
}

load() {  # label, bench/serving.py args...
  local label=$1; shift
  python3 bench/proc_cpu.py --after 8 --interval 5 >"$OUT/$label.cpu" 2>&1 &
  local cpid=$!
  timeout 150 python3 bench/serving.py --url http://127.0.0.1:$PORT --dataset synthetic --procs "$PROCS" \
    --ping-interval 0.1 --out "$OUT/$label.json" "$@" >"$OUT/$label.log" 2>&1
  wait "$cpid"
  rows+=("$label|$*")
  summary+=("  $label ($*):" "$(grep -E '^rate|^ttft|^tpot|^shed|^/ping' "$OUT/$label.log" | sed 's/^/    /')"
            "    CPU over 5 s of the load:" "$(head -6 "$OUT/$label.cpu" | sed 's/^/    /')")
}

for stage in $STAGES; do
  case $stage in
    one)
      start_server one SERVING_MAX_WORKERS=1 && {
        load one_sat --rate 64 --num-prompts 768
        load one_over --rate 160 --num-prompts 2400 --seed 1
        curl -s localhost:$PORT/metrics | grep -E '^lmi_requests_total' >"$OUT/one_metrics.txt"
      }
      stop_server ;;
    two)
      start_server two SERVING_MAX_WORKERS=2 && {
        load two_sat --rate 128 --num-prompts 1536
        load two_prefix --rate 48 --num-prompts 576 --seed 2 --prefix-words 600 --num-prefixes 16
        curl -s localhost:$PORT/metrics | grep -E '^lmi_copy|^lmi_prefix' >"$OUT/two_metrics.txt"
        summary+=("  $(tr '\n' ' ' <"$OUT/two_metrics.txt")")
      }
      stop_server ;;
    noaff)
      start_server noaff SERVING_MAX_WORKERS=2 OPTION_PREFIX_AFFINITY=false && {
        load noaff_sat --rate 128 --num-prompts 1536
        load noaff_prefix --rate 48 --num-prompts 576 --seed 2 --prefix-words 600 --num-prefixes 16
      }
      stop_server ;;
    profile)  # where the HTTP process's time goes with 2 copies saturated: py-spy, GIL holders only
      start_server profile SERVING_MAX_WORKERS=2 && {
        load profile_sat --rate 128 --num-prompts 1536 &
        lpid=$!
        sleep 10
        worker=$(pgrep -P "$SPID" -f 'serving.server.wsgi' | head -1)  # serve exec'd gunicorn: SPID is the arbiter
        core=$(pgrep -P "$SPID" -f 'multiprocessing.spawn' | head -1)  # the engine cores are the arbiter's children
        summary+=("  profiled: arbiter $SPID, worker $worker, engine core $core")
        timeout 30 py-spy record --gil --nonblocking --duration 10 --rate 200 --format raw -o "$OUT/prof_http.txt" \
          --pid "$worker" >"$OUT/pyspy.log" 2>&1 &
        timeout 30 py-spy record --nonblocking --duration 10 --rate 200 --format raw -o "$OUT/prof_http_all.txt" \
          --pid "$worker" >>"$OUT/pyspy.log" 2>&1 &
        timeout 30 py-spy record --gil --nonblocking --duration 10 --rate 200 --format raw -o "$OUT/prof_core.txt" \
          --pid "$core" >>"$OUT/pyspy.log" 2>&1
        wait $lpid
        sleep 2
        for f in prof_http prof_http_all prof_core; do
          [ -f "$OUT/$f.txt" ] && summary+=("  $f: top self frames" "$(python3 - "$OUT/$f.txt" <<'PY'
import collections, sys
own, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); total += n
    own[stack.split(";")[-1][:110]] += n
print(f"    {total} samples")
for frame, n in own.most_common(14):
    print(f"    {100*n/total:5.1f}% {frame}")
PY
)")
        done
        summary+=("  py-spy: $(tail -2 "$OUT/pyspy.log" | tr '\n' ' ')")
      }
      stop_server ;;
    onefull)  # one copy offered the two-copy load: the saturated baseline at the same offered rate
      start_server onefull SERVING_MAX_WORKERS=1 && load onefull_sat --rate 128 --num-prompts 1536
      stop_server ;;
    twomp)  # two engine processes, each with its model's host work in a worker process of its own
      start_server twomp SERVING_MAX_WORKERS=2 OPTION_DISTRIBUTED_EXECUTOR_BACKEND=mp && \
        load twomp_sat --rate 128 --num-prompts 1536
      stop_server ;;
    four)  # 4 copies of TP=1: engine cores, one HTTP frontend per copy (frontends=auto)
      start_server four SERVING_MAX_WORKERS=4 && {
        load four_sat --rate 256 --num-prompts 3072
        curl -s localhost:$PORT/metrics | grep -E '^lmi_copy' | tr '\n' ' ' >"$OUT/four_metrics.txt"
        summary+=("  $(cat "$OUT/four_metrics.txt")" "  frontends: $(pgrep -P "$SPID" -f 'serving.server.wsgi' | wc -l)")
      }
      stop_server ;;
    tp2)  # 2 copies of 2 ranks each
      start_server tp2 SERVING_MAX_WORKERS=2 TENSOR_PARALLEL_DEGREE=2 && load tp2_sat --rate 128 --num-prompts 1536
      stop_server ;;
    over)  # 1 copy (~45 req/s of capacity at these lengths: run 22) offered ~4x that
      start_server over SERVING_MAX_WORKERS=1 && load over_4x --rate 192 --num-prompts 2304 --seed 1
      stop_server ;;
    fourpre)  # 4 copies, a shared-prefix workload (16 system prompts of 600 words), prefix affinity on then off
      start_server fouraff SERVING_MAX_WORKERS=4 && {
        load fouraff_prefix --rate 96 --num-prompts 1152 --seed 2 --prefix-words 600 --num-prefixes 16
        curl -s localhost:$PORT/metrics | grep -E '^lmi_copy|^lmi_prefix' | tr '\n' ' ' >"$OUT/fouraff_metrics.txt"
        summary+=("  $(cat "$OUT/fouraff_metrics.txt")")
      }
      stop_server
      start_server fournoaff SERVING_MAX_WORKERS=4 OPTION_PREFIX_AFFINITY=false && \
        load fournoaff_prefix --rate 96 --num-prompts 1152 --seed 2 --prefix-words 600 --num-prefixes 16
      stop_server ;;
    threads)
      start_server threads SERVING_MAX_WORKERS=2 OPTION_ENGINE_PROCESS=false && load threads_sat --rate 128 --num-prompts 1536
      stop_server ;;
  esac
done
echo "================ summary ================"
cat "$OUT/device.txt"
printf '%s\n' "${summary[@]}"
echo "================ table ================"
printf '%s\n' "${rows[@]}" >"$OUT/rows.txt"  # (the script itself comes on stdin: the rows go by file)
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = (out / "rows.txt").read_text()
print("| load | offered | served | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | 503 | lost | /ping max ms |")
print("|---|---|---|---|---|---|---|---|---|")
tok = {}
for line in rows.splitlines():
    label, _, args = line.partition("|")
    path = out / f"{label}.json"
    if not path.exists():
        print(f"| {label} | {args} | (no result) | | | | | | |")
        continue
    s = json.loads(path.read_text())
    tok[label] = s["output_throughput_tok_s"]
    ping = s.get("ping", {}).get("max_ms", float("nan"))
    print(f"| {label} | {s['rate']:g} req/s x {s['num_prompts']:,} | {s['completed']:,} | {s['output_throughput_tok_s']:,.0f} | "
          f"{s['ttft_ms']['p50']:,.0f} / {s['ttft_ms']['p99']:,.0f} | {s['tpot_ms']['p50']:.1f} | {s['refused_503']} | "
          f"{s['lost']} | {ping:,.0f} |")
if "one_sat" in tok and "four_sat" in tok:
    print(f"4 copies / 1 copy output tok/s: {tok['four_sat'] / tok['one_sat']:.2f}x (bar: >= 3.5x)")
if "one_sat" in tok and "tp2_sat" in tok:
    print(f"2 copies of TP=2 / 1 copy output tok/s: {tok['tp2_sat'] / tok['one_sat']:.2f}x")
PY
# A device call brings back at most 8 files: every log and JSON of the run travel in one archive.
(cd "$OUT" && tar czf /tmp/copies_all.tgz --exclude copies_all.tgz . && find . -type f -delete && mv /tmp/copies_all.tgz .)
