#include "support/fake_service.h"

#include <algorithm>
#include <chrono>

#include "common/bytes_tensor.h"
#include "server/request_admission.h"
#include "support/eventually.h"

namespace hearth::testing {
namespace {

using Buffers = std::vector<std::vector<std::byte>>;

// Replaces each output's bytes by a view of a copy in `lent`, which the
// caller spoils once the receiver has returned.
void Lend(InferResponse& response, Buffers& lent) {
  lent.reserve(response.outputs.size());
  for (InferTensor& output : response.outputs) {
    lent.emplace_back(output.data.bytes().begin(), output.data.bytes().end());
    output.data = TensorData::Borrowed(lent.back());
  }
}

void Spoil(Buffers& lent) {
  for (std::vector<std::byte>& bytes : lent) std::fill(bytes.begin(), bytes.end(), std::byte{0xee});
}

// FP32 [rows, cols] -> BYTES [rows, min(n, cols)] "value:index", highest
// first, as the server's classification answers it.
InferTensor Classify(const InferTensor& t, uint32_t n) {
  const int64_t rows = t.shape.at(0);
  const int64_t cols = t.shape.at(1);
  const std::vector<float> values = ValuesOf<float>(t);
  std::vector<std::byte> bytes;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int64_t> order(static_cast<size_t>(cols));
    for (int64_t c = 0; c < cols; ++c) order[static_cast<size_t>(c)] = c;
    auto at = [&](int64_t c) { return values[static_cast<size_t>(r * cols + c)]; };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return at(a) > at(b); });
    for (int64_t k = 0; k < std::min<int64_t>(n, cols); ++k) {
      const int64_t c = order[static_cast<size_t>(k)];
      (void)AppendBytesElement(bytes, std::to_string(at(c)) + ":" + std::to_string(c), "");
    }
  }
  return {t.name, DType::kBytes, {rows, std::min<int64_t>(n, cols)}, std::move(bytes)};
}

Status NoRegion(const std::string& name) {
  return NotFound("no shared-memory region named '" + name + "' is registered");
}

// Unregisters a region of `regions` (all of them for an empty name).
template <typename Regions>
Status Unregister(Regions& regions, const std::string& name, Status unknown) {
  if (name.empty()) {
    regions.clear();
  } else if (regions.erase(name) == 0) {
    return unknown;
  }
  return Status::Ok();
}

// The status of a region of `regions` (of all of them for an empty name).
template <typename Info, typename Regions>
Result<std::vector<Info>> StatusOf(const Regions& regions, const std::string& name,
                                   Status unknown) {
  std::vector<Info> out;
  for (const auto& [n, region] : regions) {
    if (name.empty() || n == name) out.push_back(region.info);
  }
  if (!name.empty() && out.empty()) return unknown;
  return out;
}

}  // namespace

FakeService::FakeService(FakeSettings settings, std::vector<FakeModel> models)
    : settings_(std::move(settings)) {
  for (FakeModel& model : models) {
    if (model.metadata.versions.empty()) model.metadata.versions = {"1"};
    std::string name = model.metadata.name;
    models_.insert_or_assign(std::move(name), std::move(model));
  }
  repository_pool_ =
      std::make_unique<TaskPool>(settings_.repository_calls, "repository loads and unloads");
  worker_ = std::thread([this] { Work(); });
}

FakeService::~FakeService() {
  OpenGate();  // the worker runs what was parked before it quits
  repository_pool_->Stop();
  {
    std::lock_guard lock(mu_);
    quit_ = true;
  }
  wake_.notify_all();
  worker_.join();
  for (std::thread& thread : threads_) thread.join();
}

// models_ is never written after the constructor: read without mu_.
Result<const FakeModel*> FakeService::Find(const std::string& model,
                                           const std::string& version) const {
  const auto it = models_.find(model);
  if (it == models_.end()) return NotFound("no model '" + model + "'");
  const std::vector<std::string>& versions = it->second.metadata.versions;
  if (!version.empty() && std::find(versions.begin(), versions.end(), version) == versions.end()) {
    return NotFound("model '" + model + "' has no version '" + version + "'");
  }
  return &it->second;
}

Result<ModelMetadata> FakeService::Metadata(const std::string& model,
                                            const std::string& version) const {
  ASSIGN_OR_RETURN(const FakeModel* found, Find(model, version));
  return found->metadata;
}

Result<bool> FakeService::ModelReady(const std::string& model, const std::string& version) const {
  ASSIGN_OR_RETURN(const FakeModel* found, Find(model, version));
  return found->ready;
}

std::vector<std::string> FakeService::ModelNames() const {
  std::vector<std::string> names;
  for (const auto& [name, model] : models_) names.push_back(name);
  return names;
}

Result<std::string> FakeService::ModelConfigJson(const std::string& model,
                                                 const std::string& version) const {
  ASSIGN_OR_RETURN(const FakeModel* found, Find(model, version));
  if (!found->config_json.has_value()) {
    return Unimplemented("the fake service has no config for " + model);
  }
  return *found->config_json;
}

Result<std::vector<ModelStatistics>> FakeService::Statistics(const std::string& model,
                                                             const std::string& version) const {
  if (model.empty()) {
    std::vector<ModelStatistics> all;
    for (const auto& [name, m] : models_) {
      if (m.statistics.has_value()) all.push_back(*m.statistics);
    }
    return all;
  }
  ASSIGN_OR_RETURN(const FakeModel* found, Find(model, version));
  if (!found->statistics.has_value()) return NotFound("no statistics of model '" + model + "'");
  return std::vector<ModelStatistics>{*found->statistics};
}

std::vector<RepositoryEntry> FakeService::RepositoryIndex(bool ready_only) const {
  std::vector<RepositoryEntry> entries = settings_.repository;
  if (ready_only) {
    std::erase_if(entries, [](const RepositoryEntry& e) { return e.state != "READY"; });
  }
  return entries;
}

Result<std::vector<ModelWorkers>> FakeService::Workers() const {
  if (!settings_.workers.has_value()) return InferenceService::Workers();
  return *settings_.workers;
}

void FakeService::LoadModel(const std::string& model, std::function<void(Status)> done) {
  OnRepositoryPool([this, model] { return Load(model); }, std::move(done));
}

void FakeService::LoadModelWith(const std::string& model, ModelLoadOverrides overrides,
                                std::function<void(Status)> done) {
  {
    std::lock_guard lock(mu_);
    if (!overrides.config_json.empty())
      load_overrides_.push_back("config " + overrides.config_json);
    for (const auto& [path, bytes] : overrides.files)
      load_overrides_.push_back("file " + path + "=" + bytes);
  }
  LoadModel(model, std::move(done));
}

void FakeService::UnloadModel(const std::string& model, std::function<void(Status)> done) {
  OnRepositoryPool([this, model] { return Unload(model); }, std::move(done));
}

void FakeService::OnRepositoryPool(std::function<Status()> call, std::function<void(Status)> done) {
  auto answer = std::make_shared<std::function<void(Status)>>(std::move(done));
  Status queued = repository_pool_->Submit(
      std::move(call), [answer](Status status) { (*answer)(std::move(status)); });
  if (!queued.ok()) (*answer)(std::move(queued));
}

Status FakeService::Load(const std::string& model) {
  std::unique_lock lock(mu_);
  control_calls_.push_back("load " + model);
  const bool parks = settings_.parked_loads.count(model) > 0;
  if (!parks && models_.count(model) == 0) {
    return NotFound("no model '" + model + "' in the repository");
  }
  if (parks) {
    ++parked_loads_;
    wake_.notify_all();
    wake_.wait(lock, [this] { return gate_open_; });
    --parked_loads_;
  }
  ++loads_done_;
  return Status::Ok();
}

Status FakeService::Unload(const std::string& model) {
  std::lock_guard lock(mu_);
  control_calls_.push_back("unload " + model);
  if (settings_.parked_loads.count(model) == 0 && models_.count(model) == 0) {
    return NotFound("unknown model '" + model + "'");
  }
  return Status::Ok();
}

Status FakeService::CheckNewRegion(const std::string& name) const {
  if (regions_.count(name) > 0 || cuda_regions_.count(name) > 0) {
    return AlreadyExists(settings_.taken_region(name));
  }
  return Status::Ok();
}

Status FakeService::RegisterSystemSharedMemory(const ClientConnection& client,
                                               const std::string& name, const std::string& key,
                                               uint64_t offset, uint64_t byte_size) {
  std::lock_guard lock(mu_);
  last_client_ = client;
  if (key == "/missing") return NotFound("region '" + name + "': no shared-memory object " + key);
  RETURN_IF_ERROR(CheckNewRegion(name));
  regions_[name] = {{name, key, offset, byte_size}, std::vector<std::byte>(byte_size)};
  return Status::Ok();
}

Status FakeService::UnregisterSystemSharedMemory(const std::string& name) {
  std::lock_guard lock(mu_);
  return Unregister(regions_, name, NoRegion(name));
}

Result<std::vector<SharedMemoryRegion>> FakeService::SystemSharedMemoryStatus(
    const std::string& name) const {
  std::lock_guard lock(mu_);
  return StatusOf<SharedMemoryRegion>(regions_, name, NoRegion(name));
}

Status FakeService::RegisterCudaSharedMemory(const ClientConnection& client,
                                             const std::string& name,
                                             std::span<const std::byte> raw_handle,
                                             int64_t device_id, uint64_t byte_size) {
  if (!settings_.cuda_shared_memory) {
    return InferenceService::RegisterCudaSharedMemory(client, name, raw_handle, device_id,
                                                      byte_size);
  }
  std::lock_guard lock(mu_);
  last_client_ = client;
  if (raw_handle.size() != 64) {
    return InvalidArgument("the handle has " + std::to_string(raw_handle.size()) + " bytes");
  }
  RETURN_IF_ERROR(CheckNewRegion(name));
  cuda_regions_[name] = {{name, device_id, byte_size}, {raw_handle.begin(), raw_handle.end()}};
  return Status::Ok();
}

Status FakeService::UnregisterCudaSharedMemory(const std::string& name) {
  if (!settings_.cuda_shared_memory) return InferenceService::UnregisterCudaSharedMemory(name);
  std::lock_guard lock(mu_);
  return Unregister(cuda_regions_, name, NotFound("no CUDA region '" + name + "'"));
}

Result<std::vector<CudaSharedMemoryRegion>> FakeService::CudaSharedMemoryStatus(
    const std::string& name) const {
  if (!settings_.cuda_shared_memory) return InferenceService::CudaSharedMemoryStatus(name);
  std::lock_guard lock(mu_);
  return StatusOf<CudaSharedMemoryRegion>(cuda_regions_, name,
                                          NotFound("no CUDA region '" + name + "'"));
}

std::vector<std::byte> FakeService::Region(const std::string& name) const {
  std::lock_guard lock(mu_);
  return regions_.at(name).bytes;
}

void FakeService::FillRegion(const std::string& name, uint64_t offset,
                             const std::vector<std::byte>& bytes) {
  std::lock_guard lock(mu_);
  std::copy(bytes.begin(), bytes.end(),
            regions_.at(name).bytes.begin() + static_cast<std::ptrdiff_t>(offset));
}

std::vector<std::byte> FakeService::CudaHandle(const std::string& name) const {
  std::lock_guard lock(mu_);
  const auto it = cuda_regions_.find(name);
  return it == cuda_regions_.end() ? std::vector<std::byte>{} : it->second.handle;
}

Result<std::span<std::byte>> FakeService::RegionBytes(const SharedMemoryRef& ref) {
  const auto it = regions_.find(ref.region);
  if (it == regions_.end()) return NoRegion(ref.region);
  std::vector<std::byte>& bytes = it->second.bytes;
  if (ref.offset > bytes.size() || ref.byte_size > bytes.size() - ref.offset) {
    return InvalidArgument("outside region '" + ref.region + "'");
  }
  return std::span<std::byte>(bytes).subspan(ref.offset, ref.byte_size);
}

void FakeService::Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) {
  if (Result<ModelMetadata> m = Metadata(request.model, request.version); !m.ok()) {
    return done(m.status());
  } else if (Status admitted = AdmitInferRequest(request, *m); !admitted.ok()) {
    return done(admitted);
  }
  std::lock_guard lock(mu_);
  ++arrived_;
  last_request_ = request;
  last_request_.on_response = nullptr;
  last_request_.cancelled = nullptr;
  for (InferTensor& input : last_request_.inputs) {
    if (!input.shm.has_value()) input.data = {};
  }
  last_input_was_view_ = !request.inputs.empty() && request.inputs[0].data.is_view();
  const auto model = models_.find(request.model);
  Job job{std::move(request), std::move(done), model == models_.end() ? nullptr : &model->second};
  if (job.model != nullptr && job.model->gated && !gate_open_) {
    parked_.push_back(std::move(job));
    ++parked_count_;
    wake_.notify_all();
    return;
  }
  Dispatch(std::move(job));
}

void FakeService::Dispatch(Job job) {
  if (job.model != nullptr && job.model->own_thread) {
    threads_.emplace_back([this, job = std::move(job)]() mutable { Run(job); });
  } else {
    queue_.push_back(std::move(job));
    wake_.notify_all();
  }
}

void FakeService::Work() {
  for (;;) {
    Job job;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [this] { return quit_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    Run(job);
  }
}

void FakeService::Run(Job& job) {
  InferRequest& request = job.request;
  Seen seen;
  seen.model = request.model;
  seen.id = request.id;
  seen.parameters_json = request.parameters_json;
  for (const InferTensor& input : request.inputs) {
    seen.inputs.push_back(
        {input.name, input.dtype, input.shape,
         std::vector<std::byte>(input.data.bytes().begin(), input.data.bytes().end())});
  }
  seen.streamed = static_cast<bool>(request.on_response);
  if (seen.streamed) {
    // Each response lent as the server lends it; after a refusal the
    // model's further responses go nowhere.
    request.on_response = [to = std::move(request.on_response),
                           &seen](const InferResponse& response) {
      if (seen.refused) return false;
      InferResponse lent_response = response;
      Buffers lent;
      Lend(lent_response, lent);
      const bool go_on = to(lent_response);
      Spoil(lent);
      if (go_on) {
        ++seen.accepted;
      } else {
        seen.refused = true;
      }
      return go_on;
    };
  }
  Result<InferResponse> result = Execute(job.model, request);
  seen.cancelled = request.cancelled != nullptr && request.cancelled->load();
  Buffers lent;
  if (result.ok()) Lend(*result, lent);
  job.done(std::move(result));
  Spoil(lent);
  {
    std::lock_guard lock(mu_);
    finished_.push_back(std::move(seen));
  }
  wake_.notify_all();
}

Result<InferResponse> FakeService::Execute(const FakeModel* model, InferRequest& request) {
  if (model == nullptr) return NotFound("no model '" + request.model + "'");
  if (!model->run) return Internal("the fake's model '" + request.model + "' runs nothing");
  for (InferTensor& input : request.inputs) {
    if (!input.shm.has_value()) continue;
    std::lock_guard lock(mu_);
    ASSIGN_OR_RETURN(std::span<std::byte> bytes, RegionBytes(*input.shm));
    input.data = std::vector<std::byte>(bytes.begin(), bytes.end());
  }
  ASSIGN_OR_RETURN(InferResponse response, model->run(*this, request));
  return AsRequested(request, std::move(response));
}

// Only the outputs asked for, classified, or written to a region.
Result<InferResponse> FakeService::AsRequested(const InferRequest& request,
                                               InferResponse response) {
  if (request.outputs.empty()) return response;
  std::vector<InferTensor> chosen;
  for (const RequestedOutput& want : request.outputs) {
    for (const InferTensor& t : response.outputs) {
      if (t.name != want.name) continue;
      InferTensor out = want.class_count > 0 ? Classify(t, want.class_count) : t;
      if (want.shm.has_value()) {
        std::lock_guard lock(mu_);
        ASSIGN_OR_RETURN(std::span<std::byte> bytes, RegionBytes(*want.shm));
        if (out.data.size() > bytes.size()) {
          return InvalidArgument("output '" + t.name + "' does not fit in its region");
        }
        std::copy(out.data.bytes().begin(), out.data.bytes().end(), bytes.begin());
        out.shm = SharedMemoryRef{want.shm->region, want.shm->offset, out.data.size()};
        out.data = TensorData();
      }
      chosen.push_back(std::move(out));
    }
  }
  response.outputs = std::move(chosen);
  return response;
}

void FakeService::AwaitGate() {
  std::unique_lock lock(mu_);
  ++parked_count_;
  wake_.notify_all();
  wake_.wait(lock, [this] { return gate_open_; });
}

bool FakeService::AwaitCancel(const InferRequest& request) {
  {
    std::lock_guard lock(mu_);
    ++parked_count_;
  }
  wake_.notify_all();
  auto cancelled = [&] { return request.cancelled != nullptr && request.cancelled->load(); };
  Eventually([&] { return cancelled() || Get(quit_); });
  return cancelled();
}

void FakeService::OpenGate() {
  std::lock_guard lock(mu_);
  gate_open_ = true;
  for (Job& job : parked_) Dispatch(std::move(job));
  parked_.clear();
  wake_.notify_all();
}

bool FakeService::WaitFor(std::function<bool()> condition) {
  std::unique_lock lock(mu_);
  return wake_.wait_for(lock, std::chrono::seconds(60), condition);
}

bool FakeService::WaitParkedCancelled() {
  return Eventually([&] {  // polled: nothing tells the fake when `cancelled` is set
    std::lock_guard lock(mu_);
    return std::any_of(parked_.begin(), parked_.end(), [](const Job& job) {
      return job.request.cancelled != nullptr && job.request.cancelled->load();
    });
  });
}

std::optional<Seen> FakeService::WaitFinished(size_t n) {
  if (!WaitFor([&] { return finished_.size() >= n; })) return std::nullopt;
  std::lock_guard lock(mu_);
  return finished_[n - 1];
}

InferResponse ResponseTo(const InferRequest& request) {
  InferResponse response;
  response.model = request.model;
  response.version = "1";
  response.id = request.id;
  return response;
}

FakeModel MakeModel(std::string name, std::string platform, int max_batch_size,
                    std::vector<TensorMetadata> inputs, std::vector<TensorMetadata> outputs,
                    ModelRun run) {
  FakeModel model;
  model.metadata.name = std::move(name);
  model.metadata.platform = std::move(platform);
  model.metadata.max_batch_size = max_batch_size;
  model.metadata.inputs = std::move(inputs);
  model.metadata.outputs = std::move(outputs);
  model.run = std::move(run);
  return model;
}

ModelRun Fails(Status status) {
  return [status](FakeService&, InferRequest&) -> Result<InferResponse> { return status; };
}

ModelRun Echo(std::string output) {
  return [output](FakeService&, InferRequest& request) -> Result<InferResponse> {
    InferResponse response = ResponseTo(request);
    const InferTensor& in = request.inputs.at(0);
    response.outputs.push_back(
        {output, in.dtype, in.shape,
         std::vector<std::byte>(in.data.bytes().begin(), in.data.bytes().end())});
    return response;
  };
}

}  // namespace hearth::testing
