#!/usr/bin/env bash
# The hearth command end to end: make-model, inspect FILE, store, inspect
# --socket (the two checksums must match), list, status, load, unload, and
# clear errors for bad arguments.
set -euo pipefail
BIN=$1
DIR=$(mktemp -d)
trap 'kill $store 2>/dev/null || true; rm -rf "$DIR"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$BIN" make-model mlp --dims 16,32,8 --dtype bf16 --seed 3 --out "$DIR/m.safetensors" >/dev/null
"$BIN" make-model scale --dims 500 --seed 1 --out "$DIR/s.safetensors" >/dev/null
file_sum=$("$BIN" inspect "$DIR/m.safetensors" | awk '/^checksum:/ {print $2}')
[ ${#file_sum} -eq 16 ] || fail "no checksum from inspect FILE"
"$BIN" inspect "$DIR/m.safetensors" | grep -q "encoder.weight *BF16 *\[32,16\]" || fail "tensor table"

"$BIN" store --socket "$DIR/s.sock" --device cpu --model "m=$DIR/m.safetensors" > "$DIR/store.log" 2>&1 &
store=$!
for _ in $(seq 100); do grep -q ready "$DIR/store.log" && break; sleep 0.1; done
grep -q ready "$DIR/store.log" || fail "store not ready: $(cat "$DIR/store.log")"

out=$("$BIN" inspect --socket "$DIR/s.sock" --model m --verify)
echo "$out" | grep -q "checksum: $file_sum" || fail "attached checksum differs from the file's: $out"
echo "$out" | grep -q "checksum ok" || fail "verify failed"
"$BIN" load --socket "$DIR/s.sock" "m=$DIR/s.safetensors" | grep -q "loaded m@2" || fail "load"
"$BIN" list --socket "$DIR/s.sock" | grep -cE "^m +[12] " | grep -q 2 || fail "list shows both versions"
"$BIN" inspect --socket "$DIR/s.sock" --model m@1 --verify | grep -q "checksum ok" || fail "m@1"
"$BIN" unload --socket "$DIR/s.sock" m@1 | grep -q "unloaded 1" || fail "unload"
"$BIN" status --socket "$DIR/s.sock" | grep -q "m@2" || fail "status"

# Bad input: clear errors, non-zero exit, the store keeps serving.
err=$("$BIN" inspect --socket "$DIR/s.sock" --model nope 2>&1) && fail "unknown model accepted"
echo "$err" | grep -q "no model 'nope'" || fail "unknown model error: $err"
err=$("$BIN" make-model mlp --dims 1,2 --out "$DIR/x" 2>&1) && fail "bad dims accepted"
echo "$err" | grep -q "IN,HIDDEN,OUT" || fail "bad dims error: $err"
err=$("$BIN" store --socket "$DIR/t.sock" --model "x=$DIR/missing" 2>&1) && fail "missing file accepted"
echo "$err" | grep -q "missing" || fail "missing checkpoint error: $err"
err=$("$BIN" store --socket "$DIR/t.sock" --device tpu 2>&1) && fail "bad device accepted"
echo "$err" | grep -q "tpu" || fail "bad device error: $err"
"$BIN" --help | grep -q "make-model" || fail "--help"
err=$("$BIN" store --socket "$DIR/s.sock" --device cpu 2>&1) && fail "second store on a live socket"
echo "$err" | grep -q "another store is serving at $DIR/s.sock" || fail "second store error: $err"
err=$(HEARTH_STORE_UID=12,x "$BIN" list --socket "$DIR/s.sock" 2>&1) && fail "bad HEARTH_STORE_UID accepted"
echo "$err" | grep -q "HEARTH_STORE_UID='12,x'" || fail "bad HEARTH_STORE_UID error: $err"
HEARTH_STORE_UID=12 "$BIN" list --socket "$DIR/s.sock" --store-uid 13 | grep -q "^m " \
  || fail "trusting more uids must not stop a store of our own"
for cmd in inspect list status load unload; do
  "$BIN" "$cmd" --help | grep -q -- "--store-uid" || fail "$cmd --help lacks --store-uid"
done
"$BIN" inspect --help | tr -s ' \n' ' ' | grep -q "peer check" || fail "inspect --help: what --verify proves"
"$BIN" store --help | grep -q -- "--max-connections" || fail "store --help lacks --max-connections"
"$BIN" store --help | grep -q -- "--max-partial-bytes" || fail "store --help lacks --max-partial-bytes"
kill -TERM $store; wait $store || fail "store exit status"
[ ! -e "$DIR/s.sock" ] || fail "socket left behind"
echo "cli ok"
