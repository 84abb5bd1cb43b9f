#!/usr/bin/env bash
# The NVIDIA backend's acceptance runs on a lent GPU machine, from the repository root, with the
# missing wheels in .whl (bash ../shared/gpu/wheels.sh, plus setuptools). Writes under $OUT.
#   bash plugins/nvidia/scripts/gpu_bench.sh conformance bench8b smollm   # any of the steps, in order
# PEER=none skips transformers; PEER_MODE=eager runs it eager at batch 1 too (default: its fastest mode). Steps: conformance (the op suite's matrix), bench8b (Llama-3.1-8B config, random bf16 weights,
# batch 1 and 64, against transformers), smollm (SmolLM2-135M config, batch 1), check (kernels,
# model against transformers, profile: gpu_check.py), profile (kernels of decode steps: PROFILES
# "model:batch ..." of the models bench8b/smollm made), serve (bench serve on a live server, engine in a
# process and in a thread, SERVE_MODES picks; then the offline run of the same batch), moecheck (MoE and MLA
# kernels, the five MoE/MLA architectures against transformers, their conformance rows), models (the other
# architectures' conformance configs, bf16 against transformers: models_check.py, MODELS names them), moe (full-size MoE configs
# with dummy weights, MOE_BENCH "config:batch ..."; PEER=hf compares transformers on its own random weights), quant
# (quantized linears' and methods' conformance rows, quant_check.py: in-situ fp8/int8/int4 and the fp8 KV cache on
# the Llama-3.1-8B config against bf16), quantbench (Llama-3.1-8B config, dummy weights, QUANT_BENCH "method:batch ..."
# with method bf16, fp8, int8 or int4; QUANT_TAG, a suffix to the runs' names, tells apart runs of other settings),
# emulate (the Hygon and MetaX backends in emulation, CHITU_EMULATE: their conformance suites in parts side by side,
# merged; EMULATED names them), emulatebench (their greedy tokens against
# this backend's: emulation_check.py; Llama-3.1-8B config, dummy weights, batch 1 and 64 on this backend and each),
# longctx (Qwen3-1.7B config, dummy bf16 weights, LONGCTX "batch:input:output ...": long contexts at small batch),
# breakdown (bench profile, a decode step by module: BREAKDOWN "config:batch[:input[:quant]] ...", dummy bf16 weights,
# quant fp8, int8 or int4 in situ; under
# CHITU_PDL=0, since a kernel launched dependent counts the wait it overlaps as its own time), prefillgraphs (contract
# 1.16's prefill graphs: greedy tokens with and without, one prefill step's time eager and replayed:
# prefill_graphs_check.py).
# PACK=1 leaves one archive, results.tgz, in $OUT instead of the files.
# Commit what $OUT holds under docs/benchmarks/<machine>/ and make the page from it:
#   python -m chitu_core.bench report docs/benchmarks/<machine> > docs/benchmarks/<machine>.md
set -uo pipefail
OUT=${OUT:-/tmp/chitu-out}
mkdir -p "$OUT" ~/bt ~/site
if [ ! -d ~/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --target ~/bt .whl/setuptools-*.whl
  python3 -m pip install -q --no-index --no-deps --target ~/site $(ls .whl/*.whl | grep -v setuptools)
fi
rm -rf ~/chitu
PYTHONPATH=~/bt python3 -m pip install -q --no-index --no-deps --no-build-isolation --target ~/chitu . ./models ./plugins/nvidia ./plugins/cpu \
  ./plugins/hygon ./plugins/muxi
export PYTHONPATH=~/chitu:~/site
ROOT=$(pwd)
cd /tmp

bench() {  # name, then bench offline arguments
  local name=$1; shift
  python3 -m chitu_core.bench offline --input-len 128 --output-len 256 --runs 3 --no-profile --peer ${PEER:-hf} \
    --peer-mode ${PEER_MODE:-fastest} "$@" \
    --json > "$OUT/$name.json" 2> "$OUT/$name.err" || tail -20 "$OUT/$name.err"
  python3 - "$OUT/$name.json" <<'EOF'
import json, sys
from chitu_core.bench.offline import render
print(render(json.load(open(sys.argv[1]))))
EOF
}

for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    conformance) python3 -m chitu_core.conformance --backend nvidia --format md --quiet > "$OUT/conformance.md"
                 tail -40 "$OUT/conformance.md" ;;
    bench8b) [ -d /tmp/llama8b ] || python3 -m chitu_core.bench random-model --like llama-3.1-8b --out /tmp/llama8b --init-device cuda
             bench llama8b-b1 --model /tmp/llama8b --batch-size 1
             bench llama8b-b64 --model /tmp/llama8b --batch-size 64 ;;
    smollm) [ -d /tmp/smollm ] || python3 -m chitu_core.bench random-model --like smollm2-135m --out /tmp/smollm --init-device cuda
            bench smollm-b1 --model /tmp/smollm --batch-size 1 ;;
    serve) [ -d /tmp/llama8b ] || python3 -m chitu_core.bench random-model --like llama-3.1-8b --out /tmp/llama8b --init-device cuda
           for mode in ${SERVE_MODES:-engine-process no-engine-process}; do
             python3 -m chitu_core.serve --model /tmp/llama8b --max-model-len 512 --max-num-seqs 64 --port 8391 \
               --log-level warning --$mode > "$OUT/serve-$mode.log" 2>&1 &
             pid=$!
             for _ in $(seq 180); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8391/health')" 2>/dev/null && break; sleep 1; done
             python3 -m chitu_core.bench serve --base-url http://127.0.0.1:8391 --model llama8b --concurrency 64 \
               --num-prompts 64 --input-len 128 --output-len 256 --warmup 65 --client-procs 8 --json > "$OUT/serve-$mode.json" || tail -20 "$OUT/serve-$mode.log"
             kill $pid; wait $pid
             python3 -c "import json,sys; x=json.load(open(sys.argv[1]))['results'][0]; print(sys.argv[2], {k: v for k, v in x.items() if not isinstance(v, (list, dict))})" "$OUT/serve-$mode.json" $mode
           done
           bench llama8b-b64-total --model /tmp/llama8b --batch-size 64 --peer none ;;
    prefillgraphs) [ -d /tmp/llama-3.1-8b ] || python3 -m chitu_core.bench random-model --like llama-3.1-8b --config-only --out /tmp/llama-3.1-8b > /dev/null
                   [ -d /tmp/tiny-mixtral ] || python3 -m chitu_core.bench random-model --like tiny-mixtral --out /tmp/tiny-mixtral --dtype float32 > /dev/null
                   python3 "$ROOT/plugins/nvidia/scripts/prefill_graphs_check.py" --model /tmp/llama-3.1-8b --mixtral /tmp/tiny-mixtral \
                     --out "$OUT/prefill_graphs_check.json" 2> "$OUT/prefill_graphs_check.err" || tail -20 "$OUT/prefill_graphs_check.err" ;;
    moecheck) for script in moe_check mla_check models_check; do
                OUT=$OUT python3 "$ROOT/plugins/nvidia/scripts/$script.py" || echo "$script failed: $?"
              done
              python3 -m chitu_core.conformance --backend nvidia --ops 'moe*,fused*,mla*' --dtypes bfloat16,float32 \
                --format md --quiet > "$OUT/conformance-moe.md"; tail -12 "$OUT/conformance-moe.md" ;;
    models) OUT=$OUT python3 "$ROOT/plugins/nvidia/scripts/models_check.py" \
              ${MODELS:-Gemma2ForCausalLM Gemma3ForCausalLM Phi3ForCausalLM Glm4ForCausalLM} || echo "models_check failed: $?" ;;
    moe) for spec in ${MOE_BENCH:-deepseek-v2-lite:1 deepseek-v2-lite:32 qwen3-30b-a3b:1 qwen3-30b-a3b:64 mixtral-8x7b:1 mixtral-8x7b:64}; do
           name=${spec%%:*}; b=${spec##*:}
           [ -d /tmp/$name ] || python3 -m chitu_core.bench random-model --like $name --config-only --out /tmp/$name
           bench $name-b$b --model /tmp/$name --batch-size $b --load-format dummy --dtype bfloat16
         done ;;
    emulate) emulated=${EMULATED:-hygon muxi}
             parts=("*norm*,rotary*,*_and_mul,linear,embedding,greedy_sample,apply_*,log_softmax,random_sample,sampler,all_gather,all_reduce,broadcast,reduce_scatter,send_recv"
                    "moe_route,fused_experts" "fused_experts_fp8" "fp8_linear,int8_linear" "int4_linear,gguf_linear" "quant*"
                    "attention/*/fp8-kv" "attention/*/softcap*,attention/*/window" "attention/triton-dcu,attention/triton-maca"
                    "mla_attention*" "model/[A-L]*" "model/[M-Z]*")
             for b in $emulated; do  # every case in exactly one part?
               CHITU_EMULATE=$b python3 - $b "${parts[@]}" <<'PY'
import fnmatch, sys
from chitu_core.conformance.runner import build_cases, load_target
cases = build_cases(load_target(sys.argv[1]))
hits = [sum(any(fnmatch.fnmatchcase(c.row, p) or fnmatch.fnmatchcase(c.op, p) for p in part.split(",")) for part in sys.argv[2:])
        for c in cases]
print(sys.argv[1], len(cases), "cases;", "in no part:", sorted({c.row for c, h in zip(cases, hits) if h == 0}) or "none",
      "in several:", sorted({c.row for c, h in zip(cases, hits) if h > 1}) or "none")
PY
             done
             for b in $emulated; do  # the suite in parts side by side (it takes minutes whole, mostly compiling), then merged;
               for i in "${!parts[@]}"; do  # two host threads a part: 24 processes of 16 threads each thrashed the 16 cores
                 OMP_NUM_THREADS=2 CHITU_EMULATE=$b timeout ${PART_TIMEOUT:-3000} python3 -m chitu_core.conformance --backend $b --ops "${parts[$i]}" --format json \
                   --output "$OUT/conformance-$b-part$(printf %02d $i).json" > /dev/null 2> "$OUT/conformance-$b-part$(printf %02d $i).err" &
               done
             done
             wait; date +%T
             for b in $emulated; do
               if [ $(ls "$OUT"/conformance-$b-part*.json 2>/dev/null | wc -l) != ${#parts[@]} ]; then
                 echo "$b: parts did not finish:"; for f in "$OUT"/conformance-$b-part*.err; do [ -f ${f%.err}.json ] || tail -2 $f; done
                 continue
               fi
               python3 -m chitu_core.conformance --merge "$OUT"/conformance-$b-part*.json --format md > "$OUT/conformance-$b.md"
               rm -f "$OUT"/conformance-$b-part*; tail -3 "$OUT/conformance-$b.md"
             done ;;
    emulatebench) OUT=$OUT python3 "$ROOT/plugins/nvidia/scripts/emulation_check.py" ${EMULATED:-hygon muxi} || echo "emulation_check failed: $?"
             [ -d /tmp/llama8b-config ] || python3 -m chitu_core.bench random-model --like llama-3.1-8b --config-only --out /tmp/llama8b-config
             for b in nvidia ${EMULATED:-hygon muxi}; do
               for n in 1 64; do
                 if [ $b = nvidia ]; then unset CHITU_EMULATE; else export CHITU_EMULATE=$b; fi
                 PEER=none bench $b-b$n --device $b --model /tmp/llama8b-config --load-format dummy --dtype bfloat16 --batch-size $n
               done
             done
             unset CHITU_EMULATE ;;
    longctx) [ -d /tmp/qwen3-1.7b ] || python3 -m chitu_core.bench random-model --like qwen3-1.7b --config-only --out /tmp/qwen3-1.7b
             for spec in ${LONGCTX:-4:8000:256 4:32000:256 128:448:128}; do  # batch:input:output, dummy bf16 weights
               IFS=: read -r b i o <<< "$spec"
               PEER=none bench qwen3-1.7b-b$b-i$i --model /tmp/qwen3-1.7b --load-format dummy --dtype bfloat16 \
                 --batch-size $b --input-len $i --output-len $o --warmup 1
             done ;;
    breakdown) for spec in ${BREAKDOWN:-smollm2-135m:1 llama-3.1-8b:1 llama-3.1-8b:64}; do  # config:batch[:input[:quant]]
               IFS=: read -r name b i q <<< "$spec"
               [ -d /tmp/$name-config ] || python3 -m chitu_core.bench random-model --like $name --config-only --out /tmp/$name-config
               f="$OUT/breakdown-$name${q:+-$q}-b$b"
               CHITU_PDL=0 python3 -m chitu_core.bench profile --model /tmp/$name-config --load-format dummy --dtype bfloat16 \
                 --batch-size $b --input-len ${i:-128} ${q:+--quantization $q} --json > "$f.json" 2> "$f.err" || tail -5 "$f.err"
             done ;;
    quant) python3 -m chitu_core.conformance --backend nvidia --ops '*_linear,quant/*' --dtypes bfloat16,float16,float32 \
             --format md --quiet > "$OUT/conformance-quant.md"; tail -14 "$OUT/conformance-quant.md"
           OUT=$OUT python3 "$ROOT/plugins/nvidia/scripts/quant_check.py" /tmp/llama8b-config || echo "quant_check failed: $?" ;;
    quantbench) [ -d /tmp/llama8b-config ] || python3 -m chitu_core.bench random-model --like llama-3.1-8b --config-only --out /tmp/llama8b-config
                for spec in ${QUANT_BENCH:-bf16:1 int4:1 fp8:1 int8:1 bf16:64 int4:64 fp8:64 int8:64}; do
                  q=${spec%%:*}; b=${spec##*:}
                  bench llama8b-$q-b$b${QUANT_TAG:-} --model /tmp/llama8b-config --batch-size $b --load-format dummy --dtype bfloat16 \
                    $([ $q = bf16 ] || echo --quantization $q)
                done ;;
    check) OUT=$OUT python3 "$ROOT/plugins/nvidia/scripts/gpu_check.py" environment build_model model_vs_transformers profile ;;
    profile) for spec in ${PROFILES:-smollm:1 llama8b:1 llama8b:64}; do  # model:batch, models made by the steps above
               python3 "$ROOT/plugins/nvidia/scripts/profile_step.py" --model /tmp/${spec%%:*} --batch-size ${spec##*:} \
                 --out "$OUT/profile-${spec%%:*}-b${spec##*:}.txt"
             done ;;
  esac
done
if [ "${PACK:-0}" = 1 ]; then  # one archive instead of the files: the device tool brings back only a few files
  (cd "$OUT" && tar czf /tmp/results.tgz . && find . -mindepth 1 -delete && mv /tmp/results.tgz .)
fi
