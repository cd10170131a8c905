// Backends: the math a worker runs on attached, read-only weights.
//
// Each backend has a CPU reference and a CUDA implementation of the same math;
// tests run both on the same inputs and compare them with a per-dtype
// tolerance. Backends know nothing of HTTP, sockets or the store: they get
// tensor views (hearth/attach.h) and host buffers.
//
// Built-in kinds (the registry, backends/registry.h, holds these and any
// other, such as the Python backend's program):
//  - "mlp": weights encoder.weight [H,IN], encoder.bias [H], head.weight
//    [OUT,H], head.bias [OUT] (F32, F16 or BF16, all the same dtype).
//    Input "input" F32 [B,IN]; outputs "logits" F32 [B,OUT] =
//    head(relu(encoder(x))) and "argmax" I64 [B,1] (first index of the max).
//  - "scale": weight "weight" [N] F32. Input "x" F32 [B,N]; output "y" F32
//    [B,1], y[b] = sum_j x[b,j] * w[j].
//
// Thread-safety: one Backend is used by one thread.
//
// A Run that fails with DeviceLost has met a sticky GPU fault: the process's
// CUDA context is unusable and the worker must exit (its supervisor starts a
// fresh process).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/attach.h"
#include "hearth/device.h"
#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

using IoSpec = TensorSpec;

struct BackendOptions {
  int max_batch_size = 1;
  // Let fp32 GEMMs use TF32 tensor cores (config parameter allow_tf32: true).
  bool allow_tf32 = false;
  // Backend-specific parameters from the model config (strings as written).
  std::map<std::string, std::string> parameters;
  // The model's version directory (where backends that run a file of the
  // model's, such as aoti's model.pt2, find it).
  std::string version_dir;
  // The inputs and outputs the config lists; empty: the backend says.
  std::vector<IoSpec> inputs, outputs;
  // The config's max_batch_size > 0: tensors have a batch dimension.
  bool batching = true;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Names in the order Run takes them.
  virtual const std::vector<IoSpec>& inputs() const = 0;
  virtual const std::vector<IoSpec>& outputs() const = 0;

  // Runs one batch, synchronously. inputs[i] points to batch x inputs()[i]
  // elements in host memory (or device memory: takes_device_addresses),
  // outputs[i] to room for batch x outputs()[i].
  // 1 <= batch <= max_batch_size. On CUDA the host buffers should be pinned
  // or registered (see RegisterHostMemory) for full copy speed.
  virtual Status Run(int64_t batch, std::span<const void* const> inputs,
                     std::span<void* const> outputs) = 0;

  // Run's inputs and outputs may also be device addresses on the backend's
  // device (a client's CUDA shared-memory region, or a staging buffer):
  // the backend copies them with cudaMemcpyDefault. False: host memory only.
  virtual bool takes_device_addresses() const { return false; }

  // Device memory this backend allocated itself (workspaces, activations).
  virtual uint64_t device_memory_bytes() const = 0;

  // Fault injection (tests of crash handling): queues a kernel that faults
  // with an illegal address, so that the next Run fails with DeviceLost.
  // Unimplemented where there is no GPU kernel to fault.
  virtual Status InjectDeviceFault() {
    return Unimplemented("fault injection cuda_illegal_address needs a GPU worker");
  }
};

// Checks the weights (names, dtypes, shapes) and builds the backend on the
// weights' device. The weights must outlive the backend.
Result<std::unique_ptr<Backend>> CreateBackend(std::string_view kind,
                                               const std::vector<TensorView>& weights,
                                               Device device, const BackendOptions& options);

// The inputs and outputs a backend of `kind` would have for these weights,
// without creating it (what its worker reports in its ready message).
// Works for any device; touches no GPU. Both look `kind` up in the registry
// (backends/registry.h).
Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>> BackendSignature(
    std::string_view kind, const std::vector<TensorView>& weights);

// Page-locks a host range for fast copies (cudaHostRegister) on CUDA builds
// with a GPU; a no-op returning OK on host-memory workers.
Status RegisterHostMemory(Device device, void* data, uint64_t bytes);
Status UnregisterHostMemory(Device device, void* data);

// Loads what a worker on `device` will need (the CUDA backend library, for a
// GPU) without touching the device: no context, no device memory. For
// standby workers; a failure is left for the real start to report.
void PreloadDeviceLibrary(Device device);

}  // namespace hearth
