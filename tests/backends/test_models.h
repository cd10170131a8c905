// Synthetic weights for backend tests, in host memory, plus double-precision
// references of the backends' math.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/float16.h"
#include "hearth/attach.h"

namespace hearth::testing {

// One tensor: `values` are exactly what the stored bytes hold (already
// rounded to the dtype), `bytes` the little-endian storage.
struct HostTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<float> values;
  std::vector<std::byte> bytes;

  TensorView View() const {
    return TensorView{name, dtype, shape, bytes.data(), 0, bytes.size(), Device::Host()};
  }
};

inline HostTensor MakeTensor(std::string name, DType dtype, std::vector<int64_t> shape,
                             std::vector<float> values) {
  HostTensor t{std::move(name), dtype, std::move(shape), std::move(values), {}};
  t.bytes.resize(t.values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < t.values.size(); ++i) {
    float& v = t.values[i];
    if (dtype == DType::kF32) {
      std::memcpy(t.bytes.data() + 4 * i, &v, 4);
      continue;
    }
    const uint16_t h = dtype == DType::kF16 ? FloatToHalf(v) : FloatToBFloat16(v);
    v = dtype == DType::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
    std::memcpy(t.bytes.data() + 2 * i, &h, 2);
  }
  return t;
}

inline std::vector<float> RandomValues(std::mt19937_64& rng, size_t n, float bound) {
  std::uniform_real_distribution<float> dist(-bound, bound);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// encoder.weight, encoder.bias, head.weight, head.bias with Linear's init range.
struct MlpModel {
  int64_t in, hidden, out;
  std::vector<HostTensor> tensors;

  MlpModel(int64_t in_, int64_t hidden_, int64_t out_, DType dtype, uint64_t seed)
      : in(in_), hidden(hidden_), out(out_) {
    std::mt19937_64 rng(seed);
    const float b1 = 1.0f / std::sqrt(static_cast<float>(in)),
                b2 = 1.0f / std::sqrt(static_cast<float>(hidden));
    const auto u = [](int64_t n) { return static_cast<size_t>(n); };
    tensors.push_back(
        MakeTensor("encoder.weight", dtype, {hidden, in}, RandomValues(rng, u(hidden * in), b1)));
    tensors.push_back(
        MakeTensor("encoder.bias", dtype, {hidden}, RandomValues(rng, u(hidden), b1)));
    tensors.push_back(
        MakeTensor("head.weight", dtype, {out, hidden}, RandomValues(rng, u(out * hidden), b2)));
    tensors.push_back(MakeTensor("head.bias", dtype, {out}, RandomValues(rng, u(out), b2)));
  }

  std::vector<TensorView> Views() const {
    std::vector<TensorView> views;
    for (const HostTensor& t : tensors) views.push_back(t.View());
    return views;
  }

  // logits in double, from the stored (rounded) weights and the f32 input.
  std::vector<double> Reference(const std::vector<float>& x, int64_t batch) const {
    const auto& w1 = tensors[0].values;
    const auto& b1 = tensors[1].values;
    const auto& w2 = tensors[2].values;
    const auto& b2 = tensors[3].values;
    std::vector<double> logits(static_cast<size_t>(batch * out)), h(static_cast<size_t>(hidden));
    for (int64_t r = 0; r < batch; ++r) {
      for (int64_t j = 0; j < hidden; ++j) {
        double s = b1[static_cast<size_t>(j)];
        for (int64_t i = 0; i < in; ++i)
          s += double{x[static_cast<size_t>(r * in + i)]} * w1[static_cast<size_t>(j * in + i)];
        h[static_cast<size_t>(j)] = std::max(s, 0.0);
      }
      for (int64_t o = 0; o < out; ++o) {
        double s = b2[static_cast<size_t>(o)];
        for (int64_t j = 0; j < hidden; ++j)
          s += h[static_cast<size_t>(j)] * w2[static_cast<size_t>(o * hidden + j)];
        logits[static_cast<size_t>(r * out + o)] = s;
      }
    }
    return logits;
  }
};

// Index of the max of row `r`, and whether it is unambiguous: the runner-up
// is more than `tolerance` below it.
template <typename T>
std::pair<int64_t, bool> ClearArgmax(const std::vector<T>& logits, int64_t r, int64_t cols,
                                     double tolerance) {
  const T* row = logits.data() + r * cols;
  int64_t best = 0;
  for (int64_t j = 1; j < cols; ++j) {
    if (row[j] > row[best]) best = j;
  }
  double second = -INFINITY;
  for (int64_t j = 0; j < cols; ++j) {
    if (j != best) second = std::max(second, static_cast<double>(row[j]));
  }
  return {best, static_cast<double>(row[best]) - second > tolerance};
}

}  // namespace hearth::testing
