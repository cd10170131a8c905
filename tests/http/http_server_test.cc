// HttpServer over real TCP: a fake InferenceService behind it, requests sent
// with Beast's client or as raw bytes on a plain socket. Tests wait on events
// (the service's gate, the server's stats) or poll a condition with a
// deadline; none depends on how long anything takes.
#include "http/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "common/log_settings.h"
#include "support/eventually.h"
#include "support/fake_service.h"

namespace hearth {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using json = nlohmann::json;
using namespace std::chrono_literals;
using testing::Echo;
using testing::Fails;
using testing::FakeModel;
using testing::FakeService;
using testing::FakeSettings;
using testing::MakeModel;
using testing::ResponseTo;
using testing::TensorOf;
using testing::ValuesOf;

// Models (only version "1" of each; see support/fake_service.h for what the
// fake does with every request: regions, classification, lent outputs):
//   scale     x FP32 [-1,4] -> y FP32 [-1,1] = row sums, max batch 8; a
//             config and statistics
//   gated     the same once the test opens the gate (loading it waits too)
//   busy      queue full; gone: NotFound from Infer
//   unready   known, not ready
//   fixed     no batching, a INT32 [2,3] -> b = a + 1; statistics
//   wide      x FP32 [-1,65536] -> row sums: bodies past the front-end's
//             large-body threshold
//   borrowed  as scale (the fake lends every output, as the server does)
//   ragged    as scale, with x FP32 [-1,-1]: any number of columns
//   strings   s BYTES [-1,-1] -> o, the same elements: an echo
Result<InferResponse> SumRows(FakeService&, InferRequest& request) {
  const InferTensor& x = request.inputs.at(0);
  const int64_t rows = x.shape[0];
  const int64_t cols = x.shape[1];
  const std::vector<float> values = ValuesOf<float>(x);
  std::vector<float> y(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) y[r] += values[r * cols + c];
  }
  InferResponse response = ResponseTo(request);
  response.outputs.push_back(TensorOf("y", DType::kF32, {rows, 1}, y));
  return response;
}

Result<InferResponse> AddOne(FakeService&, InferRequest& request) {
  std::vector<int32_t> b = ValuesOf<int32_t>(request.inputs.at(0));
  for (int32_t& v : b) ++v;
  InferResponse response = ResponseTo(request);
  response.outputs.push_back(TensorOf("b", DType::kI32, request.inputs[0].shape, b));
  return response;
}

FakeModel Scale(std::string name, int64_t cols = 4) {
  return MakeModel(std::move(name), "hearth_scale", 8, {{"x", DType::kF32, {-1, cols}}},
                   {{"y", DType::kF32, {-1, 1}}}, SumRows);
}

ModelStatistics StatisticsOf(const std::string& name) {
  ModelStatistics s;
  s.name = name;
  s.version = "1";
  s.last_inference_ms = 1700000000123;
  s.inference_count = 12;
  s.execution_count = 5;
  s.success = {5, 5000};
  s.fail = {1, 100};
  s.queue = {5, 700};
  s.compute_input = {5, 10};
  s.compute_infer = {5, 4000};
  s.compute_output = {5, 20};
  s.batch_stats = {{1, {2, 2}, {2, 1000}, {2, 3}}, {4, {3, 8}, {3, 3000}, {3, 17}}};
  return s;
}

std::vector<FakeModel> Models() {
  std::vector<FakeModel> models = {Scale("scale"),    Scale("gated"),     Scale("busy"),
                                   Scale("gone"),     Scale("unready"),   Scale("wide", 65536),
                                   Scale("borrowed"), Scale("ragged", -1)};
  models[0].config_json = R"({"name":"scale","max_batch_size":8})";
  models[0].statistics = StatisticsOf("scale");
  models[1].gated = true;
  models[2].run = Fails(ResourceExhausted("queue of model 'busy' is full"));
  models[3].run = Fails(NotFound("model 'gone' was unloaded"));
  models[4].ready = false;
  models.push_back(MakeModel("fixed", "hearth_mlp", 0, {{"a", DType::kI32, {2, 3}}},
                             {{"b", DType::kI32, {2, 3}}}, AddOne));
  models.back().statistics = StatisticsOf("fixed");
  models.push_back(MakeModel("strings", "hearth_python", 8, {{"s", DType::kBytes, {-1, -1}}},
                             {{"o", DType::kBytes, {-1, -1}}}, Echo("o")));
  return models;
}

FakeSettings Settings() {
  FakeSettings settings;
  settings.metrics_text = "# TYPE fake_total counter\nfake_total 3\n";
  settings.repository = {{"scale", "1", "READY", ""},
                         {"unready", "", "UNAVAILABLE", "no worker is ready"}};
  settings.parked_loads = {"gated"};
  settings.cuda_shared_memory = true;
  settings.taken_region = [](const std::string& name) {
    return "region '" + name + "' is already registered";
  };
  return settings;
}

void SetReceiveTimeout(int fd, std::chrono::seconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count());
  ASSERT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
}

using Response = http::response<http::string_body>;

// A blocking HTTP/1.1 client on one connection.
class Client {
 public:
  explicit Client(uint16_t port) : socket_(io_) {
    socket_.connect(tcp::endpoint(net::ip::address_v4::loopback(), port));
    SetReceiveTimeout(socket_.native_handle(), 20s);
  }
  uint16_t local_port() const { return socket_.local_endpoint().port(); }

  Response Send(http::verb method, const std::string& target, const std::string& body = "",
                const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    Write(method, target, body, headers);
    return Read();
  }
  void Write(http::verb method, const std::string& target, const std::string& body = "",
             const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    http::request<http::string_body> request(method, target, 11);
    request.set(http::field::host, "localhost");
    for (const auto& [name, value] : headers) request.set(name, value);
    request.body() = body;
    request.prepare_payload();
    http::write(socket_, request);
  }
  Response Read() {
    Response response;
    http::read(socket_, buffer_, response);
    return response;
  }
  Response Get(const std::string& target) { return Send(http::verb::get, target); }
  Response Post(const std::string& target, const std::string& body,
                const std::vector<std::pair<std::string, std::string>>& headers = {}) {
    return Send(http::verb::post, target, body, headers);
  }

  tcp::socket& socket() { return socket_; }

 private:
  net::io_context io_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

// Connects, sends `bytes`, and returns all that comes back until the server
// closes (or 20 s pass).
std::string RawExchange(uint16_t port, const std::string& bytes, bool half_close = false) {
  net::io_context io;
  tcp::socket socket(io);
  socket.connect(tcp::endpoint(net::ip::address_v4::loopback(), port));
  SetReceiveTimeout(socket.native_handle(), 20s);
  net::write(socket, net::buffer(bytes));
  if (half_close) socket.shutdown(tcp::socket::shutdown_send);
  std::string received;
  char chunk[4096];
  for (;;) {
    beast::error_code ec;
    const size_t n = socket.read_some(net::buffer(chunk), ec);
    received.append(chunk, n);
    if (ec) break;
  }
  return received;
}

std::string ErrorOf(const Response& response) {
  const json body = json::parse(response.body(), nullptr, false);
  if (!body.is_object() || !body.contains("error") || !body["error"].is_string()) return "<none>";
  return body["error"].get<std::string>();
}

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpOptions options = {}) {
    options.port = 0;
    Result<std::unique_ptr<HttpServer>> created = HttpServer::Create(&service_, options);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    server_ = std::move(created).value();
    ASSERT_TRUE(server_->Start().ok());
    ASSERT_NE(server_->port(), 0);
  }
  void SetUp() override { StartServer(); }
  void TearDown() override {
    service_.OpenGate();  // Stop() waits for every infer
    if (server_) server_->Stop();
  }

  uint16_t port() const { return server_->port(); }

  FakeService service_{Settings(), Models()};
  std::unique_ptr<HttpServer> server_;
};

const char* kTwoRows =
    R"({"id":"r7","inputs":[{"name":"x","datatype":"FP32","shape":[2,4],"data":[[1,2,3,4],[5,6,7,8.5]]}]})";

TEST_F(HttpServerTest, Health) {
  Client client(port());
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
  EXPECT_EQ(client.Get("/v2/health/ready").result_int(), 200);
  service_.ready_ = false;
  EXPECT_EQ(client.Get("/v2/health/ready").result_int(), 503);
  EXPECT_EQ(client.Get("/v2/health/live?verbose=1").result_int(), 200);
}

TEST_F(HttpServerTest, MetricsAreServedAsPrometheusText) {
  Client client(port());
  Response r = client.Get("/metrics");
  EXPECT_EQ(r.result_int(), 200);
  EXPECT_EQ(r[http::field::content_type], "text/plain; version=0.0.4");
  // The service's metrics, then the front-end's own.
  EXPECT_EQ(r.body().rfind("# TYPE fake_total counter\nfake_total 3\n# HELP hearth_http_", 0), 0u)
      << r.body();
  for (const char* line : {"\nhearth_http_connections 1\n", "\nhearth_http_connection_limit 1024\n",
                           "\nhearth_http_inflight_body_bytes 0\n",
                           "\nhearth_http_inflight_body_bytes_limit 1073741824\n",
                           "\nhearth_http_timeouts_total{phase=\"head\"} 0\n"}) {
    EXPECT_NE(r.body().find(line), std::string::npos) << line;
  }
  EXPECT_EQ(client.Post("/metrics", "").result_int(), 405);
}

TEST_F(HttpServerTest, ServerMetadataGivesTheNameItIsToldToGive) {
  server_->Stop();
  HttpOptions options;
  options.server_name = "triton";
  StartServer(options);
  Client client(port());
  EXPECT_EQ(json::parse(client.Get("/v2").body())["name"], "triton");
}

TEST_F(HttpServerTest, ServerAndModelMetadata) {
  Client client(port());
  Response server = client.Get("/v2");
  ASSERT_EQ(server.result_int(), 200);
  EXPECT_EQ(server[http::field::content_type], "application/json");
  EXPECT_EQ(
      json::parse(server.body()),
      json::parse(R"({"name":"hearth","version":"0.1.0","extensions":["binary_tensor_data"]})"));

  for (const char* target : {"/v2/models/scale", "/v2/models/scale/versions/1"}) {
    Response model = client.Get(target);
    ASSERT_EQ(model.result_int(), 200) << target;
    const json m = json::parse(model.body());
    EXPECT_EQ(m["name"], "scale");
    EXPECT_EQ(m["versions"], json::parse(R"(["1"])"));
    EXPECT_EQ(m["platform"], "hearth_scale");
    EXPECT_EQ(m["inputs"], json::parse(R"([{"name":"x","datatype":"FP32","shape":[-1,4]}])"));
    EXPECT_EQ(m["outputs"], json::parse(R"([{"name":"y","datatype":"FP32","shape":[-1,1]}])"));
  }
  Response unknown = client.Get("/v2/models/nope");
  EXPECT_EQ(unknown.result_int(), 404);
  EXPECT_EQ(ErrorOf(unknown), "no model 'nope'");
  Response version = client.Get("/v2/models/scale/versions/7");
  EXPECT_EQ(version.result_int(), 404);
  EXPECT_EQ(ErrorOf(version), "model 'scale' has no version '7'");
  // Percent-encoded names are decoded.
  EXPECT_EQ(client.Get("/v2/models/sc%61le").result_int(), 200);
  EXPECT_EQ(client.Get("/v2/models/sc%6").result_int(), 400);
}

TEST_F(HttpServerTest, ModelReady) {
  Client client(port());
  EXPECT_EQ(client.Get("/v2/models/scale/ready").result_int(), 200);
  EXPECT_EQ(client.Get("/v2/models/scale/versions/1/ready").result_int(), 200);
  EXPECT_EQ(client.Get("/v2/models/unready/ready").result_int(), 503);
  Response unknown = client.Get("/v2/models/nope/ready");
  EXPECT_EQ(unknown.result_int(), 404);
  EXPECT_EQ(ErrorOf(unknown), "no model 'nope'");
  EXPECT_EQ(client.Get("/v2/models/scale/versions/2/ready").result_int(), 404);
}

TEST_F(HttpServerTest, UnknownPathsAndWrongMethods) {
  Client client(port());
  for (const char* target : {"/", "/v1/models/scale", "/v2/models", "/v2/health",
                             "/v2/models/scale/infer/more", "/v2/models/scale/versions"}) {
    Response response = client.Get(target);
    EXPECT_EQ(response.result_int(), 404) << target;
    EXPECT_NE(ErrorOf(response).find("no such endpoint"), std::string::npos) << target;
  }
  Response get_infer = client.Get("/v2/models/scale/infer");
  EXPECT_EQ(get_infer.result_int(), 405);
  EXPECT_EQ(get_infer[http::field::allow], "POST");
  EXPECT_NE(ErrorOf(get_infer).find("GET"), std::string::npos);
  Response post_live = client.Post("/v2/health/live", "");
  EXPECT_EQ(post_live.result_int(), 405);
  EXPECT_EQ(post_live[http::field::allow], "GET");
  EXPECT_EQ(client.Send(http::verb::delete_, "/v2/models/scale").result_int(), 405);
}

TEST_F(HttpServerTest, InferJson) {
  Client client(port());
  for (const char* target : {"/v2/models/scale/infer", "/v2/models/scale/versions/1/infer"}) {
    Response response = client.Post(target, kTwoRows);
    ASSERT_EQ(response.result_int(), 200) << response.body();
    EXPECT_EQ(response[http::field::content_type], "application/json");
    const json j = json::parse(response.body());
    EXPECT_EQ(j["model_name"], "scale");
    EXPECT_EQ(j["model_version"], "1");
    EXPECT_EQ(j["id"], "r7");
    ASSERT_EQ(j["outputs"].size(), 1u);
    EXPECT_EQ(j["outputs"][0]["name"], "y");
    EXPECT_EQ(j["outputs"][0]["datatype"], "FP32");
    EXPECT_EQ(j["outputs"][0]["shape"], json::parse("[2,1]"));
    EXPECT_EQ(j["outputs"][0]["data"], json::parse("[10,26.5]"));
  }
  Response fixed = client.Post(
      "/v2/models/fixed/infer",
      R"({"parameters":{"timeout":2500},"inputs":[{"name":"a","datatype":"INT32","shape":[2,3],"data":[1,2,3,4,5,-6]}]})");
  ASSERT_EQ(fixed.result_int(), 200) << fixed.body();
  EXPECT_EQ(json::parse(fixed.body())["outputs"][0]["data"], json::parse("[2,3,4,5,6,-5]"));
  EXPECT_EQ(service_.last_request().timeout_us, 2500u);
}

TEST_F(HttpServerTest, InferBinaryInAndOut) {
  const std::vector<float> x = {1, 2, 3, 4, 0.5f, 0.25f, 0, 0, -1, -1, -1, -1};
  const std::string header =
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[3,4],"parameters":{"binary_data_size":48}}],)"
      R"("outputs":[{"name":"y","parameters":{"binary_data":true}}]})";
  std::string body = header;
  body.append(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  Client client(port());
  Response response =
      client.Post("/v2/models/scale/infer", body,
                  {{"Inference-Header-Content-Length", std::to_string(header.size())},
                   {"Content-Type", "application/octet-stream"}});
  ASSERT_EQ(response.result_int(), 200) << response.body();
  EXPECT_EQ(response[http::field::content_type], "application/octet-stream");
  const size_t json_length = std::stoul(std::string(response["Inference-Header-Content-Length"]));
  ASSERT_EQ(response.body().size(), json_length + 12);
  const json j = json::parse(response.body().substr(0, json_length));
  EXPECT_EQ(j["outputs"][0]["parameters"]["binary_data_size"], 12);
  std::vector<float> y(3);
  std::memcpy(y.data(), response.body().data() + json_length, 12);
  EXPECT_EQ(y, (std::vector<float>{10, 0.75f, -4}));

  // binary_data_output with a JSON input.
  Response all_binary = client.Post(
      "/v2/models/scale/infer",
      R"({"parameters":{"binary_data_output":true},"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,1,1,1]}]})");
  ASSERT_EQ(all_binary.result_int(), 200);
  EXPECT_EQ(all_binary.body().size(),
            std::stoul(std::string(all_binary["Inference-Header-Content-Length"])) + 4);

  Response bad = client.Post("/v2/models/scale/infer", body + "extra",
                             {{"Inference-Header-Content-Length", std::to_string(header.size())}});
  EXPECT_EQ(bad.result_int(), 400);
  EXPECT_NE(ErrorOf(bad).find("binary sizes do not add up"), std::string::npos) << ErrorOf(bad);
  Response bad_header =
      client.Post("/v2/models/scale/infer", body, {{"Inference-Header-Content-Length", "x12"}});
  EXPECT_EQ(bad_header.result_int(), 400);
  EXPECT_NE(ErrorOf(bad_header).find("Inference-Header-Content-Length"), std::string::npos);
}

TEST_F(HttpServerTest, BinaryInputsReachTheServiceAsViewsOfTheBody) {
  Client client(port());
  // A small body (read by Beast's parser) and one past the large-body
  // threshold (read in one operation): both parsed in place.
  for (const int64_t rows : {int64_t{1}, int64_t{3}}) {
    const bool wide = rows == 3;
    const int64_t cols = wide ? 65536 : 4;
    std::vector<float> x(static_cast<size_t>(rows * cols), 0.5f);
    x[0] = 2;
    const std::string header = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[)" +
                               std::to_string(rows) + "," + std::to_string(cols) +
                               R"(],"parameters":{"binary_data_size":)" +
                               std::to_string(x.size() * 4) +
                               R"(}}],"outputs":[{"name":"y","parameters":{"binary_data":true}}]})";
    std::string body = header;
    body.append(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
    Response response =
        client.Post(wide ? "/v2/models/wide/infer" : "/v2/models/scale/infer", body,
                    {{"Inference-Header-Content-Length", std::to_string(header.size())}});
    ASSERT_EQ(response.result_int(), 200) << response.body();
    EXPECT_TRUE(service_.last_input_was_view()) << rows;
    const size_t json_length = std::stoul(std::string(response["Inference-Header-Content-Length"]));
    ASSERT_EQ(response.body().size(), json_length + rows * 4);
    std::vector<float> y(static_cast<size_t>(rows));
    std::memcpy(y.data(), response.body().data() + json_length, y.size() * 4);
    EXPECT_EQ(y[0], 2 + 0.5f * static_cast<float>(cols - 1));
    if (wide) {
      EXPECT_EQ(y[2], 0.5f * static_cast<float>(cols));
    }
  }
  // JSON inputs are decoded into bytes of their own.
  ASSERT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
  EXPECT_FALSE(service_.last_input_was_view());
}

TEST_F(HttpServerTest, OutputsBorrowedFromTheServiceAreEncodedBeforeDoneReturns) {
  // The service spoils its outputs as soon as `done` returns: the answers
  // must hold the values it lent, in JSON and in binary.
  Client client(port());
  for (int i = 0; i < 20; ++i) {
    Response json_response = client.Post("/v2/models/borrowed/infer", kTwoRows);
    ASSERT_EQ(json_response.result_int(), 200) << json_response.body();
    EXPECT_EQ(json::parse(json_response.body())["outputs"][0]["data"], json::parse("[10,26.5]"));

    Response binary = client.Post(
        "/v2/models/borrowed/infer",
        R"({"parameters":{"binary_data_output":true},"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4.5]}]})");
    ASSERT_EQ(binary.result_int(), 200);
    const size_t json_length = std::stoul(std::string(binary["Inference-Header-Content-Length"]));
    ASSERT_EQ(binary.body().size(), json_length + 4);
    float y = 0;
    std::memcpy(&y, binary.body().data() + json_length, 4);
    EXPECT_EQ(y, 10.5f);
  }
}

// BYTES elements serialised by hand: a 4-byte little-endian length, then the bytes.
std::string SerialisedBytes(const std::vector<std::string>& elements) {
  std::string out;
  for (const std::string& element : elements) {
    const auto n = static_cast<uint32_t>(element.size());
    for (int shift = 0; shift < 32; shift += 8) out += static_cast<char>((n >> shift) & 0xff);
    out += element;
  }
  return out;
}

// A request whose one input "s" is BYTES of `shape`, sent as binary data.
std::pair<std::string, std::string> BinaryBytesRequest(const std::string& shape,
                                                       const std::string& binary,
                                                       const std::string& rest = "") {
  const std::string header = R"({"inputs":[{"name":"s","datatype":"BYTES","shape":)" + shape +
                             R"(,"parameters":{"binary_data_size":)" +
                             std::to_string(binary.size()) + "}}]" + rest + "}";
  return {header + binary, std::to_string(header.size())};
}

TEST_F(HttpServerTest, BytesTravelAsJsonStrings) {
  using namespace std::string_literals;
  Client client(port());
  Response r = client.Post(
      "/v2/models/strings/infer",
      R"({"id":"b1","inputs":[{"name":"s","datatype":"BYTES","shape":[2,2],"data":[["","a\u0000b"],["\u00e9\ud83d\ude00","tab\there \"q\""]]}]})");
  ASSERT_EQ(r.result_int(), 200) << r.body();
  EXPECT_EQ(r[http::field::content_type], "application/json");
  const json j = json::parse(r.body());
  EXPECT_EQ(j["id"], "b1");
  const json& o = j["outputs"][0];
  EXPECT_EQ(o["name"], "o");
  EXPECT_EQ(o["datatype"], "BYTES");
  EXPECT_EQ(o["shape"], json::parse("[2,2]"));
  EXPECT_EQ(o["data"], json(std::vector<std::string>{"", "a\0b"s, "\xc3\xa9\xf0\x9f\x98\x80",
                                                     "tab\there \"q\""}));
}

TEST_F(HttpServerTest, BytesTravelAsBinaryDataUnchanged) {
  using namespace std::string_literals;
  Client client(port());
  // Past the front-end's large-body threshold, with a NUL and bytes that are not UTF-8.
  const std::vector<std::string> elements = {"", "\0\xff\xfe"s, "plain", std::string(70000, 'x')};
  const std::string binary = SerialisedBytes(elements);
  const auto [body, json_length] = BinaryBytesRequest(
      "[1,4]", binary, R"(,"outputs":[{"name":"o","parameters":{"binary_data":true}}])");
  Response r = client.Post("/v2/models/strings/infer", body,
                           {{"Inference-Header-Content-Length", json_length}});
  ASSERT_EQ(r.result_int(), 200) << r.body().substr(0, 300);
  EXPECT_TRUE(service_.last_input_was_view());
  const size_t header = std::stoul(std::string(r["Inference-Header-Content-Length"]));
  const json j = json::parse(r.body().substr(0, header));
  EXPECT_EQ(j["outputs"][0]["datatype"], "BYTES");
  EXPECT_EQ(j["outputs"][0]["shape"], json::parse("[1,4]"));
  EXPECT_EQ(j["outputs"][0]["parameters"]["binary_data_size"], binary.size());
  EXPECT_EQ(r.body().substr(header), binary);

  // The same bytes answered in JSON: valid JSON (nlohmann checks UTF-8),
  // the bytes that are not UTF-8 as the Latin-1 characters of their values.
  const auto [json_body, length] = BinaryBytesRequest("[1,4]", binary);
  Response as_json = client.Post("/v2/models/strings/infer", json_body,
                                 {{"Inference-Header-Content-Length", length}});
  ASSERT_EQ(as_json.result_int(), 200);
  EXPECT_EQ(as_json[http::field::content_type], "application/json");
  json parsed;
  ASSERT_NO_THROW(parsed = json::parse(as_json.body()));
  EXPECT_EQ(parsed["outputs"][0]["data"][1], "\0\xc3\xbf\xc3\xbe"s);
  EXPECT_EQ(parsed["outputs"][0]["data"][3], elements[3]);
}

TEST_F(HttpServerTest, MalformedBytesGet400NamingTheInputAndTheServerServesOn) {
  using namespace std::string_literals;
  Client client(port());
  Response number =
      client.Post("/v2/models/strings/infer",
                  R"({"inputs":[{"name":"s","datatype":"BYTES","shape":[1,2],"data":["a",7]}]})");
  EXPECT_EQ(number.result_int(), 400);
  EXPECT_NE(ErrorOf(number).find("input \"s\": element 1 (7) is not a string"), std::string::npos)
      << ErrorOf(number);
  const std::vector<std::pair<std::pair<std::string, std::string>, std::string>> cases = {
      {{"[1,2]", SerialisedBytes({"abcdef"}) + "\x02\x00"s}, "truncated length prefix"},
      {{"[1,2]", SerialisedBytes({"a"}) + "\x09\x00\x00\x00xy"s}, "past the end"},
      {{"[1,1]", SerialisedBytes({"a"}) + "zz"}, "2 trailing bytes"},
      {{"[1,1]", SerialisedBytes({"a", "b"})}, "too many elements"},
      {{"[1,3]", SerialisedBytes({"abcdefgh"})}, "too few elements"},
      {{"[1,3]", SerialisedBytes({"a"})}, "too few for shape [1,3] of BYTES"},
  };
  for (const auto& [request, reason] : cases) {
    const auto [body, json_length] = BinaryBytesRequest(request.first, request.second);
    Response r = client.Post("/v2/models/strings/infer", body,
                             {{"Inference-Header-Content-Length", json_length}});
    EXPECT_EQ(r.result_int(), 400) << reason;
    EXPECT_NE(ErrorOf(r).find("input \"s\""), std::string::npos) << ErrorOf(r);
    EXPECT_NE(ErrorOf(r).find(reason), std::string::npos) << ErrorOf(r);
  }
  // A BYTES input where the model wants FP32, and FP32 where it wants BYTES.
  Response wrong = client.Post(
      "/v2/models/scale/infer",
      R"({"inputs":[{"name":"x","datatype":"BYTES","shape":[1,4],"data":["a","b","c","d"]}]})");
  EXPECT_EQ(wrong.result_int(), 400);
  EXPECT_NE(ErrorOf(wrong).find("datatype BYTES does not match the model's FP32"),
            std::string::npos)
      << ErrorOf(wrong);
  Response floats =
      client.Post("/v2/models/strings/infer",
                  R"({"inputs":[{"name":"s","datatype":"FP32","shape":[1,1],"data":[1]}]})");
  EXPECT_EQ(floats.result_int(), 400);
  // The connection and the server serve on.
  const auto [body, json_length] = BinaryBytesRequest("[1,1]", SerialisedBytes({"ok"}));
  Response good = client.Post("/v2/models/strings/infer", body,
                              {{"Inference-Header-Content-Length", json_length}});
  ASSERT_EQ(good.result_int(), 200) << good.body();
  EXPECT_EQ(json::parse(good.body())["outputs"][0]["data"], json::parse(R"(["ok"])"));
}

TEST_F(HttpServerTest, VariableDimsAcceptVaryingSizesAndFixedOnesDoNot) {
  Client client(port());
  const auto infer = [&](const std::string& model, int rows, int cols) {
    std::string data = "[";
    for (int i = 0; i < rows * cols; ++i) data += (i > 0 ? ",1" : "1");
    data += "]";
    return client.Post("/v2/models/" + model + "/infer",
                       R"({"inputs":[{"name":"x","datatype":"FP32","shape":[)" +
                           std::to_string(rows) + "," + std::to_string(cols) + R"(],"data":)" +
                           data + "}]}");
  };
  for (const auto& [rows, cols] :
       std::vector<std::pair<int, int>>{{1, 3}, {2, 7}, {1, 0}, {3, 40}}) {
    Response r = infer("ragged", rows, cols);
    ASSERT_EQ(r.result_int(), 200) << rows << "x" << cols << ": " << r.body();
    const json y = json::parse(r.body())["outputs"][0];
    EXPECT_EQ(y["shape"], json::array({rows, 1}));
    EXPECT_EQ(y["data"][0], static_cast<double>(cols));
  }
  EXPECT_EQ(infer("scale", 1, 4).result_int(), 200);
  for (const int cols : {3, 5, 0}) {
    Response r = infer("scale", 1, cols);
    EXPECT_EQ(r.result_int(), 400) << cols;
    EXPECT_NE(ErrorOf(r).find("does not match the model's [-1,4]"), std::string::npos)
        << ErrorOf(r);
  }
  // The metadata shows -1 beyond the batch dimension, and BYTES.
  EXPECT_EQ(json::parse(client.Get("/v2/models/ragged").body())["inputs"],
            json::parse(R"([{"name":"x","datatype":"FP32","shape":[-1,-1]}])"));
  const json strings = json::parse(client.Get("/v2/models/strings").body());
  EXPECT_EQ(strings["inputs"], json::parse(R"([{"name":"s","datatype":"BYTES","shape":[-1,-1]}])"));
  EXPECT_EQ(strings["outputs"],
            json::parse(R"([{"name":"o","datatype":"BYTES","shape":[-1,-1]}])"));
}

TEST_F(HttpServerTest, InferErrors) {
  Client client(port());
  std::string nine_rows = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[9,4],"data":[)";
  for (int i = 0; i < 36; ++i) nine_rows += i == 0 ? "1" : ",1";
  nine_rows += "]}]}";
  Response too_big = client.Post("/v2/models/scale/infer", nine_rows);
  EXPECT_EQ(too_big.result_int(), 400);
  EXPECT_EQ(ErrorOf(too_big), "input \"x\": batch of 9 exceeds max_batch_size 8");

  Response unknown = client.Post("/v2/models/nope/infer", kTwoRows);
  EXPECT_EQ(unknown.result_int(), 404);
  EXPECT_EQ(ErrorOf(unknown), "no model 'nope'");
  EXPECT_EQ(client.Post("/v2/models/scale/versions/3/infer", kTwoRows).result_int(), 404);

  Response busy = client.Post("/v2/models/busy/infer", kTwoRows);
  EXPECT_EQ(busy.result_int(), 503);
  EXPECT_EQ(busy[http::field::retry_after], "1");
  EXPECT_EQ(ErrorOf(busy), "queue of model 'busy' is full");

  Response gone = client.Post("/v2/models/gone/infer", kTwoRows);
  EXPECT_EQ(gone.result_int(), 404);
  EXPECT_EQ(ErrorOf(gone), "model 'gone' was unloaded");

  Response bad_json = client.Post("/v2/models/scale/infer", "{\"inputs\": [");
  EXPECT_EQ(bad_json.result_int(), 400);
  EXPECT_NE(ErrorOf(bad_json).find("invalid JSON"), std::string::npos);

  Response dtype =
      client.Post("/v2/models/scale/infer",
                  R"({"inputs":[{"name":"x","datatype":"FP64","shape":[1,4],"data":[1,2,3,4]}]})");
  EXPECT_EQ(dtype.result_int(), 400);
  EXPECT_EQ(ErrorOf(dtype), "input \"x\": datatype FP64 does not match the model's FP32");

  Response output = client.Post(
      "/v2/models/scale/infer",
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],"outputs":[{"name":"z"}]})");
  EXPECT_EQ(output.result_int(), 400);
  EXPECT_NE(ErrorOf(output).find("unknown output \"z\""), std::string::npos);

  // The connection survives every one of these errors.
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
}

TEST_F(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  Client client(port());
  const auto local = client.socket().local_endpoint();
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
  EXPECT_EQ(client.Get("/v2/models/scale").result_int(), 200);
  EXPECT_EQ(client.socket().local_endpoint(), local);

  // Two pipelined requests in one write come back in order.
  const std::string two =
      "GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
      "GET /v2/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  const std::string received = RawExchange(port(), two);
  const size_t first = received.find("HTTP/1.1 200");
  const size_t second = received.find("HTTP/1.1 404");
  EXPECT_NE(first, std::string::npos) << received;
  EXPECT_NE(second, std::string::npos) << received;
  EXPECT_LT(first, second);
}

TEST_F(HttpServerTest, ExpectContinue) {
  const std::string body = kTwoRows;
  net::io_context io;
  tcp::socket socket(io);
  socket.connect(tcp::endpoint(net::ip::address_v4::loopback(), port()));
  SetReceiveTimeout(socket.native_handle(), 20s);
  const std::string head = "POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                           std::to_string(body.size()) + "\r\nExpect: 100-continue\r\n\r\n";
  net::write(socket, net::buffer(head));
  beast::flat_buffer buffer;
  http::response<http::empty_body> interim;
  http::read(socket, buffer, interim);
  EXPECT_EQ(interim.result_int(), 100);
  net::write(socket, net::buffer(body));
  Response response;
  http::read(socket, buffer, response);
  EXPECT_EQ(response.result_int(), 200) << response.body();
}

TEST_F(HttpServerTest, GarbageGets400AndTheServerKeepsServing) {
  for (const std::string& garbage :
       {std::string("\x00\x01\x02 garbage\r\n\r\n", 16), std::string("GET / HTTP/9.9\r\n\r\n"),
        std::string("GET /v2 HTTP/1.1\r\nContent-Length: -5\r\n\r\n"),
        std::string("GET /v2 HTTP/1.1\r\nBad Header\r\n\r\n"),
        std::string(
            "POST /v2/models/scale/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")}) {
    const std::string received = RawExchange(port(), garbage);
    EXPECT_EQ(received.rfind("HTTP/1.1 400", 0), 0u) << received;
    EXPECT_NE(received.find("{\"error\":\"malformed HTTP request"), std::string::npos) << received;
  }
  // A header past the limit.
  const std::string huge = "GET /v2 HTTP/1.1\r\nX-Big: " + std::string(64 * 1024, 'a') + "\r\n\r\n";
  EXPECT_EQ(RawExchange(port(), huge).rfind("HTTP/1.1 400", 0), 0u);
  Client client(port());
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
}

// This process's resident memory, in bytes.
uint64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A raw connection, for requests cut anywhere and for watching exactly how
// the server answers and closes.
class Peer {
 public:
  explicit Peer(uint16_t port) : socket_(io_) {
    socket_.connect(tcp::endpoint(net::ip::address_v4::loopback(), port));
    SetReceiveTimeout(socket_.native_handle(), 60s);
  }
  void Send(std::string_view bytes) {
    net::write(socket_, net::buffer(bytes.data(), bytes.size()));
  }
  // One response; a failure (an empty response with result 0) if the
  // connection ends first.
  Response ReadResponse() {
    Response response;
    beast::error_code ec;
    http::read(socket_, buffer_, response, ec);
    EXPECT_FALSE(ec) << "reading a response: " << ec.message();
    return response;
  }
  // The interim response to Expect: 100-continue.
  int ReadInterim() {
    http::response_parser<http::empty_body> parser;
    beast::error_code ec;
    http::read_header(socket_, buffer_, parser, ec);
    EXPECT_FALSE(ec) << "reading an interim response: " << ec.message();
    return parser.get().result_int();
  }
  enum class End { kEof, kReset, kTimeout, kData };
  // Reads until the connection ends: kEof for a clean close, kReset, or
  // kTimeout after 60 s. Bytes that arrive meanwhile make it kData.
  End ReadToEnd() {
    bool data = buffer_.size() > 0;
    char chunk[4096];
    for (;;) {
      beast::error_code ec;
      const size_t n = socket_.read_some(net::buffer(chunk), ec);
      if (n > 0) data = true;
      if (!ec) continue;
      if (ec == net::error::eof) return data ? End::kData : End::kEof;
      if (ec == net::error::connection_reset) return End::kReset;
      return End::kTimeout;
    }
  }
  // Bytes the server has sent that were not read yet.
  size_t Available() {
    beast::error_code ec;
    return buffer_.size() + socket_.available(ec);
  }
  tcp::socket& socket() { return socket_; }

 private:
  net::io_context io_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
};

bool Closed(Peer::End end) { return end == Peer::End::kEof || end == Peer::End::kReset; }

std::string Head(const std::string& target, uint64_t length, const std::string& extra = "") {
  return "POST " + target + " HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(length) +
         "\r\n" + extra + "\r\n";
}

// A binary request for "wide": `rows` rows of 65536 floats, all `value`.
std::string WideBody(int rows, float value) {
  const std::vector<float> x(static_cast<size_t>(rows) * 65536, value);
  const std::string header = R"({"inputs":[{"name":"x","datatype":"FP32","shape":[)" +
                             std::to_string(rows) + R"(,65536],"parameters":{"binary_data_size":)" +
                             std::to_string(x.size() * 4) + R"(}}]})";
  return header + std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4);
}
size_t WideJsonLength(const std::string& body) { return body.find("}}]}") + 4; }
std::string WideRequest(const std::string& body, const std::string& extra = "") {
  return Head("/v2/models/wide/infer", body.size(),
              "Inference-Header-Content-Length: " + std::to_string(WideJsonLength(body)) + "\r\n" +
                  extra) +
         body;
}

const char* kOneRow =
    R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]})";

TEST_F(HttpServerTest, ClientsThatDisconnectMidRequest) {
  // Mid-header, mid-body, and while the service runs the request.
  RawExchange(port(), "GET /v2/health/li", true);
  RawExchange(port(), "POST /v2/models/scale/infer HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{\"in",
              true);
  {
    Peer peer(port());
    peer.Send(Head("/v2/models/gated/infer", std::strlen(kOneRow)) + kOneRow);
    ASSERT_TRUE(service_.WaitParked(1));
  }  // closed while the service holds its request
  service_.OpenGate();
  ASSERT_TRUE(service_.WaitDone(1));  // answered onto a closed connection
  Client client(port());
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
  // Nothing is left held for the connections that went away.
  EXPECT_TRUE(Eventually([&] {
    const HttpStats stats = server_->stats();
    return stats.connections == 1 && stats.inflight_body_bytes == 0 && stats.requests == 0;
  }));
}

TEST_F(HttpServerTest, HundredConcurrentRequests) {
  // Ten threads each open ten connections and send on all of them before
  // reading any answer: a hundred requests in flight at once.
  constexpr int kThreads = 10;
  constexpr int kPerThread = 10;
  std::atomic<int> answered{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::unique_ptr<Client>> clients;
      for (int i = 0; i < kPerThread; ++i) {
        const float v = static_cast<float>(t * 100 + i);
        clients.push_back(std::make_unique<Client>(port()));
        clients.back()->Write(http::verb::post, "/v2/models/scale/infer",
                              R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[)" +
                                  std::to_string(v) + ",1,1,1]}]}");
      }
      for (int i = 0; i < kPerThread; ++i) {
        const float v = static_cast<float>(t * 100 + i);
        Response response = clients[i]->Read();
        if (response.result_int() != 200) continue;
        const json j = json::parse(response.body());
        if (j["outputs"][0]["data"][0].get<double>() == v + 3) ++answered;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(answered.load(), kThreads * kPerThread);
}

class SmallServerTest : public HttpServerTest {
 protected:
  void SetUp() override {
    HttpOptions options;
    options.max_body_bytes = 1024;
    options.idle_timeout = 300ms;
    options.head_timeout = 300ms;
    options.body_timeout = 300ms;
    options.threads = 1;
    StartServer(options);
  }
};

TEST_F(SmallServerTest, BodyOverTheLimitGets413) {
  const std::string body(2000, ' ');
  const std::string request =
      "POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  const std::string received = RawExchange(port(), request);
  EXPECT_EQ(received.rfind("HTTP/1.1 413", 0), 0u) << received;
  EXPECT_NE(received.find("{\"error\":\"request body exceeds the limit of 1024 bytes\"}"),
            std::string::npos)
      << received;
  // Chunked bodies are held to the same limit.
  std::string chunked =
      "POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 4; ++i) chunked += "200\r\n" + std::string(512, ' ') + "\r\n";
  chunked += "0\r\n\r\n";
  EXPECT_EQ(RawExchange(port(), chunked).rfind("HTTP/1.1 413", 0), 0u);

  Client client(port());
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
}

TEST_F(SmallServerTest, IdleAndSlowConnectionsAreClosed) {
  // Each is closed (not left to the peer's 60 s receive timeout), and the
  // deadline that closed it is counted.
  {
    Peer silent(port());  // nothing sent: the head deadline runs from the accept
    EXPECT_TRUE(Closed(silent.ReadToEnd()));
  }
  EXPECT_GE(server_->stats().head_timeouts, 1u);
  {
    Peer slow_head(port());
    slow_head.Send("POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\n");
    EXPECT_TRUE(Closed(slow_head.ReadToEnd()));
  }
  EXPECT_GE(server_->stats().head_timeouts, 2u);
  {
    Peer slow_body(port());
    slow_body.Send(Head("/v2/models/scale/infer", 500) + "{\"inputs\"");
    EXPECT_TRUE(Closed(slow_body.ReadToEnd()));
  }
  EXPECT_GE(server_->stats().body_timeouts, 1u);
  {
    Peer idle(port());
    idle.Send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(idle.ReadResponse().result_int(), 200);
    EXPECT_TRUE(Closed(idle.ReadToEnd()));  // kept alive, then idle too long
  }
  EXPECT_GE(server_->stats().idle_timeouts, 1u);
  // Clients that send their requests are not affected.
  Client client(port());
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
}

TEST_F(HttpServerTest, StopWaitsForInFlightInfersAndClosesConnections) {
  Client idle(port());
  EXPECT_EQ(idle.Get("/v2/health/live").result_int(), 200);
  Response response;
  std::thread caller([&] {
    Client client(port());
    response = client.Post("/v2/models/gated/infer", kOneRow);
  });
  ASSERT_TRUE(service_.WaitParked(1));
  std::thread stopper([&] { server_->Stop(); });
  ASSERT_TRUE(Eventually([&] { return server_->stats().draining; }));
  service_.OpenGate();  // only now can the infer Stop() waits for complete
  caller.join();
  stopper.join();
  EXPECT_EQ(response.result_int(), 200);
  EXPECT_EQ(response[http::field::connection], "close");
  // The kept-alive connection is closed: reading gets end of file.
  char byte = 0;
  beast::error_code ec;
  EXPECT_EQ(idle.socket().read_some(net::buffer(&byte, 1), ec), 0u);
  EXPECT_EQ(ec, net::error::eof);
  server_->Stop();  // idempotent
  EXPECT_NE(server_->port(), 0);
}

// Servers with the limits each test sets.
class LimitsTest : public HttpServerTest {
 protected:
  void SetUp() override {}
};

TEST_F(LimitsTest, StalledBodiesHoldNoneOfTheirDeclaredSize) {
  HttpOptions options;
  options.max_body_bytes = 64 << 20;
  options.max_inflight_bytes = 128 << 20;
  options.body_timeout = 120s;  // stalled for the whole test
  StartServer(options);
  const uint64_t resident_before = ResidentBytes();
  // 100 connections declare 64 MiB bodies and send none of it, half of them
  // with Expect: 100-continue: 6.4 GiB if the server sized bodies up front.
  constexpr int kStalled = 100;
  std::vector<std::unique_ptr<Peer>> stalled;
  for (int i = 0; i < kStalled; ++i) {
    stalled.push_back(std::make_unique<Peer>(port()));
    stalled.back()->Send(
        Head("/v2/models/wide/infer", 64 << 20, i % 2 == 1 ? "Expect: 100-continue\r\n" : ""));
  }
  // The budget has room for their first chunks: the body may proceed.
  for (int i = 1; i < kStalled; i += 2) EXPECT_EQ(stalled[i]->ReadInterim(), 100) << i;
  ASSERT_TRUE(Eventually([&] { return server_->stats().requests == kStalled; }));
  HttpStats stats = server_->stats();
  EXPECT_EQ(stats.inflight_body_bytes, 0u);
  EXPECT_EQ(stats.budget_waiting, 0u);
  // A normal client is answered meanwhile, its body read as usual.
  Peer normal(port());
  normal.Send(WideRequest(WideBody(2, 0.5f)));
  const Response response = normal.ReadResponse();
  ASSERT_EQ(response.result_int(), 200) << response.body();
  // Given back once the answer is written.
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_body_bytes == 0; }));
  EXPECT_LE(server_->stats().inflight_body_bytes_peak, options.max_inflight_bytes);
  EXPECT_LT(ResidentBytes(), resident_before + (uint64_t{256} << 20));
}

TEST_F(LimitsTest, TheBudgetBoundsBodiesInFlightAndEveryRequestIsAnswered) {
  HttpOptions options;
  options.max_body_bytes = 3 << 20;
  options.max_inflight_bytes = 4 << 20;
  options.body_timeout = 120s;
  StartServer(options);
  // Six 2 MiB bodies at once, each held back by its client at its last byte:
  // 12 MiB wanted, 4 MiB allowed.
  constexpr int kClients = 6;
  std::vector<std::string> bodies;
  for (int i = 0; i < kClients; ++i) bodies.push_back(WideBody(8, static_cast<float>(i)));
  std::mutex mutex;
  std::condition_variable go;
  bool release = false;
  std::vector<Response> responses(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      Peer peer(port());
      const std::string request = WideRequest(bodies[i]);
      peer.Send(std::string_view(request).substr(0, request.size() - 1));
      {
        std::unique_lock lock(mutex);
        go.wait(lock, [&] { return release; });
      }
      peer.Send(std::string_view(request).substr(request.size() - 1));
      responses[i] = peer.ReadResponse();
    });
  }
  // Some must wait: only the budget (and one finisher past it) is read.
  ASSERT_TRUE(Eventually([&] { return server_->stats().budget_waiting > 0; }));
  HttpStats stats = server_->stats();
  EXPECT_LE(stats.inflight_body_bytes, options.max_inflight_bytes + options.max_body_bytes);
  {
    std::lock_guard lock(mutex);
    release = true;
  }
  go.notify_all();
  for (std::thread& client : clients) client.join();
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(responses[i].result_int(), 200) << i << ": " << responses[i].body();
    const json j = json::parse(responses[i].body());
    EXPECT_EQ(j["outputs"][0]["data"][7].get<double>(), 65536.0 * i) << i;
  }
  stats = server_->stats();
  EXPECT_LE(stats.inflight_body_bytes_peak, options.max_inflight_bytes + options.max_body_bytes);
  EXPECT_GT(stats.budget_waits, 0u);
  EXPECT_TRUE(Eventually([&] { return server_->stats().inflight_body_bytes == 0; }));
}

TEST_F(LimitsTest, ContinueIsNotAnsweredWhileTheBudgetIsExhausted) {
  HttpOptions options;
  options.max_body_bytes = 2 << 20;
  options.max_inflight_bytes = 2 << 20;
  options.body_timeout = 120s;
  StartServer(options);
  // One body takes the whole budget and stops one byte short.
  const std::string full(2 << 20, 'x');
  Peer hog(port());
  hog.Send(Head("/v2/health/live", full.size()) + full.substr(0, full.size() - 1));
  ASSERT_TRUE(Eventually([&] { return server_->stats().inflight_body_bytes == (2u << 20); }));
  // A large body asks to continue: it waits, unanswered.
  Peer large(port());
  large.Send(Head("/v2/models/wide/infer", 100000, "Expect: 100-continue\r\n"));
  ASSERT_TRUE(Eventually([&] { return server_->stats().budget_waiting == 1; }));
  EXPECT_EQ(large.Available(), 0u);
  // A small body never waits (large ones cannot hold up small requests).
  Peer small(port());
  small.Send(Head("/v2/models/scale/infer", std::strlen(kTwoRows), "Expect: 100-continue\r\n"));
  EXPECT_EQ(small.ReadInterim(), 100);
  small.Send(kTwoRows);
  EXPECT_EQ(small.ReadResponse().result_int(), 200);
  EXPECT_EQ(large.Available(), 0u);
  // The hog's request completes (405: a body on GET's path) and gives its
  // bytes back; then the large body is told to continue.
  hog.Send("x");
  EXPECT_EQ(hog.ReadResponse().result_int(), 405);
  EXPECT_EQ(large.ReadInterim(), 100);
  large.Send(std::string(100000, ' '));
  EXPECT_EQ(large.ReadResponse().result_int(), 400);  // not a request, but read and answered
}

TEST_F(LimitsTest, SmallBodiesNeverWaitForTheBudgetEvenInPieces) {
  HttpOptions options;
  options.max_body_bytes = 1 << 20;
  options.max_inflight_bytes = 1 << 20;
  options.body_timeout = 120s;
  StartServer(options);
  const std::string full(1 << 20, 'x');
  Peer hog(port());
  hog.Send(Head("/v2/health/live", full.size()) + full.substr(0, full.size() - 1));
  ASSERT_TRUE(Eventually([&] { return server_->stats().inflight_body_bytes == (1u << 20); }));
  // The budget is exhausted. A small request's head and half its body: the
  // server takes the body's bytes (past the limit) and reads the half...
  const size_t half = std::strlen(kTwoRows) / 2;
  Peer small(port());
  small.Send(Head("/v2/models/scale/infer", std::strlen(kTwoRows)) + std::string(kTwoRows, half));
  ASSERT_TRUE(Eventually(
      [&] { return server_->stats().inflight_body_bytes == (1u << 20) + std::strlen(kTwoRows); }));
  // ...and the rest, without waiting for the hog.
  small.Send(kTwoRows + half);
  EXPECT_EQ(small.ReadResponse().result_int(), 200);
  EXPECT_EQ(server_->stats().budget_waiting, 0u);
  hog.Send("x");
  EXPECT_EQ(hog.ReadResponse().result_int(), 405);
}

TEST_F(LimitsTest, ABodyLargerThanTheBudgetGets413) {
  HttpOptions options;
  options.max_body_bytes = 64 << 20;
  options.max_inflight_bytes = 1 << 20;
  StartServer(options);
  Peer peer(port());
  peer.Send(Head("/v2/models/wide/infer", 2 << 20));
  const Response response = peer.ReadResponse();
  EXPECT_EQ(response.result_int(), 413);
  EXPECT_NE(ErrorOf(response).find("1048576 bytes (the most the server holds"), std::string::npos)
      << ErrorOf(response);
  EXPECT_TRUE(Closed(peer.ReadToEnd()));
}

TEST_F(LimitsTest, AtTheConnectionLimitNewConnectionsWaitInTheBacklog) {
  HttpOptions options;
  options.max_connections = 3;
  options.body_timeout = 120s;
  StartServer(options);
  // Three connections with a request in progress (its body half sent): none
  // of them may be closed to make room.
  const size_t half = std::strlen(kTwoRows) / 2;
  std::vector<std::unique_ptr<Peer>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<Peer>(port()));
    held.back()->Send(Head("/v2/models/scale/infer", std::strlen(kTwoRows)) +
                      std::string(kTwoRows, half));
  }
  ASSERT_TRUE(Eventually([&] { return server_->stats().requests == 3; }));
  ASSERT_TRUE(Eventually([&] { return server_->stats().accept_paused; }));
  // The kernel completes the handshake, the server does not accept: the
  // request stays unread and unanswered.
  Peer waiting(port());
  waiting.Send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(server_->stats().connections, 3u);
  EXPECT_EQ(waiting.Available(), 0u);
  // One closes: the waiting connection takes its slot and is answered.
  held.erase(held.begin());
  EXPECT_EQ(waiting.ReadResponse().result_int(), 200);
  EXPECT_LE(server_->stats().connections, 3u);
  held[0]->Send(kTwoRows + half);
  EXPECT_EQ(held[0]->ReadResponse().result_int(), 200);
  EXPECT_EQ(server_->stats().connections_evicted, 0u);
}

TEST_F(LimitsTest, AtTheConnectionLimitSilentConnectionsMakeRoomForNewOnes) {
  HttpOptions options;
  options.max_connections = 8;
  // Much longer than the waits below: only an eviction lets a client in.
  options.head_timeout = 600s;
  options.body_timeout = 600s;
  StartServer(options);
  // One request in progress, its body half sent...
  const size_t half = std::strlen(kTwoRows) / 2;
  Peer busy(port());
  busy.Send(Head("/v2/models/scale/infer", std::strlen(kTwoRows)) + std::string(kTwoRows, half));
  ASSERT_TRUE(Eventually([&] { return server_->stats().requests == 1; }));
  // ...one with part of a head (the oldest silent-looking one)...
  Peer partial(port());
  partial.Send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n");
  // ...and six connections that send nothing, all accepted.
  constexpr int kSilent = 6;
  std::vector<std::unique_ptr<Peer>> silent;
  for (int i = 0; i < kSilent; ++i) silent.push_back(std::make_unique<Peer>(port()));
  ASSERT_TRUE(Eventually([&] { return server_->stats().connections == 8; }));
  ASSERT_TRUE(Eventually([&] { return server_->stats().accept_paused; }));
  // Each new client, kept open after its answer, takes a silent one's slot.
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kSilent; ++i) {
    clients.push_back(std::make_unique<Client>(port()));
    Client& client = *clients.back();
    auto answer = std::async(std::launch::async, [&client] {
      beast::error_code ec;
      client.Write(http::verb::get, "/v2/health/live");
      Response response;
      beast::flat_buffer buffer;
      http::read(client.socket(), buffer, response, ec);
      return response.result_int();
    });
    // A deadline for a failure only; the head timeout is far longer.
    if (answer.wait_for(30s) != std::future_status::ready) {
      beast::error_code ignored;
      client.socket().shutdown(tcp::socket::shutdown_both, ignored);
      ADD_FAILURE() << "client " << i << " not answered: no connection was evicted";
    }
    ASSERT_EQ(answer.get(), 200) << i;
  }
  EXPECT_GE(server_->stats().connections_evicted, static_cast<uint64_t>(kSilent));
  EXPECT_LE(server_->stats().connections, 8u);
  for (int i = 0; i < kSilent; ++i) EXPECT_TRUE(Closed(silent[i]->ReadToEnd())) << i;
  // The requests in progress were not touched: they complete now.
  partial.Send("\r\n");
  EXPECT_EQ(partial.ReadResponse().result_int(), 200);
  busy.Send(kTwoRows + half);
  EXPECT_EQ(busy.ReadResponse().result_int(), 200);
  const std::string metrics = clients.back()->Get("/metrics").body();
  EXPECT_NE(metrics.find("hearth_http_connections_evicted_total " +
                         std::to_string(server_->stats().connections_evicted)),
            std::string::npos)
      << metrics;
}

// Sets the soft descriptor limit for as long as it lives.
class DescriptorLimit {
 public:
  explicit DescriptorLimit(uint64_t soft) {
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit low = saved_;
    low.rlim_cur = soft;
    ok_ = ::setrlimit(RLIMIT_NOFILE, &low) == 0;
  }
  ~DescriptorLimit() { ::setrlimit(RLIMIT_NOFILE, &saved_); }
  bool ok() const { return ok_; }

 private:
  rlimit saved_{};
  bool ok_ = false;
};

uint64_t OpenDescriptorCount() {
  uint64_t count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++count;
  }
  return count;
}

TEST_F(LimitsTest, TheConnectionLimitLeavesTheReserveOfTheDescriptorLimit) {
  HttpOptions options;
  options.max_connections = 1024;
  options.reserved_descriptors = 64;
  {
    // Room for about 20 connections besides what is open and the reserve.
    DescriptorLimit limit(OpenDescriptorCount() + 64 + 20);
    ASSERT_TRUE(limit.ok());
    StartServer(options);
  }
  const uint64_t connections = server_->stats().connection_limit;
  EXPECT_GE(connections, 1u);
  EXPECT_LE(connections, 20u);
  Client client(port());
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
  // No room at all: Start says why.
  DescriptorLimit limit(OpenDescriptorCount() + 10);
  ASSERT_TRUE(limit.ok());
  options.port = 0;
  auto none = HttpServer::Create(&service_, options);
  ASSERT_TRUE(none.ok());
  const Status started = (*none)->Start();
  EXPECT_EQ(started.code(), StatusCode::kResourceExhausted) << started.ToString();
  EXPECT_NE(started.message().find("RLIMIT_NOFILE"), std::string::npos) << started.ToString();
}

TEST_F(LimitsTest, AcceptErrorsPauseAcceptingAndItResumes) {
  StartServer({});
  // Sockets made before the limit drops: connect() needs no descriptor.
  constexpr int kPeers = 3;
  std::vector<int> fds;
  for (int i = 0; i < kPeers; ++i) fds.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port());
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  {
    DescriptorLimit limit(OpenDescriptorCount());  // no descriptor is free: accept4 fails EMFILE
    ASSERT_TRUE(limit.ok());
    for (int fd : fds) {
      ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
    }
    ASSERT_TRUE(Eventually([&] { return server_->stats().accept_errors >= 2; }));
    EXPECT_TRUE(server_->stats().accept_paused);
  }
  // Descriptors again: the back-off ends and the connections are served.
  const std::string request =
      "GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  for (int fd : fds) {
    ASSERT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(request.size()));
    timeval tv{60, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    std::string received;
    char chunk[512];
    ssize_t n;
    while ((n = ::recv(fd, chunk, sizeof chunk, 0)) > 0) received.append(chunk, n);
    EXPECT_EQ(received.rfind("HTTP/1.1 200", 0), 0u) << received;
    ::close(fd);
  }
  Client client(port());
  EXPECT_EQ(client.Get("/v2/health/live").result_int(), 200);
}

TEST_F(LimitsTest, DrainAnswersWhatArrivedRefusesTheRestAndResetsNothing) {
  StartServer({});
  // a: an infer the service holds. b: a request whose head and half its body
  // arrived. c, e: kept-alive connections that will send during the drain.
  // g: a kept-alive connection that stays idle.
  Peer a(port());
  a.Send(Head("/v2/models/gated/infer", std::strlen(kOneRow)) + kOneRow);
  ASSERT_TRUE(service_.WaitParked(1));
  const std::string b_request = WideRequest(WideBody(1, 0.25f));
  Peer b(port());
  b.Send(std::string_view(b_request).substr(0, b_request.size() / 2));
  ASSERT_TRUE(Eventually([&] { return server_->stats().requests == 2; }));
  Peer c(port()), e(port()), g(port());
  for (Peer* p : {&c, &e, &g}) {
    p->Send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(p->ReadResponse().result_int(), 200);
  }

  std::thread stopper([&] { server_->Stop(); });
  ASSERT_TRUE(Eventually([&] { return !server_->stats().listening; }));
  // New connections are refused, before any byte is sent.
  {
    net::io_context io;
    tcp::socket refused(io);
    beast::error_code ec;
    refused.connect(tcp::endpoint(net::ip::address_v4::loopback(), port()), ec);
    EXPECT_EQ(ec, net::error::connection_refused) << ec.message();
  }
  // A request that arrives during the drain: 503 with Connection: close, and
  // a clean close after it.
  c.Send("GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n");
  Response refused = c.ReadResponse();
  EXPECT_EQ(refused.result_int(), 503);
  EXPECT_EQ(refused[http::field::connection], "close");
  EXPECT_EQ(c.ReadToEnd(), Peer::End::kEof);
  // The same with a large body sent in full: it is read and discarded, so
  // closing resets nothing.
  e.Send(WideRequest(WideBody(1, 1.0f)));
  EXPECT_EQ(e.ReadResponse().result_int(), 503);
  EXPECT_EQ(e.ReadToEnd(), Peer::End::kEof);
  // b's head had arrived: its request runs and is answered, its last.
  b.Send(std::string_view(b_request).substr(b_request.size() / 2));
  service_.OpenGate();
  Response a_response = a.ReadResponse();
  EXPECT_EQ(a_response.result_int(), 200) << a_response.body();
  EXPECT_EQ(a_response[http::field::connection], "close");
  EXPECT_EQ(a.ReadToEnd(), Peer::End::kEof);
  Response b_response = b.ReadResponse();
  EXPECT_EQ(b_response.result_int(), 200) << b_response.body();
  EXPECT_EQ(b_response[http::field::connection], "close");
  if (b_response.result_int() == 200) {
    EXPECT_EQ(json::parse(b_response.body())["outputs"][0]["data"][0].get<double>(), 16384.0);
  }
  EXPECT_EQ(b.ReadToEnd(), Peer::End::kEof);
  // The idle one is closed once nothing is in progress.
  EXPECT_EQ(g.ReadToEnd(), Peer::End::kEof);
  g.socket().close();  // ends its lingering close at once
  stopper.join();
}

TEST(HttpServerCreate, RejectsBadOptionsAndTakenPorts) {
  FakeService service;
  EXPECT_EQ(HttpServer::Create(nullptr, {}).status().code(), StatusCode::kInvalidArgument);
  HttpOptions zero_threads;
  zero_threads.threads = 0;
  EXPECT_EQ(HttpServer::Create(&service, zero_threads).status().code(),
            StatusCode::kInvalidArgument);

  HttpOptions options;
  options.port = 0;
  auto first = HttpServer::Create(&service, options);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE((*first)->Start().ok());
  EXPECT_EQ((*first)->Start().code(), StatusCode::kFailedPrecondition);

  HttpOptions same_port;
  same_port.port = (*first)->port();
  auto second = HttpServer::Create(&service, same_port);
  ASSERT_TRUE(second.ok());
  const Status bound = (*second)->Start();
  EXPECT_EQ(bound.code(), StatusCode::kUnavailable) << bound.ToString();

  // Bound first: a taken port fails Bind, and Start after it the same way
  // (it serves nothing); a second Bind is refused.
  auto third = HttpServer::Create(&service, same_port);
  ASSERT_TRUE(third.ok());
  const Status early = (*third)->Bind();
  EXPECT_EQ(early.code(), StatusCode::kUnavailable) << early.ToString();
  EXPECT_EQ((*third)->Start().ToString(), early.ToString());
  EXPECT_EQ((*third)->port(), 0);
  EXPECT_EQ((*third)->Bind().code(), StatusCode::kFailedPrecondition);
  // Bind, then Start, on a free port serves.
  auto fourth = HttpServer::Create(&service, options);
  ASSERT_TRUE(fourth.ok());
  ASSERT_TRUE((*fourth)->Bind().ok());
  EXPECT_NE((*fourth)->port(), 0);
  ASSERT_TRUE((*fourth)->Start().ok());
}

// ---- Triton's extensions: config, statistics, repository, shared memory ----

TEST_F(HttpServerTest, ModelConfigIsTheServicesJsonAsItIs) {
  Client client(port());
  for (const char* target : {"/v2/models/scale/config", "/v2/models/scale/versions/1/config"}) {
    Response r = client.Get(target);
    ASSERT_EQ(r.result_int(), 200) << target << " " << r.body();
    EXPECT_EQ(r.body(), R"({"name":"scale","max_batch_size":8})");
    EXPECT_EQ(r[http::field::content_type], "application/json");
  }
  EXPECT_EQ(client.Get("/v2/models/nope/config").result_int(), 404);
  EXPECT_EQ(client.Get("/v2/models/scale/versions/2/config").result_int(), 404);
  // A service without it says so: 501, not a silent success.
  Response none = client.Get("/v2/models/fixed/config");
  EXPECT_EQ(none.result_int(), 501);
  EXPECT_NE(ErrorOf(none).find("no config"), std::string::npos);
  EXPECT_EQ(client.Post("/v2/models/scale/config", "").result_int(), 405);
}

TEST_F(HttpServerTest, StatisticsInTritonsJson) {
  Client client(port());
  Response one = client.Get("/v2/models/scale/versions/1/stats");
  ASSERT_EQ(one.result_int(), 200) << one.body();
  const json body = json::parse(one.body());
  ASSERT_EQ(body["model_stats"].size(), 1u);
  const json& s = body["model_stats"][0];
  EXPECT_EQ(s["name"], "scale");
  EXPECT_EQ(s["version"], "1");
  EXPECT_EQ(s["last_inference"], 1700000000123ull);
  EXPECT_EQ(s["inference_count"], 12);
  EXPECT_EQ(s["execution_count"], 5);
  EXPECT_EQ(s["inference_stats"]["success"], json({{"count", 5}, {"ns", 5000}}));
  EXPECT_EQ(s["inference_stats"]["fail"], json({{"count", 1}, {"ns", 100}}));
  EXPECT_EQ(s["inference_stats"]["queue"]["ns"], 700);
  EXPECT_EQ(s["inference_stats"]["compute_input"]["ns"], 10);
  EXPECT_EQ(s["inference_stats"]["compute_infer"]["ns"], 4000);
  EXPECT_EQ(s["inference_stats"]["compute_output"]["ns"], 20);
  ASSERT_EQ(s["batch_stats"].size(), 2u);
  EXPECT_EQ(s["batch_stats"][1]["batch_size"], 4);
  EXPECT_EQ(s["batch_stats"][1]["compute_infer"], json({{"count", 3}, {"ns", 3000}}));
  EXPECT_EQ(client.Get("/v2/models/scale/stats").result_int(), 200);
  EXPECT_EQ(client.Get("/v2/models/nope/stats").result_int(), 404);
}

TEST_F(HttpServerTest, ModelsStatsIsEveryModelsStatisticsNotAModelNamedStats) {
  Client client(port());
  Response all = client.Get("/v2/models/stats");
  ASSERT_EQ(all.result_int(), 200) << all.body();
  const json body = json::parse(all.body());
  ASSERT_EQ(body["model_stats"].size(), 2u);
  EXPECT_EQ(body["model_stats"][0]["name"], "fixed");
  EXPECT_EQ(body["model_stats"][1]["name"], "scale");
}

TEST_F(HttpServerTest, RepositoryIndex) {
  Client client(port());
  Response all = client.Post("/v2/repository/index", "");
  ASSERT_EQ(all.result_int(), 200) << all.body();
  EXPECT_EQ(json::parse(all.body()), json::parse(R"([{"name":"scale","version":"1","state":"READY"},
                            {"name":"unready","state":"UNAVAILABLE","reason":"no worker is ready"}])"));
  Response ready = client.Post("/v2/repository/index", R"({"ready": true})");
  ASSERT_EQ(ready.result_int(), 200);
  EXPECT_EQ(json::parse(ready.body()).size(), 1u);
  EXPECT_EQ(json::parse(client.Post("/v2/repository/index", R"({"ready":false})").body()).size(),
            2u);
  Response bad = client.Post("/v2/repository/index", R"({"ready": "yes"})");
  EXPECT_EQ(bad.result_int(), 400);
  EXPECT_NE(ErrorOf(bad).find("'ready' must be a boolean"), std::string::npos);
  EXPECT_EQ(client.Post("/v2/repository/index", "{").result_int(), 400);
  EXPECT_EQ(client.Get("/v2/repository/index").result_int(), 405);
}

TEST_F(HttpServerTest, LoadAndUnloadRunOffTheIoThreads) {
  Client loader(port());
  loader.Write(http::verb::post, "/v2/repository/models/gated/load");
  ASSERT_TRUE(service_.WaitParkedLoads(1));
  // The load waits in the service; both I/O threads still answer.
  for (int i = 0; i < 4; ++i) {
    Client other(port());
    EXPECT_EQ(other.Get("/v2/health/live").result_int(), 200);
  }
  service_.OpenGate();
  Response loaded = loader.Read();
  EXPECT_EQ(loaded.result_int(), 200) << loaded.body();
  EXPECT_TRUE(loaded.body().empty());
  Response unloaded = loader.Post("/v2/repository/models/scale/unload", "");
  EXPECT_EQ(unloaded.result_int(), 200) << unloaded.body();
  Response dependents = loader.Post("/v2/repository/models/scale/unload",
                                    R"({"parameters":{"unload_dependents":true}})");
  EXPECT_EQ(dependents.result_int(), 200) << dependents.body();
  EXPECT_EQ(service_.control_calls(),
            (std::vector<std::string>{"load gated", "unload scale", "unload scale"}));
  Response unknown = loader.Post("/v2/repository/models/nope/load", "");
  EXPECT_EQ(unknown.result_int(), 404);
  EXPECT_NE(ErrorOf(unknown).find("no model 'nope'"), std::string::npos);
}

TEST_F(HttpServerTest, LoadOverridesReachTheServiceDecoded) {
  Client client(port());
  const std::pair<const char*, const char*> bad[] = {
      {R"({"parameters": 3})", "'parameters' must be an object"},
      {R"({"parameters":{"unload_dependents":true}})", "is not one a load takes"},
      {R"({"parameters":{"config":{}}})", "must be a string (JSON text)"},
      {R"({"parameters":{"file:1/m.py":"AAA"}})", "is not base64"},
      {R"({"other":{}})", "unknown field 'other'"},
  };
  for (const auto& [body, says] : bad) {
    Response r = client.Post("/v2/repository/models/scale/load", body);
    EXPECT_EQ(r.result_int(), 400) << body;
    EXPECT_NE(ErrorOf(r).find(says), std::string::npos) << ErrorOf(r);
  }
  EXPECT_TRUE(service_.control_calls().empty());
  Response ok = client.Post("/v2/repository/models/scale/load",
                            R"({"parameters":{"config":"{\"backend\":\"python\"}",)"
                            R"("file:1/model.py":"aGk="}})");
  EXPECT_EQ(ok.result_int(), 200) << ok.body();
  EXPECT_EQ(service_.load_overrides(),
            (std::vector<std::string>{R"(config {"backend":"python"})", "file 1/model.py=hi"}));
  EXPECT_EQ(service_.control_calls(), (std::vector<std::string>{"load scale"}));
}

TEST_F(HttpServerTest, SystemSharedMemoryRegisterStatusUnregister) {
  Client client(port());
  Response reg = client.Post("/v2/systemsharedmemory/region/r1/register",
                             R"({"key":"/hearth_r1","offset":16,"byte_size":64})");
  ASSERT_EQ(reg.result_int(), 200) << reg.body();
  EXPECT_TRUE(reg.body().empty());
  // The service is told whose connection asks: its two ends, which name
  // this process's socket in the kernel's table.
  const ClientConnection asker = service_.LastClient();
  EXPECT_EQ(asker.address, "127.0.0.1");
  EXPECT_EQ(asker.port, client.local_port());
  EXPECT_EQ(asker.server_port, port());
  Result<uid_t> uid = LocalPeerUid(asker);
  ASSERT_TRUE(uid.ok()) << uid.status().ToString();
  EXPECT_EQ(*uid, ::geteuid());
  Response again = client.Post("/v2/systemsharedmemory/region/r1/register",
                               R"({"key":"/hearth_r1","byte_size":64})");
  EXPECT_EQ(again.result_int(), 400);
  EXPECT_NE(ErrorOf(again).find("already registered"), std::string::npos);
  ASSERT_EQ(client
                .Post("/v2/systemsharedmemory/region/r2/register",
                      R"({"key":"/hearth_r2","byte_size":8})")
                .result_int(),
            200);
  for (const char* body :
       {R"({"byte_size":8})", R"({"key":"/k"})", R"({"key":"/k","byte_size":-1})",
        R"({"key":"/k","byte_size":8,"extra":1})", "[]"}) {
    EXPECT_EQ(client.Post("/v2/systemsharedmemory/region/r3/register", body).result_int(), 400)
        << body;
  }
  Response status = client.Get("/v2/systemsharedmemory/status");
  ASSERT_EQ(status.result_int(), 200);
  EXPECT_EQ(json::parse(status.body()),
            json::parse(R"([{"name":"r1","key":"/hearth_r1","offset":16,"byte_size":64},
                            {"name":"r2","key":"/hearth_r2","offset":0,"byte_size":8}])"));
  Response one = client.Get("/v2/systemsharedmemory/region/r2/status");
  ASSERT_EQ(one.result_int(), 200);
  EXPECT_EQ(json::parse(one.body()).size(), 1u);
  EXPECT_EQ(client.Get("/v2/systemsharedmemory/region/r9/status").result_int(), 404);
  EXPECT_EQ(client.Post("/v2/systemsharedmemory/region/r1/unregister", "").result_int(), 200);
  EXPECT_EQ(json::parse(client.Get("/v2/systemsharedmemory/status").body()).size(), 1u);
  EXPECT_EQ(client.Post("/v2/systemsharedmemory/unregister", "").result_int(), 200);
  EXPECT_EQ(json::parse(client.Get("/v2/systemsharedmemory/status").body()).size(), 0u);
  EXPECT_EQ(client.Get("/v2/systemsharedmemory/region/r1/register").result_int(), 405);
  EXPECT_EQ(client.Post("/v2/systemsharedmemory/register", "{}").result_int(), 404);
}

// Triton's body (tritonclient.http's register_cuda_shared_memory): the
// handle's base64 decoded, strictly, and passed on with the device and size.
TEST_F(HttpServerTest, CudaSharedMemoryRegisterStatusUnregister) {
  Client client(port());
  // 64 bytes 0..63, in base64.
  std::string handle_b64;
  {
    static const char* kAlphabet =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    std::vector<uint8_t> raw(64);
    for (int i = 0; i < 64; ++i) raw[static_cast<size_t>(i)] = static_cast<uint8_t>(i * 4 + 1);
    for (size_t i = 0; i < raw.size(); i += 3) {
      uint32_t g = static_cast<uint32_t>(raw[i]) << 16;
      if (i + 1 < raw.size()) g |= static_cast<uint32_t>(raw[i + 1]) << 8;
      if (i + 2 < raw.size()) g |= raw[i + 2];
      handle_b64 += kAlphabet[g >> 18 & 63];
      handle_b64 += kAlphabet[g >> 12 & 63];
      handle_b64 += i + 1 < raw.size() ? kAlphabet[g >> 6 & 63] : '=';
      handle_b64 += i + 2 < raw.size() ? kAlphabet[g & 63] : '=';
    }
  }
  ASSERT_EQ(handle_b64.size(), 88u);
  auto body = [](const std::string& b64,
                 const std::string& rest = R"("device_id":1,"byte_size":4096)") {
    return R"({"raw_handle":{"b64":")" + b64 + R"("},)" + rest + "}";
  };
  Response reg = client.Post("/v2/cudasharedmemory/region/c1/register", body(handle_b64));
  ASSERT_EQ(reg.result_int(), 200) << reg.body();
  EXPECT_TRUE(reg.body().empty());
  const std::vector<std::byte> got = service_.CudaHandle("c1");
  ASSERT_EQ(got.size(), 64u);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(got[i], static_cast<std::byte>(i * 4 + 1)) << i;
  ASSERT_EQ(client
                .Post("/v2/cudasharedmemory/region/c2/register",
                      body(handle_b64, R"("device_id":-3,"byte_size":8)"))
                .result_int(),
            200);
  Response again = client.Post("/v2/cudasharedmemory/region/c1/register", body(handle_b64));
  EXPECT_EQ(again.result_int(), 400);
  EXPECT_NE(ErrorOf(again).find("already registered"), std::string::npos);
  // The service's errors as they are: a 48-byte handle, well-formed base64.
  Response short_handle =
      client.Post("/v2/cudasharedmemory/region/c3/register", body(handle_b64.substr(0, 64)));
  EXPECT_EQ(short_handle.result_int(), 400);
  EXPECT_EQ(ErrorOf(short_handle), "the handle has 48 bytes");

  const std::pair<std::string, std::string> bad[] = {
      {body("AAA"), "'raw_handle' is not base64"},   // not a multiple of 4
      {body("AA!A"), "'raw_handle' is not base64"},  // not of the alphabet
      {body("AB=="), "bits set past its end"},       // not canonical
      {body("A==="), "'raw_handle' is not base64"},  // too much padding
      {body("AA=A"), "'raw_handle' is not base64"},  // padding inside
      {body(handle_b64, R"("device_id":0)"), "'byte_size' is missing"},
      {body(handle_b64, R"("byte_size":8)"), "'device_id' is missing"},
      {body(handle_b64, R"("device_id":"0","byte_size":8)"), "'device_id' must be an integer"},
      {body(handle_b64, R"("device_id":1.5,"byte_size":8)"), "'device_id' must be an integer"},
      {body(handle_b64, R"("device_id":18446744073709551615,"byte_size":8)"),
       "'device_id' must be an integer"},
      {body(handle_b64, R"("device_id":0,"byte_size":-8)"), "'byte_size' must be a non-negative"},
      {body(handle_b64, R"("device_id":0,"byte_size":8,"offset":0)"), "unknown field 'offset'"},
      {R"({"raw_handle":")" + handle_b64 + R"(","device_id":0,"byte_size":8})",
       "'raw_handle' must be {\"b64\""},
      {R"({"raw_handle":{"b64":1},"device_id":0,"byte_size":8})", "'raw_handle' must be"},
      {R"({"device_id":0,"byte_size":8})", "'raw_handle' is missing"},
      {body(std::string(4100, 'A')), "4100 characters of base64"},
      {"[]", "must be a JSON object"},
      {"{", ""},
  };
  for (const auto& [text, says] : bad) {
    Response r = client.Post("/v2/cudasharedmemory/region/c9/register", text);
    EXPECT_EQ(r.result_int(), 400) << text;
    EXPECT_NE(ErrorOf(r).find(says), std::string::npos) << text << ": " << ErrorOf(r);
  }

  Response status = client.Get("/v2/cudasharedmemory/status");
  ASSERT_EQ(status.result_int(), 200);
  EXPECT_EQ(json::parse(status.body()),
            json::parse(R"([{"name":"c1","device_id":1,"byte_size":4096},
                            {"name":"c2","device_id":-3,"byte_size":8}])"));
  Response one = client.Get("/v2/cudasharedmemory/region/c2/status");
  ASSERT_EQ(one.result_int(), 200);
  EXPECT_EQ(json::parse(one.body()).size(), 1u);
  Response unknown = client.Get("/v2/cudasharedmemory/region/c9/status");
  EXPECT_EQ(unknown.result_int(), 404);
  EXPECT_EQ(ErrorOf(unknown), "no CUDA region 'c9'");
  EXPECT_EQ(client.Post("/v2/cudasharedmemory/region/c9/unregister", "").result_int(), 404);
  EXPECT_EQ(client.Post("/v2/cudasharedmemory/region/c1/unregister", "").result_int(), 200);
  EXPECT_EQ(json::parse(client.Get("/v2/cudasharedmemory/status").body()).size(), 1u);
  Response all = client.Post("/v2/cudasharedmemory/unregister", "");
  EXPECT_EQ(all.result_int(), 200);
  EXPECT_EQ(all.body(), "");
  EXPECT_EQ(json::parse(client.Get("/v2/cudasharedmemory/status").body()), json::array());
  EXPECT_EQ(client.Get("/v2/cudasharedmemory/region/c1/register").result_int(), 405);
  EXPECT_EQ(client.Post("/v2/cudasharedmemory/register", "{}").result_int(), 404);
}

// Puts spdlog's level and pattern back as a test found them.
class LogLevelGuard {
 public:
  LogLevelGuard() : level_(spdlog::get_level()) {}
  ~LogLevelGuard() {
    spdlog::set_level(level_);
    LogSettingsUpdate format;
    format.format = "default";
    (void)UpdateLogSettings(format);
  }

 private:
  spdlog::level::level_enum level_;
};

TEST_F(HttpServerTest, LogSettingsAreReadAndChangedLive) {
  LogLevelGuard guard;
  spdlog::set_level(spdlog::level::info);
  Client client(port());
  Response get = client.Get("/v2/logging");
  ASSERT_EQ(get.result_int(), 200) << get.body();
  EXPECT_EQ(json::parse(get.body()), json::parse(R"({"log_file":"","log_info":true,
      "log_warning":true,"log_error":true,"log_verbose_level":0,"log_format":"default"})"));
  // Verbose messages on: spdlog's debug level, and the answer says so.
  Response verbose = client.Post("/v2/logging", R"({"log_verbose_level":1})");
  ASSERT_EQ(verbose.result_int(), 200) << verbose.body();
  EXPECT_EQ(spdlog::get_level(), spdlog::level::debug);
  EXPECT_EQ(json::parse(verbose.body())["log_verbose_level"], 1);
  // Warnings off: info and verbose go with them, errors stay.
  Response quiet = client.Post("/v2/logging", R"({"log_warning":false})");
  ASSERT_EQ(quiet.result_int(), 200) << quiet.body();
  EXPECT_EQ(spdlog::get_level(), spdlog::level::err);
  const json q = json::parse(quiet.body());
  EXPECT_EQ(q["log_info"], false);
  EXPECT_EQ(q["log_verbose_level"], 0);
  EXPECT_EQ(q["log_error"], true);
  EXPECT_EQ(client.Post("/v2/logging", R"({"log_error":false})").result_int(), 200);
  EXPECT_EQ(spdlog::get_level(), spdlog::level::off);
  EXPECT_EQ(client.Post("/v2/logging", R"({"log_info":true})").result_int(), 200);
  EXPECT_EQ(spdlog::get_level(), spdlog::level::info);
  Response iso = client.Post("/v2/logging", R"({"log_format":"ISO8601"})");
  ASSERT_EQ(iso.result_int(), 200) << iso.body();
  EXPECT_EQ(json::parse(client.Get("/v2/logging").body())["log_format"], "ISO8601");
  // Refused whole, each naming what is wrong, and nothing changes.
  const std::pair<const char*, const char*> refused[] = {
      {R"({"log_file":"/tmp/x.log"})", "log_file '/tmp/x.log' cannot be set"},
      {R"({"log_info":true,"log_warning":false})", "log_warning"},
      {R"({"log_format":"json"})", "log_format 'json'"},
      {R"({"log_verbose_level":-1})", "'log_verbose_level' must be an integer"},
      {R"({"log_info":"yes"})", "'log_info' must be a boolean"},
      {R"({"log_colour":true})", "unknown field 'log_colour'"},
      {R"({"log_verbose_level":2,"log_file":"x"})", "log_file"},
  };
  for (const auto& [body, says] : refused) {
    Response r = client.Post("/v2/logging", body);
    EXPECT_EQ(r.result_int(), 400) << body;
    EXPECT_NE(ErrorOf(r).find(says), std::string::npos) << body << ": " << ErrorOf(r);
  }
  EXPECT_EQ(spdlog::get_level(), spdlog::level::info);
  EXPECT_EQ(client.Post("/v2/logging", R"({"log_file":""})").result_int(), 200);
  Response del = client.Send(http::verb::delete_, "/v2/logging");
  EXPECT_EQ(del.result_int(), 405);
  EXPECT_EQ(del[http::field::allow], "GET, POST");
}

TEST_F(HttpServerTest, TraceSettingsSayTracingIsOffAndRefuseTurningItOn) {
  Client client(port());
  const json off = json::parse(R"({"trace_level":["OFF"],"trace_rate":"1000",
      "trace_count":"-1","log_frequency":"0","trace_file":"","trace_mode":"triton"})");
  for (const char* target : {"/v2/trace/setting", "/v2/models/scale/trace/setting"}) {
    Response get = client.Get(target);
    ASSERT_EQ(get.result_int(), 200) << target << ": " << get.body();
    EXPECT_EQ(json::parse(get.body()), off) << target;
    Response on = client.Post(target, R"({"trace_level":["TIMESTAMPS"]})");
    EXPECT_EQ(on.result_int(), 400) << target;
    EXPECT_NE(ErrorOf(on).find("hearth does not trace requests"), std::string::npos) << ErrorOf(on);
    EXPECT_NE(ErrorOf(on).find("TIMESTAMPS"), std::string::npos) << ErrorOf(on);
    Response stays = client.Post(target, R"({"trace_level":["OFF"],"trace_rate":null})");
    EXPECT_EQ(stays.result_int(), 200) << stays.body();
    EXPECT_EQ(json::parse(stays.body()), off);
  }
  EXPECT_NE(ErrorOf(client.Post("/v2/trace/setting", R"({"trace_rate":"5"})")).find("trace_rate"),
            std::string::npos);
  Response unknown_setting = client.Post("/v2/trace/setting", R"({"trace_colour":"red"})");
  EXPECT_EQ(unknown_setting.result_int(), 400);
  EXPECT_NE(ErrorOf(unknown_setting).find("unknown trace setting 'trace_colour'"),
            std::string::npos);
  EXPECT_EQ(client.Post("/v2/trace/setting", R"({"trace_level":7})").result_int(), 400);
  EXPECT_EQ(client.Get("/v2/models/nope/trace/setting").result_int(), 404);
}

TEST_F(HttpServerTest, InferParametersPriorityClassificationAndTheModelsOwn) {
  Client client(port());
  Response r =
      client.Post("/v2/models/scale/infer",
                  R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],
          "parameters":{"priority":2,"temperature":0.5,"tag":"a\"b","flag":true,
                        "stop":["]","\\"],"o":{"k":[1,{"z":"}"}]}},
          "outputs":[{"name":"y","parameters":{"classification":3}}]})");
  ASSERT_EQ(r.result_int(), 200) << r.body();
  const InferRequest last = service_.last_request();
  EXPECT_EQ(last.priority, 2u);
  EXPECT_EQ(
      json::parse(last.parameters_json),
      json::parse(
          R"({"temperature":0.5,"tag":"a\"b","flag":true,"stop":["]","\\"],"o":{"k":[1,{"z":"}"}]}})"));
  ASSERT_EQ(last.outputs.size(), 1u);
  EXPECT_EQ(last.outputs[0].class_count, 3u);
  // Without parameters of its own, the model gets none.
  ASSERT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
  EXPECT_TRUE(service_.last_request().parameters_json.empty());
  EXPECT_EQ(service_.last_request().priority, 0u);
}

TEST_F(HttpServerTest, SequenceAndMalformedInferParametersGet400) {
  Client client(port());
  auto with = [](const std::string& parameters, const std::string& output_parameters = "{}") {
    return R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],"parameters":)" +
           parameters + R"(,"outputs":[{"name":"y","parameters":)" + output_parameters + "}]}";
  };
  const std::pair<std::string, std::string> cases[] = {
      {with(R"({"sequence_id":7})"), "sequence_id"},
      {with(R"({"sequence_id":"s7"})"), "sequence_id"},
      {with(R"({"sequence_start":true})"), "sequence_start"},
      {with(R"({"sequence_end":true})"), "sequence_end"},
      {with(R"({"priority":-1})"), "priority"},
      {with(R"({"priority":"high"})"), "priority"},
      {with("{}", R"({"classification":0})"), "classification"},
      {with("{}", R"({"classification":"3"})"), "classification"},
  };
  for (const auto& [body, named] : cases) {
    Response r = client.Post("/v2/models/scale/infer", body);
    EXPECT_EQ(r.result_int(), 400) << body;
    EXPECT_NE(ErrorOf(r).find(named), std::string::npos) << body << " -> " << ErrorOf(r);
  }
  // Zero and false are "not part of a sequence", as Triton reads them.
  EXPECT_EQ(client
                .Post("/v2/models/scale/infer",
                      with(R"({"sequence_id":0,"sequence_start":false,"sequence_end":false})"))
                .result_int(),
            200);
}

TEST_F(HttpServerTest, HeadIsAnsweredWithTheHeadersOfGetAndNoBody) {
  for (const char* target : {"/v2/health/live", "/v2/models/scale", "/v2/models/stats"}) {
    Client client(port());
    const Response get = client.Get(target);
    ASSERT_EQ(get.result_int(), 200);
    ASSERT_FALSE(get.body().empty() && std::string(target) != "/v2/health/live");
    const std::string raw =
        RawExchange(port(), std::string("HEAD ") + target +
                                " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    const size_t end = raw.find("\r\n\r\n");
    ASSERT_NE(end, std::string::npos) << raw;
    EXPECT_EQ(raw.substr(0, 12), "HTTP/1.1 200") << raw;
    EXPECT_EQ(end + 4, raw.size()) << "a body after the head: " << raw;
    EXPECT_NE(raw.find("Content-Length: " + std::to_string(get.body().size()) + "\r\n"),
              std::string::npos)
        << raw;
  }
  // HEAD on a POST endpoint: 405, still without a body.
  const std::string raw = RawExchange(
      port(), "HEAD /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(raw.substr(0, 12), "HTTP/1.1 405") << raw;
  EXPECT_EQ(raw.find("\r\n\r\n") + 4, raw.size()) << raw;
  // A kept-alive connection serves on after a HEAD.
  Client client(port());
  client.Write(http::verb::head, "/v2/models/scale");
  http::response_parser<http::string_body> parser;
  parser.skip(true);
  beast::flat_buffer buffer;
  http::read(client.socket(), buffer, parser);
  EXPECT_EQ(parser.get().result_int(), 200);
  EXPECT_TRUE(parser.get().body().empty());
  EXPECT_EQ(buffer.size(), 0u);
  Response after = client.Get("/v2/models/scale");
  EXPECT_EQ(after.result_int(), 200);
}

TEST_F(HttpServerTest, SharedMemoryInputsAndOutputsTravelAsReferences) {
  ASSERT_TRUE(service_.RegisterSystemSharedMemory({}, "in", "/hearth_in", 0, 40).ok());
  ASSERT_TRUE(service_.RegisterSystemSharedMemory({}, "out", "/hearth_out", 0, 8).ok());
  Client client(port());
  Response r = client.Post("/v2/models/scale/infer",
                           R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,4],
                     "parameters":{"shared_memory_region":"in","shared_memory_offset":8,
                                   "shared_memory_byte_size":32}}],
          "outputs":[{"name":"y","parameters":{"shared_memory_region":"out",
                                               "shared_memory_byte_size":8}}]})");
  ASSERT_EQ(r.result_int(), 200) << r.body();
  const InferRequest last = service_.last_request();
  ASSERT_EQ(last.inputs.size(), 1u);
  ASSERT_TRUE(last.inputs[0].shm.has_value());
  EXPECT_EQ(last.inputs[0].shm->region, "in");
  EXPECT_EQ(last.inputs[0].shm->offset, 8u);
  EXPECT_EQ(last.inputs[0].shm->byte_size, 32u);
  ASSERT_EQ(last.outputs.size(), 1u);
  ASSERT_TRUE(last.outputs[0].shm.has_value());
  EXPECT_EQ(last.outputs[0].shm->region, "out");
  EXPECT_EQ(last.outputs[0].shm->offset, 0u);
  const json body = json::parse(r.body());
  const json& y = body["outputs"][0];
  EXPECT_EQ(y["name"], "y");
  EXPECT_EQ(y["shape"], json({2, 1}));
  // As Triton answers it: no data and no parameters (Triton's C++ client takes an
  // output with parameters for binary data of binary_data_size bytes).
  EXPECT_FALSE(y.contains("data"));
  EXPECT_FALSE(y.contains("parameters")) << y.dump();
}

TEST_F(HttpServerTest, SharedMemoryParametersAreCheckedBeforeAnythingIsRead) {
  Client client(port());
  auto input = [](const std::string& rest) {
    return R"({"inputs":[{"name":"x","datatype":"FP32","shape":[2,4])" + rest + "}]}";
  };
  const std::pair<std::string, std::string> cases[] = {
      {input(R"(,"parameters":{"shared_memory_region":"in","shared_memory_byte_size":31})"),
       "shared_memory_byte_size is 31 but shape [2,4] of FP32 needs 32"},
      {input(R"(,"parameters":{"shared_memory_region":"in"})"), "shared_memory_byte_size"},
      {input(R"(,"parameters":{"shared_memory_offset":0,"shared_memory_byte_size":32})"),
       "need 'shared_memory_region'"},
      {input(R"(,"parameters":{"shared_memory_region":7,"shared_memory_byte_size":32})"),
       "'shared_memory_region' must be a string"},
      {input(R"(,"parameters":{"shared_memory_region":"in","shared_memory_byte_size":-32})"),
       "'shared_memory_byte_size' must be a non-negative integer"},
      {input(R"(,"data":[1,2,3,4,5,6,7,8],"parameters":{"shared_memory_region":"in",
                "shared_memory_byte_size":32})"),
       "give it once"},
      {R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}],
           "outputs":[{"name":"y","parameters":{"shared_memory_offset":4}}]})",
       "need 'shared_memory_region'"},
  };
  for (const auto& [body, named] : cases) {
    Response r = client.Post("/v2/models/scale/infer", body);
    EXPECT_EQ(r.result_int(), 400) << body;
    EXPECT_NE(ErrorOf(r).find(named), std::string::npos) << body << " -> " << ErrorOf(r);
  }
}

// zlib's own compress and inflate, independent of the server's code:
// windowBits 31 is gzip, 15 zlib ("deflate").
std::string Zip(const std::string& data, int window_bits) {
  z_stream s{};
  EXPECT_EQ(deflateInit2(&s, 6, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&s, data.size()), '\0');
  s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  s.avail_in = static_cast<uInt>(data.size());
  s.next_out = reinterpret_cast<Bytef*>(out.data());
  s.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&s, Z_FINISH), Z_STREAM_END);
  out.resize(out.size() - s.avail_out);
  deflateEnd(&s);
  return out;
}
std::string Unzip(const std::string& data, int window_bits) {
  z_stream s{};
  EXPECT_EQ(inflateInit2(&s, window_bits), Z_OK);
  std::string out;
  char chunk[4096];
  s.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  s.avail_in = static_cast<uInt>(data.size());
  int rc = Z_OK;
  while (rc == Z_OK) {
    s.next_out = reinterpret_cast<Bytef*>(chunk);
    s.avail_out = sizeof(chunk);
    rc = inflate(&s, Z_NO_FLUSH);
    out.append(chunk, sizeof(chunk) - s.avail_out);
  }
  EXPECT_EQ(rc, Z_STREAM_END);
  inflateEnd(&s);
  return out;
}

TEST_F(HttpServerTest, GzipAndDeflateRequestBodiesAreInflated) {
  Client client(port());
  for (const auto& [coding, bits] : {std::pair<std::string, int>{"gzip", 31}, {"deflate", 15}}) {
    Response r =
        client.Post("/v2/models/scale/infer", Zip(kTwoRows, bits), {{"Content-Encoding", coding}});
    ASSERT_EQ(r.result_int(), 200) << coding << " " << r.body();
    EXPECT_EQ(json::parse(r.body())["outputs"][0]["data"], json({10.0, 26.5})) << coding;
  }
  // Binary data after the JSON, compressed together.
  const std::string header =
      R"({"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"parameters":{"binary_data_size":16}}]})";
  const float x[4] = {1, 2, 3, 4.5f};
  std::string body = header;
  body.append(reinterpret_cast<const char*>(x), sizeof(x));
  Response binary =
      client.Post("/v2/models/scale/infer", Zip(body, 31),
                  {{"Content-Encoding", "gzip"},
                   {"Inference-Header-Content-Length", std::to_string(header.size())}});
  ASSERT_EQ(binary.result_int(), 200) << binary.body();
  EXPECT_EQ(json::parse(binary.body())["outputs"][0]["data"], json({10.5}));
}

TEST_F(HttpServerTest, BadCompressedBodiesGetAClearErrorAndTheServerServesOn) {
  std::string zipped = Zip(kTwoRows, 31);
  const std::pair<std::string, std::pair<std::string, std::string>> cases[] = {
      {"not gzip at all", {"gzip", "400"}},
      {zipped.substr(0, zipped.size() / 2), {"gzip", "400"}},
      {zipped + "trailing", {"gzip", "400"}},
      {kTwoRows, {"br", "415"}},
  };
  for (const auto& [body, expect] : cases) {
    const std::string raw = RawExchange(
        port(),
        "POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: " + expect.first +
            "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body);
    EXPECT_EQ(raw.substr(0, 12), "HTTP/1.1 " + expect.second) << raw;
    EXPECT_NE(raw.find(expect.first), std::string::npos) << raw;
  }
  Client client(port());
  EXPECT_EQ(client.Post("/v2/models/scale/infer", kTwoRows).result_int(), 200);
}

TEST_F(HttpServerTest, ResponsesAreCompressedWhenTheClientAcceptsIt) {
  Client client(port());
  Response plain = client.Get("/v2/models/stats");
  ASSERT_EQ(plain.result_int(), 200);
  ASSERT_GE(plain.body().size(), 1024u);
  EXPECT_EQ(plain.count(http::field::content_encoding), 0u);
  for (const auto& [accept, coding, bits] :
       {std::tuple<std::string, std::string, int>{"gzip", "gzip", 31},
        {"deflate, gzip;q=0", "deflate", 15},
        {"br;q=1.0, deflate;q=0.5", "deflate", 15}}) {
    client.Write(http::verb::get, "/v2/models/stats", "", {{"Accept-Encoding", accept}});
    Response r = client.Read();
    ASSERT_EQ(r.result_int(), 200);
    EXPECT_EQ(r[http::field::content_encoding], coding) << accept;
    EXPECT_EQ(Unzip(r.body(), bits), plain.body()) << accept;
  }
  // Refused by q=0, or too small to gain anything: as it is.
  client.Write(http::verb::get, "/v2/models/stats", "", {{"Accept-Encoding", "gzip;q=0"}});
  EXPECT_EQ(client.Read().count(http::field::content_encoding), 0u);
  client.Write(http::verb::get, "/v2/models/scale", "", {{"Accept-Encoding", "gzip"}});
  EXPECT_EQ(client.Read().count(http::field::content_encoding), 0u);
}

TEST_F(SmallServerTest, ABodyThatInflatesPastTheLimitGets413) {
  const std::string zipped = Zip(std::string(4096, ' '), 31);
  ASSERT_LT(zipped.size(), 1024u);
  const std::string raw =
      RawExchange(port(),
                  "POST /v2/models/scale/infer HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                  "Content-Length: " +
                      std::to_string(zipped.size()) + "\r\n\r\n" + zipped);
  EXPECT_EQ(raw.substr(0, 12), "HTTP/1.1 413") << raw;
  EXPECT_NE(raw.find("inflates past the limit of 1024 bytes"), std::string::npos) << raw;
  Client client(port());
  EXPECT_EQ(client.Post("/v2/models/scale/infer", Zip(kTwoRows, 31), {{"Content-Encoding", "gzip"}})
                .result_int(),
            200);
}

}  // namespace
}  // namespace hearth
