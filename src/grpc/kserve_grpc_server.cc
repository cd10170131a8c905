// GrpcServer on grpc++'s callback API. Three kinds of call:
//   - the quick RPCs (health, metadata, config, statistics, index) answer
//     inside their handler with the context's default reactor;
//   - ModelInfer: an InferCall reactor, finished from the service's `done`;
//   - ModelStreamInfer: a StreamCall reactor that reads requests, hands each
//     to the service, and writes the answers one at a time from a queue.
// Accounting (calls, request bytes) happens in Impl, under mu_; a stream
// takes its own mutex first and Impl's inside it, never the other way round.
#include "grpc/kserve_grpc_server.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <grpcpp/support/proto_buffer_writer.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common/heap_trimmer.h"
#include "grpc/http2_gate.h"
#include "grpc/kserve_grpc_codec.h"
#include "grpc/request_message.h"
#include "grpc_service.grpc.pb.h"
#include "server/request_check.h"

namespace hearth {

namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

// The bytes the service will read from shared memory for `request`'s
// inputs and hold while it runs (saturating: too many is refused anyway).
uint64_t SharedMemoryInputBytes(const InferRequest& request) {
  uint64_t total = 0;
  for (const InferTensor& input : request.inputs) {
    if (!input.shm.has_value()) continue;
    total = input.shm->byte_size > std::numeric_limits<uint64_t>::max() - total
                ? std::numeric_limits<uint64_t>::max()
                : total + input.shm->byte_size;
  }
  return total;
}

// A message in its wire form, to be sent.
Result<grpc::ByteBuffer> Serialized(const google::protobuf::Message& message) {
  grpc::ByteBuffer out;
  bool own = false;
  grpc::Status status = grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(
      message, &out, &own);
  if (!status.ok())
    return ResourceExhausted("the response cannot be encoded: " + status.error_message());
  return out;
}

grpc::Status NotYet(const std::string& message) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, message);
}

// Answers a quick RPC inside its handler.
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

}  // namespace

// The inference RPCs are raw (their messages as received, not parsed by
// gRPC), so that a compressed one is inflated here within the limit
// (request_message.h); the others are parsed by gRPC.
using G = inference::GRPCInferenceService;
using Service = G::WithCallbackMethod_ServerLive<
    G::WithCallbackMethod_ServerReady<G::WithCallbackMethod_ModelReady<
        G::WithCallbackMethod_ServerMetadata<G::WithCallbackMethod_ModelMetadata<
            G::WithRawCallbackMethod_ModelInfer<G::WithRawCallbackMethod_ModelStreamInfer<
                G::WithCallbackMethod_ModelConfig<G::WithCallbackMethod_ModelStatistics<
                    G::WithCallbackMethod_RepositoryIndex<G::WithCallbackMethod_RepositoryModelLoad<
                        G::WithCallbackMethod_RepositoryModelUnload<
                            G::WithCallbackMethod_SystemSharedMemoryStatus<
                                G::WithCallbackMethod_SystemSharedMemoryRegister<
                                    G::WithCallbackMethod_SystemSharedMemoryUnregister<
                                        G::WithCallbackMethod_CudaSharedMemoryStatus<
                                            G::WithCallbackMethod_CudaSharedMemoryRegister<
                                                G::WithCallbackMethod_CudaSharedMemoryUnregister<
                                                    G::WithCallbackMethod_TraceSetting<
                                                        G::WithCallbackMethod_LogSettings<
                                                            G::Service>>>>>>>>>>>>>>>>>>>>;

class GrpcServer::Impl final : public Service {
 public:
  Impl(InferenceService* service, GrpcOptions options)
      : service_(service), options_(std::move(options)) {}
  ~Impl() override { Stop(); }

  Status Start();
  void Stop();
  uint16_t port() const {
    std::lock_guard lock(mu_);
    return bound_port_;
  }
  GrpcStats stats() const {
    std::lock_guard lock(mu_);
    GrpcStats s;
    s.listening = server_ != nullptr && !stopping_;
    s.draining = stopping_;
    s.inflight_calls = inflight_calls_;
    s.unanswered_calls = unanswered_calls_;
    s.inflight_bytes = inflight_bytes_;
    s.streams = streams_.size();
    s.stream_requests = stream_requests_;
    s.refused_calls = refused_calls_;
    s.stopped_requests = stopped_requests_;
    s.control_calls = control_calls_;
    if (gate_ != nullptr) s.gate = gate_->stats();
    return s;
  }

  InferenceService& service() { return *service_; }
  const GrpcOptions& options() const { return options_; }

  // A ModelInfer or ModelStreamInfer call begins: refused (an error to
  // answer it with) past max_inflight_calls unanswered calls or while
  // stopping. For each admitted call: AnsweredCall once, when its answer (its
  // status) is handed to gRPC, and EndCall from its OnDone.
  //
  // The limit counts calls until they are answered, not until OnDone: gRPC
  // runs OnDone on its executor some time after the answer is sent, and under
  // load that lag held a thousand calls that their clients had long seen
  // answered (perf_analyzer at concurrency 64 was refused). What an answered
  // call still holds, its request's bytes, stays in the byte budget until
  // OnDone; its answer is in gRPC's resource quota.
  Status BeginCall() {
    std::lock_guard lock(mu_);
    if (stopping_) return Unavailable("the server is shutting down");
    if (unanswered_calls_ >= static_cast<uint64_t>(options_.max_inflight_calls)) {
      ++refused_calls_;
      return ResourceExhausted("the server has " + std::to_string(unanswered_calls_) +
                               " inference calls in progress, its limit; retry later");
    }
    ++unanswered_calls_;
    ++inflight_calls_;
    return Status::Ok();
  }
  void AnsweredCall() {
    std::lock_guard lock(mu_);
    --unanswered_calls_;
  }
  void EndCall() {
    {
      std::lock_guard lock(mu_);
      --inflight_calls_;
    }
    idle_.notify_all();
  }

  // Takes `bytes` of a request into the budget; ResourceExhausted past it.
  Status TakeBytes(uint64_t bytes) {
    std::lock_guard lock(mu_);
    if (bytes > options_.max_inflight_bytes - inflight_bytes_) {
      ++refused_calls_;
      return ResourceExhausted("the server holds " + std::to_string(inflight_bytes_) +
                               " bytes of requests in progress; this one's " +
                               std::to_string(bytes) + " would pass the limit of " +
                               std::to_string(options_.max_inflight_bytes) + "; retry later");
    }
    inflight_bytes_ += bytes;
    return Status::Ok();
  }
  void GiveBytes(uint64_t bytes) {
    std::lock_guard lock(mu_);
    inflight_bytes_ -= bytes;
  }

  // Reads a received ModelInferRequest, its bytes taken into the budget
  // and counted in `*held`.
  Status ReadRequest(const grpc::ByteBuffer& message, uint64_t* held, ModelInferRequest* out) {
    return ReadRequestMessage(
        message, options_.max_message_bytes, [this](uint64_t n) { return TakeBytes(n); },
        [this](uint64_t n) { GiveBytes(n); }, held, out);
  }

  void CountStreamRequest(int delta) {
    std::lock_guard lock(mu_);
    stream_requests_ += delta;
  }
  void CountStoppedRequest() {
    std::lock_guard lock(mu_);
    ++stopped_requests_;
  }

  class InferCall;
  class StreamCall;
  // A stream is registered while open, so that Stop() can drain it.
  void AddStream(std::shared_ptr<StreamCall> stream) {
    std::lock_guard lock(mu_);
    streams_.insert(std::move(stream));
  }
  void RemoveStream(const std::shared_ptr<StreamCall>& stream) {
    std::lock_guard lock(mu_);
    streams_.erase(stream);
  }

  // ---- the RPCs ------------------------------------------------------------

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* response) override {
    response->set_live(service_->Live());
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* response) override {
    response->set_ready(service_->Ready());
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override {
    const Result<bool> ready = service_->ModelReady(request->name(), request->version());
    if (!ready.ok()) {
      // Known but not ready (Unavailable, with its reason): not ready, as
      // REST's 503. Unknown: NOT_FOUND, as REST's 404.
      if (ready.status().code() != StatusCode::kUnavailable) {
        return Answer(context, ToGrpcStatus(ready.status()));
      }
      response->set_ready(false);
    } else {
      response->set_ready(*ready);
    }
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* response) override {
    response->set_name(service_->ServerName());
    response->set_version(service_->ServerVersion());
    for (const std::string& extension : service_->Extensions()) {
      response->add_extensions(extension);
    }
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override {
    const Result<hearth::ModelMetadata> metadata =
        service_->Metadata(request->name(), request->version());
    if (!metadata.ok()) return Answer(context, ToGrpcStatus(metadata.status()));
    EncodeModelMetadata(*metadata, response);
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;

  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override {
    const Result<std::string> json = service_->ModelConfigJson(request->name(), request->version());
    if (!json.ok()) return Answer(context, ToGrpcStatus(json.status()));
    return Answer(context, ToGrpcStatus(ModelConfigFromJson(*json, response->mutable_config())));
  }

  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override {
    const Result<std::vector<hearth::ModelStatistics>> statistics =
        service_->Statistics(request->name(), request->version());
    if (!statistics.ok()) return Answer(context, ToGrpcStatus(statistics.status()));
    EncodeModelStatistics(*statistics, response);
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override {
    if (!request->repository_name().empty()) {
      return Answer(context,
                    grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                 "hearth serves one model repository: leave repository_name "
                                 "empty"));
    }
    EncodeRepositoryIndex(service_->RepositoryIndex(request->ready()), response);
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse*) override {
    if (Status valid = CheckRepositoryRequest(request->repository_name(), request->model_name(),
                                              request->parameters(), {});
        !valid.ok()) {
      return Answer(context, ToGrpcStatus(valid));
    }
    return RunControl(context,
                      [this, name = request->model_name()] { return service_->LoadModel(name); });
  }
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse*) override {
    // Triton's unload_dependents: hearth has no ensembles, so no model
    // depends on another and there is nothing more to unload.
    if (Status valid = CheckRepositoryRequest(request->repository_name(), request->model_name(),
                                              request->parameters(), "unload_dependents");
        !valid.ok()) {
      return Answer(context, ToGrpcStatus(valid));
    }
    return RunControl(context,
                      [this, name = request->model_name()] { return service_->UnloadModel(name); });
  }

  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override {
    const Result<std::vector<SharedMemoryRegion>> regions =
        service_->SystemSharedMemoryStatus(request->name());
    if (!regions.ok()) return Answer(context, ToGrpcStatus(regions.status()));
    EncodeSystemSharedMemoryStatus(*regions, response);
    return Answer(context, grpc::Status::OK);
  }
  // The call's connection, for the server to find the client's user.
  ClientConnection Client(const grpc::CallbackServerContext& context) const {
    // Every connection comes through the gate, whose peers grpc names
    // "fd:N"; one it does not know has no client the server could check.
    return gate_->Client(context.peer()).value_or(ClientConnection{});
  }
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse*) override {
    return Answer(context, ToGrpcStatus(service_->RegisterSystemSharedMemory(
                               Client(*context), request->name(), request->key(), request->offset(),
                               request->byte_size())));
  }
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse*) override {
    return Answer(context, ToGrpcStatus(service_->UnregisterSystemSharedMemory(request->name())));
  }
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
      inference::CudaSharedMemoryStatusResponse* response) override {
    const Result<std::vector<CudaSharedMemoryRegion>> regions =
        service_->CudaSharedMemoryStatus(request->name());
    if (!regions.ok()) return Answer(context, ToGrpcStatus(regions.status()));
    for (const CudaSharedMemoryRegion& r : *regions) {
      inference::CudaSharedMemoryStatusResponse::RegionStatus& status =
          (*response->mutable_regions())[r.name];
      status.set_name(r.name);
      status.set_device_id(static_cast<uint64_t>(r.device_id));
      status.set_byte_size(r.byte_size);
    }
    return Answer(context, grpc::Status::OK);
  }
  // raw_handle: the handle's bytes themselves (tritonclient.grpc decodes the
  // base64 that its cuda_shared_memory.get_raw_handle gives before sending).
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryRegisterRequest* request,
      inference::CudaSharedMemoryRegisterResponse*) override {
    const std::string& handle = request->raw_handle();
    return Answer(context, ToGrpcStatus(service_->RegisterCudaSharedMemory(
                               Client(*context), request->name(),
                               std::as_bytes(std::span(handle.data(), handle.size())),
                               request->device_id(), request->byte_size())));
  }
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryUnregisterRequest* request,
      inference::CudaSharedMemoryUnregisterResponse*) override {
    return Answer(context, ToGrpcStatus(service_->UnregisterCudaSharedMemory(request->name())));
  }

  grpc::ServerUnaryReactor* TraceSetting(grpc::CallbackServerContext* context,
                                         const inference::TraceSettingRequest*,
                                         inference::TraceSettingResponse*) override {
    return Answer(context, NotYet("hearth has no request tracing yet: there are no trace "
                                  "settings to read or change"));
  }
  grpc::ServerUnaryReactor* LogSettings(grpc::CallbackServerContext* context,
                                        const inference::LogSettingsRequest*,
                                        inference::LogSettingsResponse*) override {
    return Answer(context, NotYet("hearth's log settings cannot be read or changed over "
                                  "the API yet: start hearth with --log-level"));
  }

 private:
  // A repository request names a model of this server's one repository and
  // no parameters but `allowed` (Triton's `config` and `file:` overrides of
  // a load are not supported: the model's directory is what is loaded).
  template <typename Parameters>
  static Status CheckRepositoryRequest(const std::string& repository, const std::string& model,
                                       const Parameters& parameters, std::string_view allowed) {
    if (!repository.empty()) {
      return InvalidArgument("hearth serves one model repository: leave repository_name empty");
    }
    if (model.empty()) return InvalidArgument("the request names no model (model_name)");
    for (const auto& [key, value] : parameters) {
      if (key != allowed) {
        return InvalidArgument("parameter '" + key +
                               "' is not supported: hearth loads the model's directory in the "
                               "repository as it is, with no parameters");
      }
    }
    return Status::Ok();
  }

  // Runs `task` (a repository load or unload, which waits for workers to
  // start or drain) on a control thread, never on one of gRPC's, and
  // answers the call with its status. At most max_control_calls at once;
  // past that, RESOURCE_EXHAUSTED.
  grpc::ServerUnaryReactor* RunControl(grpc::CallbackServerContext* context,
                                       std::function<Status()> task);
  void ControlLoop();

  InferenceService* const service_;
  const GrpcOptions options_;

  mutable std::mutex mu_;
  std::condition_variable idle_;  // inflight_calls_ fell
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Http2Gate> gate_;       // the port's listener; outlives server_
  std::unique_ptr<HeapTrimmer> trimmer_;  // while serving, when heap_trim_bytes > 0
  uint16_t bound_port_ = 0;
  bool started_ = false;
  bool stopping_ = false;
  bool stopped_ = false;
  uint64_t inflight_calls_ = 0;    // admitted, not yet done (OnDone)
  uint64_t unanswered_calls_ = 0;  // admitted, not yet answered: the limit's count
  uint64_t inflight_bytes_ = 0;
  uint64_t stream_requests_ = 0;
  uint64_t refused_calls_ = 0;
  uint64_t stopped_requests_ = 0;
  std::set<std::shared_ptr<StreamCall>> streams_;
  // Control calls: queued or running tasks, and the threads that run them
  // (started as needed, at most max_control_calls, joined by Stop()).
  std::condition_variable control_wake_;
  std::deque<std::function<void()>> control_queue_;
  std::vector<std::thread> control_threads_;
  uint64_t control_calls_ = 0;
  uint64_t idle_control_threads_ = 0;
  bool control_quit_ = false;
};

grpc::ServerUnaryReactor* GrpcServer::Impl::RunControl(grpc::CallbackServerContext* context,
                                                       std::function<Status()> task) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  std::unique_lock lock(mu_);
  if (stopping_) {
    lock.unlock();
    reactor->Finish(ToGrpcStatus(Unavailable("the server is shutting down")));
    return reactor;
  }
  if (control_calls_ >= static_cast<uint64_t>(options_.max_control_calls)) {
    ++refused_calls_;
    const uint64_t running = control_calls_;
    lock.unlock();
    reactor->Finish(ToGrpcStatus(
        ResourceExhausted("the server has " + std::to_string(running) +
                          " repository loads and unloads in progress, its limit; retry later")));
    return reactor;
  }
  ++control_calls_;
  // The reactor stays valid until Finish: gRPC calls OnDone only after it.
  control_queue_.emplace_back(
      [reactor, task = std::move(task)] { reactor->Finish(ToGrpcStatus(task())); });
  if (idle_control_threads_ == 0 &&
      control_threads_.size() < static_cast<size_t>(options_.max_control_calls)) {
    try {
      control_threads_.emplace_back([this] { ControlLoop(); });
    } catch (const std::system_error&) {
      // No thread now: one that is running takes the task when it is done.
      if (control_threads_.empty()) {
        control_queue_.pop_back();
        --control_calls_;
        lock.unlock();
        reactor->Finish(ToGrpcStatus(ResourceExhausted("cannot start a thread for the call")));
        return reactor;
      }
    }
  }
  control_wake_.notify_one();
  return reactor;
}

void GrpcServer::Impl::ControlLoop() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_control_threads_;
    control_wake_.wait(lock, [this] { return control_quit_ || !control_queue_.empty(); });
    --idle_control_threads_;
    if (control_queue_.empty()) return;  // quitting
    std::function<void()> task = std::move(control_queue_.front());
    control_queue_.pop_front();
    lock.unlock();
    task();
    lock.lock();
    --control_calls_;
  }
}

// ---- ModelInfer --------------------------------------------------------------

// One ModelInfer call. Owns itself: deleted in OnDone, which gRPC calls after
// Finish, and Finish comes only from the service's `done` (or before the
// service is called). The request, whose raw inputs the service borrows, is
// the call's and lives until then.
class GrpcServer::Impl::InferCall final : public grpc::ServerUnaryReactor {
 public:
  InferCall(Impl* server, const grpc::ByteBuffer* message, grpc::ByteBuffer* response)
      : server_(server), message_(message), response_(response) {}

  void Start() {
    if (Status admitted = server_->BeginCall(); !admitted.ok()) {
      return Finish(ToGrpcStatus(admitted));
    }
    admitted_ = true;
    // From here on every answer goes through Reply.
    Status read = server_->ReadRequest(*message_, &bytes_, &request_);
    // Read: the message's bytes go now rather than with the call. gRPC
    // created the buffer for this call and reads it no more.
    const_cast<grpc::ByteBuffer*>(message_)->Clear();
    if (!read.ok()) return Reply(ToGrpcStatus(read));
    Result<GrpcInferRequest> parsed = ParseModelInferRequest(request_, nullptr);
    if (!parsed.ok()) return Reply(ToGrpcStatus(parsed.status()));
    InferRequest& request = parsed->request;
    const uint64_t shared = SharedMemoryInputBytes(request);
    if (Status taken = server_->TakeBytes(shared); !taken.ok()) return Reply(ToGrpcStatus(taken));
    bytes_ += shared;
    const Result<hearth::ModelMetadata> metadata =
        server_->service().Metadata(request.model, request.version);
    if (!metadata.ok()) return Reply(ToGrpcStatus(metadata.status()));
    if (Status valid = ValidateInferRequest(request, *metadata); !valid.ok()) {
      return Reply(ToGrpcStatus(valid));
    }
    outputs_ = request.outputs;
    request.cancelled = cancelled_;
    // `done` may run on any thread, even inside Infer; the outputs it gets
    // may be borrowed, so they are copied into the response right there.
    server_->service().Infer(std::move(request), [this](Result<InferResponse> result) {
      if (!result.ok()) return Reply(ToGrpcStatus(result.status()));
      ModelInferResponse response;
      if (Status encoded = EncodeModelInferResponse(*result, outputs_, &response); !encoded.ok()) {
        return Reply(ToGrpcStatus(encoded));
      }
      Result<grpc::ByteBuffer> wire = Serialized(response);
      if (!wire.ok()) return Reply(ToGrpcStatus(wire.status()));
      *response_ = std::move(*wire);
      Reply(grpc::Status::OK);
    });
  }

  void OnCancel() override { cancelled_->store(true); }

  void OnDone() override {
    if (bytes_ > 0) server_->GiveBytes(bytes_);
    if (admitted_) server_->EndCall();
    delete this;
  }

 private:
  void Reply(grpc::Status status) {
    server_->AnsweredCall();
    Finish(std::move(status));
  }

  Impl* const server_;
  const grpc::ByteBuffer* const message_;  // gRPC's, as received
  grpc::ByteBuffer* const response_;       // gRPC's, sent as it is
  ModelInferRequest request_;
  std::vector<RequestedOutput> outputs_;
  std::shared_ptr<std::atomic<bool>> cancelled_ = std::make_shared<std::atomic<bool>>(false);
  bool admitted_ = false;
  uint64_t bytes_ = 0;
};

grpc::ServerUnaryReactor* GrpcServer::Impl::ModelInfer(grpc::CallbackServerContext*,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  auto* call = new InferCall(this, request, response);
  call->Start();
  return call;
}

// ---- ModelStreamInfer -----------------------------------------------------------

// One ModelStreamInfer call. Shared ownership: gRPC's hold (self_, dropped
// in OnDone) and each of its requests' (until the service has called their
// `done`), so that a `done` that finishes the stream can still unlock it.
// Every gRPC operation (StartRead, StartWrite, Finish) is started under mu_
// and none after Finish; gRPC never calls a reaction from inside them.
class GrpcServer::Impl::StreamCall final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
      public std::enable_shared_from_this<StreamCall> {
 public:
  static StreamCall* Open(Impl* server) {
    std::shared_ptr<StreamCall> call(new StreamCall(server));
    call->self_ = call;
    call->Begin();
    return call.get();
  }

  // Stop(): answer what has been read, read nothing more, then end.
  void Drain() {
    std::lock_guard lock(mu_);
    draining_ = true;
    MaybeFinishLocked();
  }

  void OnReadDone(bool ok) override {
    grpc::ByteBuffer message;
    bool unrun = false;
    {
      std::lock_guard lock(mu_);
      reading_ = false;
      if (!ok) {
        read_closed_ = true;  // the client is done writing, or gone
        MaybeFinishLocked();
        return;
      }
      if (cancelled_ || finished_) {
        MaybeFinishLocked();
        return;
      }
      message.Swap(&read_buffer_);
      ++inflight_;  // the stream cannot finish before this request's end
      // Read as a drain began: answered, not run.
      unrun = draining_;
      MaybeReadLocked();
    }
    Submit(message, unrun);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard lock(mu_);
    writing_ = false;
    pending_bytes_ -= writing_bytes_;
    writing_bytes_ = 0;
    current_.Clear();
    if (!ok) {
      CancelLocked();  // the client is gone: nothing more can be written
    } else {
      MaybeWriteLocked();
    }
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard lock(mu_);
    CancelLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    std::shared_ptr<StreamCall> self = std::move(self_);
    server_->RemoveStream(self);
    if (admitted_) server_->EndCall();
    // `self` may be the last owner: this object goes with it.
  }

 private:
  // One request of the stream, shared by its `on_response` and `done`.
  struct Request {
    std::shared_ptr<StreamCall> call;
    std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
    std::string model, version, id;
    std::vector<RequestedOutput> outputs;
    bool decoupled = false;
    bool empty_final = false;
    uint64_t bytes = 0;       // taken from the server's budget
    bool registered = false;  // in the stream's cancellation set
    Status failed;            // an earlier response could not be encoded
    bool overflowed = false;  // stopped: the client did not read
  };

  explicit StreamCall(Impl* server) : server_(server) {}

  void Begin() {
    std::lock_guard lock(mu_);
    if (Status admitted = server_->BeginCall(); !admitted.ok()) {
      finished_ = true;
      Finish(ToGrpcStatus(admitted));
      return;
    }
    admitted_ = true;
    server_->AddStream(shared_from_this());
    MaybeReadLocked();
  }

  // Reads and checks one request and hands it to the service (`unrun`:
  // answers it without running it); every failure before that is the
  // request's answer on the stream.
  void Submit(grpc::ByteBuffer& message, bool unrun) {
    auto request = std::make_shared<Request>();
    request->call = shared_from_this();
    auto proto = std::make_shared<ModelInferRequest>();
    Status read = server_->ReadRequest(message, &request->bytes, proto.get());
    message.Clear();
    request->model = proto->model_name();
    request->version = proto->model_version();
    request->id = proto->id();
    if (!read.ok()) return Complete(*request, std::move(read));
    if (unrun) {
      return Complete(*request,
                      Unavailable("the server is shutting down: the request was not run"));
    }
    // Views into `proto` share it: it lives as long as the service keeps them.
    Result<GrpcInferRequest> parsed = ParseModelInferRequest(*proto, proto);
    if (!parsed.ok()) return Complete(*request, parsed.status());
    InferRequest& infer = parsed->request;
    const uint64_t shared = SharedMemoryInputBytes(infer);
    if (Status taken = server_->TakeBytes(shared); !taken.ok()) {
      return Complete(*request, std::move(taken));
    }
    request->bytes += shared;
    const Result<hearth::ModelMetadata> metadata =
        server_->service().Metadata(infer.model, infer.version);
    if (!metadata.ok()) return Complete(*request, metadata.status());
    if (Status valid = ValidateInferRequest(infer, *metadata); !valid.ok()) {
      return Complete(*request, std::move(valid));
    }
    request->decoupled = metadata->decoupled;
    request->empty_final = parsed->empty_final_response;
    request->outputs = infer.outputs;
    infer.cancelled = request->cancelled;
    {
      std::lock_guard lock(mu_);
      if (cancelled_) request->cancelled->store(true);
      cancellations_.insert(request->cancelled);
      request->registered = true;
    }
    server_->CountStreamRequest(1);
    if (request->decoupled) {
      infer.on_response = [request](const InferResponse& response) {
        return request->call->OnPartial(*request, response);
      };
    }
    server_->service().Infer(std::move(infer), [request](Result<InferResponse> result) {
      request->call->OnFinal(*request, std::move(result));
    });
  }

  // A decoupled request's response before its last: written as it comes.
  // False stops the request: the stream is gone, the client does not read,
  // or the response cannot be encoded.
  bool OnPartial(Request& request, const InferResponse& response) {
    auto message = std::make_unique<ModelStreamInferResponse>();
    Status encoded =
        EncodeModelInferResponse(response, request.outputs, message->mutable_infer_response());
    if (!encoded.ok()) {
      request.failed = std::move(encoded);
      return false;
    }
    SetFinal(*message, false);
    Result<grpc::ByteBuffer> wire = Serialized(*message);
    if (!wire.ok()) {
      request.failed = wire.status();
      return false;
    }
    message.reset();
    std::lock_guard lock(mu_);
    if (cancelled_ || finished_) return false;
    if (wire->Length() > server_->options().max_stream_pending_bytes - pending_bytes_) {
      request.overflowed = true;
      server_->CountStoppedRequest();
      return false;
    }
    QueueLocked(std::move(*wire));
    return true;
  }

  // The request's end: its last response, or its error.
  void OnFinal(Request& request, Result<InferResponse> result) {
    server_->CountStreamRequest(-1);
    std::unique_ptr<ModelStreamInferResponse> message;
    if (!request.failed.ok()) {
      message = ErrorMessage(request, request.failed);
    } else if (request.overflowed) {
      message = ErrorMessage(
          request,
          ResourceExhausted("the request was stopped: its responses were not read (more than " +
                            std::to_string(server_->options().max_stream_pending_bytes) +
                            " bytes of the stream's responses were waiting for the client)"));
    } else if (!result.ok()) {
      message = ErrorMessage(request, result.status());
    } else if (!request.decoupled || !result->outputs.empty() || request.empty_final) {
      message = std::make_unique<ModelStreamInferResponse>();
      Status encoded =
          EncodeModelInferResponse(*result, request.outputs, message->mutable_infer_response());
      if (!encoded.ok()) {
        message = ErrorMessage(request, encoded);
      } else {
        SetFinal(*message, true);
      }
    }
    // else: a decoupled stream that ended without a last response, which
    // Triton's clients are told of only when they asked for it.
    Complete(request, std::move(message));
  }

  void Complete(Request& request, Status error) { Complete(request, ErrorMessage(request, error)); }

  void Complete(Request& request, std::unique_ptr<ModelStreamInferResponse> message) {
    if (request.bytes > 0) server_->GiveBytes(request.bytes);
    request.bytes = 0;
    std::optional<grpc::ByteBuffer> wire;
    if (message != nullptr) {
      Result<grpc::ByteBuffer> serialized = Serialized(*message);
      if (!serialized.ok()) serialized = Serialized(*ErrorMessage(request, serialized.status()));
      if (serialized.ok()) wire = std::move(*serialized);
      message.reset();
    }
    std::lock_guard lock(mu_);
    if (request.registered) cancellations_.erase(request.cancelled);
    request.registered = false;
    --inflight_;
    // The last answer of a request always goes out: one per request, and
    // the stream reads no more requests while it is behind.
    if (wire.has_value() && !cancelled_ && !finished_) QueueLocked(std::move(*wire));
    MaybeReadLocked();
    MaybeFinishLocked();
  }

  static std::unique_ptr<ModelStreamInferResponse> ErrorMessage(const Request& request,
                                                                const Status& error) {
    auto message = std::make_unique<ModelStreamInferResponse>();
    message->set_error_message(error.message());
    // Which request failed, for clients that match answers by id.
    ModelInferResponse* response = message->mutable_infer_response();
    response->set_model_name(request.model);
    response->set_model_version(request.version);
    response->set_id(request.id);
    return message;
  }

  static void SetFinal(ModelStreamInferResponse& message, bool final) {
    (*message.mutable_infer_response()->mutable_parameters())[std::string(kFinalResponseParameter)]
        .set_bool_param(final);
  }

  void QueueLocked(grpc::ByteBuffer message) {
    pending_bytes_ += message.Length();
    queue_.push_back(std::move(message));
    MaybeWriteLocked();
  }

  void MaybeWriteLocked() {
    if (writing_ || queue_.empty() || finished_ || cancelled_) return;
    current_ = std::move(queue_.front());
    writing_bytes_ = current_.Length();
    queue_.pop_front();
    writing_ = true;
    StartWrite(&current_);
  }

  // Reads the next request unless the stream is at its limit of requests in
  // the service, or ending.
  void MaybeReadLocked() {
    if (reading_ || read_closed_ || cancelled_ || draining_ || finished_) return;
    if (inflight_ >= server_->options().max_stream_requests) return;
    reading_ = true;
    StartRead(&read_buffer_);
  }

  void CancelLocked() {
    cancelled_ = true;
    for (const auto& flag : cancellations_) flag->store(true);
    for (const grpc::ByteBuffer& message : queue_) pending_bytes_ -= message.Length();
    queue_.clear();
  }

  // Finishes once nothing is in the service or being written, and the
  // stream has a reason to end: cancelled, draining, or read to its end.
  void MaybeFinishLocked() {
    if (finished_ || writing_ || inflight_ > 0) return;
    grpc::Status status;
    if (cancelled_) {
      status = grpc::Status(grpc::StatusCode::CANCELLED, "the stream was cancelled");
    } else if (!queue_.empty()) {
      return;  // being written (cannot happen: MaybeWriteLocked starts it)
    } else if (draining_) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
    } else if (read_closed_) {
      status = grpc::Status::OK;
    } else {
      return;
    }
    finished_ = true;
    server_->AnsweredCall();
    Finish(std::move(status));
  }

  Impl* const server_;
  std::shared_ptr<StreamCall> self_;  // gRPC's reference, until OnDone
  bool admitted_ = false;             // counted by BeginCall (set once, in Begin)

  std::mutex mu_;
  grpc::ByteBuffer read_buffer_;  // the read in progress writes here
  bool reading_ = false;
  bool read_closed_ = false;
  bool writing_ = false;
  bool cancelled_ = false;  // the client is gone: nothing more is written
  bool draining_ = false;
  bool finished_ = false;
  int inflight_ = 0;  // requests read and not yet answered
  std::set<std::shared_ptr<std::atomic<bool>>> cancellations_;  // of those in the service
  std::deque<grpc::ByteBuffer> queue_;                          // responses in their wire form
  grpc::ByteBuffer current_;                                    // being written
  uint64_t writing_bytes_ = 0;
  uint64_t pending_bytes_ = 0;  // queued and being written
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GrpcServer::Impl::ModelStreamInfer(
    grpc::CallbackServerContext*) {
  return StreamCall::Open(this);
}

// ---- start and stop ------------------------------------------------------------

Status GrpcServer::Impl::Start() {
  std::lock_guard lock(mu_);
  if (started_) return FailedPrecondition("the gRPC server was started already");
  started_ = true;
  // The gate owns the port: grpc++ gets each connection as a socketpair.
  Http2GateLimits limits;
  limits.max_connections = options_.max_connections;
  limits.max_open_streams = 2 * options_.max_concurrent_streams;
  limits.streams_per_second = options_.streams_per_second;
  // A new connection may open as many streams at once as it may keep open.
  limits.stream_burst = std::min<double>(options_.streams_per_second, limits.max_open_streams);
  limits.max_total_open_streams = 4 * options_.max_inflight_calls;
  limits.resets_per_second = options_.resets_per_second;
  limits.reset_burst = std::max(1.0, 2 * options_.resets_per_second);
  limits.total_resets_per_second = 5 * options_.resets_per_second;
  limits.handshake_timeout = options_.handshake_timeout;
  Result<std::unique_ptr<Http2Gate>> gate =
      Http2Gate::Listen(options_.host, options_.port, limits,
                        [this](int fd) { grpc::AddInsecureChannelFromFd(server_.get(), fd); });
  if (!gate.ok()) return gate.status();
  grpc::ServerBuilder builder;
  builder.RegisterService(this);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options_.max_message_bytes));
  // grpc 1.51 inflates a compressed message whole and only then compares it
  // with the limit above: 1 MB of gzip on the wire held 1 GB until refused.
  // So gRPC inflates nothing: the inference RPCs inflate their messages
  // within the limit themselves (request_message.h). The limit above is the
  // compressed size's. The other RPCs' messages are small, and any of them
  // sent compressed fails to parse (INTERNAL) without being inflated.
  builder.AddChannelArgument(GRPC_ARG_ENABLE_PER_MESSAGE_DECOMPRESSION, 0);
  // Room for one message more than the front-end's byte budget: under
  // pressure gRPC resets streams (ENHANCE_YOUR_CALM), held ones too, so the
  // budget, which refuses with a clear error, must be reached first.
  grpc::ResourceQuota quota("hearth-grpc");
  quota.Resize(static_cast<size_t>(options_.max_inflight_bytes + options_.max_message_bytes));
  builder.SetResourceQuota(quota);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options_.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(options_.keepalive_time.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(options_.keepalive_timeout.count()));
  // Clients may keep idle connections alive with pings every 10 s or more
  // (tritonclient's keepalive options); more often is answered with GOAWAY.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                             static_cast<int>(options_.idle_timeout.count()));
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                             static_cast<int>(options_.handshake_timeout.count()));
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) return Unavailable("gRPC: the server could not be started");
  gate_ = std::move(*gate);
  bound_port_ = gate_->port();
  gate_->Start();
  if (options_.heap_trim_bytes > 0) {
    trimmer_ = std::make_unique<HeapTrimmer>(options_.heap_trim_bytes, std::chrono::seconds(1));
  }
  return Status::Ok();
}

void GrpcServer::Impl::Stop() {
  std::vector<std::shared_ptr<StreamCall>> streams;
  {
    std::lock_guard lock(mu_);
    if (stopped_ || server_ == nullptr) {
      stopped_ = true;
      return;
    }
    stopping_ = true;
    streams.assign(streams_.begin(), streams_.end());
  }
  for (const auto& stream : streams) stream->Drain();
  streams.clear();
  gate_->StopAccepting();
  // New calls are refused from here on; calls in progress get until the
  // deadline, then gRPC cancels them (their requests' `cancelled` is set).
  server_->Shutdown(std::chrono::system_clock::now() + options_.drain_timeout);
  {
    std::unique_lock lock(mu_);
    idle_.wait(lock, [this] { return inflight_calls_ == 0; });
  }
  server_->Wait();
  // Every control call has finished (Wait() returns after their OnDone):
  // their threads have nothing left to run.
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    control_quit_ = true;
    threads.swap(control_threads_);
  }
  control_wake_.notify_all();
  for (std::thread& thread : threads) thread.join();
  std::lock_guard lock(mu_);
  server_.reset();
  gate_.reset();  // closes what connections remain
  trimmer_.reset();
  stopped_ = true;
  bound_port_ = 0;
}

// ---- GrpcServer ------------------------------------------------------------------

Result<std::unique_ptr<GrpcServer>> GrpcServer::Create(InferenceService* service,
                                                       GrpcOptions options) {
  if (service == nullptr) return InvalidArgument("the gRPC server needs a service");
  if (options.host.empty()) return InvalidArgument("the gRPC server needs a host");
  constexpr uint64_t kIntMax = static_cast<uint64_t>(std::numeric_limits<int>::max());
  if (options.max_message_bytes == 0 || options.max_message_bytes > kIntMax) {
    return InvalidArgument("the gRPC message limit must be in [1, " + std::to_string(kIntMax) +
                           "] bytes");
  }
  if (options.max_inflight_bytes < options.max_message_bytes) {
    return InvalidArgument("the gRPC in-flight byte limit must hold at least one message of " +
                           std::to_string(options.max_message_bytes) + " bytes");
  }
  if (options.max_inflight_calls < 1 || options.max_concurrent_streams < 1 ||
      options.max_stream_requests < 1 || options.max_stream_pending_bytes == 0 ||
      options.max_control_calls < 1) {
    return InvalidArgument("the gRPC call, stream and pending-byte limits must be positive");
  }
  if (options.max_connections < 1 || !(options.streams_per_second > 0) ||
      !(options.resets_per_second > 0)) {
    return InvalidArgument(
        "the gRPC connection limit and the stream and reset rates must be positive");
  }
  for (const auto& [name, value] : {std::pair{"keepalive_time", options.keepalive_time},
                                    std::pair{"keepalive_timeout", options.keepalive_timeout},
                                    std::pair{"idle_timeout", options.idle_timeout},
                                    std::pair{"handshake_timeout", options.handshake_timeout}}) {
    if (value.count() < 1 || value.count() > static_cast<int64_t>(kIntMax)) {
      return InvalidArgument(std::string("the gRPC ") + name + " must be in [1, " +
                             std::to_string(kIntMax) + "] ms");
    }
  }
  if (options.drain_timeout.count() < 0) {
    return InvalidArgument("the gRPC drain timeout must not be negative");
  }
  return std::unique_ptr<GrpcServer>(
      new GrpcServer(std::make_unique<Impl>(service, std::move(options))));
}

GrpcServer::GrpcServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcServer::~GrpcServer() { Stop(); }
Status GrpcServer::Start() { return impl_->Start(); }
void GrpcServer::Stop() { impl_->Stop(); }
uint16_t GrpcServer::port() const { return impl_->port(); }
GrpcStats GrpcServer::stats() const { return impl_->stats(); }

}  // namespace hearth
