#include "loadgen/grpc_load.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "grpc_service.grpc.pb.h"
#include "loadgen/bench_common.h"

namespace hearth::bench {
namespace {

using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;

// A channel is one HTTP/2 connection; hearth's server allows 128 streams on
// one (GrpcOptions::max_concurrent_streams), so each carries at most this
// many requests in flight.
constexpr int kCallsPerChannel = 100;

// HOST:PORT or grpc://HOST:PORT ([V6]:PORT) as a gRPC target.
Result<std::string> ParseTarget(const std::string& url) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument("bad gRPC URL '" + url + "': " + why +
                           " (--transport grpc takes HOST:PORT or grpc://HOST:PORT, the "
                           "server's gRPC port: hearth serve --grpc-port, default 8001)");
  };
  std::string rest = url;
  if (rest.rfind("grpc://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.find("://") != std::string::npos) {
    return bad("not a gRPC scheme");
  }
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.find('/') != std::string::npos) return bad("a path");
  std::string host, port;
  if (!rest.empty() && rest.front() == '[') {
    const size_t close = rest.find(']');
    if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':')
      return bad("expected [V6]:PORT");
    host = rest.substr(0, close + 1);
    port = rest.substr(close + 2);
  } else {
    const size_t colon = rest.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  int value = -1;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (host.empty() || ec != std::errc() || end != port.data() + port.size() || value <= 0 ||
      value > 65535)
    return bad("expected a host and a port in [1, 65535]");
  return host + ":" + port;
}

StatusCode CodeForGrpc(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
      return StatusCode::kInvalidArgument;
    case grpc::StatusCode::NOT_FOUND:
      return StatusCode::kNotFound;
    case grpc::StatusCode::ALREADY_EXISTS:
      return StatusCode::kAlreadyExists;
    case grpc::StatusCode::PERMISSION_DENIED:
      return StatusCode::kPermissionDenied;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return StatusCode::kResourceExhausted;
    case grpc::StatusCode::FAILED_PRECONDITION:
      return StatusCode::kFailedPrecondition;
    case grpc::StatusCode::UNIMPLEMENTED:
      return StatusCode::kUnimplemented;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return StatusCode::kDeadlineExceeded;
    case grpc::StatusCode::INTERNAL:
      return StatusCode::kInternal;
    default:
      return StatusCode::kUnavailable;
  }
}

const char* GrpcCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    default:
      return "gRPC error";
  }
}

std::string Describe(const grpc::Status& status) {
  std::string message = status.error_message();
  if (message.size() > 300) message = message.substr(0, 300) + "...";
  return std::string(GrpcCodeName(status.error_code())) + ": " + message;
}

Status FromGrpc(const grpc::Status& status) {
  return status.ok() ? Status::Ok() : Status(CodeForGrpc(status.error_code()), Describe(status));
}

void SetDeadline(grpc::ClientContext& context, double seconds) {
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::duration_cast<std::chrono::system_clock::duration>(
                           std::chrono::duration<double>(seconds)));
}

std::optional<uint64_t> NonNegative(const inference::InferParameter& p) {
  if (p.parameter_choice_case() == inference::InferParameter::kUint64Param) return p.uint64_param();
  if (p.parameter_choice_case() == inference::InferParameter::kInt64Param && p.int64_param() >= 0)
    return static_cast<uint64_t>(p.int64_param());
  return std::nullopt;
}

// Where each output of a ModelInfer answer says it is.
Result<std::vector<OutputPlacement>> Placements(const ModelInferResponse& response) {
  std::vector<OutputPlacement> placements;
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& output = response.outputs(i);
    OutputPlacement placement;
    placement.name = output.name();
    placement.inline_data =
        (i < response.raw_output_contents_size() && !response.raw_output_contents(i).empty()) ||
        output.contents().ByteSizeLong() > 0;
    const auto& parameters = output.parameters();
    const auto region = parameters.find("shared_memory_region");
    if (region != parameters.end()) {
      placement.in_region = true;
      placement.region = region->second.string_param();
      const auto offset = parameters.find("shared_memory_offset");
      const auto size = parameters.find("shared_memory_byte_size");
      std::optional<uint64_t> value;
      if (offset != parameters.end() && !(value = NonNegative(offset->second)))
        return Internal("output '" + placement.name + "': shared_memory_offset is not a size");
      placement.offset = value.value_or(0);
      if (size == parameters.end() || !(value = NonNegative(size->second)))
        return Internal("output '" + placement.name + "': no shared_memory_byte_size");
      placement.byte_size = *value;
    }
    placements.push_back(std::move(placement));
  }
  return placements;
}

void SetRegion(google::protobuf::Map<std::string, inference::InferParameter>* parameters,
               const std::string& region, uint64_t offset, uint64_t bytes) {
  (*parameters)["shared_memory_region"].set_string_param(region);
  (*parameters)["shared_memory_offset"].set_uint64_param(offset);
  (*parameters)["shared_memory_byte_size"].set_uint64_param(bytes);
}

// The request without data: model, inputs' names, types and shapes, the
// requested outputs.
ModelInferRequest BaseRequest(const BenchOptions& options, const ModelSpec& model) {
  ModelInferRequest request;
  request.set_model_name(options.model);
  request.set_model_version(options.version);
  for (const TensorSpec& input : model.inputs) {
    auto* tensor = request.add_inputs();
    tensor->set_name(input.name);
    tensor->set_datatype(input.datatype);
    for (int64_t d : input.shape) tensor->add_shape(d);
  }
  for (const TensorSpec& output : model.outputs) request.add_outputs()->set_name(output.name);
  return request;
}

class GrpcRegionControl : public RegionControl {
 public:
  GrpcRegionControl(GRPCInferenceService::Stub* stub, double timeout_seconds)
      : stub_(stub), timeout_seconds_(timeout_seconds) {}
  // Owning its stub (and so its channel).
  GrpcRegionControl(std::unique_ptr<GRPCInferenceService::Stub> stub, double timeout_seconds)
      : owned_(std::move(stub)), stub_(owned_.get()), timeout_seconds_(timeout_seconds) {}

  Status Register(const std::string& name, const RegionHandle& handle) override {
    grpc::ClientContext context;
    SetDeadline(context, timeout_seconds_);
    if (handle.kind == BenchSharedMemory::kCuda) {
      inference::CudaSharedMemoryRegisterRequest request;
      request.set_name(name);
      request.set_raw_handle(handle.ipc_handle);
      request.set_device_id(handle.device_id);
      request.set_byte_size(handle.byte_size);
      inference::CudaSharedMemoryRegisterResponse response;
      return FromGrpc(stub_->CudaSharedMemoryRegister(&context, request, &response));
    }
    inference::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(handle.key);
    request.set_offset(0);
    request.set_byte_size(handle.byte_size);
    inference::SystemSharedMemoryRegisterResponse response;
    return FromGrpc(stub_->SystemSharedMemoryRegister(&context, request, &response));
  }
  Status Unregister(BenchSharedMemory kind, const std::string& name) override {
    grpc::ClientContext context;
    SetDeadline(context, timeout_seconds_);
    if (kind == BenchSharedMemory::kCuda) {
      inference::CudaSharedMemoryUnregisterRequest request;
      request.set_name(name);
      inference::CudaSharedMemoryUnregisterResponse response;
      return FromGrpc(stub_->CudaSharedMemoryUnregister(&context, request, &response));
    }
    inference::SystemSharedMemoryUnregisterRequest request;
    request.set_name(name);
    inference::SystemSharedMemoryUnregisterResponse response;
    return FromGrpc(stub_->SystemSharedMemoryUnregister(&context, request, &response));
  }

 private:
  std::unique_ptr<GRPCInferenceService::Stub> owned_;
  GRPCInferenceService::Stub* stub_;
  double timeout_seconds_;
};

std::unique_ptr<GRPCInferenceService::Stub> NewStub(const std::string& target) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(INT_MAX);
  arguments.SetMaxSendMessageSize(INT_MAX);
  // A connection of its own for each channel, not one shared subchannel.
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return GRPCInferenceService::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), arguments));
}

Result<ModelSpec> ReadModel(GRPCInferenceService::Stub* stub, const BenchOptions& options) {
  const std::string label = ModelLabel(options);
  auto failed = [&](const grpc::Status& status, const char* what) -> Status {
    if (status.error_code() == grpc::StatusCode::NOT_FOUND)
      return NotFound(label + " not found on " + options.url + " (" + Describe(status) + ")");
    if (status.error_code() == grpc::StatusCode::UNAVAILABLE ||
        status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      return Unavailable("cannot reach the gRPC server at " + options.url + ": " +
                         Describe(status) +
                         " (a hearth serve answers gRPC on its --grpc-port, unless started "
                         "with --grpc-port -1 or built without gRPC)");
    return Unavailable(std::string(what) + " of " + label + " on " + options.url + ": " +
                       Describe(status));
  };
  inference::ModelMetadataRequest metadata_request;
  metadata_request.set_name(options.model);
  metadata_request.set_version(options.version);
  inference::ModelMetadataResponse metadata;
  {
    grpc::ClientContext context;
    SetDeadline(context, options.timeout_seconds);
    const grpc::Status status = stub->ModelMetadata(&context, metadata_request, &metadata);
    if (!status.ok()) return failed(status, "metadata");
  }
  // KServe's metadata has no max_batch_size; Triton's config does.
  inference::ModelConfigRequest config_request;
  config_request.set_name(options.model);
  config_request.set_version(options.version);
  inference::ModelConfigResponse config;
  {
    grpc::ClientContext context;
    SetDeadline(context, options.timeout_seconds);
    const grpc::Status status = stub->ModelConfig(&context, config_request, &config);
    if (!status.ok()) return failed(status, "config");
  }
  auto tensors = [](const auto& list) {
    std::vector<TensorMetadata> out;
    for (const auto& t : list)
      out.push_back(
          {t.name(), t.datatype(), std::vector<int64_t>(t.shape().begin(), t.shape().end())});
    return out;
  };
  return ResolveModel(options, config.config().max_batch_size(), tensors(metadata.inputs()),
                      tensors(metadata.outputs()));
}

// The run: calls in flight on grpc++'s callback threads, each from a slot
// (a channel, and with shared memory a region) that no other call uses
// meanwhile. Closed loop: each slot's completion starts its next call until
// the end. Open loop: a scheduler queues send times; a free slot takes the
// next one, or a finishing call does.
class GrpcRun {
 public:
  GrpcRun(const BenchOptions& options,
          std::vector<std::unique_ptr<GRPCInferenceService::Stub>>& stubs,
          std::vector<ModelInferRequest> requests, ShmSession* shm, RunRecord& record)
      : options_(options),
        stubs_(stubs),
        requests_(std::move(requests)),
        shm_(shm),
        record_(record) {}

  void ClosedLoop(Clock::time_point end) {
    end_ = end;
    closed_ = true;
    {
      std::lock_guard lock(mu_);
      outstanding_ = options_.concurrency;
    }
    for (int i = 0; i < options_.concurrency; ++i) Start(static_cast<size_t>(i), Clock::now());
    WaitForCalls();
  }

  // Returns the most calls that were in flight at once.
  int OpenLoop(Clock::time_point begin, Clock::time_point end, Clock::time_point measure_begin,
               uint64_t* unsent) {
    closed_ = false;
    drain_deadline_ = end + ToDuration(std::min(options_.timeout_seconds, 2.0));
    for (int i = options_.max_connections - 1; i >= 0; --i) free_.push_back(static_cast<size_t>(i));
    std::mt19937_64 rng(options_.seed ^ 0x5eedULL);
    std::exponential_distribution<double> gap(options_.request_rate);
    const double interval = 1.0 / options_.request_rate;
    for (Clock::time_point next = begin; next < end;) {
      std::this_thread::sleep_until(next);
      std::optional<size_t> slot;
      {
        std::lock_guard lock(mu_);
        if (free_.empty()) {
          queue_.push_back(next);
        } else {
          slot = free_.back();
          free_.pop_back();
          ++outstanding_;
          peak_ = std::max(peak_, outstanding_);
        }
      }
      if (slot) Start(*slot, next);
      const double seconds = options_.arrival == BenchArrival::kPoisson ? gap(rng) : interval;
      next += ToDuration(seconds);
    }
    WaitForCalls();
    std::lock_guard lock(mu_);
    for (const Clock::time_point t : queue_) {  // left behind by the drain deadline
      if (t >= measure_begin) ++*unsent;
    }
    return peak_;
  }

 private:
  struct Call {
    size_t slot = 0;
    Clock::time_point start;
    grpc::ClientContext context;
    ModelInferResponse response;
  };

  void Start(size_t slot, Clock::time_point start) {
    auto* call = new Call;  // owned by its completion
    call->slot = slot;
    call->start = start;
    SetDeadline(call->context, options_.timeout_seconds);
    const ModelInferRequest* request;
    if (shm_ != nullptr) {
      shm_->BeforeRequest(shm_->slot(slot));
      request = &requests_[slot];
    } else {
      request = &requests_[next_++ % requests_.size()];
    }
    stubs_[slot / kCallsPerChannel]->async()->ModelInfer(
        &call->context, request, &call->response,
        [this, call](grpc::Status status) { Finish(call, std::move(status)); });
  }

  void Finish(Call* call, grpc::Status status) {
    const Clock::time_point done = Clock::now();
    std::unique_ptr<Call> owned(call);
    if (!status.ok()) {
      record_.RecordError("gRPC " + Describe(status));
    } else if (shm_ != nullptr) {
      Result<std::vector<OutputPlacement>> placements = Placements(call->response);
      Status s = placements.ok()
                     ? shm_->AfterResponse(shm_->slot(call->slot), *placements, &record_)
                     : placements.status();
      if (s.ok())
        record_.RecordSample(call->start, done);
      else
        record_.RecordError(s.message());
    } else {
      record_.RecordSample(call->start, done);
    }
    const size_t slot = call->slot;
    // Destroyed here, before the run may end: a call holds a reference to
    // its channel, and grpc++ 1.51 must never drop a channel's last one on
    // its callback thread (the callback CQ would shut down from its own
    // thread and crash later: grpc/grpc#32584). The main thread drops the
    // channels, after the last call is gone.
    owned.reset();
    if (closed_) {
      if (Clock::now() < end_) return Start(slot, Clock::now());
    } else {
      std::optional<Clock::time_point> scheduled;
      {
        std::lock_guard lock(mu_);
        // After the schedule ends, what is queued is still sent, until the drain deadline.
        if (!queue_.empty() && Clock::now() < drain_deadline_) {
          scheduled = queue_.front();
          queue_.pop_front();
        } else {
          free_.push_back(slot);
        }
      }
      if (scheduled) return Start(slot, *scheduled);
    }
    std::lock_guard lock(mu_);
    // Notified under the lock: the waiter cannot return (and destroy this
    // run) before this callback is done with it.
    if (--outstanding_ == 0) idle_.notify_all();
  }

  void WaitForCalls() {
    std::unique_lock lock(mu_);
    idle_.wait(lock, [&] { return outstanding_ == 0; });
  }

  const BenchOptions& options_;
  std::vector<std::unique_ptr<GRPCInferenceService::Stub>>& stubs_;
  std::vector<ModelInferRequest> requests_;
  std::atomic<uint64_t> next_{0};
  ShmSession* shm_;
  RunRecord& record_;
  bool closed_ = true;
  Clock::time_point end_, drain_deadline_;
  std::mutex mu_;
  std::condition_variable idle_;
  int outstanding_ = 0;  // calls started and not finished
  int peak_ = 0;
  std::vector<size_t> free_;  // open loop: slots without a call
  std::deque<Clock::time_point> queue_;
};

}  // namespace

Result<BenchReport> RunGrpcBench(const BenchOptions& options, std::FILE* err) {
  ASSIGN_OR_RETURN(const std::string target, ParseTarget(options.url));
  const int slots = options.request_rate > 0 ? options.max_connections : options.concurrency;
  std::vector<std::unique_ptr<GRPCInferenceService::Stub>> stubs;
  for (int i = 0; i < (slots + kCallsPerChannel - 1) / kCallsPerChannel; ++i)
    stubs.push_back(NewStub(target));
  ASSIGN_OR_RETURN(const ModelSpec model, ReadModel(stubs.front().get(), options));

  const bool shm = options.shared_memory != BenchSharedMemory::kNone;
  std::mt19937_64 rng(options.seed);
  GrpcRegionControl control(stubs.front().get(), options.timeout_seconds);
  std::unique_ptr<ShmSession> session;
  std::vector<ModelInferRequest> requests;
  const ModelInferRequest base = BaseRequest(options, model);
  if (shm) {
    ASSIGN_OR_RETURN(session, ShmSession::Create(model, options, slots, &control,
                                                 DefaultRegionFactory(options), rng));
    for (size_t i = 0; i < session->size(); ++i) {
      const ShmSlot& slot = session->slot(i);
      ModelInferRequest request = base;
      for (size_t k = 0; k < model.inputs.size(); ++k)
        SetRegion(request.mutable_inputs(static_cast<int>(k))->mutable_parameters(), slot.region,
                  slot.inputs[k].offset, slot.inputs[k].bytes);
      for (size_t k = 0; k < model.outputs.size(); ++k)
        SetRegion(request.mutable_outputs(static_cast<int>(k))->mutable_parameters(), slot.region,
                  slot.outputs[k].offset, slot.outputs[k].bytes);
      requests.push_back(std::move(request));
    }
  } else {
    for (int i = 0; i < options.distinct_bodies; ++i) {
      ModelInferRequest request = base;
      for (const TensorSpec& input : model.inputs)
        request.add_raw_input_contents(RandomInputBytes(input, rng));
      requests.push_back(std::move(request));
    }
  }

  BenchReport report;
  report.protocol = "protobuf";
  report.batch = options.batch;
  RunRecord record(options, err);
  {
    GrpcRun run(options, stubs, std::move(requests), session.get(), record);
    const Clock::time_point begin = Clock::now();
    const Clock::time_point measure_begin = begin + ToDuration(options.warmup);
    const Clock::time_point measure_end = measure_begin + ToDuration(options.seconds);
    if (options.request_rate > 0) {
      report.mode = "request_rate";
      report.concurrency = run.OpenLoop(begin, measure_end, measure_begin, &report.unsent);
    } else {
      report.mode = "concurrency";
      report.concurrency = options.concurrency;
      run.ClosedLoop(measure_end);
    }
    record.Summarize(measure_begin, measure_end, &report);
  }
  return report;
}

Result<std::unique_ptr<RegionControl>> MakeGrpcRegionControl(const BenchOptions& options) {
  ASSIGN_OR_RETURN(const std::string target, ParseTarget(options.url));
  return std::unique_ptr<RegionControl>(
      new GrpcRegionControl(NewStub(target), options.timeout_seconds));
}

}  // namespace hearth::bench
