#include <cstdint>

#include "backends/cpu/blas.h"
#include "backends/cpu/cpu_backends.h"

namespace hearth {
namespace {

// y = X w with one sgemv.
class ScaleCpu final : public Backend {
 public:
  explicit ScaleCpu(const ScaleWeights& w)
      : n_(w.n),
        w_(static_cast<const float*>(w.weight->data)),
        inputs_(ScaleInputs(w)),
        outputs_(ScaleOutputs()) {}

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint64_t device_memory_bytes() const override { return 0; }

  Status Run(int64_t batch, std::span<const void* const> inputs,
             std::span<void* const> outputs) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      return InvalidArgument("scale takes 1 input and 1 output");
    }
    const int n = static_cast<int>(n_);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(batch), n, 1.0f,
                static_cast<const float*>(inputs[0]), n, w_, 1, 0.0f,
                static_cast<float*>(outputs[0]), 1);
    return Status::Ok();
  }

 private:
  int64_t n_;
  const float* w_;
  std::vector<IoSpec> inputs_, outputs_;
};

}  // namespace

std::unique_ptr<Backend> CreateScaleCpu(const ScaleWeights& weights, const BackendOptions&) {
  return std::make_unique<ScaleCpu>(weights);
}

}  // namespace hearth
