#!/usr/bin/env bash
# The embedded default (SmolLM2-135M-Instruct Q4_1 GGUF) on this machine's CPU against llama.cpp on the
# same file, threads and prompts, in the same runs; writes docs/benchmarks/cpu-smollm2/ and its page.
#   bash plugins/cpu/scripts/bench_embedded.sh [THREADS]
# Needs llama-cpp-python (pip install '.[bench-llamacpp]': it builds llama.cpp, about 14 minutes).
# Run it on a quiet machine: both sides swing by 10x when other processes hold a core. Ours runs in the
# dtype the server picks by default (--dtype auto: the file's float32 here), the dtype users get.
set -euo pipefail
cd "$(dirname "$0")/../../.."
THREADS=${1:-2}
PY=${PY:-.venv/bin/python}
OUT=docs/benchmarks/cpu-smollm2
mkdir -p "$OUT"
for B in 1 16; do
  $PY -m chitu_core.bench offline --device cpu --dtype auto --batch-size $B --input-len 128 --output-len 128 \
      --threads "$THREADS" --runs 3 --peer llama.cpp --peer-runs 3 --json > "$OUT/offline-b$B.json"
  $PY -m chitu_core.bench offline --device cpu --dtype auto --batch-size $B --input-len 128 --output-len 128 \
      --threads "$THREADS" --runs 3 --compile-forward --peer llama.cpp --peer-runs 3 --json > "$OUT/offline-b$B-compiled.json"
done
# The default server (python -m chitu_core.serve, nothing else set but the threads) under bench serve, with
# its peak resident memory: loading included, 1 then 16 concurrent streams of 128/128.
PORT=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
$PY -m chitu_core.serve --num-threads "$THREADS" --port "$PORT" --log-level warning &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
$PY - "$PORT" <<'WAIT'
import sys, time, urllib.request
for _ in range(600):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("the server did not come up in 5 minutes")
WAIT
$PY -m chitu_core.bench serve --base-url "http://127.0.0.1:$PORT" --model SmolLM2-135M-Instruct --concurrency 1,16 \
    --input-len 128 --output-len 128 --num-prompts 32 --warmup 4 --server-pid "$SERVER" --json > "$OUT/serve-default.json"
kill -INT "$SERVER"; wait "$SERVER" || true
trap - EXIT
$PY -m chitu_core.bench agree --threads "$THREADS" > "$OUT/agree.txt"
$PY -m chitu_core.bench agree --threads "$THREADS" --dtype float32 --unpacked > "$OUT/agree-unpacked.txt"  # the ceiling
echo "\`plugins/cpu/scripts/bench_embedded.sh $THREADS\` made them on this machine's CPU (named in each JSON)" > "$OUT/MADE_BY"
$PY -m chitu_core.bench report "$OUT" > docs/benchmarks/cpu-smollm2.md
echo "wrote docs/benchmarks/cpu-smollm2.md"
