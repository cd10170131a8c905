#!/usr/bin/env python3
"""Writes fuzz/seeds/store_frames/: inputs for store_frame_fuzzer.

Each seed is a sequence of received frames in the fuzzer's input format
([u8 flags][u16 LE length][frame]; flags bit 0 = a descriptor came with it),
built from docs/protocol.md alone: valid messages of every type, one split
over several frames, and a few that break a rule.

    python3 fuzz/make_store_seeds.py
"""

import pathlib
import struct

MAGIC = 0x48545248
VERSION = 1
MAX_FRAME_PAYLOAD = 32 * 1024
TYPES = {"error": 1, "list-models": 2, "model-list": 3, "attach": 4, "manifest": 5,
         "status": 6, "status-reply": 7, "load": 8, "loaded": 9, "unload": 10, "unloaded": 11}


def u8(v): return struct.pack("<B", v)
def u16(v): return struct.pack("<H", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def i32(v): return struct.pack("<i", v)
def i64(v): return struct.pack("<q", v)
def string(s): return u32(len(s.encode())) + s.encode()
def device(kind=0, index=0): return u8(kind) + i32(index)


def frames(type_name, payload, max_payload=MAX_FRAME_PAYLOAD):
    """The frames of one message, as the senders cut it."""
    out, offset = [], 0
    while True:
        chunk = payload[offset:offset + max_payload]
        out.append(u32(MAGIC) + u16(VERSION) + u16(TYPES[type_name]) + u32(len(payload))
                   + u32(offset) + chunk)
        offset += len(chunk)
        if offset >= len(payload):
            return out


def record(frame, with_fd=False):
    return u8(1 if with_fd else 0) + u16(len(frame)) + frame


def summary(name="mlp", version=1, path="/models/mlp.safetensors"):
    return (string(name) + u64(version) + device() + string(path) + u64(4096) + u32(2)
            + u64(3000) + u64(0x1234567890abcdef) + u32(1) + i64(1700000000000))


def manifest(tensors=(("a.bias", 1, (4,), 0, 16), ("a.weight", 1, (4, 8), 256, 128)),
             arena_size=512):
    body = (string("mlp") + u64(1) + device() + u64(arena_size) + u64(0xfeedface)
            + u32(len(tensors)))
    for name, dtype, shape, offset, nbytes in tensors:
        body += string(name) + u8(dtype) + u8(len(shape))
        body += b"".join(i64(d) for d in shape) + u64(offset) + u64(nbytes)
    return body


def status_reply():
    lease = i32(4242) + u32(1000) + u32(1000) + string("mlp") + u64(1) + i64(1700000000000)
    arena = string("mlp") + u64(1) + device(1, 0) + u64(1 << 21) + u8(1) + u32(1)
    return i32(17) + device() + u32(3) + u32(1) + lease + u32(1) + arena


def main():
    messages = {
        "attach": [("attach", string("mlp") + u64(0), False)],
        "attach_version": [("attach", string("scale") + u64(7), False)],
        "list_models": [("list-models", b"", False)],
        "status": [("status", b"", False)],
        "load": [("load", string("mlp") + string("/models/mlp.safetensors"), False)],
        "unload": [("unload", string("mlp") + u64(2), False)],
        "error": [("error", u16(6) + string("no model 'x' in this store"), False)],
        "manifest_with_fd": [("manifest", manifest(), True)],
        "model_list": [("model-list", u32(2) + summary() + summary("scale", 3), False)],
        "loaded": [("loaded", summary(), False)],
        "unloaded": [("unloaded", u32(1), False)],
        "status_reply": [("status-reply", status_reply(), False)],
        "session": [("list-models", b"", False), ("attach", string("mlp") + u64(0), False),
                    ("status", b"", False)],
    }
    out = pathlib.Path(__file__).resolve().parent / "seeds" / "store_frames"
    out.mkdir(parents=True, exist_ok=True)
    for name, msgs in messages.items():
        data = b""
        for type_name, payload, with_fd in msgs:
            for i, f in enumerate(frames(type_name, payload)):
                data += record(f, with_fd and i == 0)
        (out / name).write_bytes(data)
    # A message cut into small frames, as a long one would be.
    big = manifest(tuple((f"layer{i:03d}.weight", 2, (16, 16), 512 * i, 512) for i in range(40)),
                   arena_size=512 * 40)
    (out / "manifest_in_frames").write_bytes(
        b"".join(record(f, i == 0) for i, f in enumerate(frames("manifest", big, 300))))
    # Rule breakers: a continuation that skips ahead, a descriptor on a
    # continuation, a total past the limit.
    two = frames("load", string("m") + string("/" + "p" * 600), 256)
    (out / "skipped_frame").write_bytes(record(two[0]) + record(two[2]))
    (out / "fd_on_continuation").write_bytes(record(two[0]) + record(two[1], True))
    huge = u32(MAGIC) + u16(VERSION) + u16(TYPES["attach"]) + u32(1 << 30) + u32(0) + b"\0" * 8
    (out / "oversized_total").write_bytes(record(huge))


if __name__ == "__main__":
    main()
