#!/usr/bin/env bash
# Scale-out figures on one host of two GPUs (issue 19), from the repository root with the wheels in .whl:
#   bash plugins/nvidia/scripts/scaleout.sh [steps]    # default: every step, in this order
# Steps: allreduce (8 KB .. 2 MB latency, NCCL and the fast path), collectives (conformance rows on 2 ranks),
# tokens (TP2 and PP2 greedy tokens against one GPU, fp32, small config), tp (Llama-3.1-8B config bf16, dummy
# weights, in 128 / out 256, batches TP_BATCHES, default 1 and 64, on one GPU and on two), tp-composed (the TP2 runs with
# CHITU_FUSED_BOUNDARY=0), tp-boundary (TP2 at batch 1 with CHITU_FUSED_LINEAR_ALL_REDUCE=0: the layer boundary
# instead of the row-parallel products with their sums, contract 1.13), pp (the same,
# two stages, batch 64; and batch 128 on two stages and on one GPU),
# ep (DeepSeek-V2-Lite config, batch 64, one GPU and EP2 with TP2 attention), serve (bench serve, 64 streams,
# against a TP2 server started with torchrun, then the offline TP2 run of the same batch; SERVE_OFFLINE=0 skips that,
# SERVE_FLAGS adds server flags, SERVE_TAG suffixes the result's name), profile (decode step
# kernels of one GPU and TP2, profile_step.py, batches PROFILE_BATCHES), cpuexperts (one GPU:
# half the MoE layers' experts on the CPU). Every command has a time limit; results go to $OUT/scaleout.tar
# (JSON per run; python -m chitu_core.bench report renders them), rewritten after every run.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule: no multicast
OUT=${OUT:-/tmp/chitu-out}
ROOT=$(pwd)
bash plugins/nvidia/scripts/gpu_bench.sh > /dev/null 2>&1  # installs chitu and the wheels, runs no step
export PYTHONPATH=~/chitu:~/site
R=/tmp/scaleout; rm -rf $R; mkdir -p $R
cd /tmp
TR="torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29517"
BENCH="-m chitu_core.bench offline --input-len 128 --output-len 256 --runs 2 --warmup 1 --no-profile --peer none
       --load-format dummy --dtype bfloat16 --json"

limit() {  # seconds, name, command...: stdout to $R/name.json, stderr to $R/name.err. A run whose result is out
  # (a JSON line, a table row, tp_check's line) gets 20 s more to leave, then is killed: teardown can hang.
  local s=$1 name=$2 t=0 done_at=""; shift 2
  "$@" > "$R/$name.json" 2> "$R/$name.err" &
  local pid=$!
  while kill -0 $pid 2> /dev/null; do
    sleep 2; t=$((t + 2))
    [ -z "$done_at" ] && grep -qE '^\{.*\}$|^\| [0-9]|^TP ' "$R/$name.json" 2> /dev/null && done_at=$t
    if [ $t -ge $s ] || { [ -n "$done_at" ] && [ $((t - done_at)) -ge 20 ]; }; then
      [ -n "$done_at" ] || { echo "!! $name: no result in ${s}s"; grep -v -i warn "$R/$name.err" | tail -4; }
      pkill -9 -P $pid 2> /dev/null; kill -9 $pid 2> /dev/null; break
    fi
  done
  wait $pid 2> /dev/null
  tar -cf "$OUT/scaleout.tar" -C $R .  # after every run: a call cut short still returns what finished
  pkill -9 -f "[-]m chitu_core" 2> /dev/null; pkill -9 -f "[t]orchrun" 2> /dev/null
  pkill -9 -f "scripts/[a-z_]*(check|bench)\.py" 2> /dev/null; sleep 1
}
model() { [ -d /tmp/$1 ] || python3 -m chitu_core.bench random-model --like $1 --config-only --out /tmp/$1 > /dev/null; }

for step in ${@:-allreduce collectives tokens tp pp ep serve cpuexperts}; do
  echo "=== $step $(date +%T)"
  case $step in
    allreduce) limit 120 allreduce $TR "$ROOT/plugins/nvidia/scripts/allreduce_bench.py" --out $R/allreduce-table.json
               tail -14 $R/allreduce.json
               grep -qE "^\| 1 \| .* \| True \| True \|" $R/allreduce.json || { export CHITU_FUSED_BOUNDARY=0; echo "one-kernel boundary off"; }
               # A fast path that failed its check (or hung) is left off for the runs after it.
               grep -q "| 8192 | .* | True | True |" $R/allreduce.json || { export CHITU_FAST_ALL_REDUCE=0; echo "fast all-reduce off"; } ;;
    collectives) limit 240 collectives python3 -m chitu_core.conformance --backend nvidia \
                   --ops 'all_reduce,all_gather,reduce_scatter,broadcast,send_recv,all_reduce_add_rms_norm,linear_all_reduce_add' --format md --quiet
                 grep -E "cases:|^\| \`" $R/collectives.json | cut -c1-120 | head -9 ;;
    tokens) for m in tiny tiny-mixtral; do
              [ -d /tmp/$m ] || python3 -m chitu_core.bench random-model --like $m --out /tmp/$m --dtype float32 > /dev/null
            done
            limit 120 tokens-tp1 python3 "$ROOT/plugins/nvidia/scripts/tp_check.py" /tmp/tiny
            limit 150 tokens-tp2 $TR "$ROOT/plugins/nvidia/scripts/tp_check.py" /tmp/tiny
            CHITU_PIPELINE_PARALLEL_SIZE=2 limit 150 tokens-pp2 $TR "$ROOT/plugins/nvidia/scripts/tp_check.py" /tmp/tiny
            limit 120 tokens-ep1 python3 "$ROOT/plugins/nvidia/scripts/tp_check.py" /tmp/tiny-mixtral
            CHITU_ENABLE_EXPERT_PARALLEL=true limit 150 tokens-ep2 $TR "$ROOT/plugins/nvidia/scripts/tp_check.py" /tmp/tiny-mixtral
            python3 - $R <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
def tokens(name):
    line = next((l for l in (r / f"{name}.json").read_text().splitlines() if l.startswith("TP ")), None)
    return None if line is None else json.loads(line[line.index("["):])
checks = {k: tokens(a) is not None and tokens(a) == tokens(b) for k, a, b in
          (("tp2 == tp1", "tokens-tp2", "tokens-tp1"), ("pp2 == tp1", "tokens-pp2", "tokens-tp1"),
           ("ep2 == ep1", "tokens-ep2", "tokens-ep1"))}
(r / "tokens.json").write_text(json.dumps(checks))
print("fp32 greedy tokens equal:", checks)
PY
            ;;
    tp) model llama-3.1-8b
        for b in ${TP_BATCHES:-1 64}; do
          limit 240 tp1-b$b python3 $BENCH --model /tmp/llama-3.1-8b --batch-size $b
          limit 240 tp2-b$b $TR $BENCH --model /tmp/llama-3.1-8b --batch-size $b --tensor-parallel-size 2
        done ;;
    tp-boundary) model llama-3.1-8b
        CHITU_FUSED_LINEAR_ALL_REDUCE=0 limit 240 tp2-boundary-b1 $TR $BENCH --model /tmp/llama-3.1-8b --batch-size 1 \
          --tensor-parallel-size 2 ;;
    tp-composed) model llama-3.1-8b  # the TP2 runs with the layer boundary composed, not in one kernel
        for b in 1 64; do
          CHITU_FUSED_BOUNDARY=0 limit 240 tp2-composed-b$b $TR $BENCH --model /tmp/llama-3.1-8b --batch-size $b --tensor-parallel-size 2
        done ;;
    pp) model llama-3.1-8b
        [ -s $R/tp1-b64.json ] || limit 240 tp1-b64 python3 $BENCH --model /tmp/llama-3.1-8b --batch-size 64
        limit 240 pp2-b64 $TR $BENCH --model /tmp/llama-3.1-8b --batch-size 64 --pipeline-parallel-size 2
        # The stages' freed memory holds twice the batch: 128 sequences, two groups of 64, against one GPU at 128.
        limit 240 pp2-b128 $TR $BENCH --model /tmp/llama-3.1-8b --batch-size 128 --pipeline-parallel-size 2
        limit 240 tp1-b128 python3 $BENCH --model /tmp/llama-3.1-8b --batch-size 128 ;;
    profile) model llama-3.1-8b  # where a decode step's time goes, one GPU and TP2, batch 1 and 64
        for b in ${PROFILE_BATCHES:-1 64}; do
          limit 200 profile-tp1-b$b python3 "$ROOT/plugins/nvidia/scripts/profile_step.py" --model /tmp/llama-3.1-8b \
            --load-format dummy --batch-size $b --rows 24 --out $R/profile-tp1-b$b.txt
          limit 200 profile-tp2-b$b $TR "$ROOT/plugins/nvidia/scripts/profile_step.py" --model /tmp/llama-3.1-8b \
            --load-format dummy --batch-size $b --rows 24 --tensor-parallel-size 2 --out $R/profile-tp2-b$b.txt
          tail -30 $R/profile-tp2-b$b.json
        done ;;
    ep) model deepseek-v2-lite
        limit 300 ep1-dsv2-b64 python3 $BENCH --model /tmp/deepseek-v2-lite --batch-size 64
        limit 300 ep2-dsv2-b64 $TR $BENCH --model /tmp/deepseek-v2-lite --batch-size 64 --enable-expert-parallel ;;
    serve) model llama-3.1-8b  # SERVE_FLAGS: more server flags; SERVE_TAG: a suffix to the result's name
           $TR -m chitu_core.serve --model /tmp/llama-3.1-8b --load-format dummy --dtype bfloat16 --max-model-len 512 \
             --max-num-seqs 64 --port 8391 --log-level warning --served-model-name llama-3.1-8b ${SERVE_FLAGS:-} \
             > $R/serve-tp2${SERVE_TAG:-}.log 2>&1 &
           for _ in $(seq 240); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8391/health')" 2>/dev/null && break; sleep 1; done
           limit 240 serve-tp2${SERVE_TAG:-} python3 -m chitu_core.bench serve --base-url http://127.0.0.1:8391 --model llama-3.1-8b \
             --concurrency 64 --num-prompts 64 --input-len 128 --output-len 256 --warmup 65 --client-procs 8 --json
           python3 -c "import json,sys; x=json.load(open(sys.argv[1]))['results'][0]; print('serve', {k: v for k, v in x.items() if not isinstance(v, (list, dict))})" $R/serve-tp2${SERVE_TAG:-}.json
           [ "${SERVE_OFFLINE:-1}" = 0 ] || limit 240 tp2-b64-total $TR $BENCH --model /tmp/llama-3.1-8b --batch-size 64 --tensor-parallel-size 2 ;;
    cpuexperts) limit 400 cpu_experts_check python3 "$ROOT/plugins/nvidia/scripts/cpu_experts_check.py" --out $R/cpu_experts.json
                tail -12 $R/cpu_experts_check.json ;;
  esac
done
python3 - $R <<'PY'
import json, pathlib, sys
rows = []
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        r = json.loads(p.read_text().strip().splitlines()[-1])
    except Exception:
        continue
    if isinstance(r, dict) and "floor" in r:
        rows.append(f"{p.stem:16} B={r['batch_size']:<3} {r['decode_tok_per_s'] or 0:9.1f} tok/s  floor {r['floor']['decode_tok_per_s']:9.1f}  {100 * r.get('floor_fraction', 0):5.1f}%")
print("\n".join(rows))
PY
tar -cf "$OUT/scaleout.tar" -C $R .
