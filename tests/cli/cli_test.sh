#!/usr/bin/env bash
# The hearth command end to end: make-model, inspect FILE, store, inspect
# --socket (the two checksums must match), list, status, load, unload, and
# clear errors for bad arguments; the same with checkpoint directories (one
# sharded as save_pretrained does it must give the file's checksum); and one
# store per device (--device host0,host1), each client command on each.
set -euo pipefail
BIN=$1
DIR=$(mktemp -d)
store=
dstore=
mstore=
trap 'kill $store $dstore $mstore 2>/dev/null || true; rm -rf "$DIR"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$BIN" make-model mlp --dims 16,32,8 --dtype bf16 --seed 3 --out "$DIR/m.safetensors" >/dev/null
"$BIN" make-model scale --dims 500 --seed 1 --out "$DIR/s.safetensors" >/dev/null
file_sum=$("$BIN" inspect "$DIR/m.safetensors" | awk '/^checksum:/ {print $2}')
[ ${#file_sum} -eq 16 ] || fail "no checksum from inspect FILE"
"$BIN" inspect "$DIR/m.safetensors" | grep -q "encoder.weight *BF16 *\[32,16\]" || fail "tensor table"

# The same model as a checkpoint directory, sharded as save_pretrained does it:
# every shard's tensors listed, each with its shard, and the same checksum.
"$BIN" make-model mlp --dims 16,32,8 --dtype bf16 --seed 3 --shard-bytes 600 --out "$DIR/sharded" >/dev/null
[ -f "$DIR/sharded/model.safetensors.index.json" ] || fail "make-model --shard-bytes wrote no index"
out=$("$BIN" inspect "$DIR/sharded")
grep -q "^index: $DIR/sharded/model.safetensors.index.json" <<<"$out" || fail "inspect DIR: index: $out"
grep -q "encoder.weight *BF16 *\[32,16\].*model-00001-of-00002.safetensors" <<<"$out" || fail "inspect DIR: shard column: $out"
grep -q "head.bias *BF16 *\[8\].*model-00002-of-00002.safetensors" <<<"$out" || fail "inspect DIR: second shard: $out"
[ "$(echo "$out" | grep -c 'model-0000[12]-of-00002.safetensors$')" -eq 4 ] || fail "inspect DIR: not all 4 tensors: $out"
grep -q "checksum: $file_sum" <<<"$out" || fail "sharded checksum differs from the file's: $out"
mkdir "$DIR/single" && cp "$DIR/m.safetensors" "$DIR/single/model.safetensors"
"$BIN" inspect "$DIR/single" | grep -q "checksum: $file_sum" || fail "inspect of a directory with model.safetensors"
mkdir "$DIR/broken" && cp "$DIR/sharded/"* "$DIR/broken/" && rm "$DIR/broken/model-00002-of-00002.safetensors"
err=$("$BIN" inspect "$DIR/broken" 2>&1) && fail "a directory missing a shard was accepted"
grep -q "model.safetensors.index.json: shard 'model-00002-of-00002.safetensors', listed for tensor 'encoder.bias'" <<<"$err" \
  || fail "missing shard error: $err"

"$BIN" store --socket "$DIR/s.sock" --device cpu --model "m=$DIR/m.safetensors" > "$DIR/store.log" 2>&1 &
store=$!
for _ in $(seq 100); do grep -q ready "$DIR/store.log" && break; sleep 0.1; done
grep -q ready "$DIR/store.log" || fail "store not ready: $(cat "$DIR/store.log")"

out=$("$BIN" inspect --socket "$DIR/s.sock" --model m --verify)
grep -q "checksum: $file_sum" <<<"$out" || fail "attached checksum differs from the file's: $out"
grep -q "checksum ok" <<<"$out" || fail "verify failed"
"$BIN" load --socket "$DIR/s.sock" "m=$DIR/s.safetensors" | grep -q "loaded m@2" || fail "load"
"$BIN" list --socket "$DIR/s.sock" | grep -cE "^m +[12] " | grep -q 2 || fail "list shows both versions"
"$BIN" inspect --socket "$DIR/s.sock" --model m@1 --verify | grep -q "checksum ok" || fail "m@1"
"$BIN" unload --socket "$DIR/s.sock" m@1 | grep -q "unloaded 1" || fail "unload"
"$BIN" load --socket "$DIR/s.sock" "d=$DIR/sharded" | grep -q "loaded d@1 (4 tensors, 1616 bytes, checksum $file_sum)" \
  || fail "load of a sharded directory"
"$BIN" inspect --socket "$DIR/s.sock" --model d --verify | grep -q "checksum: $file_sum" || fail "attached sharded model's checksum"
err=$("$BIN" load --socket "$DIR/s.sock" "x=$DIR/broken" 2>&1) && fail "load of a broken directory accepted"
grep -q "listed for tensor 'encoder.bias'" <<<"$err" || fail "load of a broken directory: $err"
"$BIN" unload --socket "$DIR/s.sock" d | grep -q "unloaded 1" || fail "unload d"
"$BIN" status --socket "$DIR/s.sock" | grep -q "m@2" || fail "status"

# Bad input: clear errors, non-zero exit, the store keeps serving.
err=$("$BIN" inspect --socket "$DIR/s.sock" --model nope 2>&1) && fail "unknown model accepted"
grep -q "no model 'nope'" <<<"$err" || fail "unknown model error: $err"
err=$("$BIN" make-model mlp --dims 1,2 --out "$DIR/x" 2>&1) && fail "bad dims accepted"
grep -q "IN,HIDDEN,OUT" <<<"$err" || fail "bad dims error: $err"
err=$("$BIN" store --socket "$DIR/t.sock" --model "x=$DIR/missing" 2>&1) && fail "missing file accepted"
grep -q "missing" <<<"$err" || fail "missing checkpoint error: $err"
err=$("$BIN" store --socket "$DIR/t.sock" --device tpu 2>&1) && fail "bad device accepted"
grep -q "tpu" <<<"$err" || fail "bad device error: $err"
"$BIN" --help | grep -q "make-model" || fail "--help"
err=$("$BIN" store --socket "$DIR/s.sock" --device cpu 2>&1) && fail "second store on a live socket"
grep -q "another store is serving at $DIR/s.sock" <<<"$err" || fail "second store error: $err"
err=$(HEARTH_STORE_UID=12,x "$BIN" list --socket "$DIR/s.sock" 2>&1) && fail "bad HEARTH_STORE_UID accepted"
grep -q "HEARTH_STORE_UID='12,x'" <<<"$err" || fail "bad HEARTH_STORE_UID error: $err"
HEARTH_STORE_UID=12 "$BIN" list --socket "$DIR/s.sock" --store-uid 13 | grep -q "^m " \
  || fail "trusting more uids must not stop a store of our own"
for cmd in inspect list status load unload; do
  "$BIN" "$cmd" --help | grep -q -- "--store-uid" || fail "$cmd --help lacks --store-uid"
done
"$BIN" inspect --help | tr -s ' \n' ' ' | grep -q "peer check" || fail "inspect --help: what --verify proves"
"$BIN" store --help | grep -q -- "--max-connections" || fail "store --help lacks --max-connections"
for cmd in store inspect load; do
  "$BIN" "$cmd" --help | tr -s ' \n' ' ' | grep -q "checkpoint directory" || fail "$cmd --help does not say a directory is accepted"
done

# A store started on a sharded directory serves it.
"$BIN" store --socket "$DIR/d.sock" --device cpu --model "d=$DIR/sharded" > "$DIR/dstore.log" 2>&1 &
dstore=$!
for _ in $(seq 100); do grep -q ready "$DIR/dstore.log" && break; sleep 0.1; done
grep -q ready "$DIR/dstore.log" || fail "store of a directory not ready: $(cat "$DIR/dstore.log")"
"$BIN" inspect --socket "$DIR/d.sock" --model d --verify | grep -q "checksum: $file_sum" || fail "store --model d=DIR checksum"
kill -TERM $dstore; wait $dstore || fail "directory store exit status"
"$BIN" store --help | grep -q -- "--max-partial-bytes" || fail "store --help lacks --max-partial-bytes"
kill -TERM $store; wait $store || fail "store exit status"
[ ! -e "$DIR/s.sock" ] || fail "socket left behind"

# One store per device, each at SOCKET-<device>.sock with its own copy; the
# client commands take the same --device list.
"$BIN" store --socket "$DIR/multi.sock" --device host0,host1 --model "m=$DIR/m.safetensors" > "$DIR/mstore.log" 2>&1 &
mstore=$!
for _ in $(seq 100); do grep -q ready "$DIR/mstore.log" && break; sleep 0.1; done
grep -q "ready: socket $DIR/multi-host0.sock for host0, socket $DIR/multi-host1.sock for host1" "$DIR/mstore.log" \
  || fail "multi-device store not ready: $(cat "$DIR/mstore.log")"
[ ! -e "$DIR/multi.sock" ] || fail "a store at the plain socket path with several devices"
for d in host0 host1; do
  "$BIN" inspect --socket "$DIR/multi.sock" --device $d --model m --verify | grep -q "checksum: $file_sum" \
    || fail "attached checksum on $d"
done
out=$("$BIN" status --socket "$DIR/multi.sock" --device host0,host1)
grep -q "^== host0: $DIR/multi-host0.sock" <<<"$out" || fail "status --device: host0 heading: $out"
grep -q "^== host1: $DIR/multi-host1.sock" <<<"$out" || fail "status --device: host1 heading: $out"
[ "$(echo "$out" | grep -c '^holds 1 arenas')" -eq 2 ] || fail "status --device: one arena per store: $out"
out=$("$BIN" load --socket "$DIR/multi.sock" --device host0,host1 "s=$DIR/s.safetensors")
grep -q "^loaded s@1 on host0 " <<<"$out" || fail "load --device: host0: $out"
grep -q "^loaded s@1 on host1 " <<<"$out" || fail "load --device: host1: $out"
"$BIN" list --socket "$DIR/multi.sock" --device host1 | grep -q "^s " || fail "list --device host1"
"$BIN" unload --socket "$DIR/multi.sock" --device host0,host1 s | grep -c "unloaded 1" | grep -q 2 || fail "unload --device"
err=$("$BIN" status --socket "$DIR/multi.sock" --device host0,host0 2>&1) && fail "a device listed twice accepted"
grep -q "names host0 twice" <<<"$err" || fail "device listed twice: $err"
err=$("$BIN" inspect --socket "$DIR/multi.sock" --device host0,host1 --model m 2>&1) && fail "inspect of two stores accepted"
grep -q "give one --device" <<<"$err" || fail "inspect of two stores: $err"
err=$("$BIN" store --socket "$DIR/t.sock" --device host0,tpu 2>&1) && fail "a bad device in a list accepted"
grep -q "'tpu'" <<<"$err" || fail "bad device in a list: $err"
kill -TERM $mstore; wait $mstore || fail "multi-device store exit status"
[ ! -e "$DIR/multi-host0.sock" ] && [ ! -e "$DIR/multi-host1.sock" ] || fail "multi-device sockets left behind"
echo "cli ok"
