// A C++ Engine (backends/engine.h) given to a C caller through the table of
// backends/engine_abi.h: the plug-in library's side of that ABI, the inverse
// of WrapCEngine (backends/c_engine.h). A library that provides engines
// lists its kinds (ExportedEngines) and implements hearth_create_engine with
// CreateExportedEngine; everything else (the table, the sink, the views of
// each request, the errors) is here.
//
// No exception leaves a function of the table. add and step turn one into
// Internal naming the engine, the function and what it said; the functions
// that have no error to return log it and answer as an engine that fails
// safe: capacity 0 (the worker refuses an engine that holds fewer requests
// than its config's max_streams), device_memory_bytes 0, busy 1 (so that
// the next step reports the failure), cancel nothing more.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "backends/engine.h"
#include "backends/engine_abi.h"

namespace hearth {

// Gives `engine` to a C caller: *table (one static table for every engine
// exported this way, in this library) and *handle, which owns the engine
// until table->destroy(handle). `name` (the kind) is for error messages.
// The table's sink callbacks are the ResponseSink the engine's Step gets;
// the table keeps what the engine's EngineRequest views need (the array of
// its inputs) until the request ends. Internal, nothing given, if the
// engine's inputs() or outputs() throw.
Status ExportEngine(std::unique_ptr<Engine> engine, std::string_view name,
                    const HearthEngineTable** table, void** handle) noexcept;

// A kind of engine a library provides: its name and its factory, which gets
// the weights as views (checked: well formed, all on `device`), the device
// and the options of the C call (EngineOptions::inputs and outputs empty:
// the C call has none).
struct ExportedEngineKind {
  const char* name;
  Result<std::unique_ptr<Engine>> (*create)(const std::vector<TensorView>& weights, Device device,
                                            const EngineOptions& options);
};

// The engines of one library.
struct ExportedEngines {
  const char* library;  // its file name, for error messages
  std::span<const ExportedEngineKind> kinds;
  // The device kinds its engines are built on; a call for another is
  // refused (InvalidArgument).
  bool on_host = true;
  bool on_cuda = true;
};

// The body of a library's hearth_create_engine (HearthCreateEngineFn, whose
// arguments follow `engines`): checks abi_version (FailedPrecondition naming
// both versions), the arguments (InvalidArgument) and the kind
// (FailedPrecondition naming it and the library's kinds), builds the engine
// with its factory and exports it. An exception thrown by the factory is
// Internal; none leaves.
int CreateExportedEngine(const ExportedEngines& engines, uint32_t abi_version, const char* kind,
                         const HearthCudaTensor* weights, size_t num_weights, int32_t device_kind,
                         int32_t device_index, const HearthEngineOptions* options,
                         const HearthEngineTable** table, void** engine, char* error,
                         size_t error_size) noexcept;

}  // namespace hearth
