// GrpcServer over real TCP: a fake InferenceService behind it, called with a
// grpc++ client stub generated from proto/grpc_service.proto. Tests wait on
// events (the service's gate and counters, the server's stats) or poll a
// condition with a deadline; none depends on how long anything takes.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/bytes_tensor.h"
#include "grpc/kserve_grpc_codec.h"
#include "grpc/kserve_grpc_server.h"
#include "grpc_service.grpc.pb.h"
#include "support/eventually.h"
#include "support/fake_service.h"

namespace hearth {
namespace {

using inference::GRPCInferenceService;
using inference::ModelInferRequest;
using inference::ModelInferResponse;
using inference::ModelStreamInferResponse;
using json = nlohmann::json;
using namespace std::chrono_literals;
using testing::Echo;
using testing::Fails;
using testing::FakeModel;
using testing::FakeService;
using testing::FakeSettings;
using testing::MakeModel;
using testing::ResponseTo;
using testing::Seen;
using testing::TensorOf;
using testing::ValuesOf;

template <typename T>
std::vector<std::byte> AsBytes(const std::vector<T>& values) {
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

template <typename T>
std::vector<T> FromRaw(const std::string& raw) {
  std::vector<T> values(raw.size() / sizeof(T));
  if (!values.empty()) std::memcpy(values.data(), raw.data(), values.size() * sizeof(T));
  return values;
}

template <typename T>
std::string RawOf(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Models (only version "1" of each; see support/fake_service.h for what the
// fake does with every request: regions, classification, lent outputs):
//   scale      x FP32 [-1,4] -> y FP32 [-1,1] (row sums), z FP32 [-1,1] (their
//              negation); max batch 8; a config and statistics
//   echo_<DT>  in <DT> [-1,-1] -> out, the same bytes (DT: BOOL, INT8, INT16,
//              INT32, INT64, UINT8, UINT16, UINT32, UINT64, FP16, BF16, FP32,
//              FP64, BYTES)
//   gated      as scale with x [-1,-1], parked in the service until OpenGate()
//   busy, gone, late, broken, away: Infer fails with ResourceExhausted,
//              NotFound, DeadlineExceeded, Internal, Unavailable
//   unready    known, not ready (ModelReady: Unavailable)
//   countdown  decoupled: n INT32 [1] -> n responses of i INT32 [1] = n-1..0
//              through on_response, then `done` with no outputs; with the
//              model parameter {"last_in_done": true} the last one comes in
//              `done`
//   endless    decoupled: one response, then waits until `cancelled`; or
//              stops if on_response returns false
//   flood      decoupled: 256 KiB responses until on_response returns false
//   crumble    decoupled: two responses, then `done` with Internal
//   pair       a FP32 [-1,2], b FP32 [-1,2] -> sum FP32 [-1,2]; max batch 8
//   badconfig  a config that does not fit ModelConfig
// LoadModel("slow") parks until OpenGate().
InferTensor Int32Tensor(const std::string& name, int32_t value) {
  return TensorOf<int32_t>(name, DType::kI32, {1}, {value});
}

Result<InferResponse> SumRows(FakeService&, InferRequest& request) {
  const InferTensor& x = request.inputs.at(0);
  const int64_t rows = x.shape[0];
  const int64_t cols = x.shape[1];
  const std::vector<float> values = ValuesOf<float>(x);
  std::vector<float> y(static_cast<size_t>(rows)), z(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[r] += values[r * cols + c];
    z[r] = -y[r];
  }
  InferResponse response = ResponseTo(request);
  response.outputs = {TensorOf("y", DType::kF32, {rows, 1}, y),
                      TensorOf("z", DType::kF32, {rows, 1}, z)};
  return response;
}

FakeModel Scale(std::string name, int64_t cols = 4) {
  return MakeModel(std::move(name), "hearth_scale", 8, {{"x", DType::kF32, {-1, cols}}},
                   {{"y", DType::kF32, {-1, 1}}, {"z", DType::kF32, {-1, 1}}}, SumRows);
}

// countdown and crumble.
Result<InferResponse> Countdown(FakeService&, InferRequest& request) {
  const bool crumble = request.model == "crumble";
  const int32_t n = crumble ? 2 : ValuesOf<int32_t>(request.inputs.at(0)).at(0);
  const bool last_in_done =
      json::parse(request.parameters_json.empty() ? "{}" : request.parameters_json)
          .value("last_in_done", false);
  for (int32_t k = 0; k < (last_in_done ? n - 1 : n); ++k) {
    InferResponse response = ResponseTo(request);
    response.outputs.push_back(Int32Tensor("i", n - 1 - k));
    if (!request.on_response(response)) break;
  }
  if (crumble) return Internal("the worker of model 'crumble' died mid-stream");
  InferResponse last = ResponseTo(request);
  if (last_in_done && n > 0) last.outputs.push_back(Int32Tensor("i", 0));
  return last;
}

Result<InferResponse> Endless(FakeService& fake, InferRequest& request) {
  InferResponse response = ResponseTo(request);
  response.outputs.push_back(Int32Tensor("i", 7));
  if (request.on_response(response)) fake.AwaitCancel(request);
  return Unavailable("the stream of model 'endless' was stopped");
}

Result<InferResponse> Flood(FakeService&, InferRequest& request) {
  for (int k = 0; k < 100'000; ++k) {
    InferResponse response = ResponseTo(request);
    response.outputs.push_back(
        {"blob", DType::kU8, {256 << 10}, std::vector<std::byte>(256 << 10, std::byte{1})});
    if (!request.on_response(response)) break;
  }
  return Unavailable("the stream of model 'flood' was stopped");
}

Result<InferResponse> AddPair(FakeService&, InferRequest& request) {
  std::vector<float> sum = ValuesOf<float>(request.inputs.at(0));
  const std::vector<float> b = ValuesOf<float>(request.inputs.at(1));
  for (size_t k = 0; k < sum.size(); ++k) sum[k] += b[k];
  InferResponse response = ResponseTo(request);
  response.outputs.push_back(TensorOf("sum", DType::kF32, request.inputs[0].shape, sum));
  return response;
}

// As server/model_config_json.cc writes it, plus a field that ModelConfig
// does not define.
const char* kScaleConfig = R"({"name":"scale","backend":"scale","max_batch_size":8,
      "input":[{"name":"x","data_type":"TYPE_FP32","dims":[4]}],
      "output":[{"name":"y","data_type":"TYPE_FP32","dims":[1]},{"name":"z","data_type":"TYPE_FP32","dims":[1]}],
      "instance_group":[{"count":2,"kind":"KIND_GPU","gpus":[0]}],
      "dynamic_batching":{"max_queue_delay_microseconds":300,"preferred_batch_size":[4,8],
                          "default_queue_policy":{"default_timeout_microseconds":5000}},
      "parameters":{"fault_injection":{"string_value":"none"}},
      "version_policy":{"specific":{"versions":["1"]}},
      "model_transaction_policy":{"decoupled":true},
      "hearth_future_field":{"anything":[1,2]}})";

std::vector<FakeModel> Models() {
  std::vector<FakeModel> models;
  FakeModel scale = Scale("scale");
  scale.config_json = kScaleConfig;
  ModelStatistics& s = scale.statistics.emplace();
  s.name = "scale";
  s.version = "1";
  s.last_inference_ms = 1'700'000'000'123;
  s.inference_count = 12;
  s.execution_count = 5;
  s.success = {10, 1000};
  s.fail = {2, 20};
  s.queue = {10, 300};
  s.compute_input = {5, 40};
  s.compute_infer = {5, 500};
  s.compute_output = {5, 60};
  s.batch_stats = {{1, {2, 10}, {2, 100}, {2, 20}}, {4, {3, 30}, {3, 400}, {3, 40}}};
  s.streams = ModelStatistics::Streams{{3, 0}, 9, 2, 40, 120};
  models.push_back(std::move(scale));
  models.push_back(Scale("gated", -1));
  models.back().gated = true;
  const std::pair<const char*, Status> failing[] = {
      {"busy", ResourceExhausted("queue of model 'busy' is full")},
      {"gone", NotFound("model 'gone' was unloaded")},
      {"late", DeadlineExceeded("the request timed out in the queue")},
      {"broken", Internal("the worker of model 'broken' crashed")},
      {"away", Unavailable("no worker of model 'away' is ready")}};
  for (const auto& [name, status] : failing) {
    models.push_back(Scale(name));
    models.back().run = Fails(status);
  }
  models.push_back(Scale("unready"));
  models.back().ready = Unavailable("model 'unready': no worker is ready");
  for (const char* type : {"BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32",
                           "UINT64", "FP16", "BF16", "FP32", "FP64", "BYTES"}) {
    const DType dtype = ParseKserveDatatype(type).value();
    models.push_back(MakeModel(std::string("echo_") + type, "hearth_fake", 8,
                               {{"in", dtype, {-1, -1}}}, {{"out", dtype, {-1, -1}}}, Echo("out")));
  }
  const TensorMetadata n = {"n", DType::kI32, {1}};
  const TensorMetadata i = {"i", DType::kI32, {1}};
  models.push_back(MakeModel("countdown", "hearth_fake", 0, {n}, {i}, Countdown));
  models.push_back(MakeModel("crumble", "hearth_fake", 0, {n}, {i}, Countdown));
  models.push_back(MakeModel("endless", "hearth_fake", 0, {n}, {i}, Endless));
  models.back().own_thread = true;
  models.push_back(MakeModel("flood", "hearth_fake", 0, {n}, {{"blob", DType::kU8, {-1}}}, Flood));
  models.back().own_thread = true;
  for (auto it = models.end() - 4; it != models.end(); ++it) it->metadata.decoupled = true;
  models.push_back(MakeModel("pair", "hearth_fake", 8,
                             {{"a", DType::kF32, {-1, 2}}, {"b", DType::kF32, {-1, 2}}},
                             {{"sum", DType::kF32, {-1, 2}}}, AddPair));
  models.push_back(MakeModel("badconfig", "hearth_fake", 0, {}, {}));
  models.back().config_json = R"({"max_batch_size": "many"})";
  return models;
}

FakeSettings Settings() {
  FakeSettings settings;
  settings.extensions = {"binary_tensor_data", "statistics"};
  settings.repository = {{"broken", "", "UNAVAILABLE", "config.yaml: bad dims"},
                         {"scale", "1", "READY", ""}};
  settings.parked_loads = {"slow"};
  settings.repository_calls = 2;
  return settings;
}

// How the stream of endless or flood ended: "cancelled" (its `cancelled`
// was set) or "refused" (on_response returned false).
std::string StreamEnd(FakeService& service) {
  const std::optional<Seen> seen =
      service.WaitSeen([](const Seen& s) { return s.model == "endless" || s.model == "flood"; });
  if (!seen.has_value()) return "timeout";
  return seen->refused ? "refused" : seen->cancelled ? "cancelled" : "none";
}

class GrpcServerTest : public ::testing::Test {
 protected:
  void StartServer(GrpcOptions options = {}) {
    options.port = 0;
    Result<std::unique_ptr<GrpcServer>> created = GrpcServer::Create(&service_, options);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    server_ = std::move(created).value();
    Status started = server_->Start();
    ASSERT_TRUE(started.ok()) << started.ToString();
    ASSERT_NE(server_->port(), 0);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    channel_ = grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(server_->port()),
                                         grpc::InsecureChannelCredentials(), args);
    stub_ = GRPCInferenceService::NewStub(channel_);
  }
  void TearDown() override {
    service_.OpenGate();  // Stop() waits for every infer
    if (server_) server_->Stop();
  }

  // A context that gives up after 60 s, so that a broken server fails a test
  // instead of hanging it.
  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + 60s);
    return context;
  }

  grpc::Status Infer(const ModelInferRequest& request, ModelInferResponse* response) {
    return stub_->ModelInfer(Context().get(), request, response);
  }

  FakeService service_{Settings(), Models()};
  std::unique_ptr<GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<GRPCInferenceService::Stub> stub_;
};

ModelInferRequest ScaleRequest(const std::vector<float>& x, int64_t rows, std::string id = "") {
  ModelInferRequest request;
  request.set_model_name("scale");
  request.set_id(std::move(id));
  auto* input = request.add_inputs();
  input->set_name("x");
  input->set_datatype("FP32");
  input->add_shape(rows);
  input->add_shape(static_cast<int64_t>(x.size()) / rows);
  request.add_raw_input_contents(RawOf(x));
  return request;
}

ModelInferRequest ScaleRequest() { return ScaleRequest({1, 2, 3, 4, 5, 6, 7, 8.5f}, 2, "r7"); }

ModelInferRequest CountdownRequest(const std::string& model, int32_t n, std::string id) {
  ModelInferRequest request;
  request.set_model_name(model);
  request.set_id(std::move(id));
  auto* input = request.add_inputs();
  input->set_name("n");
  input->set_datatype("INT32");
  input->add_shape(1);
  request.add_raw_input_contents(RawOf(std::vector<int32_t>{n}));
  return request;
}

bool IsFinal(const ModelInferResponse& response) {
  const auto it = response.parameters().find(std::string(kFinalResponseParameter));
  return it != response.parameters().end() && it->second.bool_param();
}

bool HasFinalFlag(const ModelInferResponse& response) {
  return response.parameters().count(std::string(kFinalResponseParameter)) > 0;
}

// ---- health, metadata, config, statistics, index ------------------------------

TEST_F(GrpcServerTest, Health) {
  StartServer();
  inference::ServerLiveResponse live;
  ASSERT_TRUE(stub_->ServerLive(Context().get(), {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(stub_->ServerReady(Context().get(), {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
  service_.ready_ = false;
  ASSERT_TRUE(stub_->ServerReady(Context().get(), {}, &ready).ok());
  EXPECT_FALSE(ready.ready());
}

TEST_F(GrpcServerTest, ServerAndModelMetadata) {
  StartServer();
  inference::ServerMetadataResponse server;
  ASSERT_TRUE(stub_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_EQ(server.name(), "hearth");
  EXPECT_EQ(server.version(), "0.1.0");
  ASSERT_EQ(server.extensions_size(), 2);
  EXPECT_EQ(server.extensions(1), "statistics");

  for (const char* version : {"", "1"}) {
    inference::ModelMetadataRequest request;
    request.set_name("scale");
    request.set_version(version);
    inference::ModelMetadataResponse model;
    ASSERT_TRUE(stub_->ModelMetadata(Context().get(), request, &model).ok());
    EXPECT_EQ(model.name(), "scale");
    ASSERT_EQ(model.versions_size(), 1);
    EXPECT_EQ(model.versions(0), "1");
    EXPECT_EQ(model.platform(), "hearth_scale");
    ASSERT_EQ(model.inputs_size(), 1);
    EXPECT_EQ(model.inputs(0).name(), "x");
    EXPECT_EQ(model.inputs(0).datatype(), "FP32");
    EXPECT_EQ(std::vector<int64_t>(model.inputs(0).shape().begin(), model.inputs(0).shape().end()),
              (std::vector<int64_t>{-1, 4}));
    ASSERT_EQ(model.outputs_size(), 2);
    EXPECT_EQ(model.outputs(1).name(), "z");
  }
  inference::ModelMetadataRequest unknown;
  unknown.set_name("nope");
  inference::ModelMetadataResponse ignored;
  grpc::Status status = stub_->ModelMetadata(Context().get(), unknown, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "no model 'nope'");
  unknown.set_name("scale");
  unknown.set_version("7");
  status = stub_->ModelMetadata(Context().get(), unknown, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "model 'scale' has no version '7'");
}

TEST_F(GrpcServerTest, ModelReady) {
  StartServer();
  auto ready = [&](const std::string& name, inference::ModelReadyResponse* response) {
    inference::ModelReadyRequest request;
    request.set_name(name);
    return stub_->ModelReady(Context().get(), request, response);
  };
  inference::ModelReadyResponse response;
  ASSERT_TRUE(ready("scale", &response).ok());
  EXPECT_TRUE(response.ready());
  ASSERT_TRUE(ready("unready", &response).ok());
  EXPECT_FALSE(response.ready());
  // Unknown models and versions are not ready, as Triton answers: no error.
  response.set_ready(true);
  ASSERT_TRUE(ready("nope", &response).ok());
  EXPECT_FALSE(response.ready());
  inference::ModelReadyRequest version;
  version.set_name("scale");
  version.set_version("7");
  response.set_ready(true);
  ASSERT_TRUE(stub_->ModelReady(Context().get(), version, &response).ok());
  EXPECT_FALSE(response.ready());
}

TEST_F(GrpcServerTest, ServerMetadataGivesTheNameItIsToldToGive) {
  GrpcOptions options;
  options.server_name = "triton";
  StartServer(options);
  inference::ServerMetadataResponse server;
  ASSERT_TRUE(stub_->ServerMetadata(Context().get(), {}, &server).ok());
  EXPECT_EQ(server.name(), "triton");
}

TEST_F(GrpcServerTest, LogSettingsAreReadAndChangedLive) {
  const spdlog::level::level_enum before = spdlog::get_level();
  spdlog::set_level(spdlog::level::info);
  StartServer();
  auto settings = [&](inference::LogSettingsRequest request,
                      inference::LogSettingsResponse* response) {
    return stub_->LogSettings(Context().get(), request, response);
  };
  inference::LogSettingsResponse now;
  ASSERT_TRUE(settings({}, &now).ok());
  EXPECT_EQ(now.settings().at("log_file").string_param(), "");
  EXPECT_TRUE(now.settings().at("log_info").bool_param());
  EXPECT_TRUE(now.settings().at("log_warning").bool_param());
  EXPECT_TRUE(now.settings().at("log_error").bool_param());
  EXPECT_EQ(now.settings().at("log_verbose_level").uint32_param(), 0u);
  EXPECT_EQ(now.settings().at("log_format").string_param(), "default");
  inference::LogSettingsRequest verbose;
  (*verbose.mutable_settings())["log_verbose_level"].set_uint32_param(2);
  ASSERT_TRUE(settings(verbose, &now).ok());
  EXPECT_EQ(spdlog::get_level(), spdlog::level::trace);
  EXPECT_EQ(now.settings().at("log_verbose_level").uint32_param(), 2u);
  inference::LogSettingsRequest errors_only;
  (*errors_only.mutable_settings())["log_warning"].set_bool_param(false);
  ASSERT_TRUE(settings(errors_only, &now).ok());
  EXPECT_EQ(spdlog::get_level(), spdlog::level::err);
  EXPECT_FALSE(now.settings().at("log_info").bool_param());
  EXPECT_EQ(now.settings().at("log_verbose_level").uint32_param(), 0u);
  // Refused whole: nothing changes.
  inference::LogSettingsRequest file;
  (*file.mutable_settings())["log_info"].set_bool_param(true);
  (*file.mutable_settings())["log_file"].set_string_param("/tmp/hearth.log");
  grpc::Status refused = settings(file, &now);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("log_file '/tmp/hearth.log' cannot be set"),
            std::string::npos)
      << refused.error_message();
  EXPECT_EQ(spdlog::get_level(), spdlog::level::err);
  inference::LogSettingsRequest wrong_kind;
  (*wrong_kind.mutable_settings())["log_verbose_level"].set_bool_param(true);
  refused = settings(wrong_kind, &now);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("uint32_param"), std::string::npos);
  inference::LogSettingsRequest unknown;
  (*unknown.mutable_settings())["log_colour"].set_bool_param(true);
  EXPECT_EQ(settings(unknown, &now).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  inference::LogSettingsRequest back;
  (*back.mutable_settings())["log_info"].set_bool_param(true);
  ASSERT_TRUE(settings(back, &now).ok());
  EXPECT_EQ(spdlog::get_level(), spdlog::level::info);
  spdlog::set_level(before);
}

TEST_F(GrpcServerTest, TraceSettingsSayTracingIsOffAndRefuseTurningItOn) {
  StartServer();
  auto trace = [&](inference::TraceSettingRequest request,
                   inference::TraceSettingResponse* response) {
    return stub_->TraceSetting(Context().get(), request, response);
  };
  auto value = [](const inference::TraceSettingResponse& r, const std::string& name) {
    const auto& v = r.settings().at(name).value();
    return std::vector<std::string>(v.begin(), v.end());
  };
  inference::TraceSettingResponse now;
  ASSERT_TRUE(trace({}, &now).ok());
  EXPECT_EQ(value(now, "trace_level"), (std::vector<std::string>{"OFF"}));
  EXPECT_EQ(value(now, "trace_rate"), (std::vector<std::string>{"1000"}));
  EXPECT_EQ(value(now, "trace_count"), (std::vector<std::string>{"-1"}));
  EXPECT_EQ(value(now, "log_frequency"), (std::vector<std::string>{"0"}));
  EXPECT_EQ(value(now, "trace_mode"), (std::vector<std::string>{"triton"}));
  inference::TraceSettingRequest on;
  (*on.mutable_settings())["trace_level"].add_value("TIMESTAMPS");
  grpc::Status refused = trace(on, &now);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("hearth does not trace requests"), std::string::npos)
      << refused.error_message();
  inference::TraceSettingRequest off;
  (*off.mutable_settings())["trace_level"].add_value("OFF");
  (*off.mutable_settings())["trace_rate"];  // no values: cleared
  off.set_model_name("scale");
  ASSERT_TRUE(trace(off, &now).ok());
  EXPECT_EQ(value(now, "trace_level"), (std::vector<std::string>{"OFF"}));
  off.set_model_name("nope");
  EXPECT_EQ(trace(off, &now).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(GrpcServerTest, ModelConfigFromTheConfigsJson) {
  StartServer();
  inference::ModelConfigRequest request;
  request.set_name("scale");
  inference::ModelConfigResponse response;
  grpc::Status status = stub_->ModelConfig(Context().get(), request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const inference::ModelConfig& config = response.config();
  EXPECT_EQ(config.name(), "scale");
  EXPECT_EQ(config.backend(), "scale");
  EXPECT_EQ(config.max_batch_size(), 8);
  ASSERT_EQ(config.input_size(), 1);
  EXPECT_EQ(config.input(0).name(), "x");
  EXPECT_EQ(config.input(0).data_type(), inference::TYPE_FP32);
  ASSERT_EQ(config.input(0).dims_size(), 1);
  EXPECT_EQ(config.input(0).dims(0), 4);
  ASSERT_EQ(config.output_size(), 2);
  EXPECT_EQ(config.output(1).name(), "z");
  ASSERT_EQ(config.instance_group_size(), 1);
  EXPECT_EQ(config.instance_group(0).count(), 2);
  EXPECT_EQ(config.instance_group(0).kind(), inference::ModelInstanceGroup::KIND_GPU);
  ASSERT_EQ(config.instance_group(0).gpus_size(), 1);
  ASSERT_TRUE(config.has_dynamic_batching());
  EXPECT_EQ(config.dynamic_batching().max_queue_delay_microseconds(), 300u);
  ASSERT_EQ(config.dynamic_batching().preferred_batch_size_size(), 2);
  EXPECT_EQ(config.dynamic_batching().preferred_batch_size(1), 8);
  EXPECT_EQ(config.dynamic_batching().default_queue_policy().default_timeout_microseconds(), 5000u);
  EXPECT_EQ(config.parameters().at("fault_injection").string_value(), "none");
  ASSERT_EQ(config.version_policy().specific().versions_size(), 1);
  EXPECT_EQ(config.version_policy().specific().versions(0), 1);
  EXPECT_TRUE(config.model_transaction_policy().decoupled());

  request.set_name("nope");
  EXPECT_EQ(stub_->ModelConfig(Context().get(), request, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);
  request.set_name("badconfig");
  status = stub_->ModelConfig(Context().get(), request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INTERNAL);
  EXPECT_NE(status.error_message().find("does not fit ModelConfig"), std::string::npos)
      << status.error_message();
}

TEST_F(GrpcServerTest, ModelStatisticsCarryTritonsFields) {
  StartServer();
  for (const char* name : {"scale", ""}) {
    inference::ModelStatisticsRequest request;
    request.set_name(name);
    inference::ModelStatisticsResponse response;
    ASSERT_TRUE(stub_->ModelStatistics(Context().get(), request, &response).ok());
    ASSERT_EQ(response.model_stats_size(), 1);
    const inference::ModelStatistics& s = response.model_stats(0);
    EXPECT_EQ(s.name(), "scale");
    EXPECT_EQ(s.version(), "1");
    EXPECT_EQ(s.last_inference(), 1'700'000'000'123u);
    EXPECT_EQ(s.inference_count(), 12u);
    EXPECT_EQ(s.execution_count(), 5u);
    EXPECT_EQ(s.inference_stats().success().count(), 10u);
    EXPECT_EQ(s.inference_stats().success().ns(), 1000u);
    EXPECT_EQ(s.inference_stats().fail().count(), 2u);
    EXPECT_EQ(s.inference_stats().queue().ns(), 300u);
    EXPECT_EQ(s.inference_stats().compute_input().ns(), 40u);
    EXPECT_EQ(s.inference_stats().compute_infer().ns(), 500u);
    ASSERT_TRUE(s.has_hearth_streams());
    EXPECT_EQ(s.hearth_streams().in_flight_size(), 2);
    EXPECT_EQ(s.hearth_streams().in_flight(0), 3u);
    EXPECT_EQ(s.hearth_streams().opened(), 9u);
    EXPECT_EQ(s.hearth_streams().resumed(), 2u);
    EXPECT_EQ(s.hearth_streams().responses(), 40u);
    EXPECT_EQ(s.hearth_streams().tokens(), 120u);
    EXPECT_EQ(s.inference_stats().compute_output().ns(), 60u);
    ASSERT_EQ(s.batch_stats_size(), 2);
    EXPECT_EQ(s.batch_stats(1).batch_size(), 4u);
    EXPECT_EQ(s.batch_stats(1).compute_infer().count(), 3u);
    EXPECT_EQ(s.batch_stats(1).compute_infer().ns(), 400u);
  }
  inference::ModelStatisticsRequest unknown;
  unknown.set_name("nope");
  inference::ModelStatisticsResponse ignored;
  EXPECT_EQ(stub_->ModelStatistics(Context().get(), unknown, &ignored).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(GrpcServerTest, RepositoryIndex) {
  StartServer();
  inference::RepositoryIndexRequest request;
  inference::RepositoryIndexResponse response;
  ASSERT_TRUE(stub_->RepositoryIndex(Context().get(), request, &response).ok());
  ASSERT_EQ(response.models_size(), 2);
  EXPECT_EQ(response.models(0).name(), "broken");
  EXPECT_EQ(response.models(0).state(), "UNAVAILABLE");
  EXPECT_EQ(response.models(0).reason(), "config.yaml: bad dims");
  EXPECT_EQ(response.models(1).version(), "1");
  request.set_ready(true);
  response.Clear();
  ASSERT_TRUE(stub_->RepositoryIndex(Context().get(), request, &response).ok());
  ASSERT_EQ(response.models_size(), 1);
  EXPECT_EQ(response.models(0).state(), "READY");
  request.set_repository_name("other");
  EXPECT_EQ(stub_->RepositoryIndex(Context().get(), request, &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// A service without CUDA shared memory (the fake keeps InferenceService's
// defaults) has none to list or unregister: perf_analyzer unregisters all of
// them on every run with shared memory, and stops if that fails.
TEST_F(GrpcServerTest, ThereAreNoCudaSharedMemoryRegions) {
  StartServer();
  {
    inference::CudaSharedMemoryStatusResponse r;
    ASSERT_TRUE(stub_->CudaSharedMemoryStatus(Context().get(), {}, &r).ok());
    EXPECT_TRUE(r.regions().empty());
  }
  {
    inference::CudaSharedMemoryUnregisterResponse r;
    EXPECT_TRUE(stub_->CudaSharedMemoryUnregister(Context().get(), {}, &r).ok());
  }
  std::vector<grpc::Status> named;
  {
    inference::CudaSharedMemoryStatusRequest q;
    q.set_name("c");
    inference::CudaSharedMemoryStatusResponse r;
    named.push_back(stub_->CudaSharedMemoryStatus(Context().get(), q, &r));
  }
  {
    inference::CudaSharedMemoryUnregisterRequest q;
    q.set_name("c");
    inference::CudaSharedMemoryUnregisterResponse r;
    named.push_back(stub_->CudaSharedMemoryUnregister(Context().get(), q, &r));
  }
  for (const grpc::Status& status : named) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_NE(status.error_message().find("no CUDA shared-memory region named 'c'"),
              std::string::npos)
        << status.error_message();
  }
}

TEST_F(GrpcServerTest, UnimplementedRpcsSaySo) {
  StartServer();
  std::vector<std::pair<std::string, grpc::Status>> answers;
  {
    inference::CudaSharedMemoryRegisterResponse r;
    answers.emplace_back("cuda", stub_->CudaSharedMemoryRegister(Context().get(), {}, &r));
  }
  const std::map<std::string, std::string> says = {{"cuda", "CUDA shared memory"}};
  for (const auto& [what, status] : answers) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << what;
    EXPECT_NE(status.error_message().find(says.at(what)), std::string::npos)
        << what << ": " << status.error_message();
  }
}

// ---- repository load and unload ------------------------------------------------

TEST_F(GrpcServerTest, RepositoryLoadAndUnloadCallTheService) {
  StartServer();
  auto load = [&](const std::string& name, inference::RepositoryModelLoadRequest request = {}) {
    request.set_model_name(name);
    inference::RepositoryModelLoadResponse response;
    return stub_->RepositoryModelLoad(Context().get(), request, &response);
  };
  auto unload = [&](const std::string& name, inference::RepositoryModelUnloadRequest request = {}) {
    request.set_model_name(name);
    inference::RepositoryModelUnloadResponse response;
    return stub_->RepositoryModelUnload(Context().get(), request, &response);
  };
  EXPECT_TRUE(unload("scale").ok());
  EXPECT_TRUE(load("scale").ok());
  grpc::Status status = load("nope");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "no model 'nope' in the repository");
  EXPECT_EQ(unload("nope").error_code(), grpc::StatusCode::NOT_FOUND);
  // unload_dependents is accepted; it unloads nothing more.
  inference::RepositoryModelUnloadRequest dependents;
  (*dependents.mutable_parameters())["unload_dependents"].set_bool_param(true);
  EXPECT_TRUE(unload("scale", dependents).ok());
  EXPECT_EQ(service_.control_calls(),
            (std::vector<std::string>{"unload scale", "load scale", "load nope", "unload nope",
                                      "unload scale"}));
  // Refused before the service sees them.
  status = load("");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "the request names no model (model_name)");
  inference::RepositoryModelLoadRequest other;
  other.set_repository_name("elsewhere");
  status = load("scale", other);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("one model repository"), std::string::npos);
  inference::RepositoryModelLoadRequest with_file;
  (*with_file.mutable_parameters())["file:1/model.py"].set_string_param("hi");
  status = load("scale", with_file);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("parameter 'file:1/model.py' must be a bytes_param"),
            std::string::npos)
      << status.error_message();
  inference::RepositoryModelLoadRequest with_config;
  (*with_config.mutable_parameters())["config"].set_string_param("{}");
  (*with_config.mutable_parameters())["file:1/model.py"].set_bytes_param(std::string("\0x", 2));
  EXPECT_TRUE(load("scale", with_config).ok());
  EXPECT_EQ(service_.load_overrides(),
            (std::vector<std::string>{"config {}", std::string("file 1/model.py=\0x", 18)}));
  inference::RepositoryModelUnloadRequest unload_config;
  (*unload_config.mutable_parameters())["config"].set_string_param("{}");
  EXPECT_EQ(unload("scale", unload_config).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(service_.control_calls().size(), 6u);
}

// A load waits for workers: it runs on the service's pool, never on a
// thread of gRPC's, at most repository_calls (2) at once (the fake's pool, as
// the server's), while everything else is answered; Stop() waits for it.
TEST_F(GrpcServerTest, LoadsInProgressAreBoundedAndHoldUpNothingElse) {
  StartServer();
  std::vector<grpc::Status> statuses(2);
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] {
      inference::RepositoryModelLoadRequest request;
      request.set_model_name("slow");
      inference::RepositoryModelLoadResponse response;
      statuses[i] = stub_->RepositoryModelLoad(Context().get(), request, &response);
    });
  }
  ASSERT_TRUE(service_.WaitParkedLoads(2));
  EXPECT_EQ(server_->stats().control_calls, 2u);
  inference::RepositoryModelUnloadRequest third;
  third.set_model_name("scale");
  inference::RepositoryModelUnloadResponse ignored;
  grpc::Status refused = stub_->RepositoryModelUnload(Context().get(), third, &ignored);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("2 repository loads and unloads in progress"),
            std::string::npos)
      << refused.error_message();
  // Everything else is answered meanwhile.
  inference::ServerLiveResponse live;
  EXPECT_TRUE(stub_->ServerLive(Context().get(), {}, &live).ok());
  ModelInferResponse response;
  ASSERT_TRUE(Infer(ScaleRequest(), &response).ok());
  service_.OpenGate();
  for (std::thread& t : clients) t.join();
  for (const grpc::Status& status : statuses) EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(Eventually([&] { return server_->stats().control_calls == 0; }));
  EXPECT_TRUE(stub_->RepositoryModelUnload(Context().get(), third, &ignored).ok());
}

TEST_F(GrpcServerTest, StopWaitsForALoadInProgress) {
  StartServer();
  grpc::Status status;
  std::thread client([&] {
    inference::RepositoryModelLoadRequest request;
    request.set_model_name("slow");
    inference::RepositoryModelLoadResponse response;
    status = stub_->RepositoryModelLoad(Context().get(), request, &response);
  });
  ASSERT_TRUE(service_.WaitParkedLoads(1));
  std::thread stopper([&] { server_->Stop(); });
  ASSERT_TRUE(Eventually([&] { return server_->stats().draining; }));
  EXPECT_EQ(service_.loads_done(), 0);
  service_.OpenGate();
  stopper.join();
  // Stop() returned only once the load had.
  EXPECT_EQ(service_.loads_done(), 1);
  client.join();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

// ---- system shared memory ---------------------------------------------------------

TEST_F(GrpcServerTest, SharedMemoryRegisterStatusUnregister) {
  StartServer();
  auto reg = [&](const std::string& name, const std::string& key, uint64_t offset,
                 uint64_t byte_size) {
    inference::SystemSharedMemoryRegisterRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_offset(offset);
    request.set_byte_size(byte_size);
    inference::SystemSharedMemoryRegisterResponse response;
    return stub_->SystemSharedMemoryRegister(Context().get(), request, &response);
  };
  auto status_of = [&](const std::string& name, inference::SystemSharedMemoryStatusResponse* out) {
    inference::SystemSharedMemoryStatusRequest request;
    request.set_name(name);
    return stub_->SystemSharedMemoryStatus(Context().get(), request, out);
  };
  auto unreg = [&](const std::string& name) {
    inference::SystemSharedMemoryUnregisterRequest request;
    request.set_name(name);
    inference::SystemSharedMemoryUnregisterResponse response;
    return stub_->SystemSharedMemoryUnregister(Context().get(), request, &response);
  };
  ASSERT_TRUE(reg("in", "/hearth-in", 16, 64).ok());
  // The service is told whose connection asks: gRPC's peer, which names
  // this process's socket in the kernel's table, and the server's port.
  const ClientConnection asker = service_.LastClient();
  EXPECT_NE(asker.address, "");
  EXPECT_NE(asker.port, 0);
  EXPECT_EQ(asker.server_port, server_->port());
  Result<uid_t> uid = LocalPeerUid(asker);
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  EXPECT_EQ(*uid, ::geteuid());
  ASSERT_TRUE(reg("out", "/hearth-out", 0, 32).ok());
  grpc::Status status = reg("in", "/hearth-other", 0, 8);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(status.error_message(), "a shared-memory region named 'in' is registered");
  EXPECT_EQ(reg("gone", "/missing", 0, 8).error_code(), grpc::StatusCode::NOT_FOUND);

  inference::SystemSharedMemoryStatusResponse all;
  ASSERT_TRUE(status_of("", &all).ok());
  ASSERT_EQ(all.regions_size(), 2);
  const auto& in = all.regions().at("in");
  EXPECT_EQ(in.name(), "in");
  EXPECT_EQ(in.key(), "/hearth-in");
  EXPECT_EQ(in.offset(), 16u);
  EXPECT_EQ(in.byte_size(), 64u);
  EXPECT_EQ(all.regions().at("out").key(), "/hearth-out");
  inference::SystemSharedMemoryStatusResponse one;
  ASSERT_TRUE(status_of("out", &one).ok());
  ASSERT_EQ(one.regions_size(), 1);
  EXPECT_EQ(one.regions().at("out").byte_size(), 32u);
  EXPECT_EQ(status_of("nope", &one).error_code(), grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE(unreg("in").ok());
  EXPECT_EQ(unreg("in").error_code(), grpc::StatusCode::NOT_FOUND);
  ASSERT_TRUE(reg("in", "/hearth-in", 0, 8).ok());
  ASSERT_TRUE(unreg("").ok());  // every region
  inference::SystemSharedMemoryStatusResponse none;
  ASSERT_TRUE(status_of("", &none).ok());
  EXPECT_EQ(none.regions_size(), 0);
}

// ---- ModelInfer ------------------------------------------------------------------

TEST_F(GrpcServerTest, InferWithRawInputs) {
  StartServer();
  ModelInferResponse response;
  grpc::Status status = Infer(ScaleRequest(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.model_name(), "scale");
  EXPECT_EQ(response.model_version(), "1");
  EXPECT_EQ(response.id(), "r7");
  ASSERT_EQ(response.outputs_size(), 2);
  ASSERT_EQ(response.raw_output_contents_size(), 2);
  EXPECT_EQ(response.outputs(0).name(), "y");
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  EXPECT_EQ(
      std::vector<int64_t>(response.outputs(0).shape().begin(), response.outputs(0).shape().end()),
      (std::vector<int64_t>{2, 1}));
  // Borrowed from the service and spoiled once `done` returned: copied in time.
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), (std::vector<float>{10, 26.5f}));
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(1)), (std::vector<float>{-10, -26.5f}));
  // Raw inputs reach the service as views of the request, not copies.
  EXPECT_TRUE(service_.last_input_was_view());
}

TEST_F(GrpcServerTest, InferReturnsOnlyTheRequestedOutputs) {
  StartServer();
  ModelInferRequest request = ScaleRequest();
  request.add_outputs()->set_name("z");
  ModelInferResponse response;
  ASSERT_TRUE(Infer(request, &response).ok());
  ASSERT_EQ(response.outputs_size(), 1);
  EXPECT_EQ(response.outputs(0).name(), "z");
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), (std::vector<float>{-10, -26.5f}));
}

// Typed contents become the same bytes as raw ones, for every datatype that
// has a typed field.
TEST_F(GrpcServerTest, TypedContentsOfEachDatatype) {
  StartServer();
  struct Case {
    std::string datatype;
    std::function<void(inference::InferTensorContents*)> fill;
    std::string expected;  // raw bytes
  };
  std::vector<std::byte> strings;
  ASSERT_TRUE(AppendBytesElement(strings, "hi", "").ok());
  ASSERT_TRUE(AppendBytesElement(strings, std::string("\0\xff", 2), "").ok());
  const std::vector<Case> cases = {
      {"BOOL",
       [](auto* c) {
         c->add_bool_contents(true);
         c->add_bool_contents(false);
       },
       std::string("\x01\x00", 2)},
      {"INT8",
       [](auto* c) {
         c->add_int_contents(-128);
         c->add_int_contents(127);
       },
       RawOf(std::vector<int8_t>{-128, 127})},
      {"INT16",
       [](auto* c) {
         c->add_int_contents(-300);
         c->add_int_contents(300);
       },
       RawOf(std::vector<int16_t>{-300, 300})},
      {"INT32",
       [](auto* c) {
         c->add_int_contents(-70000);
         c->add_int_contents(70000);
       },
       RawOf(std::vector<int32_t>{-70000, 70000})},
      {"INT64",
       [](auto* c) {
         c->add_int64_contents(int64_t{1} << 40);
         c->add_int64_contents(-1);
       },
       RawOf(std::vector<int64_t>{int64_t{1} << 40, -1})},
      {"UINT8",
       [](auto* c) {
         c->add_uint_contents(0);
         c->add_uint_contents(255);
       },
       RawOf(std::vector<uint8_t>{0, 255})},
      {"UINT16",
       [](auto* c) {
         c->add_uint_contents(0);
         c->add_uint_contents(65535);
       },
       RawOf(std::vector<uint16_t>{0, 65535})},
      {"UINT32",
       [](auto* c) {
         c->add_uint_contents(7);
         c->add_uint_contents(4294967295u);
       },
       RawOf(std::vector<uint32_t>{7, 4294967295u})},
      {"UINT64",
       [](auto* c) {
         c->add_uint64_contents(uint64_t{1} << 63);
         c->add_uint64_contents(~uint64_t{0});
       },
       RawOf(std::vector<uint64_t>{uint64_t{1} << 63, ~uint64_t{0}})},
      {"FP32",
       [](auto* c) {
         c->add_fp32_contents(1.5f);
         c->add_fp32_contents(-2.25f);
       },
       RawOf(std::vector<float>{1.5f, -2.25f})},
      {"FP64",
       [](auto* c) {
         c->add_fp64_contents(1e300);
         c->add_fp64_contents(-0.5);
       },
       RawOf(std::vector<double>{1e300, -0.5})},
      {"BYTES",
       [](auto* c) {
         c->add_bytes_contents("hi");
         c->add_bytes_contents(std::string("\0\xff", 2));
       },
       std::string(reinterpret_cast<const char*>(strings.data()), strings.size())},
  };
  for (const Case& c : cases) {
    ModelInferRequest request;
    request.set_model_name("echo_" + c.datatype);
    auto* input = request.add_inputs();
    input->set_name("in");
    input->set_datatype(c.datatype);
    input->add_shape(1);
    input->add_shape(2);
    c.fill(input->mutable_contents());
    ModelInferResponse typed;
    grpc::Status status = Infer(request, &typed);
    ASSERT_TRUE(status.ok()) << c.datatype << ": " << status.error_message();
    ASSERT_EQ(typed.raw_output_contents_size(), 1) << c.datatype;
    EXPECT_EQ(typed.raw_output_contents(0), c.expected) << c.datatype;
    EXPECT_EQ(typed.outputs(0).datatype(), c.datatype);
    // The same data sent raw comes back the same.
    input->clear_contents();
    request.add_raw_input_contents(c.expected);
    ModelInferResponse raw;
    ASSERT_TRUE(Infer(request, &raw).ok()) << c.datatype;
    EXPECT_EQ(raw.raw_output_contents(0), c.expected) << c.datatype;
  }
  // FP16 and BF16 travel raw only.
  ModelInferRequest half;
  half.set_model_name("echo_FP16");
  auto* input = half.add_inputs();
  input->set_name("in");
  input->set_datatype("FP16");
  input->add_shape(1);
  input->add_shape(1);
  half.add_raw_input_contents(std::string("\x00\x3c", 2));
  ModelInferResponse response;
  ASSERT_TRUE(Infer(half, &response).ok());
  EXPECT_EQ(response.raw_output_contents(0), std::string("\x00\x3c", 2));
  half.clear_raw_input_contents();
  input->mutable_contents()->add_fp32_contents(1.0f);
  grpc::Status status = Infer(half, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(),
            "input \"in\": FP16 data has no typed field in 'contents'; send it in "
            "raw_input_contents");
}

struct BadRequest {
  std::string what;
  std::function<void(ModelInferRequest&)> spoil;
  std::string message;  // the whole error message, or a part of it
};

// Every malformed request is INVALID_ARGUMENT naming what is wrong, and the
// server answers the next request right.
TEST_F(GrpcServerTest, MalformedRequestsAreInvalidArgument) {
  StartServer();
  auto echo = [](const std::string& datatype, auto fill) {
    return [datatype, fill](ModelInferRequest& r) {
      r.Clear();
      r.set_model_name("echo_" + datatype);
      auto* input = r.add_inputs();
      input->set_name("in");
      input->set_datatype(datatype);
      input->add_shape(1);
      input->add_shape(1);
      fill(r, input);
    };
  };
  const std::vector<BadRequest> cases = {
      {"shape", [](auto& r) { r.mutable_inputs(0)->set_shape(1, 3); },
       "input \"x\": raw_input_contents has 32 bytes but shape [2,3] of FP32 needs 24"},
      {"model shape",
       [](auto& r) {
         r.mutable_inputs(0)->set_shape(0, 4);
         r.mutable_inputs(0)->set_shape(1, 2);
       },
       "input \"x\": shape [4,2] does not match the model's [-1,4]"},
      {"unknown input", [](auto& r) { r.mutable_inputs(0)->set_name("w"); },
       "unknown input \"w\" for model \"scale\""},
      {"missing input",
       [](auto& r) {
         r.clear_inputs();
         r.clear_raw_input_contents();
       },
       "missing input \"x\" for model \"scale\""},
      {"duplicate input",
       [](auto& r) {
         *r.add_inputs() = r.inputs(0);
         r.add_raw_input_contents(r.raw_input_contents(0));
       },
       "duplicate input \"x\""},
      {"datatype", [](auto& r) { r.mutable_inputs(0)->set_datatype("FP33"); },
       "input \"x\": unsupported datatype \"FP33\""},
      {"wrong datatype", [](auto& r) { r.mutable_inputs(0)->set_datatype("INT32"); },
       "input \"x\": datatype INT32 does not match the model's FP32"},
      {"negative dim", [](auto& r) { r.mutable_inputs(0)->set_shape(0, -2); },
       "input \"x\": 'shape' must be an array of non-negative integers, got [-2,4]"},
      {"rank",
       [](auto& r) {
         for (int i = 0; i < 40; ++i) r.mutable_inputs(0)->add_shape(1);
       },
       "input \"x\": shape has 42 dimensions; at most 32 are supported"},
      {"batch",
       [](auto& r) {
         r.mutable_inputs(0)->set_shape(0, 9);
         r.set_raw_input_contents(0, std::string(9 * 4 * 4, '\0'));
       },
       "input \"x\": batch of 9 exceeds max_batch_size 8"},
      {"raw count", [](auto& r) { r.add_raw_input_contents("extra"); },
       "the request has 2 raw_input_contents for 1 inputs: give every input's data there, in "
       "input order, or none"},
      {"raw and contents",
       [](auto& r) { r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
       "contents field must not be specified when using raw_input_contents for 'x' for "
       "model 'scale'"},
      {"raw and contents, counts differ too",
       [](auto& r) {
         r.add_raw_input_contents("extra");
         r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
       },
       "contents field must not be specified when using raw_input_contents for 'x' for "
       "model 'scale'"},
      {"no data", [](auto& r) { r.clear_raw_input_contents(); },
       "input \"x\": contents.fp32_contents has 0 elements but the shape needs 8"},
      {"wrong field",
       [](auto& r) {
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->add_int_contents(1);
       },
       "input \"x\": datatype FP32 takes its data in contents.fp32_contents, not "
       "contents.int_contents"},
      {"int8 range",
       echo("INT8", [](auto&, auto* input) { input->mutable_contents()->add_int_contents(200); }),
       "input \"in\": element 0 (200) is out of range for INT8"},
      {"uint8 range",
       echo("UINT8", [](auto&, auto* input) { input->mutable_contents()->add_uint_contents(256); }),
       "input \"in\": element 0 (256) is out of range for UINT8"},
      {"uint16 range",
       echo("UINT16",
            [](auto&, auto* input) { input->mutable_contents()->add_uint_contents(65536); }),
       "input \"in\": element 0 (65536) is out of range for UINT16"},
      {"uint64 field",
       echo("UINT64", [](auto&, auto* input) { input->mutable_contents()->add_uint_contents(1); }),
       "input \"in\": datatype UINT64 takes its data in contents.uint64_contents, not "
       "contents.uint_contents"},
      {"raw bytes",
       echo("BYTES",
            [](auto& r, auto*) { r.add_raw_input_contents(std::string("\x09\0\0\0ab", 6)); }),
       "input \"in\""},
      {"unknown output", [](auto& r) { r.add_outputs()->set_name("w"); },
       "unknown output \"w\" requested from model \"scale\""},
      {"output twice",
       [](auto& r) {
         r.add_outputs()->set_name("y");
         r.add_outputs()->set_name("y");
       },
       "output \"y\" is requested twice"},
      {"class_count",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("y");
         (*output->mutable_parameters())["class_count"].set_int64_param(3);
       },
       "output \"y\": there is no parameter 'class_count'; Triton's gRPC protocol names it "
       "'classification'"},
      {"classification zero",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("y");
         (*output->mutable_parameters())["classification"].set_int64_param(0);
       },
       "output \"y\": parameter 'classification' must be an integer in [1, 4294967295]"},
      {"classification string",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("y");
         (*output->mutable_parameters())["classification"].set_string_param("3");
       },
       "output \"y\": parameter 'classification' must be an integer"},
      {"classification too many",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("y");
         (*output->mutable_parameters())["classification"].set_uint64_param(uint64_t{1} << 32);
       },
       "output \"y\": parameter 'classification' must be an integer in [1, 4294967295]"},
      {"shm offset without region",
       [](auto& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["shared_memory_offset"].set_int64_param(8);
       },
       "input \"x\": parameters 'shared_memory_offset' and 'shared_memory_byte_size' need "
       "'shared_memory_region'"},
      {"shm region not a string",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_int64_param(1);
         p["shared_memory_byte_size"].set_int64_param(32);
         r.clear_raw_input_contents();
       },
       "input \"x\": parameter 'shared_memory_region' must be a string naming a registered "
       "region"},
      {"shm without byte size",
       [](auto& r) {
         (*r.mutable_inputs(0)->mutable_parameters())["shared_memory_region"].set_string_param(
             "in");
         r.clear_raw_input_contents();
       },
       "input \"x\": parameter 'shared_memory_byte_size' must be given with "
       "'shared_memory_region'"},
      {"shm negative byte size",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_string_param("in");
         p["shared_memory_byte_size"].set_int64_param(-32);
         r.clear_raw_input_contents();
       },
       "input \"x\": parameter 'shared_memory_byte_size' must be a non-negative integer"},
      {"shm negative offset",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_string_param("in");
         p["shared_memory_offset"].set_int64_param(-1);
         p["shared_memory_byte_size"].set_int64_param(32);
         r.clear_raw_input_contents();
       },
       "input \"x\": parameter 'shared_memory_offset' must be a non-negative integer"},
      {"shm byte size vs shape",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_string_param("in");
         p["shared_memory_byte_size"].set_int64_param(31);
         r.clear_raw_input_contents();
       },
       "input \"x\": shared_memory_byte_size is 31 but shape [2,4] of FP32 needs 32"},
      {"shm and contents",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_string_param("in");
         p["shared_memory_byte_size"].set_int64_param(32);
         r.clear_raw_input_contents();
         r.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
       },
       "input \"x\" is in shared memory and has data in 'contents' too; give it once"},
      {"shm and raw",
       [](auto& r) {
         auto& p = *r.mutable_inputs(0)->mutable_parameters();
         p["shared_memory_region"].set_string_param("in");
         p["shared_memory_byte_size"].set_int64_param(32);
       },
       "the request has 1 raw_input_contents for 0 inputs not in shared memory: give each of "
       "their data there, in input order, or none"},
      {"output shm without byte size",
       [](auto& r) {
         auto* output = r.add_outputs();
         output->set_name("y");
         (*output->mutable_parameters())["shared_memory_region"].set_string_param("out");
       },
       "output \"y\": parameter 'shared_memory_byte_size' must be given with "
       "'shared_memory_region'"},
      {"sequence", [](auto& r) { (*r.mutable_parameters())["sequence_id"].set_uint64_param(5); },
       "model \"scale\" has no sequence_batching: send its requests without sequence_id, "
       "sequence_start and sequence_end (this one sets sequence_id)"},
      {"sequence start",
       [](auto& r) { (*r.mutable_parameters())["sequence_start"].set_bool_param(true); },
       "has no sequence_batching: send its requests without sequence_id, sequence_start and "
       "sequence_end (this one sets sequence_start)"},
      {"sequence id of a kind",
       [](auto& r) { (*r.mutable_parameters())["sequence_id"].set_double_param(1.5); },
       "request: parameter 'sequence_id' must be a non-negative integer or a string, got 1.5"},
      {"negative priority",
       [](auto& r) { (*r.mutable_parameters())["priority"].set_int64_param(-1); },
       "request: parameter 'priority' must be a non-negative integer (1 is the highest level, "
       "0 the model's default), got -1"},
      {"string priority",
       [](auto& r) { (*r.mutable_parameters())["priority"].set_string_param("high"); },
       "request: parameter 'priority' must be a non-negative integer"},
      {"negative timeout",
       [](auto& r) { (*r.mutable_parameters())["timeout"].set_int64_param(-1); },
       "request: parameter 'timeout' must be a non-negative integer of microseconds"},
      {"string timeout",
       [](auto& r) { (*r.mutable_parameters())["timeout"].set_string_param("soon"); },
       "request: parameter 'timeout' must be a non-negative integer of microseconds"},
      {"nan parameter",
       [](auto& r) {
         (*r.mutable_parameters())["temperature"].set_double_param(
             std::numeric_limits<double>::quiet_NaN());
       },
       "request: parameter \"temperature\" must be a finite number"},
      {"unset parameter", [](auto& r) { (*r.mutable_parameters())["empty"]; },
       "request: parameter \"empty\" has no value"},
  };
  for (const BadRequest& c : cases) {
    ModelInferRequest request = ScaleRequest();
    c.spoil(request);
    ModelInferResponse response;
    grpc::Status status = Infer(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.what << ": " << status.error_message();
  }
  // None of them reached the service, and it still answers right.
  EXPECT_EQ(service_.arrived(), 0);
  ModelInferResponse response;
  ASSERT_TRUE(Infer(ScaleRequest(), &response).ok());
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), (std::vector<float>{10, 26.5f}));
  // Unknown models are NOT_FOUND, as REST's 404.
  ModelInferRequest unknown = ScaleRequest();
  unknown.set_model_name("nope");
  EXPECT_EQ(Infer(unknown, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(GrpcServerTest, ServiceErrorsMapToGrpcCodes) {
  StartServer();
  const std::vector<std::tuple<std::string, grpc::StatusCode, std::string>> cases = {
      {"busy", grpc::StatusCode::RESOURCE_EXHAUSTED, "queue of model 'busy' is full"},
      {"gone", grpc::StatusCode::NOT_FOUND, "model 'gone' was unloaded"},
      {"late", grpc::StatusCode::DEADLINE_EXCEEDED, "the request timed out in the queue"},
      {"broken", grpc::StatusCode::INTERNAL, "the worker of model 'broken' crashed"},
      {"away", grpc::StatusCode::UNAVAILABLE, "no worker of model 'away' is ready"},
  };
  for (const auto& [model, code, message] : cases) {
    ModelInferRequest request = ScaleRequest();
    request.set_model_name(model);
    ModelInferResponse response;
    grpc::Status status = Infer(request, &response);
    EXPECT_EQ(status.error_code(), code) << model;
    EXPECT_EQ(status.error_message(), message) << model;
  }
}

TEST_F(GrpcServerTest, ParametersReachTheModelAsJson) {
  StartServer();
  ModelInferRequest request = ScaleRequest();
  auto& parameters = *request.mutable_parameters();
  parameters["timeout"].set_int64_param(2500);
  parameters["max_tokens"].set_int64_param(16);
  parameters["temperature"].set_double_param(0.5);
  parameters["stop"].set_string_param("\n");
  parameters["echo"].set_bool_param(true);
  parameters["seed"].set_uint64_param(uint64_t{1} << 63);
  parameters["sequence_id"].set_uint64_param(0);  // zero: no sequence, accepted
  parameters["priority"].set_uint64_param(0);
  parameters["binary_data_output"].set_bool_param(true);
  parameters[std::string(kEmptyFinalParameter)].set_bool_param(true);
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(service_.last_request().timeout_us, 2500u);
  EXPECT_EQ(json::parse(service_.last_request().parameters_json),
            json::parse(R"({"max_tokens":16,"temperature":0.5,"stop":"\n","echo":true,
                            "seed":9223372036854775808})"));
  // A uint64 timeout is taken too; no parameters: no JSON.
  ModelInferRequest plain = ScaleRequest();
  (*plain.mutable_parameters())["timeout"].set_uint64_param(7);
  ASSERT_TRUE(Infer(plain, &response).ok());
  EXPECT_EQ(service_.last_request().timeout_us, 7u);
  EXPECT_EQ(service_.last_request().parameters_json, "");
}

TEST_F(GrpcServerTest, PriorityReachesTheService) {
  StartServer();
  ModelInferRequest request = ScaleRequest();
  (*request.mutable_parameters())["priority"].set_uint64_param(2);  // as tritonclient sends it
  ModelInferResponse response;
  ASSERT_TRUE(Infer(request, &response).ok());
  EXPECT_EQ(service_.last_request().priority, 2u);
  (*request.mutable_parameters())["priority"].set_int64_param(1);
  ASSERT_TRUE(Infer(request, &response).ok());
  EXPECT_EQ(service_.last_request().priority, 1u);
  // Not a model parameter.
  EXPECT_EQ(service_.last_request().parameters_json, "");
  ASSERT_TRUE(Infer(ScaleRequest(), &response).ok());
  EXPECT_EQ(service_.last_request().priority, 0u);
}

std::vector<std::string> BytesElements(const std::string& raw) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at + 4 <= raw.size()) {
    uint32_t length = 0;
    std::memcpy(&length, raw.data() + at, 4);
    out.push_back(raw.substr(at + 4, length));
    at += 4 + length;
  }
  return out;
}

TEST_F(GrpcServerTest, ClassificationComesBackAsBytes) {
  StartServer();
  ModelInferRequest request = ScaleRequest();
  auto* y = request.add_outputs();
  y->set_name("y");
  (*y->mutable_parameters())["classification"].set_int64_param(3);
  request.add_outputs()->set_name("z");
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const std::vector<RequestedOutput> asked = service_.last_request().outputs;
  ASSERT_EQ(asked.size(), 2u);
  EXPECT_EQ(asked[0].class_count, 3u);
  EXPECT_EQ(asked[1].class_count, 0u);
  ASSERT_EQ(response.outputs_size(), 2);
  ASSERT_EQ(response.raw_output_contents_size(), 2);
  // y is [2,1]: one class per row, the only one there is.
  EXPECT_EQ(response.outputs(0).datatype(), "BYTES");
  EXPECT_EQ(
      std::vector<int64_t>(response.outputs(0).shape().begin(), response.outputs(0).shape().end()),
      (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(BytesElements(response.raw_output_contents(0)),
            (std::vector<std::string>{"10.000000:0", "26.500000:0"}));
  EXPECT_EQ(response.outputs(1).datatype(), "FP32");
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(1)), (std::vector<float>{-10, -26.5f}));
  // Wider rows: the top classes, highest first.
  ModelInferRequest pair;
  pair.set_model_name("pair");
  for (const char* name : {"a", "b"}) {
    auto* input = pair.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    input->add_shape(1);
    input->add_shape(2);
  }
  pair.add_raw_input_contents(RawOf(std::vector<float>{1, 5}));
  pair.add_raw_input_contents(RawOf(std::vector<float>{1, 0}));
  auto* sum = pair.add_outputs();
  sum->set_name("sum");
  (*sum->mutable_parameters())["classification"].set_uint64_param(1);
  ASSERT_TRUE(Infer(pair, &response).ok());
  EXPECT_EQ(BytesElements(response.raw_output_contents(0)),
            (std::vector<std::string>{"5.000000:1"}));
}

TEST_F(GrpcServerTest, InputsAndOutputsInSharedMemory) {
  StartServer();
  for (const auto& [name, size] : {std::pair{"in", 64}, std::pair{"out", 32}}) {
    inference::SystemSharedMemoryRegisterRequest reg;
    reg.set_name(name);
    reg.set_key(std::string("/hearth-") + name);
    reg.set_byte_size(static_cast<uint64_t>(size));
    inference::SystemSharedMemoryRegisterResponse ignored;
    ASSERT_TRUE(stub_->SystemSharedMemoryRegister(Context().get(), reg, &ignored).ok());
  }
  const std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8.5f};
  service_.FillRegion("in", 16, AsBytes(x));
  ModelInferRequest request;
  request.set_model_name("scale");
  auto* input = request.add_inputs();
  input->set_name("x");
  input->set_datatype("FP32");
  input->add_shape(2);
  input->add_shape(4);
  auto& in = *input->mutable_parameters();
  in["shared_memory_region"].set_string_param("in");
  in["shared_memory_offset"].set_int64_param(16);
  in["shared_memory_byte_size"].set_int64_param(32);
  auto* y = request.add_outputs();
  y->set_name("y");
  auto& out = *y->mutable_parameters();
  out["shared_memory_region"].set_string_param("out");
  out["shared_memory_offset"].set_uint64_param(8);
  out["shared_memory_byte_size"].set_int64_param(24);
  request.add_outputs()->set_name("z");
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  // The service got the region, not bytes.
  const std::vector<InferTensor> inputs = service_.last_request().inputs;
  ASSERT_EQ(inputs.size(), 1u);
  ASSERT_TRUE(inputs[0].shm.has_value());
  EXPECT_EQ(inputs[0].shm->region, "in");
  EXPECT_EQ(inputs[0].shm->offset, 16u);
  EXPECT_EQ(inputs[0].shm->byte_size, 32u);
  EXPECT_TRUE(inputs[0].data.empty());
  const std::vector<RequestedOutput> asked = service_.last_request().outputs;
  ASSERT_EQ(asked.size(), 2u);
  ASSERT_TRUE(asked[0].shm.has_value());
  EXPECT_EQ(asked[0].shm->region, "out");
  EXPECT_EQ(asked[0].shm->offset, 8u);
  EXPECT_EQ(asked[0].shm->byte_size, 24u);
  EXPECT_FALSE(asked[1].shm.has_value());
  // y went to the region: the response says where, and has no bytes of it;
  // z came inline. One raw entry per output, as tritonclient indexes them.
  ASSERT_EQ(response.outputs_size(), 2);
  ASSERT_EQ(response.raw_output_contents_size(), 2);
  const auto& where = response.outputs(0).parameters();
  EXPECT_EQ(where.at("shared_memory_region").string_param(), "out");
  EXPECT_EQ(where.at("shared_memory_offset").int64_param(), 8);
  EXPECT_EQ(where.at("shared_memory_byte_size").int64_param(), 8);
  EXPECT_EQ(response.outputs(0).datatype(), "FP32");
  EXPECT_EQ(
      std::vector<int64_t>(response.outputs(0).shape().begin(), response.outputs(0).shape().end()),
      (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(response.raw_output_contents(0), "");
  EXPECT_EQ(response.outputs(1).parameters_size(), 0);
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(1)), (std::vector<float>{-10, -26.5f}));
  const std::vector<std::byte> region = service_.Region("out");
  EXPECT_EQ(std::vector<std::byte>(region.begin() + 8, region.begin() + 16),
            AsBytes(std::vector<float>{10, 26.5f}));
}

// raw_input_contents holds the inputs that are not in shared memory, in
// input order, as tritonclient sends them.
TEST_F(GrpcServerTest, RawContentsSkipInputsInSharedMemory) {
  StartServer();
  inference::SystemSharedMemoryRegisterRequest reg;
  reg.set_name("b");
  reg.set_key("/hearth-b");
  reg.set_byte_size(8);
  inference::SystemSharedMemoryRegisterResponse ignored;
  ASSERT_TRUE(stub_->SystemSharedMemoryRegister(Context().get(), reg, &ignored).ok());
  service_.FillRegion("b", 0, AsBytes(std::vector<float>{10, 20}));
  for (bool shm_first : {true, false}) {
    ModelInferRequest request;
    request.set_model_name("pair");
    for (const char* name : {"a", "b"}) {
      auto* input = request.add_inputs();
      input->set_name(name);
      input->set_datatype("FP32");
      input->add_shape(1);
      input->add_shape(2);
      if ((std::string(name) == "a") == shm_first) {
        auto& p = *input->mutable_parameters();
        p["shared_memory_region"].set_string_param("b");
        p["shared_memory_byte_size"].set_int64_param(8);
      }
    }
    request.add_raw_input_contents(RawOf(std::vector<float>{1, 2}));
    ModelInferResponse response;
    grpc::Status status = Infer(request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), (std::vector<float>{11, 22}));
    // One entry per input is one too many now.
    request.add_raw_input_contents(RawOf(std::vector<float>{1, 2}));
    status = Infer(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(),
              "the request has 2 raw_input_contents for 1 inputs not in shared memory: give each "
              "of their data there, in input order, or none");
  }
}

// Bytes that the service will read from shared memory count towards the
// in-flight budget, as a request's own bytes do.
TEST_F(GrpcServerTest, SharedMemoryInputsCountTowardsTheByteBudget) {
  GrpcOptions options;
  options.max_message_bytes = 1 << 20;
  options.max_inflight_bytes = 1 << 20;
  StartServer(options);
  ModelInferRequest request;
  request.set_model_name("echo_UINT8");
  auto* input = request.add_inputs();
  input->set_name("in");
  input->set_datatype("UINT8");
  input->add_shape(1);
  input->add_shape(2 << 20);
  auto& p = *input->mutable_parameters();
  p["shared_memory_region"].set_string_param("big");
  p["shared_memory_byte_size"].set_int64_param(2 << 20);
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.error_message().find("would pass the limit of 1048576"), std::string::npos)
      << status.error_message();
  EXPECT_EQ(service_.arrived(), 0);
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_bytes == 0; }));
}

TEST_F(GrpcServerTest, OversizeMessagesAreRefusedAndTheServerGoesOn) {
  GrpcOptions options;
  options.max_message_bytes = 1 << 20;
  StartServer(options);
  std::vector<float> big(300'000, 1.0f);  // 1.2 MB
  ModelInferRequest request = ScaleRequest(big, 75'000);
  ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  // Compressed, the same request is a few KB on the wire; it inflates past
  // the limit and is refused before anything of it is held.
  for (grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    auto context = Context();
    context->set_compression_algorithm(algorithm);
    status = stub_->ModelInfer(context.get(), request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
    EXPECT_NE(status.error_message().find("inflates past the limit of 1048576 bytes"),
              std::string::npos)
        << status.error_message();
  }
  EXPECT_EQ(service_.arrived(), 0);
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_bytes == 0; }));
  // Uncompressed requests within the limit are served.
  status = Infer(ScaleRequest(), &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), (std::vector<float>{10, 26.5f}));
  EXPECT_EQ(service_.arrived(), 1);
}

TEST_F(GrpcServerTest, CompressedRequestsAreInflatedWithinTheLimit) {
  GrpcOptions options;
  options.max_message_bytes = 1 << 20;
  StartServer(options);
  // 0.8 MB inflated (within the limit), of which most compresses away.
  std::vector<float> x(200'000, 0.0f);
  x[0] = 2;
  x[199'999] = 4;
  ModelInferRequest request;
  request.set_model_name("echo_FP32");
  request.set_id("big");
  auto* input = request.add_inputs();
  input->set_name("in");
  input->set_datatype("FP32");
  input->add_shape(1);
  input->add_shape(200'000);
  request.add_raw_input_contents(RawOf(x));
  for (grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    auto context = Context();
    context->set_compression_algorithm(algorithm);
    ModelInferResponse response;
    grpc::Status status = stub_->ModelInfer(context.get(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(FromRaw<float>(response.raw_output_contents(0)), x);
  }
  // On a stream too, beside a small request.
  for (grpc_compression_algorithm algorithm : {GRPC_COMPRESS_GZIP, GRPC_COMPRESS_DEFLATE}) {
    auto context = Context();
    context->set_compression_algorithm(algorithm);
    auto stream = stub_->ModelStreamInfer(context.get());
    ASSERT_TRUE(stream->Write(ScaleRequest()));
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->WritesDone());
    std::map<std::string, ModelStreamInferResponse> answers;
    for (int i = 0; i < 2; ++i) {
      ModelStreamInferResponse answer;
      ASSERT_TRUE(stream->Read(&answer));
      EXPECT_EQ(answer.error_message(), "");
      answers[answer.infer_response().id()] = answer;
    }
    ASSERT_TRUE(stream->Finish().ok());
    ASSERT_EQ(answers.size(), 2u);
    EXPECT_EQ(FromRaw<float>(answers["r7"].infer_response().raw_output_contents(0)),
              (std::vector<float>{10, 26.5f}));
    EXPECT_EQ(FromRaw<float>(answers["big"].infer_response().raw_output_contents(0)), x);
  }
  EXPECT_EQ(service_.arrived(), 2 + 4);
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_bytes == 0; }));
}

TEST_F(GrpcServerTest, AMessageThatIsNotValidGzipIsNamed) {
  StartServer(GrpcOptions{});
  // Sent as it is, a message that begins as gzip does and is not.
  const std::string bytes = std::string("\x1f\x8b\x08\x00", 4) + std::string(32, 'x');
  grpc::Slice slice(bytes);
  grpc::ByteBuffer message(&slice, 1);
  grpc::ByteBuffer answer;
  grpc::GenericStub generic(channel_);
  std::promise<grpc::Status> done;
  auto context = Context();
  generic.UnaryCall(context.get(), "/inference.GRPCInferenceService/ModelInfer",
                    grpc::StubOptions(), &message, &answer,
                    [&done](grpc::Status status) { done.set_value(std::move(status)); });
  grpc::Status status = done.get_future().get();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("the request message is not valid gzip data"),
            std::string::npos)
      << status.error_message();
  EXPECT_EQ(service_.arrived(), 0);
  // And the server goes on.
  ModelInferResponse response;
  ASSERT_TRUE(Infer(ScaleRequest(), &response).ok());
}

TEST_F(GrpcServerTest, CallsPastTheLimitAreRefusedNotQueued) {
  GrpcOptions options;
  options.max_inflight_calls = 2;
  StartServer(options);
  ModelInferRequest gated = ScaleRequest();
  gated.set_model_name("gated");
  std::vector<std::thread> clients;
  std::vector<grpc::Status> statuses(2);
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] {
      ModelInferResponse response;
      statuses[i] = Infer(gated, &response);
    });
  }
  ASSERT_TRUE(service_.WaitParked(2));
  EXPECT_EQ(server_->stats().inflight_calls, 2u);
  ModelInferResponse response;
  grpc::Status refused = Infer(ScaleRequest(), &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("2 inference calls in progress"), std::string::npos)
      << refused.error_message();
  // A stream is a call too.
  auto context = Context();
  auto stream = stub_->ModelStreamInfer(context.get());
  ModelStreamInferResponse ignored;
  EXPECT_FALSE(stream->Read(&ignored));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Health is never refused.
  inference::ServerLiveResponse live;
  EXPECT_TRUE(stub_->ServerLive(Context().get(), {}, &live).ok());
  service_.OpenGate();
  for (std::thread& t : clients) t.join();
  for (const grpc::Status& status : statuses) EXPECT_TRUE(status.ok()) << status.error_message();
  // A call leaves the count once gRPC is done with it, just after its answer.
  ASSERT_TRUE(Eventually([&] { return server_->stats().inflight_calls == 0; }));
  EXPECT_TRUE(Infer(ScaleRequest(), &response).ok());
  EXPECT_GE(server_->stats().refused_calls, 2u);
}

TEST_F(GrpcServerTest, RequestBytesPastTheBudgetAreRefused) {
  GrpcOptions options;
  options.max_message_bytes = 1 << 20;
  options.max_inflight_bytes = (1 << 20) + (1 << 19);  // 1.5 MiB
  StartServer(options);
  ModelInferRequest held = ScaleRequest(std::vector<float>(225'000, 1.0f), 1);  // 900 KB
  held.set_model_name("gated");
  grpc::Status held_status;
  std::thread holder([&] {
    ModelInferResponse response;
    held_status = Infer(held, &response);
  });
  ASSERT_TRUE(service_.WaitParked(1));
  EXPECT_GE(server_->stats().inflight_bytes, 900'000u);
  ModelInferResponse response;
  grpc::Status refused = Infer(held, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("would pass the limit of 1572864"), std::string::npos)
      << refused.error_message();
  // Small requests still fit.
  EXPECT_TRUE(Infer(ScaleRequest(), &response).ok());
  service_.OpenGate();
  holder.join();
  EXPECT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_bytes == 0; }));
}

TEST_F(GrpcServerTest, AClientDeadlineCancelsTheRequest) {
  StartServer();
  ModelInferRequest request = ScaleRequest();
  request.set_model_name("gated");
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + 200ms);
  ModelInferResponse response;
  grpc::Status status = stub_->ModelInfer(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server saw the call end and told the service.
  ASSERT_TRUE(service_.WaitParked(1));
  EXPECT_TRUE(service_.WaitParkedCancelled());
}

// ---- ModelStreamInfer --------------------------------------------------------------

using Stream = grpc::ClientReaderWriter<ModelInferRequest, ModelStreamInferResponse>;

TEST_F(GrpcServerTest, StreamAnswersEachRequestAndErrorsKeepItOpen) {
  StartServer();
  auto context = Context();
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(context.get());
  ASSERT_TRUE(stream->Write(ScaleRequest({1, 2, 3, 4}, 1, "a")));
  ModelInferRequest bad = ScaleRequest({1, 2, 3, 4}, 1, "bad");
  bad.mutable_inputs(0)->set_name("w");
  ASSERT_TRUE(stream->Write(bad));
  ModelInferRequest failing = ScaleRequest({1, 2, 3, 4}, 1, "busy");
  failing.set_model_name("busy");
  ASSERT_TRUE(stream->Write(failing));
  ASSERT_TRUE(stream->Write(ScaleRequest({5, 5, 5, 5}, 1, "b")));
  std::map<std::string, ModelStreamInferResponse> answers;
  for (int i = 0; i < 4; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message)) << i;
    answers[message.infer_response().id()] = message;
  }
  ASSERT_EQ(answers.size(), 4u);
  EXPECT_EQ(answers["a"].error_message(), "");
  EXPECT_EQ(FromRaw<float>(answers["a"].infer_response().raw_output_contents(0)),
            (std::vector<float>{10}));
  EXPECT_TRUE(IsFinal(answers["a"].infer_response()));
  EXPECT_EQ(answers["bad"].error_message(), "unknown input \"w\" for model \"scale\"");
  EXPECT_EQ(answers["bad"].infer_response().model_name(), "scale");
  EXPECT_EQ(answers["busy"].error_message(), "queue of model 'busy' is full");
  EXPECT_EQ(FromRaw<float>(answers["b"].infer_response().raw_output_contents(0)),
            (std::vector<float>{20}));
  ASSERT_TRUE(stream->WritesDone());
  ModelStreamInferResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(Eventually([&] { return server_->stats().streams == 0; }));
}

TEST_F(GrpcServerTest, DecoupledStreamWritesEachResponseWithTheFinalFlag) {
  StartServer();
  auto context = Context();
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(context.get());
  // Three responses through on_response, then an end without outputs: not
  // sent unless asked for.
  ASSERT_TRUE(stream->Write(CountdownRequest("countdown", 3, "c")));
  std::vector<int32_t> values;
  for (int i = 0; i < 3; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message));
    ASSERT_EQ(message.error_message(), "");
    EXPECT_EQ(message.infer_response().id(), "c");
    ASSERT_TRUE(HasFinalFlag(message.infer_response()));
    EXPECT_FALSE(IsFinal(message.infer_response()));
    // Borrowed and spoiled once on_response returned: copied in time.
    values.push_back(FromRaw<int32_t>(message.infer_response().raw_output_contents(0)).at(0));
  }
  EXPECT_EQ(values, (std::vector<int32_t>{2, 1, 0}));
  // Asked for: the end comes as an empty final response.
  ModelInferRequest empty_final = CountdownRequest("countdown", 2, "e");
  (*empty_final.mutable_parameters())[std::string(kEmptyFinalParameter)].set_bool_param(true);
  ASSERT_TRUE(stream->Write(empty_final));
  for (int i = 0; i < 3; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(message.infer_response().id(), "e");
    EXPECT_EQ(IsFinal(message.infer_response()), i == 2) << i;
    EXPECT_EQ(message.infer_response().outputs_size(), i == 2 ? 0 : 1) << i;
  }
  // The last response given to `done` is the final one; the model gets the
  // request's parameters.
  ModelInferRequest last_in_done = CountdownRequest("countdown", 2, "d");
  (*last_in_done.mutable_parameters())["last_in_done"].set_bool_param(true);
  ASSERT_TRUE(stream->Write(last_in_done));
  for (int i = 0; i < 2; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(IsFinal(message.infer_response()), i == 1) << i;
    EXPECT_EQ(FromRaw<int32_t>(message.infer_response().raw_output_contents(0)).at(0), 1 - i);
  }
  ASSERT_TRUE(stream->WritesDone());
  ModelStreamInferResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServerTest, AStreamThatBreaksReportsItsErrorAndGoesOn) {
  StartServer();
  auto context = Context();
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(context.get());
  ASSERT_TRUE(stream->Write(CountdownRequest("crumble", 0, "k")));
  for (int i = 0; i < 2; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(message.error_message(), "");
    EXPECT_FALSE(IsFinal(message.infer_response()));
  }
  ModelStreamInferResponse error;
  ASSERT_TRUE(stream->Read(&error));
  EXPECT_EQ(error.error_message(), "the worker of model 'crumble' died mid-stream");
  EXPECT_EQ(error.infer_response().id(), "k");
  ASSERT_TRUE(stream->Write(ScaleRequest({1, 1, 1, 1}, 1, "after")));
  ModelStreamInferResponse after;
  ASSERT_TRUE(stream->Read(&after));
  EXPECT_EQ(after.infer_response().id(), "after");
  EXPECT_EQ(FromRaw<float>(after.infer_response().raw_output_contents(0)), (std::vector<float>{4}));
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServerTest, CancellingTheStreamSetsCancelledOnItsRequests) {
  StartServer();
  grpc::ClientContext context;
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(&context);
  ASSERT_TRUE(stream->Write(CountdownRequest("endless", 0, "forever")));
  ModelStreamInferResponse first;
  ASSERT_TRUE(stream->Read(&first));
  EXPECT_EQ(FromRaw<int32_t>(first.infer_response().raw_output_contents(0)).at(0), 7);
  context.TryCancel();
  EXPECT_EQ(StreamEnd(service_), "cancelled");
  ModelStreamInferResponse rest;
  while (stream->Read(&rest)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The server lets go of the stream once the service is done with it.
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_calls == 0; }));
  EXPECT_EQ(server_->stats().stream_requests, 0u);
}

TEST_F(GrpcServerTest, ResponsesNobodyReadsStopTheirRequest) {
  GrpcOptions options;
  options.max_stream_pending_bytes = 1 << 20;
  StartServer(options);
  auto context = Context();
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(context.get());
  ModelInferRequest flood = CountdownRequest("flood", 0, "f");
  ASSERT_TRUE(stream->Write(flood));
  // Nothing is read until the service has been told to stop.
  EXPECT_EQ(StreamEnd(service_), "refused");
  int responses = 0;
  ModelStreamInferResponse message;
  while (stream->Read(&message) && message.error_message().empty()) ++responses;
  EXPECT_GT(responses, 0);
  EXPECT_NE(message.error_message().find("its responses were not read"), std::string::npos)
      << message.error_message();
  EXPECT_EQ(server_->stats().stopped_requests, 1u);
  // The stream goes on.
  ASSERT_TRUE(stream->Write(ScaleRequest({1, 1, 1, 1}, 1, "after")));
  ASSERT_TRUE(stream->Read(&message));
  EXPECT_EQ(message.infer_response().id(), "after");
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(GrpcServerTest, AStreamHasAtMostItsLimitOfRequestsInTheService) {
  GrpcOptions options;
  options.max_stream_requests = 2;
  StartServer(options);
  auto context = Context();
  std::unique_ptr<Stream> stream = stub_->ModelStreamInfer(context.get());
  for (const char* id : {"1", "2", "3"}) {
    ModelInferRequest request = ScaleRequest({1, 2, 3, 4}, 1, id);
    request.set_model_name("gated");
    ASSERT_TRUE(stream->Write(request));
  }
  ASSERT_TRUE(service_.WaitParked(2));
  EXPECT_EQ(server_->stats().stream_requests, 2u);
  // The third waits unread (in the transport), not in the service.
  EXPECT_EQ(service_.arrived(), 2);
  service_.OpenGate();
  std::set<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    ModelStreamInferResponse message;
    ASSERT_TRUE(stream->Read(&message));
    EXPECT_EQ(message.error_message(), "");
    ids.insert(message.infer_response().id());
  }
  EXPECT_EQ(ids, (std::set<std::string>{"1", "2", "3"}));
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());
}

// ---- start and stop -------------------------------------------------------------------

TEST_F(GrpcServerTest, StopDrainsCallsInProgressAndEndsIdleStreams) {
  GrpcOptions options;
  options.drain_timeout = 60s;
  StartServer(options);
  ModelInferRequest gated = ScaleRequest();
  gated.set_model_name("gated");
  grpc::Status gated_status;
  ModelInferResponse gated_response;
  std::thread client([&] { gated_status = Infer(gated, &gated_response); });
  ASSERT_TRUE(service_.WaitParked(1));
  auto context = Context();
  std::unique_ptr<Stream> idle = stub_->ModelStreamInfer(context.get());
  ASSERT_TRUE(idle->Write(ScaleRequest({1, 1, 1, 1}, 1, "s")));
  ModelStreamInferResponse answered;
  ASSERT_TRUE(idle->Read(&answered));

  std::thread stopper([&] { server_->Stop(); });
  EXPECT_TRUE(Eventually([&] { return server_->stats().draining; }));
  // The idle stream ends at once, saying why.
  ModelStreamInferResponse none;
  EXPECT_FALSE(idle->Read(&none));
  grpc::Status ended = idle->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ended.error_message(), "the server is shutting down");
  // The call in progress is answered once the service answers it.
  service_.OpenGate();
  client.join();
  stopper.join();
  ASSERT_TRUE(gated_status.ok()) << gated_status.error_message();
  EXPECT_EQ(FromRaw<float>(gated_response.raw_output_contents(0)), (std::vector<float>{10, 26.5f}));
  EXPECT_FALSE(server_->stats().listening);
  EXPECT_EQ(server_->port(), 0);
  // Nothing listens any more.
  inference::ServerLiveResponse live;
  EXPECT_EQ(stub_->ServerLive(Context().get(), {}, &live).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  server_->Stop();  // idempotent
}

TEST_F(GrpcServerTest, APortInUseIsAnError) {
  StartServer();
  GrpcOptions options;
  options.port = server_->port();
  Result<std::unique_ptr<GrpcServer>> second = GrpcServer::Create(&service_, options);
  ASSERT_TRUE(second.ok());
  Status started = (*second)->Start();
  EXPECT_EQ(started.code(), StatusCode::kUnavailable);
  EXPECT_NE(started.message().find("cannot listen for gRPC on 127.0.0.1:" +
                                   std::to_string(server_->port())),
            std::string::npos)
      << started.message();
  EXPECT_EQ((*second)->Start().code(), StatusCode::kFailedPrecondition);
}

TEST(GrpcServerOptions, BadOptionsAreRefused) {
  FakeService service;
  EXPECT_EQ(GrpcServer::Create(nullptr, {}).status().code(), StatusCode::kInvalidArgument);
  GrpcOptions zero_calls;
  zero_calls.max_inflight_calls = 0;
  EXPECT_EQ(GrpcServer::Create(&service, zero_calls).status().code(), StatusCode::kInvalidArgument);
  GrpcOptions huge;
  huge.max_message_bytes = uint64_t{1} << 32;
  EXPECT_EQ(GrpcServer::Create(&service, huge).status().code(), StatusCode::kInvalidArgument);
  GrpcOptions small_budget;
  small_budget.max_inflight_bytes = 1000;
  EXPECT_EQ(GrpcServer::Create(&service, small_budget).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hearth
