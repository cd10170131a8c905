// scale on CUDA: one block per row, warp-shuffle reduction (kernels.cu).
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/cuda_backends.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels.h"
#include "backends/model_weights.h"
#include "memory/cuda_driver.h"

namespace hearth {
namespace {

using cuda::CudaCheck;

class ScaleCuda final : public Backend {
 public:
  ScaleCuda(const ScaleWeights& w, int device, const BackendOptions& options)
      : device_(device),
        max_batch_(options.max_batch_size),
        n_(w.n),
        weight_(static_cast<const float*>(w.weight->data)),
        inputs_(ScaleInputs(w)),
        outputs_(ScaleOutputs()) {}

  Status Init() {
    const auto b = static_cast<uint64_t>(max_batch_);
    ASSIGN_OR_RETURN(stream_, cuda::CreateStream());
    ASSIGN_OR_RETURN(
        x_, cuda::AllocateDevice(b * static_cast<uint64_t>(n_) * 4, "scale input", &device_bytes_));
    ASSIGN_OR_RETURN(y_, cuda::AllocateDevice(b * 4, "scale output", &device_bytes_));
    return Status::Ok();
  }

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint64_t device_memory_bytes() const override { return device_bytes_; }
  // Every copy is cudaMemcpyDefault: host or device addresses alike.
  bool takes_device_addresses() const override { return true; }

  Status InjectDeviceFault() override {
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    return CudaCheck(cuda::LaunchIllegalAddressWrite(stream_.get()), "fault injection kernel");
  }

  Status Run(int64_t batch, std::span<const void* const> inputs,
             std::span<void* const> outputs) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      return InvalidArgument("scale takes 1 input and 1 output");
    }
    if (batch < 1 || batch > max_batch_) {
      return InvalidArgument("batch " + std::to_string(batch) + " outside [1, " +
                             std::to_string(max_batch_) + "]");
    }
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    const auto rows = static_cast<uint64_t>(batch);
    cudaStream_t s = stream_.get();
    RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(x_.get(), inputs[0], rows * static_cast<uint64_t>(n_) * 4,
                                  cudaMemcpyDefault, s),
                  "copy scale input to the device"));
    RETURN_IF_ERROR(CudaCheck(cuda::LaunchRowDot(static_cast<const float*>(x_.get()), weight_,
                                                 batch, n_, static_cast<float*>(y_.get()), s),
                              "row-dot kernel"));
    RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(outputs[0], y_.get(), rows * 4, cudaMemcpyDefault, s),
                              "copy scale output to the host"));
    return CudaCheck(cudaStreamSynchronize(s), "scale forward");
  }

 private:
  const int device_;
  const int64_t max_batch_, n_;
  const float* weight_;
  std::vector<IoSpec> inputs_, outputs_;
  uint64_t device_bytes_ = 0;
  cuda::CudaStream stream_;  // destroyed after the buffers
  cuda::DeviceBuffer x_, y_;
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateScaleCuda(const ScaleWeights& weights, int device,
                                                 const BackendOptions& options) {
  RETURN_IF_ERROR(MakeContextCurrent(device));
  auto backend = std::make_unique<ScaleCuda>(weights, device, options);
  RETURN_IF_ERROR(backend->Init().WithContext("scale on cuda:" + std::to_string(device)));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace hearth
