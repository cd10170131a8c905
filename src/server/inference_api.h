// The server's request API: what the HTTP front-end calls. No CUDA, no
// device pointers, no sockets: tensors travel as host bytes, owned or viewed
// (TensorData), so that the front-end and the server copy them only where
// docs/data-plane.md says.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "common/datatype.h"
#include "hearth/dtype.h"
#include "hearth/status.h"
#include "server/local_peer.h"

namespace hearth {

struct TensorMetadata {
  std::string name;
  DType dtype = DType::kF32;
  // Full shape as KServe reports it: -1 for the batch dimension when the
  // model batches (max_batch_size > 0), then the config's dims.
  std::vector<int64_t> shape;
  bool optional = false;  // an input a request may leave out
};

struct ModelMetadata {
  std::string name;
  std::vector<std::string> versions;  // served versions, as strings
  std::string platform;               // "hearth_mlp", "hearth_scale"
  int max_batch_size = 0;
  std::vector<TensorMetadata> inputs;
  std::vector<TensorMetadata> outputs;
  // The config's model_transaction_policy.decoupled: any number of
  // responses per request (a stream), each request run alone.
  bool decoupled = false;
  // The config has sequence_batching: every request names its sequence.
  bool sequence = false;
};

// The bytes of one tensor, row-major, little-endian, held in one of three ways:
//   owned     in a vector of this object: JSON inputs, decoded into their
//             datatype; outputs that a service builds itself.
//   shared    a read-only view into a buffer that `owner` keeps alive. The
//             front-end hands binary inputs over this way: views into the
//             HTTP request body, never copied before the server assembles its
//             batch. Copies of a shared TensorData share the owner.
//   borrowed  a read-only view with no owner, valid for as long as whoever
//             hands it out says. Infer's `done` receives outputs borrowed from
//             the server's memory (the worker's slot) that are valid only
//             until `done` returns (see InferenceService::Infer).
// Nobody writes viewed bytes while a view of them exists, so a const
// TensorData may be read from several threads.
class TensorData {
 public:
  TensorData() = default;
  // Owned bytes. Implicit, so that `tensor.data = std::move(bytes)` reads well.
  TensorData(std::vector<std::byte> bytes) : owned_(std::move(bytes)) {}  // NOLINT

  static TensorData Shared(std::span<const std::byte> bytes, std::shared_ptr<const void> owner) {
    TensorData data;
    data.view_ = bytes;
    data.is_view_ = true;
    data.owner_ = std::move(owner);
    return data;
  }
  static TensorData Borrowed(std::span<const std::byte> bytes) {
    TensorData data;
    data.view_ = bytes;
    data.is_view_ = true;
    return data;
  }

  std::span<const std::byte> bytes() const {
    return is_view_ ? view_ : std::span<const std::byte>(owned_);
  }
  const std::byte* data() const { return bytes().data(); }
  size_t size() const { return bytes().size(); }
  bool empty() const { return size() == 0; }
  // A view (shared or borrowed) rather than owned bytes.
  bool is_view() const { return is_view_; }
  // A view whose lifetime nobody here guarantees.
  bool is_borrowed() const { return is_view_ && owner_ == nullptr; }

 private:
  std::vector<std::byte> owned_;
  std::span<const std::byte> view_;
  bool is_view_ = false;
  std::shared_ptr<const void> owner_;
};

// A parameter of a request, or of one of its inputs or outputs, as the
// client wrote it: KServe's `parameters` map, from JSON (REST) or protobuf
// (gRPC). The front-ends keep the parameters of their own syntax
// (binary_data, binary_data_size, binary_data_output,
// triton_enable_empty_final_response) and hand every other one on as it
// came; the server applies KServe's rules to them (server/request_admission.h).
struct JsonText {
  std::string text;  // one JSON value as written: a fraction, null, an array, an object
  bool operator==(const JsonText&) const = default;
};
struct Parameter {
  std::string name;
  // monostate: a protobuf parameter with no value set. Integers that fit
  // are int64_t (uint64_t above INT64_MAX); a JSON number that is not one,
  // or any other JSON value, is JsonText.
  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, JsonText> value;
};
using Parameters = std::vector<Parameter>;

// A registered CUDA shared-memory region as the server holds it (defined
// in server/shared_memory.h; front-ends never look inside).
struct CudaSharedMemoryEntry;

// Bytes in a registered shared-memory region, system or CUDA (Triton's
// shared_memory_region, shared_memory_offset and shared_memory_byte_size
// parameters), in place of a body's bytes.
struct SharedMemoryRef {
  SharedMemoryRef() = default;
  // {region, offset, byte_size} reads as the parameters do.
  SharedMemoryRef(std::string name, uint64_t at, uint64_t bytes,
                  std::shared_ptr<const CudaSharedMemoryEntry> entry = nullptr)
      : region(std::move(name)), offset(at), byte_size(bytes), cuda(std::move(entry)) {}

  std::string region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  // Set by the service when `region` is a CUDA region: the registration it
  // found, which the request holds until it is answered (unregistering the
  // name meanwhile does not take it away). Front-ends leave it empty.
  std::shared_ptr<const CudaSharedMemoryEntry> cuda;
};

struct InferTensor {
  InferTensor() = default;
  InferTensor(std::string tensor, DType type, std::vector<int64_t> dims,  // NOLINT
              TensorData bytes = {})
      : name(std::move(tensor)), dtype(type), shape(std::move(dims)), data(std::move(bytes)) {}

  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  TensorData data;
  // An input whose bytes are in a region (data empty until the service
  // reads them); in a response, an output the service wrote to the region
  // the request named for it (data empty). Set by the service from
  // `parameters` (shared_memory_region, _offset, _byte_size).
  std::optional<SharedMemoryRef> shm;
  // An input's parameters as the client sent them (see Parameter).
  Parameters parameters;
};

struct RequestedOutput {
  RequestedOutput() = default;
  RequestedOutput(std::string output, bool binary_data)  // NOLINT: {name, binary} reads well
      : name(std::move(output)), binary(binary_data) {}

  std::string name;
  bool binary = false;
  // Triton's classification (parameter "classification"): > 0 answers this
  // output's top class_count entries per row as BYTES "value:index",
  // highest first, instead of the tensor.
  uint32_t class_count = 0;
  // Written to this region instead of the response body; the output's
  // bytes must fit in byte_size.
  std::optional<SharedMemoryRef> shm;
  // The output's parameters as the client sent them (see Parameter):
  // class_count and shm are set from them by the service.
  Parameters parameters;
};

struct InferResponse;

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
  // Triton's priority level (parameter "priority"): 1 is the highest; 0 the
  // model's default (dynamic_batching.default_priority_level). Requests of
  // a higher level are run first; within a level, in order of arrival.
  uint64_t priority = 0;
  // Triton's sequence parameters (a model with sequence_batching): the
  // sequence's id, an unsigned integer or a string (sequence_id, which
  // Triton's clients send as either; empty: none), and whether this request
  // starts or ends it.
  std::string sequence_id;
  bool sequence_id_is_string = false;
  uint64_t sequence_number = 0;  // sequence_id as an integer (0 when a string)
  bool sequence_start = false;
  bool sequence_end = false;
  // The request's parameters as the client sent them (see Parameter). The
  // service takes timeout, priority and the sequence_* ones from them and
  // adds every other one to parameters_json.
  Parameters parameters;
  // The request's parameters for the model, as a JSON object's text
  // ({"max_tokens": 16, "stop": ["\n"]}); empty: none. Decoupled models get
  // them (the Python backend's `execute(inputs, parameters)`). A front-end
  // whose syntax gives the model's parameters apart (the generate
  // extension, OpenAI's fields) sets it directly.
  std::string parameters_json;

  // Streaming, for decoupled models. Set: each response before the last is
  // handed to on_response as it comes, in order, on the server's thread;
  // its outputs are borrowed and valid only until it returns (as `done`'s).
  // It returns false to stop the request (its client is gone, or cannot
  // keep up): the model is told to stop within one step, and `done` follows.
  // Unset: the request is answered once, by `done`, with each BYTES
  // output's pieces joined in order (element by element), each vector
  // output of any length (dims [-1], such as token ids) its pieces one
  // after the other, and every other output as its last response gave it.
  std::function<bool(const InferResponse&)> on_response;
  // Set true (from any thread) when the client goes away: the server stops
  // the request, queued or running, within one step of the model.
  std::shared_ptr<std::atomic<bool>> cancelled;
};

// Triton's load with overrides (the "config" and "file:" parameters of a
// repository load): the model's config as Triton's JSON form, in place of
// its config file; and files, each by its path in the model's directory
// ("1/model.py", "config.pbtxt" excluded), which then stand for the whole
// directory (the config is needed with them). Checked by the service
// (ModelLoadOverrides' limits below).
struct ModelLoadOverrides {
  std::string config_json;                                 // empty: none
  std::vector<std::pair<std::string, std::string>> files;  // path, bytes
  bool empty() const { return config_json.empty() && files.empty(); }
};
inline constexpr size_t kMaxOverrideFiles = 256;
inline constexpr uint64_t kMaxOverrideBytes = 64ull << 20;  // the files together
inline constexpr size_t kMaxOverridePathBytes = 1024;

struct InferResponse {
  std::string model;
  std::string version;
  std::string id;
  std::vector<InferTensor> outputs;
};

// Triton's statistics of a model version (its /stats and ModelStatistics).
struct DurationStatistics {
  uint64_t count = 0;
  uint64_t ns = 0;  // summed
};

struct BatchStatistics {
  int64_t batch_size = 0;
  DurationStatistics compute_input, compute_infer, compute_output;
};

struct ModelStatistics {
  std::string name;
  std::string version;
  uint64_t last_inference_ms = 0;  // ms since the Unix epoch; 0: none yet
  uint64_t inference_count = 0;    // rows inferred, every batch member counted
  uint64_t execution_count = 0;    // batches run
  DurationStatistics success, fail, queue, compute_input, compute_infer, compute_output;
  std::vector<BatchStatistics> batch_stats;  // batch sizes that ran, ascending
  // A decoupled model's streams (hearth's own, beside Triton's fields): in
  // flight now on each worker (by worker index), opened on a worker (a
  // resumed one again), resumed after their worker died, responses taken,
  // token ids in them.
  struct Streams {
    std::vector<uint64_t> in_flight;
    uint64_t opened = 0, resumed = 0, responses = 0, tokens = 0;
  };
  std::optional<Streams> streams;  // set for a decoupled model
};

// A registered system shared-memory region (its status).
struct SharedMemoryRegion {
  std::string name;
  std::string key;  // the POSIX shared-memory object, "/name"
  uint64_t offset = 0;
  uint64_t byte_size = 0;
};

// A registered CUDA shared-memory region (its status, Triton's fields).
struct CudaSharedMemoryRegion {
  std::string name;
  int64_t device_id = 0;
  uint64_t byte_size = 0;
};

// One model of the repository (its index).
struct RepositoryEntry {
  std::string name;
  std::string version;  // the served version; empty when none
  std::string state;    // READY, UNAVAILABLE or LOADING, as Triton names them
  std::string reason;   // why not READY
};

// The worker processes of a served model, per placement (GET
// /v2/hearth/workers, `hearth status --url`). A pid of -1: none running
// (between a worker's death and its replacement).
struct WorkerInfo {
  int index = 0;  // among the model's workers
  int64_t pid = -1;
  bool ready = false;  // serving
  uint64_t restarts = 0;
  uint64_t device_memory_bytes = 0;  // its backend's own buffers, as it reported them
  uint64_t streams = 0;              // a decoupled model's: the streams it holds now
  // What the NVIDIA driver accounts to its process (as nvidia-smi shows it:
  // its CUDA context included); unknown off a GPU, without NVML, or where
  // the driver does not list the pid (server/device_process_memory.h).
  std::optional<uint64_t> driver_device_memory_bytes = std::nullopt;
};

// A standby worker (parameters.standby_mode: cold): started, waiting with
// no device context.
struct StandbyInfo {
  int64_t pid = -1;
};

// A hot spare (parameters.standby_mode: hot): ready and warmed up.
struct HotSpareInfo {
  int64_t pid = -1;
  uint64_t device_memory_bytes = 0;  // its backend's own buffers, as it reported them
  uint64_t warm_up_us = 0;           // its warm-up batch, from the run sent to the answer
  std::optional<uint64_t> driver_device_memory_bytes = std::nullopt;  // as WorkerInfo's
};

struct PlacementWorkers {
  std::string device;  // "cpu", "cuda:N", "hostN"
  std::vector<WorkerInfo> workers;
  std::vector<StandbyInfo> standbys;
  std::vector<HotSpareInfo> hot_spares;
};

struct ModelWorkers {
  std::string name;
  std::string version;
  std::string standby_mode;  // "cold" or "hot"
  int standby_workers = 0;   // per placement, as configured
  std::vector<PlacementWorkers> placements;
};

// Status codes map to HTTP: InvalidArgument 400, NotFound 404,
// ResourceExhausted 503 (queue full), Unavailable 503, FailedPrecondition 400,
// DeadlineExceeded 504 (the request timed out before it ran),
// anything else 500.
// The newer members (configuration, statistics, repository control, shared
// memory) answer Unimplemented unless a service has them, so that a service
// made for one purpose (a test's fake) need not.
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
  // OK(true) when the model can run requests. NotFound for unknown models or
  // versions; Unavailable, whose message says why (the path and reason of a
  // model whose directory, config or checkpoint is wrong, or that no worker
  // is ready), when known but not ready. OK(false) is also "not ready", with
  // no reason to give.
  virtual Result<bool> ModelReady(const std::string& model, const std::string& version) const = 0;
  // The names of the models the repository holds, sorted (ready or not).
  virtual std::vector<std::string> ModelNames() const = 0;
  // Runs a request as a front-end converted it from its syntax: the
  // service applies KServe's rules to its parameters and checks it against
  // the model (AdmitInferRequest, server/request_admission.h), answering
  // InvalidArgument through `done` as for any other fault. `done` is called
  // exactly once, from any thread: after every on_response call, with the
  // final response (for a stream it may have no outputs: the stream simply
  // ended) or the error (for a stream, after some responses: the stream
  // broke, e.g. its worker died; it is not retried).
  //
  // Lifetimes: the service may keep `request`, and with it the buffers its
  // inputs share, until it calls `done`. The outputs `done` receives may be
  // borrowed (TensorData::Borrowed) from the service's memory and are then
  // valid only until `done` returns: a caller that needs them later copies
  // them inside `done`. Meanwhile the service does not reuse that memory, so
  // `done` should be quick.
  virtual void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) = 0;
  // Prometheus text exposition format (version 0.0.4) for GET /metrics.
  virtual std::string MetricsText() const = 0;
  // The model's configuration in Triton's JSON form (its /config and
  // ModelConfig). NotFound and Unavailable as Metadata.
  virtual Result<std::string> ModelConfigJson(const std::string& model,
                                              const std::string& version) const {
    return Unimplemented("model configurations are not kept here (" + model + ", " + version + ")");
  }
  // Statistics of one model (version empty: its served version), or of
  // every served model when `model` is empty.
  virtual Result<std::vector<ModelStatistics>> Statistics(const std::string& model,
                                                          const std::string& version) const {
    return Unimplemented("statistics are not kept here (" + model + ", " + version + ")");
  }
  // Every model of the repository, sorted by name; only the ready ones when
  // `ready_only`.
  virtual std::vector<RepositoryEntry> RepositoryIndex(bool /*ready_only*/) const { return {}; }
  // Every served model's worker processes, standbys and hot spares, sorted
  // by model name.
  virtual Result<std::vector<ModelWorkers>> Workers() const {
    return Unimplemented("no worker processes here");
  }
  // Repository control. Each call returns at once; `done` is called
  // exactly once, from any thread, when the work is over (or at once when
  // it is refused: ResourceExhausted when the service's bounded pool for
  // these is full, Unavailable when it is stopping).
  //
  // LoadModel serves the model's directory as it is now, while its
  // requests go on: a model not served starts; a served one gets a new
  // runtime (the new version's weights into the store, or the same
  // weights with the new config), requests move to it once one of its
  // workers is ready, and the old workers run what they had queued and
  // exit (the old weights are freed when the last of them detaches). Done
  // once the new runtime serves, or with why not (the old one then goes on
  // serving). NotFound for a name with no directory in the repository.
  virtual void LoadModel(const std::string& model, std::function<void(Status)> done) {
    done(Unimplemented("no repository control here (load " + model + ")"));
  }
  // The same with Triton's overrides (none: as LoadModel above). The model
  // is served from them until its next load, which goes back to its
  // directory unless it gives overrides again. InvalidArgument naming what
  // is wrong with them; NotFound for a model the repository lacks (only a
  // model of the repository may be overridden).
  virtual void LoadModelWith(const std::string& model, ModelLoadOverrides overrides,
                             std::function<void(Status)> done) {
    if (overrides.empty()) return LoadModel(model, std::move(done));
    done(Unimplemented("no load with overrides here (load " + model + ")"));
  }
  // UnloadModel stops serving the model: new requests are refused
  // (Unavailable), the queued ones still run; its weights are freed when
  // its workers exit.
  virtual void UnloadModel(const std::string& model, std::function<void(Status)> done) {
    done(Unimplemented("no repository control here (unload " + model + ")"));
  }
  // System shared memory (Triton's extension): registers `byte_size` bytes
  // at `offset` of the POSIX shared-memory object `key` under `name`, for
  // requests to read inputs from and write outputs to. `client` is the
  // connection that asks: only a process on this machine, of a user the
  // server lets use shared memory, may register, and only an object of its
  // own user, a regular file its owner may read and write and nobody else
  // may write (PermissionDenied otherwise, saying why); the range must lie
  // inside it. AlreadyExists for a taken name.
  virtual Status RegisterSystemSharedMemory(const ClientConnection& /*client*/,
                                            const std::string& name, const std::string& /*key*/,
                                            uint64_t /*offset*/, uint64_t /*byte_size*/) {
    return Unimplemented("no shared memory here (" + name + ")");
  }
  // Unregisters `name` (empty: every region); requests using it finish first.
  virtual Status UnregisterSystemSharedMemory(const std::string& name) {
    return Unimplemented("no shared memory here (" + name + ")");
  }
  // The regions (empty name: all of them); NotFound for an unknown name.
  virtual Result<std::vector<SharedMemoryRegion>> SystemSharedMemoryStatus(
      const std::string& name) const {
    return Unimplemented("no shared memory here (" + name + ")");
  }
  // CUDA shared memory (Triton's extension): registers `byte_size` bytes of
  // device memory that a client exported with cudaIpcGetMemHandle on GPU
  // `device_id`, its 64-byte handle as the client sent it, under `name`
  // (unique among system and CUDA regions alike). Inputs in it are copied
  // device to device into the worker, outputs back into it. The handle is
  // opaque here: the worker opens it and checks it at first use.
  // InvalidArgument for a handle of another size, a device this server does
  // not use (or a server without a GPU), a byte_size of 0; PermissionDenied
  // unless `client` is a process on this machine of a user the server lets
  // use shared memory (the handle is a capability: whoever holds its bytes
  // can open the memory it names).
  virtual Status RegisterCudaSharedMemory(const ClientConnection& /*client*/,
                                          const std::string& name,
                                          std::span<const std::byte> /*raw_handle*/,
                                          int64_t /*device_id*/, uint64_t /*byte_size*/) {
    return Unimplemented("no CUDA shared memory here (" + name + ")");
  }
  // A service without CUDA shared memory has no regions: listing or
  // unregistering all of them succeeds (perf_analyzer does both on every
  // run), a named one is unknown.
  virtual Status UnregisterCudaSharedMemory(const std::string& name) {
    if (name.empty()) return Status::Ok();
    return NotFound("no CUDA shared-memory region named '" + name + "' is registered");
  }
  virtual Result<std::vector<CudaSharedMemoryRegion>> CudaSharedMemoryStatus(
      const std::string& name) const {
    if (name.empty()) return std::vector<CudaSharedMemoryRegion>{};
    return NotFound("no CUDA shared-memory region named '" + name + "' is registered");
  }
};

}  // namespace hearth
