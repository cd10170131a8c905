// GrpcServer's implementation, private to src/grpc: the service class
// (GrpcServer::Impl, with the quick RPCs inline), declared here so that its
// parts live in files of one concept:
//   kserve_grpc_server.cc  repository control on the front-end's threads,
//                          start and stop, and GrpcServer itself;
//   inference_calls.cc     ModelInfer's and ModelStreamInfer's reactors.
// The server runs on grpc++'s callback API. Three kinds of call:
//   - the quick RPCs (health, metadata, config, statistics, index) answer
//     inside their handler with the context's default reactor;
//   - ModelInfer: an InferCall reactor, finished from the service's `done`;
//   - ModelStreamInfer: a StreamCall reactor that reads requests, hands each
//     to the service, and writes the answers one at a time from a queue.
// Accounting (calls, request bytes) happens in Impl, under mu_; a stream
// takes its own mutex first and Impl's inside it, never the other way round.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/resource_quota.h>
#include <grpcpp/server_posix.h>
#include <grpcpp/support/proto_buffer_writer.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <map>
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
#include "grpc/kserve_grpc_server.h"
#include "grpc/request_message.h"
#include "grpc_service.grpc.pb.h"
#include "server/request_admission.h"

namespace hearth {

using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;

// A message in its wire form, to be sent.
inline Result<grpc::ByteBuffer> Serialized(const google::protobuf::Message& message) {
  grpc::ByteBuffer out;
  bool own = false;
  grpc::Status status = grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::Message>(
      message, &out, &own);
  if (!status.ok())
    return ResourceExhausted("the response cannot be encoded: " + status.error_message());
  return out;
}

// Answers a quick RPC inside its handler.
inline grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

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

  Status Bind();
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
  // Stop(): each stream answers what it has read, reads nothing more, ends.
  static void Drain(const std::vector<std::shared_ptr<StreamCall>>& streams);

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
    // Not ready, unknown or not served alike: `ready: false`, as Triton
    // answers (its ModelReady fails only when the server is not ready or
    // the version is not a number). REST's /ready tells them apart by
    // status (404, 503).
    if (!ready.ok() && ready.status().code() == StatusCode::kInvalidArgument)
      return Answer(context, ToGrpcStatus(ready.status()));
    response->set_ready(ready.ok() && *ready);
    return Answer(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* response) override {
    response->set_name(options_.server_name.empty() ? service_->ServerName()
                                                    : options_.server_name);
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
                                              std::map<std::string, int>(), {});
        !valid.ok()) {
      return Answer(context, ToGrpcStatus(valid));
    }
    Result<ModelLoadOverrides> overrides = LoadOverrides(request->parameters());
    if (!overrides.ok()) return Answer(context, ToGrpcStatus(overrides.status()));
    return RunControl(
        context,
        [this, name = request->model_name(),
         overrides = std::make_shared<ModelLoadOverrides>(std::move(*overrides))](auto done) {
          service_->LoadModelWith(name, std::move(*overrides), std::move(done));
        });
  }
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse*) override {
    // Triton's unload_dependents: accepted; an ensemble's unload leaves
    // the models its steps name served, with it or without it.
    if (Status valid = CheckRepositoryRequest(request->repository_name(), request->model_name(),
                                              request->parameters(), "unload_dependents");
        !valid.ok()) {
      return Answer(context, ToGrpcStatus(valid));
    }
    return RunControl(context, [this, name = request->model_name()](auto done) {
      service_->UnloadModel(name, std::move(done));
    });
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

  // Tracing is off and stays so (common/trace_settings.h); a model's
  // settings are the server's, for a model the server knows.
  grpc::ServerUnaryReactor* TraceSetting(grpc::CallbackServerContext* context,
                                         const inference::TraceSettingRequest* request,
                                         inference::TraceSettingResponse* response) override {
    if (!request->model_name().empty()) {
      const Result<hearth::ModelMetadata> metadata = service_->Metadata(request->model_name(), "");
      if (!metadata.ok() && metadata.status().code() == StatusCode::kNotFound) {
        return Answer(context, ToGrpcStatus(metadata.status()));
      }
    }
    if (Status valid = CheckTraceSettingRequest(*request); !valid.ok()) {
      return Answer(context, ToGrpcStatus(valid));
    }
    EncodeTraceSettings(CurrentTraceSettings(), response);
    return Answer(context, grpc::Status::OK);
  }
  // This process's log settings (common/log_settings.h): changed whole or
  // not at all, then answered as they are.
  grpc::ServerUnaryReactor* LogSettings(grpc::CallbackServerContext* context,
                                        const inference::LogSettingsRequest* request,
                                        inference::LogSettingsResponse* response) override {
    Result<LogSettingsUpdate> update = ParseLogSettingsRequest(*request);
    if (!update.ok()) return Answer(context, ToGrpcStatus(update.status()));
    if (Status applied = UpdateLogSettings(*update); !applied.ok()) {
      return Answer(context, ToGrpcStatus(applied));
    }
    EncodeLogSettings(CurrentLogSettings(), response);
    return Answer(context, grpc::Status::OK);
  }

 private:
  // Opens the gate on the configured address into listening_ (mu_ held).
  Status ListenLocked();
  // Triton's overrides of a load: "config" (string_param: the config as
  // Triton's JSON) and "file:PATH" (bytes_param). Their limits are the
  // service's to check.
  template <typename Parameters>
  static Result<ModelLoadOverrides> LoadOverrides(const Parameters& parameters) {
    ModelLoadOverrides overrides;
    for (const auto& [key, value] : parameters) {
      const bool file = key.rfind("file:", 0) == 0;
      const std::string name = "parameter '" + key.substr(0, 64) + "'";
      if (key == "config") {
        if (value.parameter_choice_case() != value.kStringParam)
          return InvalidArgument(name + " must be a string_param (the config as JSON)");
        overrides.config_json = value.string_param();
      } else if (file) {
        if (value.parameter_choice_case() != value.kBytesParam)
          return InvalidArgument(name + " must be a bytes_param (the file's content)");
        if (overrides.files.size() == kMaxOverrideFiles)
          return InvalidArgument("more than " + std::to_string(kMaxOverrideFiles) +
                                 " file overrides");
        overrides.files.emplace_back(key.substr(5), value.bytes_param());
      } else {
        return InvalidArgument(name + " is not one a load takes ('config', 'file:PATH')");
      }
    }
    return overrides;
  }

  // A repository request names a model of this server's one repository and
  // no parameters but `allowed`.
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

  // Starts a repository load or unload, which the service runs on its own
  // pool (it waits for workers to start or drain), never on one of gRPC's
  // threads: `start` is given the function that answers the call.
  grpc::ServerUnaryReactor* RunControl(
      grpc::CallbackServerContext* context,
      const std::function<void(std::function<void(Status)>)>& start);

  InferenceService* const service_;
  const GrpcOptions options_;

  mutable std::mutex mu_;
  std::condition_variable idle_;  // inflight_calls_ fell
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Http2Gate> gate_;       // the port's listener; outlives server_
  std::unique_ptr<Http2Gate> listening_;  // bound by Bind, accepting nothing until Start
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
  uint64_t control_calls_ = 0;  // repository calls not yet answered
};

}  // namespace hearth
