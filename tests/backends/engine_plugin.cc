// A plug-in library for plugin_engine_test.cc, built twice by the tests'
// CMake: libhearth_test_engine_plugin.so exports its entry point
// hearth_test_plugin_name and hearth_create_engine (two kinds, through
// backends/engine_export.h); libhearth_test_plain_plugin.so (built with
// HEARTH_TEST_PLUGIN_WITHOUT_ENGINES) exports the entry point only, as a
// library that serves its kinds as backends.
#include <stdexcept>
#include <string>

#include "backends/engine.h"
#include "backends/engine_abi.h"
#include "backends/engine_export.h"

extern "C" __attribute__((visibility("default"))) const char* hearth_test_plugin_name() {
#ifdef HEARTH_TEST_PLUGIN_WITHOUT_ENGINES
  return "plain";
#else
  return "engines";
#endif
}

#ifndef HEARTH_TEST_PLUGIN_WITHOUT_ENGINES
namespace hearth {
namespace {

constexpr ExportedEngineKind kKinds[] = {
    {"plugin_count", [](const std::vector<TensorView>&, Device,
                        const EngineOptions& options) { return CreateCountEngine(options); }},
    {"plugin_throws",
     [](const std::vector<TensorView>&, Device, const EngineOptions&)
         -> Result<std::unique_ptr<Engine>> { throw std::runtime_error("thrown in the plug-in"); }},
    // Refuses, naming the config's inputs and outputs as they crossed the ABI.
    {"plugin_signature",
     [](const std::vector<TensorView>&, Device,
        const EngineOptions& options) -> Result<std::unique_ptr<Engine>> {
       std::string seen;
       for (const auto* list : {&options.inputs, &options.outputs}) {
         seen += list == &options.inputs ? "inputs:" : "; outputs:";
         for (const IoSpec& s : *list)
           seen += " " + s.name + " " + std::string(DTypeName(s.dtype)) + " " + ShapeString(s.dims);
       }
       return InvalidArgument(seen);
     }},
};

constexpr ExportedEngines kEngines{"libhearth_test_engine_plugin.so", kKinds};

}  // namespace
}  // namespace hearth

extern "C" __attribute__((visibility("default"))) int hearth_create_engine(
    uint32_t abi_version, const char* kind, const HearthCudaTensor* weights, size_t num_weights,
    int32_t device_kind, int32_t device_index, const HearthEngineOptions* options,
    const HearthEngineTable** table, void** engine, char* error, size_t error_size) {
  return hearth::CreateExportedEngine(hearth::kEngines, abi_version, kind, weights, num_weights,
                                      device_kind, device_index, options, table, engine, error,
                                      error_size);
}
#endif
