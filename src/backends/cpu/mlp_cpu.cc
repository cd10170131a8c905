#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backends/cpu/blas.h"
#include "backends/cpu/cpu_backends.h"
#include "common/float16.h"

namespace hearth {
namespace {

// f32 copy of a 16-bit tensor, or a view of an f32 one.
class F32Weights {
 public:
  explicit F32Weights(const TensorView& t) {
    const uint64_t n = t.nbytes / DTypeSize(t.dtype);
    if (t.dtype == DType::kF32) {
      data_ = static_cast<const float*>(t.data);
      return;
    }
    const auto* src = static_cast<const uint16_t*>(t.data);
    widened_.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      widened_[i] = t.dtype == DType::kF16 ? HalfToFloat(src[i]) : BFloat16ToFloat(src[i]);
    }
    data_ = widened_.data();
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> widened_;
  const float* data_ = nullptr;
};

// Linear -> ReLU -> Linear -> argmax with sgemm.
//
// F16/BF16 weights are widened to f32 once, here, and not per batch: a worker
// serves many batches, and widening every weight on every batch would cost
// more than the GEMM itself. The price is one private f32 copy of the weights
// per CPU worker (2x the shared 16-bit bytes), which is acceptable for the
// CPU reference path; the CUDA backend computes on the shared weights
// directly. F32 weights are used in place (no copy).
class MlpCpu final : public Backend {
 public:
  MlpCpu(const MlpWeights& w, const BackendOptions& options)
      : in_(w.in),
        hidden_(w.hidden),
        out_(w.out),
        w1_(*w.encoder_weight),
        b1_(*w.encoder_bias),
        w2_(*w.head_weight),
        b2_(*w.head_bias),
        inputs_(MlpInputs(w)),
        outputs_(MlpOutputs(w)),
        activation_(static_cast<size_t>(options.max_batch_size) * static_cast<size_t>(w.hidden)) {}

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint64_t device_memory_bytes() const override { return 0; }

  Status Run(int64_t batch, std::span<const void* const> inputs,
             std::span<void* const> outputs) override {
    if (inputs.size() != 1 || outputs.size() != 2) {
      return InvalidArgument("mlp takes 1 input and 2 outputs");
    }
    const auto b = static_cast<int>(batch);
    const auto* x = static_cast<const float*>(inputs[0]);
    auto* logits = static_cast<float*>(outputs[0]);
    auto* argmax = static_cast<int64_t*>(outputs[1]);
    const int in = static_cast<int>(in_), hidden = static_cast<int>(hidden_),
              out = static_cast<int>(out_);

    // Each GEMM starts from its bias broadcast over the rows (beta = 1).
    float* h = activation_.data();
    for (int r = 0; r < b; ++r) std::copy_n(b1_.data(), hidden, h + int64_t{r} * hidden);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, hidden, in, 1.0f, x, in, w1_.data(), in,
                1.0f, h, hidden);
    for (int64_t i = 0; i < int64_t{b} * hidden; ++i) h[i] = std::max(h[i], 0.0f);
    for (int r = 0; r < b; ++r) std::copy_n(b2_.data(), out, logits + int64_t{r} * out);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, out, hidden, 1.0f, h, hidden,
                w2_.data(), hidden, 1.0f, logits, out);

    for (int r = 0; r < b; ++r) {
      const float* row = logits + int64_t{r} * out;
      int64_t best = 0;
      // First index of the max; a NaN counts as larger than any number (as
      // torch.argmax), the CUDA kernel uses the same order.
      for (int64_t j = 1; j < out; ++j) {
        if ((std::isnan(row[j]) && !std::isnan(row[best])) || row[j] > row[best]) best = j;
      }
      argmax[r] = best;
    }
    return Status::Ok();
  }

 private:
  int64_t in_, hidden_, out_;
  F32Weights w1_, b1_, w2_, b2_;
  std::vector<IoSpec> inputs_, outputs_;
  std::vector<float> activation_;  // [max_batch, hidden]
};

}  // namespace

std::unique_ptr<Backend> CreateMlpCpu(const MlpWeights& weights, const BackendOptions& options) {
  return std::make_unique<MlpCpu>(weights, options);
}

}  // namespace hearth
