// An Engine over a plug-in library's C table (backends/engine_abi.h): what
// a kind whose engine lives in a plug-in gives hearth-worker.
#pragma once

#include <memory>
#include <vector>

#include "backends/engine.h"
#include "backends/engine_abi.h"

namespace hearth {

// Takes `handle` (released with table->destroy, also on failure). Checks the
// table's version, its size and that each function is there:
// FailedPrecondition otherwise.
Result<std::unique_ptr<Engine>> WrapCEngine(const HearthEngineTable* table, void* handle);

// Specs as the C ABI passes them: views of `specs`' names and dims, valid
// while `specs` lives unchanged.
inline std::vector<HearthEngineSpec> EngineSpecs(const std::vector<IoSpec>& specs) {
  std::vector<HearthEngineSpec> out;
  out.reserve(specs.size());
  for (const IoSpec& s : specs)
    out.push_back({s.name.c_str(), static_cast<int32_t>(s.dtype),
                   static_cast<int32_t>(s.dims.size()), s.dims.data()});
  return out;
}

}  // namespace hearth
