// Feeds ParseModelConfig arbitrary config.yaml texts and checks every config
// it accepts against the limits model_config.h states. Aliases, merge keys
// and over-large documents must be refused at once: an input that makes the
// parser slow (libFuzzer's -timeout) is a failure too.
//
// Input: the text of a config.yaml, for a model directory `fuzzmodel` with
// one version (1/model.safetensors, empty: it is never read).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "server/model_config.h"

namespace {

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

// A model directory with one version, made once per process.
const std::string& ModelDirectory() {
  static const std::string dir = [] {
    char root[] = "/tmp/hearth-config-fuzz-XXXXXX";
    Require(::mkdtemp(root) != nullptr, "a temporary directory");
    const std::filesystem::path model = std::filesystem::path(root) / "fuzzmodel";
    std::filesystem::create_directories(model / "1");
    std::ofstream(model / "1" / "model.safetensors") << "";
    return model.string();
  }();
  return dir;
}

void CheckAccepted(const hearth::ModelConfig& c) {
  Require(c.name == "fuzzmodel", "the name is the directory's");
  Require(c.version == 1, "the one version");
  Require(!c.backend.empty() && c.backend.size() <= 64, "a backend name");
  Require(c.max_batch_size >= 0 && c.max_batch_size <= 4096, "max_batch_size in range");
  Require(c.inputs.empty() == c.outputs.empty(), "inputs and outputs, or neither");
  for (const auto* ios : {&c.inputs, &c.outputs}) {
    Require(ios->size() <= hearth::kMaxModelTensors, "tensor limit");
    for (const hearth::IoConfig& io : *ios) {
      Require(!io.name.empty() && io.name.size() <= hearth::kMaxTensorNameBytes, "tensor name");
      Require(!io.dims.empty() && io.dims.size() <= hearth::kMaxModelTensorRank, "tensor rank");
      for (int64_t d : io.dims) Require(d > 0 || d == -1, "dimensions positive or -1");
    }
  }
  Require(c.instance_groups.size() <= hearth::kMaxInstanceGroups, "instance group limit");
  for (const hearth::InstanceGroup& g : c.instance_groups) {
    Require(g.count >= 1 && g.count <= hearth::kMaxGroupInstances, "instance count in range");
    for (int gpu : g.gpus) Require(gpu >= 0 && gpu < hearth::kMaxGpuOrdinal, "GPU ordinal");
  }
  Require(c.max_queue_delay_us <= hearth::kMaxQueueDelayUs, "queue delay limit");
  Require(c.parameters.size() <= hearth::kMaxModelParameters, "parameter limit");
  size_t bytes = 0;
  for (const auto& [key, value] : c.parameters) bytes += key.size() + value.size();
  Require(bytes <= hearth::kMaxModelParameterBytes, "parameter bytes limit");
  Require(c.standby_workers >= 0 && c.standby_workers <= hearth::kMaxStandbyWorkers,
          "standby workers in range");
  Require(!c.standby_hot || c.standby_workers > 0, "hot spares only with standby workers");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > hearth::kMaxConfigBytes) return 0;  // refused before it is parsed
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::string& dir = ModelDirectory();
  hearth::Result<hearth::ModelConfig> config = hearth::ParseModelConfig(dir, text);
  if (config.ok()) {
    CheckAccepted(*config);
  } else {
    Require(config.status().code() == hearth::StatusCode::kInvalidArgument, "InvalidArgument");
    Require(config.status().message().starts_with(dir + "/config.yaml"),
            "the error names the file");
  }
  return 0;
}
