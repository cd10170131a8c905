#!/usr/bin/env bash
# The GPU check: run on the H200 machine from the repository root.
#   bash bench/gpu-check.sh
# Builds for sm_90 (+PTX), runs every test (the CUDA ones run for real there),
# runs the benchmarks beside their baselines in the same run, and prints a
# short table last. Logs go to $OUT (or ./gpu-out).
#
# Needs, carried into the tree: .deps/root/usr/include/xxhash.h (Debian's
# libxxhash-dev, unpacked), .gpu/baselines/*.py (copies of
# ../shared/baselines), .gpu/pyroot (flask, gunicorn, requests) and
# .gpu/webroot (fastapi, uvicorn), Debian's packages unpacked with dpkg -x,
# and, for the gRPC front-end, .gpu/grpc (grpc++, protobuf, protoc and
# grpc_cpp_plugin: -DHEARTH_GRPC_ROOT). bench/gpu-deps.sh makes them all.
#
# SECTIONS picks what runs after the build (default: all of them):
#   host-tests cuda-tests foundation serve-tests serve python llm pybackend aoti generate protocol restart coldstart multigpu gemm tokenizer-fixtures llm-step llm-prefetch llm-twice startup suite
# (GEN_BACKEND=llm runs the generate section on backend: llm instead of the Python example.)
# (multigpu runs only where nvidia-smi lists 2 GPUs or more.)
# (The serve-tests section runs tests/serve's files SERVE_JOBS at a time, 4
# by default, each bounded by SERVE_TIMEOUT, default 500 s; SERVE_PART=1 or 2
# runs only the first or second half of the files. Each test's result is
# logged as it ends, so a file cut short still names its failures.)
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS=${SECTIONS:-"host-tests cuda-tests foundation serve-tests serve python llm pybackend aoti generate protocol restart coldstart multigpu gemm llm-step startup suite"}
want() { case " $SECTIONS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-gpu}
JOBS=$(nproc)
DATE=$(date -u +%Y-%m-%dT%H:%MZ)

{
  echo "date: $DATE"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -2
  g++ --version | head -1
} > "$OUT/machine.txt" 2>&1
# Keep the number of files under $OUT small: the device tool brings back at most 8.
cat "$OUT/machine.txt"

echo "== build"
# With .gpu/grpc carried, gRPC is required (a build without it fails rather
# than leave the gRPC numbers out); the binaries find its libraries through
# their RPATH, so nothing below sets LD_LIBRARY_PATH.
GRPC_FLAGS=()
[ -d .gpu/grpc ] && GRPC_FLAGS=(-DHEARTH_GRPC=ON -DHEARTH_GRPC_ROOT="$PWD/.gpu/grpc")
if ! { cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DHEARTH_CUDA=ON \
        -DHEARTH_CUDA_ARCHITECTURES="90-real;90-virtual" \
        -DHEARTH_XXHASH_INCLUDE_DIR="$PWD/.deps/root/usr/include" -DHEARTH_SIMDJSON_ROOT="$PWD/.deps/simdjson/usr" \
        -DHEARTH_TEXT_DEPS_ROOT="$PWD/.deps/text" \
        "${GRPC_FLAGS[@]}" &&
      cmake --build "$BUILD" -j "$JOBS"; } > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
# The slowest build steps of this run, for whoever wants a shorter build there.
awk -F'\t' 'NR > 1 { print ($2 - $1) / 1000 " s " $4 }' "$BUILD/.ninja_log" | sort -rn | head -12 \
  | sed 's/^/slowest step: /' >> "$OUT/build.log"

host_rc=-; cuda_rc=-; serve_rc=-; py_rc=-; gunicorn_rc=-; suite_rc=-; pyb_rc=-; llm_rc=-; aoti_rc=-; gen_rc=-; multi_rc=-
if want host-tests; then
  echo "== host tests"
  (cd "$BUILD" && ctest -E 'Cuda' -j 8 --timeout 600 --output-on-failure) > "$OUT/ctest-host.log" 2>&1
  host_rc=$?
  grep -E "tests passed|Failed|SKIPPED|Skipped" "$OUT/ctest-host.log" | tail -5
fi
if want cuda-tests; then
  echo "== CUDA tests, one at a time (they measure device memory)"
  (cd "$BUILD" && ctest -R 'Cuda' -j 1 --timeout 600 --output-on-failure -V) > "$OUT/ctest-cuda.log" 2>&1
  cuda_rc=$?
  grep -E "tests passed|\*\*\*Failed|context .* MiB" "$OUT/ctest-cuda.log" | tail -12
fi
if want serve-tests; then
  echo "== hearth serve test suite with the models on the GPU"
  mapfile -t serve_files < <(ls tests/serve/test_*.py)
  half=$(( (${#serve_files[@]} + 1) / 2 ))
  case ${SERVE_PART:-all} in
    1) serve_files=("${serve_files[@]:0:$half}") ;;
    2) serve_files=("${serve_files[@]:$half}") ;;
  esac
  [ ${#serve_files[@]} -gt 0 ] || { echo "SERVE_PART=${SERVE_PART:-}: no files" >&2; exit 2; }
  # One pytest per file, SERVE_JOBS at once (as `make test` runs them under
  # ctest -j: every file starts its own servers on ports of its own), each
  # bounded by SERVE_TIMEOUT; their logs are joined in file order.
  serve_logs=$(mktemp -d)
  printf '%s\n' "${serve_files[@]}" | HEARTH_TEST_DEVICE=cuda HEARTH_TEST_LOG_DIR=$OUT \
    HEARTH_CLI=$PWD/$BUILD/bin/hearth LOGS=$serve_logs T=${SERVE_TIMEOUT:-500} \
    xargs -P "${SERVE_JOBS:-4}" -I{} sh -c 'f={}; n=$(basename "$f" .py); s=$(date +%s);
      timeout "$T" python3 -m pytest -v -rfEs --tb=short --durations=5 "$f" -p no:cacheprovider \
        > "$LOGS/$n.log" 2>&1; rc=$?; echo "== $f: exit $rc after $(( $(date +%s) - s )) s" >> "$LOGS/$n.log"'
  # pytest exits 5 when a file's tests were all skipped at collection (the
  # gRPC files without grpc_tools): that file is skipped, not failed.
  serve_rc=0
  for f in "${serve_files[@]}"; do
    log=$serve_logs/$(basename "$f" .py).log
    cat "$log"
    tail -1 "$log" | grep -q ": exit 0 after" && continue
    tail -1 "$log" | grep -q ": exit 5 after" && grep -q "collected 0 items / [0-9]* skipped" "$log" && continue
    serve_rc=1
  done > "$OUT/pytest-serve-cuda.log" 2>&1
  rm -rf "$serve_logs"
  grep -E "(FAILED|ERROR)( |$)|^== .*: exit" "$OUT/pytest-serve-cuda.log" | grep -v ": exit [05] after" | head -30
  grep -c ": exit 0 after" "$OUT/pytest-serve-cuda.log" | sed 's/$/ files passed/'
  grep -B3 ": exit 5 after" "$OUT/pytest-serve-cuda.log" | grep -E "^SKIPPED|: exit 5" | head -8
  grep -E "^== .*: exit" "$OUT/pytest-serve-cuda.log" | sort -t' ' -k6 -n -r | head -5
fi
if want serve; then
  echo "== hearth serve on the GPU beside the torch.multiprocessing baseline"
  timeout 200 python3 bench/serve/serve_bench.py --build "$BUILD" --baseline .gpu/baselines/torch_ipc_workers.py \
    --out "$OUT" --seconds 5 > "$OUT/serve-bench.log" 2>&1
  serve_rc=$?
  tail -8 "$OUT/serve-bench.log"
fi
if want python; then
  echo "== Python package against a CUDA store"
  PYROOT=$PWD/.gpu/pyroot/usr/lib/python3/dist-packages
  HEARTH_TEST_DEVICE=cuda:0 HEARTH_CLI=$PWD/$BUILD/bin/hearth HEARTH_LIBRARY=$PWD/$BUILD/src/capi/libhearth.so \
    HEARTH_TEST_LOG_DIR=$OUT PYTHONPATH=$PWD/python:$PYROOT timeout 560 python3 -m pytest -q -rs tests/python -p no:cacheprovider \
    > "$OUT/pytest-cuda.log" 2>&1
  py_rc=$?
  tail -15 "$OUT/pytest-cuda.log"
  PYTHONPATH=$PYROOT timeout 130 python3 bench/python/gunicorn_gpu.py --cli "$BUILD/bin/hearth" --workers 8 \
    > "$OUT/gunicorn-gpu.log" 2>&1
  gunicorn_rc=$?
  tail -20 "$OUT/gunicorn-gpu.log"
fi
if want llm; then
  echo "== examples/llm_uvicorn on a Llama checkpoint in a CUDA store"
  # fastapi and uvicorn: Debian's (pure Python) unpacked into .gpu/webroot.
  PYROOT=$PWD/.gpu/pyroot/usr/lib/python3/dist-packages
  WEBROOT=$PWD/.gpu/webroot/usr/lib/python3/dist-packages
  HEARTH_TEST_DEVICE=cuda:0 HEARTH_CLI=$PWD/$BUILD/bin/hearth HEARTH_LIBRARY=$PWD/$BUILD/src/capi/libhearth.so \
    HEARTH_TEST_LOG_DIR=$OUT PYTHONPATH=$PWD/python:$PYROOT:$WEBROOT timeout 300 python3 -m pytest -q -rs \
    tests/python/test_llm_uvicorn.py -p no:cacheprovider > "$OUT/pytest-llm-uvicorn.log" 2>&1
  llm_rc=$?
  tail -8 "$OUT/pytest-llm-uvicorn.log"
fi
if want pybackend; then
  echo "== backend: python beside the built-in mlp backend and the torch.multiprocessing baseline"
  timeout 400 python3 bench/serve/python_backend_bench.py --build "$BUILD" --baseline .gpu/baselines/torch_ipc_workers.py \
    --out "$OUT" --seconds 5 > "$OUT/pybackend-bench.log" 2>&1
  pyb_rc=$?
  tail -12 "$OUT/pybackend-bench.log"
fi
if want aoti; then
  echo "== backend: aoti: the seed's MLP exported with a dynamic batch, beside the built-in mlp backend"
  PYTHONUNBUFFERED=1 timeout 590 python3 bench/serve/aoti_bench.py --build "$BUILD" --out "$OUT" --seconds 5 \
    > "$OUT/aoti-bench.log" 2>&1
  aoti_rc=$?
  grep -E "^(exported|aoti|builtin|baseline|resnet50)" "$OUT/aoti-bench.log" | cut -c1-600
fi
if want generate; then
  # GEN_BACKEND: python (the Llama example) or llm (backend: llm, native);
  # GEN_WORKERS, GEN_STREAMS: hearth's worker counts and concurrent streams; GEN_MAX_STREAMS: the
  # config's max_streams (0: unset); GEN_CB: prompt counts for transformers' generate_batch (empty:
  # skipped); GEN_BASELINE_WORKERS: the uvicorn baseline (0: skipped); GEN_CHAOS_SECONDS: 64 streams
  # while worker 0 is SIGKILLed every 5 s (0: skipped); GEN_DTYPE: the checkpoint's dtype (bfloat16);
  # GEN_GEMM: backend: llm's gemm_engine (timed, cublaslt or hearth; unset: left out);
  # GEN_CHAOS_HOT_SPARES: hot spares of the chaos run's model (0: none); GEN_SHAPE: 1b or 8b
  # (Llama 3 8B's shape); GEN_PROMPT_TOKENS: each prompt padded to that many tokens (0: short).
  GEN_WORKERS=${GEN_WORKERS:-1,2}; GEN_STREAMS=${GEN_STREAMS:-1,16,64,256}
  echo "== text generation: a ${GEN_SHAPE:-1b} Llama, hearth ($GEN_WORKERS workers on one copy, $GEN_STREAMS streams) beside generate_batch, uvicorn workers with a copy each, and a chaos run"
  WEBROOT=$PWD/.gpu/webroot/usr/lib/python3/dist-packages
  PYTHONUNBUFFERED=1 timeout ${GEN_TIMEOUT:-590} python3 bench/serve/generate_bench.py --build "$BUILD" --out "$OUT" \
    --backend ${GEN_BACKEND:-python} --webroot "$WEBROOT" --seconds ${GEN_SECONDS:-10} --workers "$GEN_WORKERS" --streams "$GEN_STREAMS" \
    --max-streams ${GEN_MAX_STREAMS:-256} --continuous-batching "${GEN_CB-16,64,256}" \
    --baseline-workers ${GEN_BASELINE_WORKERS:-4} --chaos-seconds ${GEN_CHAOS_SECONDS:-60} \
    --dtype ${GEN_DTYPE:-bfloat16} ${GEN_GEMM:+--gemm-engine "$GEN_GEMM"} --json "$OUT/generate.json" \
    --chaos-hot-spares ${GEN_CHAOS_HOT_SPARES:-0} --shape ${GEN_SHAPE:-1b} --prompt-tokens ${GEN_PROMPT_TOKENS:-0} \
    > "$OUT/generate-bench.log" 2>&1
  gen_rc=$?
  grep -E "^(checkpoint|prompts|###|\||  )" "$OUT/generate-bench.log" | cut -c1-400
fi
if want protocol; then
  echo "== the protocol: hearth bench over REST (and gRPC where built), with and without system shared memory"
  timeout 200 python3 bench/serve/protocol_bench.py --build "$BUILD" --device cuda --seconds 3 --out "$OUT" \
    > "$OUT/protocol.log" 2>&1
  tail -14 "$OUT/protocol.log"
fi
if want restart; then
  echo "== SIGKILL to a serving replacement: exec'd, cold standby, forked from the zygote, hot spare"
  timeout 560 python3 bench/serve/restart_bench.py --build "$BUILD" --device cuda --models ${RESTART_MODELS:-tiny,llama,scale} \
    --modes ${RESTART_MODES:-exec,standby,zygote,hot} --kills 3 > "$OUT/restart.log" 2>&1
  cut -c1-700 "$OUT/restart.log"
fi
if want coldstart; then
  echo "== 24 Python workers of the seed's MLP from a cold start, beside 24 CUDA contexts made at once"
  timeout 560 python3 bench/serve/cold_start_bench.py --build "$BUILD" --device cuda --workers 24 \
    > "$OUT/cold-start.log" 2>&1
  cut -c1-700 "$OUT/cold-start.log"
fi
if want multigpu; then
  gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  if [ "$gpus" -ge 2 ]; then
    echo "== one model on 2 GPUs against 1: load time, device memory per GPU, merged-batch throughput"
    HEARTH_TEST_DEVICE=cuda HEARTH_TEST_LOG_DIR=$OUT HEARTH_CLI=$PWD/$BUILD/bin/hearth timeout 300 python3 -m pytest -q -rs \
      tests/serve/test_multigpu.py -p no:cacheprovider > "$OUT/pytest-multigpu.log" 2>&1
    tail -4 "$OUT/pytest-multigpu.log"
    PYTHONUNBUFFERED=1 timeout 500 python3 bench/serve/multigpu_bench.py --build "$BUILD" --out "$OUT" \
      --workers-per-gpu 4 --seconds 8 > "$OUT/multigpu-bench.log" 2>&1
    multi_rc=$?
    grep -v "^{" "$OUT/multigpu-bench.log" | tail -14
  else
    echo "== multigpu: skipped, nvidia-smi lists $gpus GPU(s)"
  fi
fi
if want gemm; then
  echo "== the mlp forward by batch size: cuBLASLt, the skinny kernel, PyTorch (baseline)"
  timeout 300 "$BUILD/bench/gemm/gemm_bench" --iterations 30 > "$OUT/gemm.log" 2>&1
  timeout 200 python3 bench/gemm/torch_mlp.py --iterations 30 >> "$OUT/gemm.log" 2>&1
  grep -E "^(forward|torch)" "$OUT/gemm.log" | grep -E "rows=(1|16|32|64) " 
  grep -E "^kernel" "$OUT/gemm.log" | grep -E "rows=(1|16|32) "
fi
if want tokenizer-fixtures; then
  echo "== backend llm's tokenizer fixtures from the Python tokenizers package (commit them into tests/data/llm/tokenizers)"
  timeout 120 python3 tests/data/llm/make_tokenizer_fixtures.py --out "$OUT/fixtures" > "$OUT/fixtures.log" 2>&1
  tail -3 "$OUT/fixtures.log"
fi
if want llm-step; then
  echo "== the CUDA llm executor: a decode step of the 1B and 8B Llama shapes by batch size, each kernel at one sequence"
  timeout 400 "$BUILD/bench/llm/llm_step_bench" --iterations 30 --profile-seqs 1 --pairing on --gemm compare > "$OUT/llm-step.log" 2>&1
  timeout 300 "$BUILD/bench/llm/llm_step_bench" --shape 8b --iterations 20 --seqs 1,16,64 --profile-seqs 1 \
    >> "$OUT/llm-step.log" 2>&1
  grep -E "^(pairing|prefill|decode|kernel)" "$OUT/llm-step.log"
fi
if want llm-prefetch; then
  echo "== L2 prefetch of o_proj's and gate/up's weights from the attention: decode steps, off against the default and 16 sequences, each three times in turn, 1B and 8B"
  P=0,default,16:24
  timeout 300 "$BUILD/bench/llm/llm_step_bench" --iterations 50 --context 192 --seqs 1,2,4,16 --profile-seqs 0 \
    --pairing on --gemm own --l2-prefetch $P,$P,$P > "$OUT/llm-prefetch.log" 2>&1
  timeout 200 "$BUILD/bench/llm/llm_step_bench" --shape 8b --iterations 20 --context 192 --seqs 1,16 \
    --profile-seqs 0 --pairing on --gemm own --l2-prefetch 0,default,0,default >> "$OUT/llm-prefetch.log" 2>&1
  grep -E "^decode " "$OUT/llm-prefetch.log" | sed -E 's/ weight_floor_ms.*//; s/pairing=on gemm=own dependent=on fuse=on fold=1 //'
fi
if want llm-twice; then
  echo "== each kernel's cost in the graphed 1B decode step (context 64, 1 and 16 sequences): its launches run twice, the step's time less the plain step's"
  timeout 300 "$BUILD/bench/llm/llm_step_bench" --iterations 50 --context 64 --seqs 1,16 --profile-seqs 0 \
    --pairing on --gemm own --twice "embed;rmsnorm;gemm q_proj + k/v;attention + rope + kv write;gemm o_proj;gemm gate_proj+up_proj + swiglu;gemm down_proj;final rmsnorm;gemm lm_head;sampling" \
    > "$OUT/llm-twice.log" 2>&1
  grep -E "^decode |llm_step_bench:" "$OUT/llm-twice.log" \
    | sed -E 's/ weight_floor_ms.*//; s/pairing=on gemm=own dependent=on fuse=on fold=1 prefetch=[^ ]* //'
fi
if want suite; then
  echo "== throughput and resilience suite beside the torch.multiprocessing baseline"
  timeout 500 python3 bench/serve/suite.py --build "$BUILD" --baseline .gpu/baselines/torch_ipc_workers.py \
    --out "$OUT" --seconds 5 > "$OUT/suite.log" 2>&1
  suite_rc=$?
  grep -v "^{" "$OUT/suite.log" | tail -16
fi
if want startup; then
  echo "== start-up of N GPU processes at once"
  R=$(mktemp -d)
  "$BUILD/bin/hearth" make-model mlp --dims 1024,4096,1024 --seed 1 --out "$R/m.safetensors" > /dev/null
  "$BUILD/bin/hearth" store --socket "$R/s.sock" --device cuda:0 --model m="$R/m.safetensors" > "$OUT/startup-store.log" 2>&1 &
  spid=$!
  for _ in $(seq 300); do grep -q ready "$OUT/startup-store.log" && break; sleep 0.1; done
  {
    echo "# default context"; "$BUILD/bench/attach/context_startup" --processes 1,8,24 --socket "$R/s.sock" --model m
    echo "# HEARTH_CUDA_STACK_SIZE=256"
    HEARTH_CUDA_STACK_SIZE=256 "$BUILD/bench/attach/context_startup" --processes 1,8,24 --socket "$R/s.sock" --model m
    echo "# HEARTH_CUDA_STACK_SIZE=256 CUDA_DEVICE_MAX_CONNECTIONS=1"
    HEARTH_CUDA_STACK_SIZE=256 CUDA_DEVICE_MAX_CONNECTIONS=1 "$BUILD/bench/attach/context_startup" --processes 1,24
  } > "$OUT/startup.log" 2>&1
  kill $spid; wait $spid
  bash bench/serve/startup.sh "$BUILD" 24 >> "$OUT/startup.log" 2>&1
  cat "$OUT/startup.log"
  rm -rf "$R"
fi
if ! want foundation; then
  echo "== summary: host tests $host_rc, CUDA tests $cuda_rc, serve bench $serve_rc, python CUDA $py_rc, gunicorn $gunicorn_rc, suite $suite_rc, python backend $pyb_rc, llm example $llm_rc, aoti bench $aoti_rc, generate bench $gen_rc, multigpu bench $multi_rc"
  (cd "$OUT" && tar czf logs.tar.gz --remove-files ./*.log ./*.txt 2>/dev/null)
  exit 0
fi

echo "== benchmarks"
B=$BUILD/bench
BIN=$BUILD/bin/hearth
# Baseline first: it writes /tmp/w.safetensors (2 GiB, 8 x 8192 x 8192 F32), which hearth then loads too.
python3 .gpu/baselines/st_load.py > "$OUT/st_load.log" 2>&1
cat "$OUT/st_load.log"
base_gbps=$(grep -o '= [0-9.]* GB/s' "$OUT/st_load.log" | awk '{print $2}' | sort -g | tail -1)
"$B/load/load_bench" --file /tmp/w.safetensors --device cuda:0 --repeat 5 > "$OUT/load-cuda.log" 2>&1
cat "$OUT/load-cuda.log"
for t in 4 6 10 12; do "$B/load/load_bench" --file /tmp/w.safetensors --device cuda:0 --threads $t --repeat 3 | tail -1; done >> "$OUT/load-cuda-threads.log" 2>&1
cat "$OUT/load-cuda-threads.log"
for t in 4 8 16; do "$B/load/load_bench" --file /tmp/w.safetensors --read-only --threads $t; done > "$OUT/read-only.log" 2>&1
cat "$OUT/read-only.log"
"$B/load/load_bench" --file /tmp/w.safetensors --device cpu --repeat 3 > "$OUT/load-cpu.log" 2>&1
cat "$OUT/load-cpu.log"
cuda_gbps=$(awk -F= '/best_gbps/ {print $NF}' "$OUT/load-cuda.log")
cpu_gbps=$(awk -F= '/best_gbps/ {print $NF}' "$OUT/load-cpu.log")

SOCK=/tmp/hearth-bench/store.sock
"$BIN" store --socket $SOCK --device cuda:0 --model w=/tmp/w.safetensors > "$OUT/store-cuda.log" 2>&1 &
store_pid=$!
for _ in $(seq 300); do grep -q ready "$OUT/store-cuda.log" && break; sleep 0.1; done
"$B/attach/attach_bench" --socket $SOCK --model w --iterations 200 > "$OUT/attach-cuda.log" 2>&1
"$B/attach/attach_bench" --socket $SOCK --model w --context-memory >> "$OUT/attach-cuda.log" 2>&1
cat "$OUT/attach-cuda.log"
kill $store_pid; wait $store_pid
HSOCK=/tmp/hearth-bench/host.sock
"$BIN" store --socket $HSOCK --device cpu --model w=/tmp/w.safetensors > "$OUT/store-cpu.log" 2>&1 &
hstore_pid=$!
for _ in $(seq 300); do grep -q ready "$OUT/store-cpu.log" && break; sleep 0.1; done
"$B/attach/attach_bench" --socket $HSOCK --model w --iterations 1000 > "$OUT/attach-cpu.log" 2>&1
cat "$OUT/attach-cpu.log"
kill $hstore_pid; wait $hstore_pid

{
echo
echo "== summary ($DATE, $(head -2 "$OUT/machine.txt" | tail -1))"
printf '%-44s %s\n' "tests, host (ctest exit)" "$host_rc" "tests, CUDA (ctest exit)" "$cuda_rc"
printf '%-44s %s\n' "load 2 GiB -> cuda:0, hearth (GB/s)" "$cuda_gbps"
printf '%-44s %s\n' "load 2 GiB -> cuda:0, safetensors (GB/s)" "$base_gbps"
printf '%-44s %s\n' "ratio hearth / safetensors" "$(awk -v a="$cuda_gbps" -v b="$base_gbps" 'BEGIN{if(b>0) printf "%.2f", a/b}')"
printf '%-44s %s\n' "load 2 GiB -> host memfd, hearth (GB/s)" "$cpu_gbps"
printf '%-44s %s\n' "attach+map, cuda (p50/p99 us)" "$(awk '/^attach/ {print $4"/"$6}' "$OUT/attach-cuda.log")"
printf '%-44s %s\n' "attach+map, host (p50/p99 us)" "$(awk '/^attach/ {print $4"/"$6}' "$OUT/attach-cpu.log")"
printf '%-44s %s\n' "client context MiB (bare/trimmed/+attach)" "$(awk '/^context_mib/ {print $2" "$3" "$4}' "$OUT/attach-cuda.log")"
} | tee "$OUT/summary.md"
(cd "$OUT" && tar czf logs.tar.gz --remove-files ./*.log ./*.txt 2>/dev/null)
[ "$host_rc" = 0 ] && [ "$cuda_rc" = 0 ]
