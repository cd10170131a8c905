// Deterministic synthetic models for `hearth make-model`: the same arguments
// give the same file, byte for byte, on every machine and for every thread
// count.
//
// Element i (row-major) of the tensor at index k of a model is
//
//   x = SplitMix64((seed ^ SplitMix64(k + 1)) + i)   (uint64_t, wrapping)
//   u = float(x >> 40) * 2^-24                        (exact, 0 <= u < 1)
//   v = (2 * u - 1) * bound                           (float: 2u - 1 is exact,
//                                                      the product rounds once)
//
// with bound = 1.0f / std::sqrt(float(fan_in)), both correctly rounded float
// operations, so that v lies in [-bound, bound) as torch.nn.Linear's init
// does. F16 and BF16 tensors hold v rounded to nearest even (float16.h).
// Bytes are little-endian, as safetensors requires.
//
// Models, with k the position in the list:
//   mlp    0 encoder.weight [hidden, in]   fan_in = in
//          1 encoder.bias   [hidden]       fan_in = in
//          2 head.weight    [out, hidden]  fan_in = hidden
//          3 head.bias      [out]          fan_in = hidden
//   scale  0 weight [n], F32, bound = 1
// Metadata: "hearth.model" = "mlp" or "scale", "hearth.seed" = seed in decimal.
#pragma once

#include <cstdint>
#include <string>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

// The output function of Vigna's splitmix64 for the state z:
//   z += 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//   z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31);
constexpr uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// bound = 1.0f / std::sqrt(float(fan_in)).
float SyntheticBound(int64_t fan_in);
// v for element `element` of tensor `tensor_index`, before any 16-bit rounding.
float SyntheticValue(uint64_t seed, uint64_t tensor_index, uint64_t element, float bound);

// Writes the mlp model to `path` (see above). `dtype` is F32, F16 or BF16;
// every dimension must be positive. With `max_shard_bytes` > 0, `path` is a
// checkpoint directory with shards of at most that many bytes of tensors
// (CheckpointWriter::WriteDirectory); the tensors are the same.
Status WriteSyntheticMlp(int64_t in, int64_t hidden, int64_t out, DType dtype, uint64_t seed,
                         const std::string& path, int threads, uint64_t max_shard_bytes = 0);
// Writes the scale model: one F32 tensor "weight" of `n` > 0 elements.
Status WriteSyntheticScale(int64_t n, uint64_t seed, const std::string& path, int threads,
                           uint64_t max_shard_bytes = 0);

}  // namespace hearth
