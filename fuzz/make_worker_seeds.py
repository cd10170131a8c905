#!/usr/bin/env python3
"""Writes fuzz/seeds/worker_messages/: inputs for worker_message_fuzzer.

Each seed is one control packet as a worker sends it to the server
(src/protocol/worker_protocol.h): ready (with start phases, and for a
decoupled model its streams and window), done answers, room, a decoupled
model's responses, ring requests and engine statistics, and the server's own kinds (among them
the streams' ring, open, credit and cancel), which a worker never sends and
the server must still decode or refuse cleanly. "partial" and "ack" are
kinds (6, 7) the protocol no longer has.

    python3 fuzz/make_worker_seeds.py
"""

import pathlib
import struct

MAGIC = 0x4B524F57  # "WORK"
KINDS = {"ready": 1, "run": 2, "done": 3, "setup": 4, "room": 5, "partial": 6, "ack": 7, "start": 8,
         "release": 9, "ring": 10, "open": 11, "response": 12, "credit": 13, "cancel": 14,
         "ring-grow": 15, "engine-stats": 16}
F32 = 1
MIB = 1 << 20


def u8(v): return struct.pack("<B", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def i64(v): return struct.pack("<q", v)
def string(s): return u32(len(s)) + s
def dims(d): return u32(len(d)) + b"".join(i64(x) for x in d)
def specs(s): return u32(len(s)) + b"".join(string(n) + u8(t) + dims(d) for n, t, d in s)
def tensors(t): return u32(len(t)) + b"".join(u64(o) + u64(b) + dims(s) for o, b, s in t)
def head(kind): return u32(MAGIC) + u32(KINDS[kind])


def ready(phases=(), streams=1, window=1):
    out = head("ready") + specs([(b"x", F32, [4])]) + specs([(b"y", F32, [1])]) + u64(0)
    out += string(b"cpu (python 3.11, pid 7)") + u8(0)
    out += u32(len(phases)) + b"".join(string(n) + u64(us) for n, us in phases)
    return out + u32(streams) + u32(window)


def ring(offset, size, slot):
    return head("ring") + u64(offset) + u64(size) + u64(slot)


def open_request(resume=(0, 0, [0]), parameters=b'{"max_tokens": 16}'):
    # A prompt (BYTES [1]) and a token budget (INT32 [1]) after a 1 MiB ring.
    return (head("open") + u64(1) + string(b"req-1") + u64(2 * MIB) +
            tensors([(MIB, 9, [1]), (MIB + 64, 4, [1])]) + string(parameters) + tensors([resume]))


def response(outputs, present, final=0, status=0, text=b"", request=1):
    return (head("response") + u64(request) + u8(final) + u32(status) + string(text) +
            tensors(outputs) + u32(len(present)) + bytes(present))


def answer(kind, outputs, present, text=b"", status=0):
    return (head(kind) + u64(1) + u32(status) + string(text) + u8(0) + u64(120) + u64(0) +
            tensors(outputs) + u32(len(present)) + bytes(present))


SEEDS = {
    "ready": ready(),
    "ready-phases": ready([(b"interpreter", 81000), (b"imports", 2568000), (b"model.py", 12),
                           (b"attach", 9000), (b"tensors", 0), (b"initialize", 4)]),
    "done": answer("done", [(0, 8, [2, 1])], [1]),
    "done-error": answer("done", [], [], b"ValueError: bad input", status=0xFFFFFFFF),
    "partial": answer("partial", [(64, 5, [1, 1])], [1]),
    "room": head("room") + u64(1) + u64(1 << 20),
    "ack": head("ack") + u64(1) + u8(1),
    "start": head("start"),
    "release": head("release") + u32(2) + u64(3) + u64(4),
    # Streams.
    "ready-streams": ready([(b"imports", 2568000)], streams=64, window=256),
    "ring": ring(0, MIB, 2 * MIB),
    "ring-past-slot": ring(MIB + 64, MIB, 2 * MIB),
    "open": open_request(),
    "open-resume": open_request(resume=(MIB + 128, 24, [3])),
    "open-resume-outside": open_request(resume=(2 * MIB - 8, 24, [3])),
    "response": response([(0, 9, [1]), (64, 16, [2])], [1, 1]),
    "response-final": response([(0, 0, []), (128, 8, [1])], [0, 1], final=1),
    "response-error": response([(0, 0, []), (0, 0, [])], [0, 0], final=1, status=1,
                               text=b"ValueError: the prompt is too long"),
    "response-error-not-final": response([], [], status=1, text=b"not final"),
    "credit": head("credit") + u32(3),
    "credit-zero": head("credit") + u32(0),
    "cancel": head("cancel") + u32(2) + u64(1) + u64(2),
    "ring-grow": head("ring-grow") + u64(4 * MIB),
    "engine-stats": head("engine-stats") + u64(120) + u64(4096) + u64(3),
    "engine-stats-overfull": head("engine-stats") + u64(4097) + u64(4096) + u64(0),
}


def main():
    out = pathlib.Path(__file__).resolve().parent / "seeds" / "worker_messages"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in SEEDS.items():
        (out / name).write_bytes(data)
    print(f"{len(SEEDS)} seeds in {out}")


if __name__ == "__main__":
    main()
