// Test support: an InferenceService for the front-ends' tests, made of a
// table of models that each test file defines, and of what every such
// test needs of a service written once: shared-memory regions, repository
// control, a gate that holds requests and loads, a record of what arrived
// and of each request that finished, and waits on all of it (bounded at
// 60 s, which is a failure, never a timing).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/task_pool.h"
#include "server/inference_api.h"

namespace hearth::testing {

class FakeService;

// How a model runs one request (see FakeModel::run).
using ModelRun = std::function<Result<InferResponse>(FakeService& fake, InferRequest& request)>;

// One model of the fake: what it says of itself and how it runs requests.
struct FakeModel {
  ModelMetadata metadata;  // versions {"1"} when left empty
  // ModelReady's answer: true, false (not ready, no reason given), or an
  // error (Unavailable, saying why).
  Result<bool> ready = true;
  std::optional<std::string> config_json;     // unset: Unimplemented
  std::optional<ModelStatistics> statistics;  // unset: none to report
  // Held before it runs until OpenGate(): on no thread, so that the
  // requests behind it go on.
  bool gated = false;
  // Run on a thread of its own rather than the fake's one worker: for a
  // model that blocks (AwaitGate, AwaitCancel) or streams without end.
  bool own_thread = false;
  // Runs one request (off the caller's thread) and returns what `done` is
  // given. A decoupled model calls request.on_response before returning;
  // the fake lends it each response's outputs as the server does. Unset:
  // Infer fails Internal.
  ModelRun run;
};

// A model of these tensors (version "1"); the other fields as FakeModel's
// defaults, for the caller to set.
FakeModel MakeModel(std::string name, std::string platform, int max_batch_size,
                    std::vector<TensorMetadata> inputs, std::vector<TensorMetadata> outputs,
                    ModelRun run = nullptr);

// What the fake saw of one request once `done` had been called.
struct Seen {
  std::string model;
  std::string id;
  std::string parameters_json;
  std::vector<InferTensor> inputs;  // as they came, bytes copied (owned)
  bool streamed = false;            // on_response was set
  bool cancelled = false;           // `cancelled` was true when it finished
  int accepted = 0;                 // on_response calls that returned true
  bool refused = false;             // an on_response call returned false
};

struct FakeSettings {
  std::string server_name = "hearth";
  std::string server_version = "0.1.0";
  std::vector<std::string> extensions = {"binary_tensor_data"};
  std::string metrics_text;
  std::vector<RepositoryEntry> repository;  // RepositoryIndex, in this order
  // Workers' answer; unset: Unimplemented, as a service without processes.
  std::optional<std::vector<ModelWorkers>> workers;
  // LoadModel of these waits until OpenGate(). LoadModel and UnloadModel
  // of a name that is neither a model nor here are NotFound.
  std::set<std::string> parked_loads;
  // Repository loads and unloads run at once on the fake's pool, as on
  // the server's; past it they are refused ResourceExhausted.
  size_t repository_calls = 4;
  // false: InferenceService's answers of a service without CUDA shared
  // memory. true: registrations kept (the handle must have 64 bytes).
  bool cuda_shared_memory = false;
  // AlreadyExists's message for a region name that is taken.
  std::function<std::string(const std::string& name)> taken_region = [](const std::string& name) {
    return "a shared-memory region named '" + name + "' is registered";
  };
};

// Thread-safe; its models are fixed when it is made. Infer runs each
// request on the fake's worker thread, one at a time in order of arrival,
// or on a thread of its own (FakeModel::own_thread). Outputs reach `done`
// and on_response borrowed from a buffer that is spoiled as soon as they
// return, as the server's slot is reused by its next batch. Inputs in a
// system region are read from it; outputs requested with class_count are
// classified (FP32 [rows, cols] -> BYTES "value:index", highest first),
// those requested into a region are written there and answered by
// reference. Regions live in the fake's memory; the key "/missing" names
// no object.
class FakeService : public InferenceService {
 public:
  explicit FakeService(FakeSettings settings = {}, std::vector<FakeModel> models = {});
  ~FakeService() override;

  bool Live() const override { return true; }
  bool Ready() const override { return ready_.load(); }
  std::string ServerName() const override { return settings_.server_name; }
  std::string ServerVersion() const override { return settings_.server_version; }
  std::vector<std::string> Extensions() const override { return settings_.extensions; }
  std::string MetricsText() const override { return settings_.metrics_text; }
  Result<ModelMetadata> Metadata(const std::string& model,
                                 const std::string& version) const override;
  Result<bool> ModelReady(const std::string& model, const std::string& version) const override;
  std::vector<std::string> ModelNames() const override;
  Result<std::string> ModelConfigJson(const std::string& model,
                                      const std::string& version) const override;
  Result<std::vector<ModelStatistics>> Statistics(const std::string& model,
                                                  const std::string& version) const override;
  std::vector<RepositoryEntry> RepositoryIndex(bool ready_only) const override;
  Result<std::vector<ModelWorkers>> Workers() const override;
  // On the fake's pool of repository calls (FakeSettings::repository_calls).
  void LoadModel(const std::string& model, std::function<void(Status)> done) override;
  // Records the overrides ("config JSON", "file PATH=BYTES"), then loads as LoadModel.
  void LoadModelWith(const std::string& model, ModelLoadOverrides overrides,
                     std::function<void(Status)> done) override;
  void UnloadModel(const std::string& model, std::function<void(Status)> done) override;
  Status RegisterSystemSharedMemory(const ClientConnection& client, const std::string& name,
                                    const std::string& key, uint64_t offset,
                                    uint64_t byte_size) override;
  Status UnregisterSystemSharedMemory(const std::string& name) override;
  Result<std::vector<SharedMemoryRegion>> SystemSharedMemoryStatus(
      const std::string& name) const override;
  Status RegisterCudaSharedMemory(const ClientConnection& client, const std::string& name,
                                  std::span<const std::byte> raw_handle, int64_t device_id,
                                  uint64_t byte_size) override;
  Status UnregisterCudaSharedMemory(const std::string& name) override;
  Result<std::vector<CudaSharedMemoryRegion>> CudaSharedMemoryStatus(
      const std::string& name) const override;
  // Where every request enters the fake: the server's admission
  // (AdmitInferRequest) first, as Server::Infer applies it.
  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) override;

  // For models, on their own thread: wait until OpenGate() (counted as
  // parked), or until the request's `cancelled` is set (polled, as nothing
  // signals it; counted as parked; false if 60 s pass first).
  void AwaitGate();
  bool AwaitCancel(const InferRequest& request);

  // Lets every parked request and load go on, and those after them pass.
  void OpenGate();
  // Each waits at most 60 s and says whether it happened: `n` requests
  // parked in all; `n` loads parked now; a request parked before it ran
  // has `cancelled` set; `done` called `n` times in all.
  bool WaitParked(int n) {
    return WaitFor([&] { return parked_count_ >= n; });
  }
  bool WaitParkedLoads(int n) {
    return WaitFor([&] { return parked_loads_ >= n; });
  }
  bool WaitParkedCancelled();
  bool WaitDone(int n) { return WaitFinished(static_cast<size_t>(n)).has_value(); }
  // The `n`th request to finish (1: the first), or the last one to finish
  // that `match`es; nullopt after 60 s.
  std::optional<Seen> WaitFinished(size_t n);
  template <typename Match>
  std::optional<Seen> WaitSeen(Match match);

  // The last request given to Infer, without on_response and cancelled,
  // and without its inputs' bytes except for an input in a region (which
  // should have none).
  InferRequest last_request() const { return Get(last_request_); }
  bool last_input_was_view() const { return Get(last_input_was_view_); }  // its first input's
  int arrived() const { return Get(arrived_); }                           // requests given to Infer
  ClientConnection LastClient() const { return Get(last_client_); }  // of the last registration
  std::vector<std::string> control_calls() const { return Get(control_calls_); }  // "load NAME"
  std::vector<std::string> load_overrides() const { return Get(load_overrides_); }
  int loads_done() const { return Get(loads_done_); }
  // A system region's bytes, and writing into them (the client's side).
  std::vector<std::byte> Region(const std::string& name) const;
  void FillRegion(const std::string& name, uint64_t offset, const std::vector<std::byte>& bytes);
  // The handle of a CUDA region as the service received it.
  std::vector<std::byte> CudaHandle(const std::string& name) const;

  std::atomic<bool> ready_{true};

 private:
  Status Load(const std::string& model);
  Status Unload(const std::string& model);
  void OnRepositoryPool(std::function<Status()> call, std::function<void(Status)> done);

  struct Job {
    InferRequest request;
    std::function<void(Result<InferResponse>)> done;
    const FakeModel* model = nullptr;
  };
  struct SystemRegion {
    SharedMemoryRegion info;
    std::vector<std::byte> bytes;
  };
  struct CudaRegion {
    CudaSharedMemoryRegion info;
    std::vector<std::byte> handle;
  };

  Result<const FakeModel*> Find(const std::string& model, const std::string& version) const;
  Status CheckNewRegion(const std::string& name) const;                  // mu_ held
  Result<std::span<std::byte>> RegionBytes(const SharedMemoryRef& ref);  // mu_ held
  void Dispatch(Job job);                                                // mu_ held
  void Work();
  void Run(Job& job);
  Result<InferResponse> Execute(const FakeModel* model, InferRequest& request);
  Result<InferResponse> AsRequested(const InferRequest& request, InferResponse response);
  bool WaitFor(std::function<bool()> condition);
  template <typename T>
  T Get(const T& member) const {
    std::lock_guard lock(mu_);
    return member;
  }

  const FakeSettings settings_;
  std::map<std::string, FakeModel> models_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  std::deque<Job> parked_;
  bool gate_open_ = false;
  bool quit_ = false;
  int parked_count_ = 0;
  int parked_loads_ = 0;
  int loads_done_ = 0;
  int arrived_ = 0;
  InferRequest last_request_;
  bool last_input_was_view_ = false;
  std::vector<Seen> finished_;
  std::vector<std::string> control_calls_;
  std::vector<std::string> load_overrides_;
  ClientConnection last_client_;
  std::map<std::string, SystemRegion> regions_;
  std::map<std::string, CudaRegion> cuda_regions_;
  std::vector<std::thread> threads_;
  std::thread worker_;
  std::unique_ptr<TaskPool> repository_pool_;  // stopped first by the destructor
};

template <typename Match>
std::optional<Seen> FakeService::WaitSeen(Match match) {
  std::optional<Seen> found;
  WaitFor([&] {
    for (const Seen& seen : finished_) {
      if (match(seen)) found = seen;
    }
    return found.has_value();
  });
  return found;
}

// Helpers for models.

// A response to `request` with no outputs yet, of version "1".
InferResponse ResponseTo(const InferRequest& request);
// A model's `run` that fails every request with `status`.
ModelRun Fails(Status status);
// A model's `run` that answers its first input's bytes, datatype and shape
// as output `output`.
ModelRun Echo(std::string output);

template <typename T>
std::vector<T> ValuesOf(const InferTensor& tensor) {
  std::vector<T> values(tensor.data.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), tensor.data.data(), values.size() * sizeof(T));
  return values;
}
template <typename T>
InferTensor TensorOf(std::string name, DType dtype, std::vector<int64_t> shape,
                     const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return {std::move(name), dtype, std::move(shape), std::move(bytes)};
}

}  // namespace hearth::testing
