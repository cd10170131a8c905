// Plug-in libraries: the shared libraries hearth-worker dlopen()s for the
// kinds whose code it does not link (libhearth_backends_cuda.so for models on
// a GPU, libhearth_backend_aoti.so for aoti). Each has its required entry
// points (cuda/cuda_backend_abi.h, aoti/aoti_backend_abi.h) and may export
// hearth_create_engine (engine_abi.h), through which it provides engines.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_backend_abi.h"
#include "backends/engine.h"
#include "backends/engine_abi.h"

namespace hearth {

// An opened library. Its handle is never closed: what it made points into it.
struct Plugin {
  std::string name;          // the library's file name
  std::string path;          // the file opened
  std::vector<void*> entry;  // its required entry points, in the order asked
  // HEARTH_CREATE_ENGINE, optional: null when the library provides no engines.
  HearthCreateEngineFn create_engine = nullptr;
};

// The running executable's directory; empty if /proc cannot say.
std::string ExecutableDir();

// Opens the library `name` and resolves `symbols` (all required) and
// HEARTH_CREATE_ENGINE (optional), trying in order: next to the running
// executable (an installed worker), the build tree (`build_path`, for tests
// and uninstalled builds; may be null), then the plain name through the
// loader's search path. A candidate that lacks a required symbol is skipped.
// Unavailable with every loader error when none will do.
Result<Plugin> OpenPlugin(const std::string& name, const char* build_path,
                          const std::vector<const char*>& symbols);

// The weights and options as the plug-in libraries' C entry points take
// them; views into `weights` and `options`, which must outlive it.
struct CArguments {
  std::vector<HearthCudaTensor> tensors;
  std::vector<const char*> keys, values;
  HearthCudaOptions options{};

  CArguments(const std::vector<TensorView>& weights, const BackendOptions& o);
  CArguments(const CArguments&) = delete;
  CArguments& operator=(const CArguments&) = delete;
};

// The engine of `kind` on `device`, built by `plugin`'s hearth_create_engine
// and given as an Engine (WrapCEngine). FailedPrecondition naming the kind,
// the device and the library when the library exports no
// hearth_create_engine; otherwise what the library answers.
Result<std::unique_ptr<Engine>> CreatePluginEngine(const Plugin& plugin, std::string_view kind,
                                                   const std::vector<TensorView>& weights,
                                                   Device device, const EngineOptions& options);

}  // namespace hearth
