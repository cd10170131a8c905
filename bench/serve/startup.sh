#!/usr/bin/env bash
# Where a GPU worker's start-up time goes, with N workers starting at once.
#   bash bench/serve/startup.sh BUILD_DIR [WORKERS]
# Prints each worker's ready line (attach incl. context, backend, slot) and the total.
set -uo pipefail
BUILD=${1:-build-gpu}
N=${2:-24}
R=$(mktemp -d)
mkdir -p "$R/mlp/1"
"$BUILD/bin/hearth" make-model mlp --dims 1024,4096,1024 --seed 1 --out "$R/mlp/1/model.safetensors" >/dev/null
cat > "$R/mlp/config.yaml" <<YAML
backend: mlp
max_batch_size: 16
input:
  - {name: input, data_type: TYPE_FP32, dims: [1024]}
output:
  - {name: logits, data_type: TYPE_FP32, dims: [1024]}
  - {name: argmax, data_type: TYPE_INT64, dims: [1]}
YAML
for n in 1 "$N"; do
  "$BUILD/bin/hearth" serve --model-repository "$R" --workers "$n" --http-port 0 --device cuda > "$R/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q "ready on" "$R/serve.log" && break; sleep 0.1; done
  echo "== $n workers"
  grep -E "worker [0-9]+ ready|workers ready" "$R/serve.log" | sed 's/^.*\] //' | sort -t'(' -k2 | tail -$((n < 6 ? n + 1 : 7))
  kill $pid; wait $pid
done
rm -rf "$R"
