// hearth_create_engine of libhearth_backends_cuda.so (backends/engine_abi.h):
// the engines of models on a GPU, by kind. A kind is one line of kEngines;
// its factory gets the weights (device addresses on `device`, checked) and
// sets up the device itself (MakeContextCurrent), as the backends do.
#include <type_traits>

#include "backends/cuda/cuda_backend_abi.h"
#include "backends/cuda/llm_executor.h"
#include "backends/engine.h"
#include "backends/engine_abi.h"
#include "backends/engine_export.h"
#include "backends/llm/llm_engine.h"

namespace hearth {
namespace {

constexpr ExportedEngineKind kEngines[] = {
    // The reference engine (backends/engine.h): it needs no weights and
    // touches no device, so that the plug-in path is tested without a model.
    {"count", [](const std::vector<TensorView>&, Device,
                 const EngineOptions& options) { return CreateCountEngine(options); }},
    // backend: llm (backends/llm/llm_engine.h) with the CUDA executor.
    {"llm",
     [](const std::vector<TensorView>& weights, Device device, const EngineOptions& options) {
       return llm::CreateLlmEngine(
           weights, options, /*on_gpu=*/true,
           [index = device.index](const llm::ModelConfig& c, const llm::ModelWeights& w,
                                  const llm::ExecutorOptions& o) {
             return llm::CreateCudaExecutor(c, w, index, o);
           });
     }},
};

constexpr ExportedEngines kCudaEngines{HEARTH_CUDA_BACKEND_LIBRARY, kEngines, /*on_host=*/false,
                                       /*on_cuda=*/true};

}  // namespace
}  // namespace hearth

extern "C" __attribute__((visibility("default"))) int hearth_create_engine(
    uint32_t abi_version, const char* kind, const HearthCudaTensor* weights, size_t num_weights,
    int32_t device_kind, int32_t device_index, const HearthEngineOptions* options,
    const HearthEngineTable** table, void** engine, char* error, size_t error_size) {
  return hearth::CreateExportedEngine(hearth::kCudaEngines, abi_version, kind, weights, num_weights,
                                      device_kind, device_index, options, table, engine, error,
                                      error_size);
}

static_assert(std::is_same_v<decltype(&hearth_create_engine), HearthCreateEngineFn>);
