// The model repository: DIR/<model>/config.yaml and
// DIR/<model>/<version>/model.safetensors. Config field names follow
// Triton's model configuration. A model whose config or checkpoint is wrong
// is reported (file, line, field) and not served; the others are.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

struct IoConfig {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;  // per sample
};

struct ModelConfig {
  std::string name;
  std::string config_path;
  std::string backend;  // mlp | scale
  int max_batch_size = 0;
  std::vector<IoConfig> inputs, outputs;
  int instance_count = 1;
  bool kind_gpu = true;  // instance_group.kind: KIND_GPU (default) or KIND_CPU
  std::vector<int> gpus;
  uint64_t max_queue_delay_us = 0;
  std::vector<int> preferred_batch_sizes;
  uint64_t max_queue_size = 1024;
  // dynamic_batching.default_queue_policy.default_timeout_microseconds; 0 = none.
  uint64_t default_timeout_us = 0;
  std::map<std::string, std::string> parameters;
  bool allow_tf32 = false;
  // parameters.fault_injection: a worker fails this way (abort, segv, hang,
  // cuda_illegal_address) on any batch holding an input element equal to
  // fault_on_value. Empty: off.
  std::string fault_kind;
  double fault_on_value = 0;
  uint64_t version = 0;  // the repository version served
  std::string checkpoint_path;
};

struct RepositoryModel {
  std::string name;
  Status status;  // not OK: why the model is not served
  ModelConfig config;
};

// Reads every model directory under `dir`. Fails only if `dir` itself cannot be read.
Result<std::vector<RepositoryModel>> ScanRepository(const std::string& dir);

// Parses one config.yaml (exposed for tests). `model_dir` is DIR/<model>.
Result<ModelConfig> LoadModelConfig(const std::string& model_dir);

// "TYPE_FP32" <-> DType.
std::optional<DType> ParseTritonDataType(std::string_view name);

}  // namespace hearth
