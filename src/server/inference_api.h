// The server's request API: what the HTTP front-end calls. No CUDA, no
// device pointers, no sockets: tensors travel as host bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

// KServe v2 datatype names ("FP32", "INT64", "BOOL", "BYTES" is not supported).
std::string_view KserveDatatypeName(DType dtype);
std::optional<DType> ParseKserveDatatype(std::string_view name);

struct TensorMetadata {
  std::string name;
  DType dtype = DType::kF32;
  // Full shape as KServe reports it: -1 for the batch dimension when the
  // model batches (max_batch_size > 0), then the config's dims.
  std::vector<int64_t> shape;
};

struct ModelMetadata {
  std::string name;
  std::vector<std::string> versions;  // served versions, as strings
  std::string platform;  // "hearth_mlp", "hearth_scale"
  int max_batch_size = 0;
  std::vector<TensorMetadata> inputs;
  std::vector<TensorMetadata> outputs;
};

// A tensor's bytes, row-major, little-endian.
struct InferTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;
};

struct RequestedOutput {
  std::string name;
  bool binary = false;
};

struct InferRequest {
  std::string model;
  std::string version;  // empty: the served version
  std::string id;
  std::vector<InferTensor> inputs;
  // Empty: all outputs, each binary iff binary_data_output.
  std::vector<RequestedOutput> outputs;
  bool binary_data_output = false;
  // Per-request timeout in microseconds (parameter "timeout"); 0 = none.
  uint64_t timeout_us = 0;
};

struct InferResponse {
  std::string model;
  std::string version;
  std::string id;
  std::vector<InferTensor> outputs;
};

// Status codes map to HTTP: InvalidArgument 400, NotFound 404,
// ResourceExhausted 503 (queue full), Unavailable 503, FailedPrecondition 400,
// DeadlineExceeded 504 (the request timed out before it ran),
// anything else 500.
class InferenceService {
 public:
  virtual ~InferenceService() = default;
  virtual bool Live() const = 0;
  virtual bool Ready() const = 0;
  // Server name, version and extensions for GET /v2.
  virtual std::string ServerName() const = 0;
  virtual std::string ServerVersion() const = 0;
  virtual std::vector<std::string> Extensions() const = 0;
  // version empty = the served version.
  virtual Result<ModelMetadata> Metadata(const std::string& model,
                                         const std::string& version) const = 0;
  // NotFound for unknown models or versions; OK(false) when known but not ready.
  virtual Result<bool> ModelReady(const std::string& model, const std::string& version) const = 0;
  // Runs a request that the front-end has already checked against
  // Metadata() (names, datatypes, shapes, batch size). `done` is called
  // exactly once, from any thread.
  virtual void Infer(InferRequest request,
                     std::function<void(Result<InferResponse>)> done) = 0;
  // Prometheus text exposition format (version 0.0.4) for GET /metrics.
  virtual std::string MetricsText() const = 0;
};

}  // namespace hearth
