#include "backends/engine.h"

#include <string>

#include "backends/registry.h"

namespace hearth {

Result<std::unique_ptr<Engine>> CreateEngine(std::string_view kind,
                                             const std::vector<TensorView>& weights, Device device,
                                             const EngineOptions& options) {
  const BackendKind* k = FindBackendKind(kind);
  if (k == nullptr) return UnknownBackendKind(kind);
  if (!k->create_engine)
    return FailedPrecondition("backend kind '" + std::string(kind) +
                              "' has no engine for decoupled models (it answers batches only); "
                              "serve it with model_transaction_policy: {decoupled: false}");
  return k->create_engine(weights, device, options);
}

}  // namespace hearth
