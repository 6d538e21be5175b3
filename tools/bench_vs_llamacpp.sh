#!/bin/bash
# tokenmill serving the default model vs llama.cpp's llama-server on the same GGUF, one server after the
# other on this machine: tools/bench_serving.py at C = 1, 4, 16 in flight (2C requests each, 144-token
# prompts, 96 output tokens, each pass's prompts new to both), after one discarded warm-up pass; a table
# of the medians at the end.
#
#   LLAMA_SERVER=/path/to/llama-server tools/bench_vs_llamacpp.sh [OUTDIR]
#   SYSTEMS="tokenmill eager llamacpp" CS="1 4 16 64" ...   (eager: tokenmill --enforce-eager)
#   LLAMA_ARGS=--no-repack ...   (more llama-server flags: on the AMX Xeon of 2026-12-06 this build's AMX
#                                  path, taken for repacked weights, died of SIGSEGV in its first matmul)
#
# llama-server without a network: `pip download --no-binary :all: llama-cpp-python`, then in its
# vendor/llama.cpp: cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build -t llama-server
cd "$(dirname "$0")/.."
GGUF=$(.venv/bin/python -c "from engine.model_path import default_model_path as d; print(d())")
LS=${LLAMA_SERVER:-llama-server}
T=${THREADS:-$(nproc)}  # llama.cpp threads; tokenmill uses torch's default, one per core
OUT=${1:-/tmp/bench_vs_llamacpp}; mkdir -p $OUT
CS=${CS:-"1 4 16"}
wait_up() { for i in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/$2" >/dev/null && return 0; sleep 0.5; done; return 1; }
# name port C seed: each pass its own prompts (--seed), so no prompt finds itself in either server's prompt
# cache (with one seed for all, the warm-up's prompts came back as C=1's and C=4's first: a cached TTFT)
bench() {
  .venv/bin/python tools/bench_serving.py --base-url http://127.0.0.1:$2/v1 --num-prompts $((2*$3)) \
    --max-concurrency $3 --input-len 144 --output-len 96 --tokenizer "$GGUF" --quiet --seed $4 \
    --save-json $OUT/$1_c$3.json > $OUT/$1_c$3.txt 2>&1
}
for sys in ${SYSTEMS:-tokenmill llamacpp}; do
  if [ $sys = tokenmill ]; then
    .venv/bin/tokenmill serve --port 8100 --max-num-seqs 64 > $OUT/tokenmill_server.log 2>&1 & PID=$!; PORT=8100; H=health
  elif [ $sys = eager ]; then
    .venv/bin/tokenmill serve --port 8100 --max-num-seqs 64 --enforce-eager > $OUT/eager_server.log 2>&1 & PID=$!; PORT=8100; H=health
  else
    $LS -m "$GGUF" -t $T -tb $T -c 16384 -np 16 --port 8101 $LLAMA_ARGS > $OUT/llamacpp_server.log 2>&1 & PID=$!; PORT=8101; H=health
  fi
  wait_up $PORT $H || { echo "$sys did not come up"; kill $PID; continue; }
  bench $sys $PORT 1 1000 >/dev/null  # warm up (discarded, overwritten below)
  for c in $CS; do bench $sys $PORT $c $c; done
  kill -INT $PID; wait $PID 2>/dev/null
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys, glob
out = sys.argv[1]
print(f"{'system':10} {'C':>3} {'out tok/s':>10} {'TTFT med ms':>12} {'ITL med ms':>11} {'TPOT med ms':>12}")
for sysname in ("tokenmill", "eager", "llamacpp"):
    for c in sorted(int(p.rsplit("_c", 1)[1][:-5]) for p in glob.glob(f"{out}/{sysname}_c*.json")):
        p = f"{out}/{sysname}_c{c}.json"
        s = json.load(open(p))
        print(f"{sysname:10} {c:>3} {s['output_throughput']:>10.1f} {s['ttft_ms']['median']:>12.1f} {s['itl_ms']['median']:>11.1f} {s['tpot_ms']['median']:>12.1f}")
PY
