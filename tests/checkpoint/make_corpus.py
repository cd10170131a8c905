#!/usr/bin/python3
"""Writes the malformed safetensors files under tests/checkpoint/corpus/.

Each file breaks one rule that Checkpoint::Open must enforce. corpus/EXPECTED
lists "<file> <substring>": opening <file> must fail with INVALID_ARGUMENT and
a message that contains the file's path and <substring> (which runs to the end
of the line and may contain spaces).

It also writes valid inputs for the header fuzzer under fuzz/seeds/safetensors/ (format:
8-byte little-endian data size, then the header JSON).

Run from anywhere: /usr/bin/python3 tests/checkpoint/make_corpus.py
"""

import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
SEEDS = os.path.join(HERE, "..", "..", "fuzz", "seeds", "safetensors")


def header_bytes(text):
    return text.encode("utf-8") if isinstance(text, str) else text


def file_with_header(text, data=b"", length=None):
    """A safetensors file: length prefix, header text, data section."""
    header = header_bytes(text)
    if length is None:
        length = len(header)
    return struct.pack("<Q", length) + header + data


def tensor(dtype="F32", shape=(2,), offsets=(0, 8), **extra):
    entry = {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}
    entry.update(extra)
    return entry


def from_dict(header, data_size=8):
    return file_with_header(json.dumps(header), b"\0" * data_size)


def deep_shape(depth):
    return ('{"t":{"dtype":"F32","shape":' + "[" * depth + "]" * depth +
            ',"data_offsets":[0,4]}}')


CASES = [
    # (file name, contents, expected substring)
    ("too_short.safetensors", b"\x05\0\0", "too short for the 8-byte header length"),
    ("zero_header_length.safetensors", struct.pack("<Q", 0) + b"{}", "header length is 0"),
    ("header_too_large.safetensors", file_with_header("{}", length=(100 << 20) + 1),
     "header length 104857601 exceeds the limit"),
    ("header_length_huge.safetensors", file_with_header("{}", length=(1 << 64) - 1),
     "header length 18446744073709551615 exceeds the limit"),
    ("header_past_eof.safetensors", file_with_header("{}", length=1000),
     "header length 1000 runs past the end of the file"),
    ("not_json.safetensors", file_with_header("{hello}"), "header: invalid JSON"),
    ("json_array.safetensors", file_with_header("[1, 2, 3]"), "header: does not start with '{'"),
    ("leading_space.safetensors", file_with_header(' {"a": 1}'),
     "header: does not start with '{'"),
    ("truncated_json.safetensors", file_with_header('{"w": {"dtype": "F32", "shape": [2'),
     "header: invalid JSON"),
    ("trailing_garbage.safetensors", file_with_header('{} x'), "header: invalid JSON"),
    ("nul_padding.safetensors", file_with_header(b"{}\0\0\0\0\0\0"), "header: invalid JSON"),
    ("nul_then_tensors.safetensors",
     file_with_header(b'{}\0{"w": ' + json.dumps(tensor(dtype="X")).encode() + b"}"),
     "header: invalid JSON: NUL byte at offset 2"),
    ("invalid_utf8_name.safetensors",
     file_with_header(b'{"w\xff": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}',
                      b"\0" * 4),
     "header: invalid JSON"),
    ("number_overflow.safetensors",
     file_with_header('{"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}'),
     "header: invalid JSON"),
    ("duplicate_tensor.safetensors",
     file_with_header('{"w": ' + json.dumps(tensor()) + ', "w": ' + json.dumps(tensor()) + "}",
                      b"\0" * 8),
     "header: duplicate key 'w'"),
    ("duplicate_field.safetensors",
     file_with_header('{"w": {"dtype": "F32", "dtype": "F16", "shape": [2], '
                      '"data_offsets": [0, 8]}}', b"\0" * 8),
     "tensor 'w': duplicate key 'dtype'"),
    ("duplicate_metadata_key.safetensors",
     file_with_header('{"__metadata__": {"k": "a", "k": "b"}}'),
     "__metadata__: key 'k': duplicate key"),
    ("entry_not_object.safetensors", from_dict({"w": [1, 2]}),
     "tensor 'w': entry is not an object"),
    ("unknown_dtype.safetensors", from_dict({"w": tensor(dtype="F128")}),
     "tensor 'w': unknown dtype 'F128'"),
    ("dtype_wrong_type.safetensors", from_dict({"w": tensor(dtype=32)}),
     "tensor 'w': dtype is not a string"),
    ("dtype_lowercase.safetensors", from_dict({"w": tensor(dtype="f32")}),
     "tensor 'w': unknown dtype 'f32'"),
    ("shape_not_array.safetensors", from_dict({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}),
     "tensor 'w': shape is not an array"),
    ("negative_dim.safetensors", from_dict({"w": tensor(shape=(2, -1))}),
     "tensor 'w': shape[1] = -1 is negative"),
    ("non_integer_dim.safetensors", from_dict({"w": tensor(shape=(2.5,))}),
     "tensor 'w': shape[0] is not an integer"),
    ("string_dim.safetensors", from_dict({"w": tensor(shape=("2",))}),
     "tensor 'w': shape[0] is not an integer"),
    ("dim_too_large.safetensors", from_dict({"w": tensor(shape=(1 << 63,))}),
     "tensor 'w': shape[0] = 9223372036854775808 is too large"),
    ("nested_shape.safetensors", file_with_header(deep_shape(2), b"\0" * 4),
     "tensor 't': shape[0] is not an integer"),
    ("deeply_nested_shape.safetensors", file_with_header(deep_shape(20000), b"\0" * 4),
     "header: JSON nests deeper than 64 levels"),
    ("shape_overflow.safetensors", from_dict({"w": tensor(shape=(1 << 32, 1 << 32))}),
     "tensor 'w': shape [4294967296, 4294967296] of F32 overflows"),
    ("shape_overflow_with_zero.safetensors",
     from_dict({"w": tensor(shape=(1 << 40, 1 << 40, 0), offsets=(0, 0))}),
     "tensor 'w': shape [1099511627776, 1099511627776, 0] of F32 overflows"),
    ("missing_dtype.safetensors",
     from_dict({"w": {"shape": [2], "data_offsets": [0, 8]}}), "tensor 'w': missing 'dtype'"),
    ("missing_shape.safetensors",
     from_dict({"w": {"dtype": "F32", "data_offsets": [0, 8]}}), "tensor 'w': missing 'shape'"),
    ("missing_data_offsets.safetensors",
     from_dict({"w": {"dtype": "F32", "shape": [2]}}), "tensor 'w': missing 'data_offsets'"),
    ("extra_field.safetensors", from_dict({"w": tensor(foo=1)}),
     "tensor 'w': unknown field 'foo'"),
    ("offsets_not_pair.safetensors", from_dict({"w": tensor(offsets=(0, 8, 16))}),
     "tensor 'w': data_offsets must be two unsigned integers"),
    ("offsets_negative.safetensors", from_dict({"w": tensor(offsets=(-8, 0))}),
     "tensor 'w': data_offsets must be two unsigned integers"),
    ("offsets_float.safetensors", from_dict({"w": tensor(offsets=(0, 8.0))}),
     "tensor 'w': data_offsets must be two unsigned integers"),
    ("offsets_reversed.safetensors", from_dict({"w": tensor(shape=(0,), offsets=(8, 0))}),
     "tensor 'w': data_offsets [8, 0] are reversed"),
    ("offsets_past_end.safetensors", from_dict({"w": tensor(offsets=(8, 16))}),
     "tensor 'w': data_offsets [8, 16] run past the end of the data section (8 bytes)"),
    ("size_mismatch.safetensors", from_dict({"w": tensor(shape=(3,), offsets=(0, 8))}),
     "tensor 'w': data_offsets [0, 8] hold 8 bytes but F32 [3] needs 12"),
    ("overlapping_tensors.safetensors",
     from_dict({"a": tensor(offsets=(0, 8)), "b": tensor(offsets=(4, 12))}, data_size=12),
     "tensor 'b': bytes [4, 12) overlap tensor 'a' [0, 8)"),
    ("overlap_nested.safetensors",
     from_dict({"big": tensor(shape=(4,), offsets=(0, 16)),
                "inner": tensor(shape=(1,), offsets=(4, 8)),
                "late": tensor(shape=(1,), offsets=(12, 16))}, data_size=16),
     "overlap tensor 'big' [0, 16)"),
    ("empty_name.safetensors", from_dict({"": tensor()}), "header: empty tensor name"),
    ("metadata_not_object.safetensors", from_dict({"__metadata__": ["a", "b"]}),
     "__metadata__: is not an object"),
    ("metadata_non_string.safetensors", from_dict({"__metadata__": {"k": 1}}),
     "__metadata__: key 'k': value is not a string"),
    ("control_char_name.safetensors", from_dict({"a\nb": tensor(dtype="X")}),
     "tensor 'a\\x0ab': unknown dtype 'X'"),
]

# Valid headers for the fuzzer: (name, data size, header).
SEEDS_VALID = [
    ("empty", 0, {}),
    ("metadata_only", 0, {"__metadata__": {"hearth.model": "mlp", "hearth.seed": "7"}}),
    ("two_tensors", 25, {
        "__metadata__": {"format": "pt"},
        "a": tensor(dtype="F32", shape=(2, 2), offsets=(0, 16)),
        "b": tensor(dtype="BF16", shape=(4,), offsets=(16, 24)),
        "empty": tensor(dtype="I8", shape=(0, 5), offsets=(24, 24)),
        "scalar": tensor(dtype="F8_E4M3", shape=(), offsets=(24, 25)),
    }),
    ("all_dtypes", 256, {
        d: tensor(dtype=d, shape=(1,), offsets=(16 * i, 16 * i + size))
        for i, (d, size) in enumerate([("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2),
                                       ("I64", 8), ("I32", 4), ("I16", 2), ("I8", 1),
                                       ("U8", 1), ("BOOL", 1), ("F8_E4M3", 1),
                                       ("F8_E5M2", 1)])
    }),
]


def main():
    shutil.rmtree(CORPUS, ignore_errors=True)
    os.makedirs(CORPUS)
    names = [name for name, _, _ in CASES]
    assert len(names) == len(set(names)), "duplicate corpus file name"
    with open(os.path.join(CORPUS, "EXPECTED"), "w") as expected:
        for name, contents, substring in CASES:
            with open(os.path.join(CORPUS, name), "wb") as f:
                f.write(contents)
            expected.write(f"{name} {substring}\n")

    # Only this script's files: fuzz/seeds/<target>/ hold other fuzzers' seeds.
    os.makedirs(SEEDS, exist_ok=True)
    for name in os.listdir(SEEDS):
        if os.path.isfile(os.path.join(SEEDS, name)):
            os.remove(os.path.join(SEEDS, name))
    for name, data_size, header in SEEDS_VALID:
        with open(os.path.join(SEEDS, name), "wb") as f:
            f.write(struct.pack("<Q", data_size) + json.dumps(header).encode())
    print(f"wrote {len(CASES)} corpus files and {len(SEEDS_VALID)} fuzz seeds")


if __name__ == "__main__":
    main()
