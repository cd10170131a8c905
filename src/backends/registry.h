// The backend registry: every kind of model a worker can run, by the name a
// config's `backend:` gives. The server knows none of them: it starts
// hearth-worker, which looks the kind up here. A kind is either
//  - built in this process: `create` makes the Backend from the attached
//    weights (the CPU backends, the CUDA library's, which are loaded with
//    dlopen when a model is on a GPU), and `signature` says what it takes
//    and gives without building it; `create_engine` makes the Engine
//    (backends/engine.h) that serves the kind's decoupled models. A kind
//    has either or both; or
//  - a program that serves the worker protocol itself (the Python backend):
//    `program` says what to exec in place of hearth-worker, with the same
//    descriptors and arguments.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backends/backend.h"
#include "backends/engine.h"

namespace hearth {

// What to exec for a program-backed kind: argv[0] is the executable, found
// through PATH when it has no '/'; `env` entries replace those of the same
// name in the environment.
struct ProgramLaunch {
  std::vector<std::string> argv;
  std::vector<std::string> env;
};

struct BackendKind {
  std::string name;
  std::string summary;  // one line, for errors and --help
  std::function<Result<std::unique_ptr<Backend>>(const std::vector<TensorView>& weights,
                                                 Device device, const BackendOptions& options)>
      create;
  std::function<Result<std::pair<std::vector<IoSpec>, std::vector<IoSpec>>>(
      const std::vector<TensorView>& weights)>
      signature;
  std::function<Result<std::unique_ptr<Engine>>(const std::vector<TensorView>& weights,
                                                Device device, const EngineOptions& options)>
      create_engine;
  std::function<Result<ProgramLaunch>(const BackendOptions& options)> program;
  // Optional, for a kind built in this process: loads ahead of `create`
  // what it will need (a plug-in library and what that links), without
  // touching any device, so that a standby worker can do it before it knows
  // its model version. Its failure is create's to report.
  std::function<void()> preload;
};

// Adds a kind; AlreadyExists-like InvalidArgument if the name is taken.
Status RegisterBackendKind(BackendKind kind);
// nullptr if unknown.
const BackendKind* FindBackendKind(std::string_view name);
// The names, sorted.
std::vector<std::string> BackendKindNames();
// InvalidArgument "unknown backend kind 'x' (known: a, b, c)".
Status UnknownBackendKind(std::string_view name);

}  // namespace hearth
