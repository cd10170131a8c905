#!/bin/sh
# Writes a model repository serving seed 000's model and seed 004's MLP
# through backend: python:  ./make_repository.sh REPO [KIND_CPU|KIND_GPU]
# MLP_DIMS (in,hidden,out; default the seed's 16384,16384,12800: 1.9 GiB of
# fp32 weights), WORKERS (default 4), HEARTH (the CLI; default hearth on PATH)
# and PYTHON (the workers' interpreter; default python3) change it.
set -eu
repo=${1:?usage: make_repository.sh REPO [KIND_CPU|KIND_GPU]}
kind=${2:-KIND_GPU}
dims=${MLP_DIMS:-16384,16384,12800}
workers=${WORKERS:-4}
hearth=${HEARTH:-hearth}
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
in=$(echo "$dims" | cut -d, -f1)
out=$(echo "$dims" | cut -d, -f3)

mkdir -p "$repo/scale/1" "$repo/mlp/1"
"$hearth" make-model scale --dims 500 --seed 0 --out "$repo/scale/1/model.safetensors"
cp "$here/scale_model.py" "$repo/scale/1/model.py"
cat > "$repo/scale/config.yaml" <<YAML
backend: python
max_batch_size: 64
input:
  - {name: x, data_type: TYPE_FP32, dims: [500]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
instance_group:
  - {count: $workers, kind: $kind}
dynamic_batching: {max_queue_delay_microseconds: 500}
parameters: {python: $python}
YAML

"$hearth" make-model mlp --dims "$dims" --seed 0 --out "$repo/mlp/1/model.safetensors"
cp "$here/mlp_model.py" "$repo/mlp/1/model.py"
cat > "$repo/mlp/config.yaml" <<YAML
backend: python
max_batch_size: 64
input:
  - {name: input, data_type: TYPE_FP32, dims: [$in]}
output:
  - {name: logits, data_type: TYPE_FP32, dims: [$out]}
  - {name: argmax, data_type: TYPE_INT64, dims: [1]}
instance_group:
  - {count: $workers, kind: $kind}
dynamic_batching: {max_queue_delay_microseconds: 500}
parameters: {python: $python}
YAML
echo "wrote $repo: hearth serve --model-repository $repo"
