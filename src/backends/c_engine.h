// An Engine over a plug-in library's C table (backends/engine_abi.h): what
// a kind whose engine lives in a plug-in gives hearth-worker.
#pragma once

#include <memory>

#include "backends/engine.h"
#include "backends/engine_abi.h"

namespace hearth {

// Takes `handle` (released with table->destroy, also on failure). Checks the
// table's version, its size and that each function is there:
// FailedPrecondition otherwise.
Result<std::unique_ptr<Engine>> WrapCEngine(const HearthEngineTable* table, void* handle);

}  // namespace hearth
