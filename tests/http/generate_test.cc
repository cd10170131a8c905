// The generate extension and the OpenAI-compatible endpoints over real TCP:
// a fake service whose decoupled models stream their responses, with
// outputs borrowed from a buffer that is spoiled as soon as on_response
// returns, as the server's are. Tests wait on the fake's events or poll a
// condition with a deadline; none depends on how long anything takes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/bytes_tensor.h"
#include "http/http_server.h"
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
using testing::Fails;
using testing::FakeModel;
using testing::FakeService;
using testing::FakeSettings;
using testing::MakeModel;
using testing::ResponseTo;
using testing::Seen;
using testing::TensorOf;

std::vector<std::byte> BytesOf(const std::vector<std::string>& elements) {
  std::vector<std::byte> out;
  for (const std::string& element : elements) {
    EXPECT_TRUE(AppendBytesElement(out, element, "test").ok());
  }
  return out;
}

std::string FirstElement(const InferTensor& tensor) {
  for (std::string_view element : BytesElements(tensor.data.bytes())) return std::string(element);
  return "";
}

template <typename T>
std::vector<T> Values(const InferTensor& tensor) {
  std::vector<T> out(tensor.data.size() / sizeof(T));
  std::memcpy(out.data(), tensor.data.data(), out.size() * sizeof(T));
  return out;
}

// Models (only version "1" of each):
//   "gen"    decoupled, batching, on a thread of its own: text_input BYTES
//            [-1,1] -> text_output BYTES, prompt_tokens / completion_tokens
//            INT64 (running counts), finish_reason BYTES. It streams
//            max_tokens (default 4) pieces "tok0 ", "tok1 ", ... The prompt
//            picks other behaviours: "fail" (two pieces, then an error),
//            "wait" (one piece, then it parks until cancelled, then tries
//            one more), "big" (64 KiB pieces until on_response refuses one),
//            "gated" (one piece, then the rest once the test opens the gate),
//            "short" (two pieces), "stop" (max_tokens pieces, then a final
//            response with finish_reason "stop").
//   "chat"   decoupled: messages BYTES [-1,1] -> text_output: "you said: "
//            then the messages' text.
//   "plain"  not decoupled, no batching: text_input BYTES [1] -> text_output
//            "echo: " + the prompt.
//   "typed"  not decoupled, no batching: text_input BYTES [1], n INT32 [1],
//            scale FP32 [-1], flag BOOL [1] -> text_output (the text n
//            times), sum FP32 [1], flags BOOL [1], list INT64 [3].
//   "vision" x FP32 [-1,4] -> y FP32 [-1,1]: no text at all.
//   "unready" as "gen", not ready, and Infer fails Unavailable.
// The fake lends each response's outputs, spoiled once on_response returns.

// gen and chat: pieces through on_response, or joined in one answer when
// the request is not streamed.
Result<InferResponse> Generate(FakeService& fake, InferRequest& request) {
  const std::string prompt = request.inputs.empty() ? "" : FirstElement(request.inputs[0]);
  int max_tokens = 4;
  if (!request.parameters_json.empty()) {
    const json parameters = json::parse(request.parameters_json, nullptr, false);
    if (parameters.is_object() && parameters.contains("max_tokens")) {
      max_tokens = parameters["max_tokens"].get<int>();
    }
  }
  const bool counts_tokens = request.model == "gen";  // "chat" gives no counts
  std::string joined;
  int64_t completion_tokens = 0;
  auto counts = [&](InferResponse& response) {
    response.outputs.push_back(
        TensorOf<int64_t>("completion_tokens", DType::kI64, {1, 1}, {completion_tokens}));
    response.outputs.push_back(TensorOf<int64_t>("prompt_tokens", DType::kI64, {1, 1}, {2}));
  };
  auto emit = [&](const std::string& piece) {
    ++completion_tokens;
    if (!request.on_response) {
      joined += piece;
      return true;
    }
    InferResponse response = ResponseTo(request);
    response.outputs.push_back({"text_output", DType::kBytes, {1, 1}, BytesOf({piece})});
    if (counts_tokens) counts(response);
    return request.on_response(response);
  };
  auto last = [&](std::optional<std::string> finish_reason = std::nullopt) {
    InferResponse response = ResponseTo(request);
    if (!request.on_response) {
      response.outputs.push_back({"text_output", DType::kBytes, {1, 1}, BytesOf({joined})});
      if (counts_tokens) counts(response);
    }
    if (finish_reason.has_value()) {
      response.outputs.push_back(
          {"finish_reason", DType::kBytes, {1, 1}, BytesOf({*finish_reason})});
    }
    return response;
  };

  if (request.model == "chat") {
    emit("you said: ");
    emit(prompt);
    return last();
  }
  if (prompt == "fail") {
    emit("tok0 ");
    emit("tok1 ");
    return Internal("the worker died");
  }
  if (prompt == "wait") {
    emit("tok0 ");
    fake.AwaitCancel(request);
    emit("tok1 ");
    return Unavailable("the request was cancelled");
  }
  if (prompt == "big") {
    const std::string chunk(64 * 1024, 'b');
    for (int i = 0; i < 1000 && emit(std::to_string(i) + ":" + chunk); ++i) {
    }
    return last();
  }
  if (prompt == "gated") {
    emit("tok0 ");
    fake.AwaitGate();
    for (int i = 1; i < max_tokens; ++i) emit("tok" + std::to_string(i) + " ");
    return last();
  }
  const int pieces = prompt == "short" ? 2 : max_tokens;
  for (int i = 0; i < pieces; ++i) emit("tok" + std::to_string(i) + " ");
  return last(prompt == "stop" ? std::optional<std::string>("stop") : std::nullopt);
}

Result<InferResponse> Plain(FakeService&, InferRequest& request) {
  InferResponse response = ResponseTo(request);
  response.outputs.push_back({"text_output",
                              DType::kBytes,
                              {1},
                              BytesOf({"echo: " + FirstElement(request.inputs.at(0))})});
  return response;
}

Result<InferResponse> Typed(FakeService&, InferRequest& request) {
  std::map<std::string, const InferTensor*> in;
  for (const InferTensor& input : request.inputs) in[input.name] = &input;
  const int32_t n = Values<int32_t>(*in["n"]).at(0);
  std::string text;
  for (int32_t i = 0; i < n; ++i) text += FirstElement(*in["text_input"]);
  float sum = 0;
  for (float v : Values<float>(*in["scale"])) sum += v;
  InferResponse response = ResponseTo(request);
  response.outputs.push_back({"text_output", DType::kBytes, {1}, BytesOf({text})});
  response.outputs.push_back(TensorOf<float>("sum", DType::kF32, {1}, {sum}));
  response.outputs.push_back({"flags", DType::kBool, {1}, in["flag"]->data});
  response.outputs.push_back(TensorOf<int64_t>("list", DType::kI64, {3}, {1, 2, 3}));
  return response;
}

std::vector<FakeModel> Models() {
  const std::vector<TensorMetadata> gen_outputs = {{"text_output", DType::kBytes, {-1, 1}},
                                                   {"prompt_tokens", DType::kI64, {-1, 1}},
                                                   {"completion_tokens", DType::kI64, {-1, 1}},
                                                   {"finish_reason", DType::kBytes, {-1, 1}}};
  const TensorMetadata text_input = {"text_input", DType::kBytes, {-1, 1}};
  std::vector<FakeModel> models = {
      MakeModel("gen", "hearth_python", 8, {text_input}, gen_outputs, Generate),
      MakeModel("unready", "hearth_python", 8, {text_input}, gen_outputs,
                Fails(Unavailable("model 'unready' has no worker ready"))),
      MakeModel("chat", "hearth_python", 8, {{"messages", DType::kBytes, {-1, 1}}},
                {{"text_output", DType::kBytes, {-1, 1}}}, Generate)};
  for (FakeModel& model : models) model.metadata.decoupled = true;
  models[0].own_thread = true;
  models[1].ready = false;
  models.push_back(MakeModel("plain", "hearth_python", 0, {{"text_input", DType::kBytes, {1}}},
                             {{"text_output", DType::kBytes, {1}}}, Plain));
  models.push_back(MakeModel("typed", "hearth_python", 0,
                             {{"text_input", DType::kBytes, {1}},
                              {"n", DType::kI32, {1}},
                              {"scale", DType::kF32, {-1}},
                              {"flag", DType::kBool, {1}}},
                             {{"text_output", DType::kBytes, {1}},
                              {"sum", DType::kF32, {1}},
                              {"flags", DType::kBool, {1}},
                              {"list", DType::kI64, {3}}},
                             Typed));
  models.push_back(MakeModel("vision", "hearth_python", 8, {{"x", DType::kF32, {-1, 4}}},
                             {{"y", DType::kF32, {-1, 1}}}));
  return models;
}

FakeSettings Settings() {
  FakeSettings settings;
  settings.extensions = {"generate"};
  return settings;
}

std::string Request(const std::string& method, const std::string& target, const std::string& body,
                    const std::string& version = "HTTP/1.1") {
  return method + " " + target + " " + version +
         "\r\nHost: x\r\nContent-Type: application/json\r\n" +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

using Message = http::response<http::string_body>;

// One connection; responses read one at a time, events one at a time.
class Connection {
 public:
  explicit Connection(uint16_t port, int receive_buffer = 0) : socket_(io_) {
    socket_.open(tcp::v4());
    if (receive_buffer > 0) {
      socket_.set_option(net::socket_base::receive_buffer_size(receive_buffer));
    }
    socket_.connect(tcp::endpoint(net::ip::address_v4::loopback(), port));
    timeval tv{};
    tv.tv_sec = 60;
    EXPECT_EQ(setsockopt(socket_.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
    Reset();
  }

  void Send(const std::string& bytes) { net::write(socket_, net::buffer(bytes)); }
  void Post(const std::string& target, const std::string& body) {
    Send(Request("POST", target, body));
  }

  // The head of the next response; false if the connection ended first.
  bool ReadHead() {
    beast::error_code ec;
    http::read_header(socket_, buffer_, *parser_, ec);
    EXPECT_FALSE(ec) << "reading a head: " << ec.message();
    return !ec;
  }
  const Message& message() const { return parser_->get(); }

  // A whole response, for those that are not streams.
  Message ReadResponse() {
    beast::error_code ec;
    http::read(socket_, buffer_, *parser_, ec);
    EXPECT_FALSE(ec) << "reading a response: " << ec.message();
    Message out = parser_->release();
    Reset();
    return out;
  }

  // The data of the next event; nullopt once the body ends or the
  // connection does (complete() tells which).
  std::optional<std::string> NextEvent() {
    for (;;) {
      const std::string& body = parser_->get().body();
      const size_t end = body.find("\n\n", position_);
      if (end != std::string::npos) {
        std::string event = body.substr(position_, end - position_);
        position_ = end + 2;
        EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
        return event.substr(std::min<size_t>(6, event.size()));
      }
      if (parser_->is_done()) {
        EXPECT_EQ(position_, body.size()) << "bytes after the last event";
        return std::nullopt;
      }
      beast::error_code ec;
      http::read_some(socket_, buffer_, *parser_, ec);
      if (ec) {
        error_ = ec;
        return std::nullopt;
      }
    }
  }
  std::vector<std::string> RestOfEvents() {
    std::vector<std::string> events;
    while (std::optional<std::string> event = NextEvent()) events.push_back(std::move(*event));
    return events;
  }
  // The body ended as HTTP says it ends (the last chunk).
  bool complete() const { return parser_->is_done(); }
  beast::error_code error() const { return error_; }

  // Ready for the next response on this connection.
  void Reset() {
    parser_.emplace();
    parser_->body_limit(std::numeric_limits<uint64_t>::max());
    position_ = 0;
  }

  // Reads until the server closes the connection: true for EOF or a reset.
  bool ReadsToClose() {
    char chunk[4096];
    for (;;) {
      beast::error_code ec;
      socket_.read_some(net::buffer(chunk), ec);
      if (ec == net::error::eof || ec == net::error::connection_reset) return true;
      if (ec) return false;
    }
  }

  tcp::socket& socket() { return socket_; }

 private:
  net::io_context io_;
  tcp::socket socket_;
  beast::flat_buffer buffer_;
  std::optional<http::response_parser<http::string_body>> parser_;
  size_t position_ = 0;
  beast::error_code error_;
};

json Parse(const std::string& text) {
  json value = json::parse(text, nullptr, false);
  EXPECT_FALSE(value.is_discarded()) << text;
  return value;
}

class GenerateTest : public ::testing::Test {
 protected:
  void StartServer(HttpOptions options = {}) {
    options.port = 0;
    Result<std::unique_ptr<HttpServer>> created = HttpServer::Create(&service_, options);
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    server_ = std::move(created).value();
    ASSERT_TRUE(server_->Start().ok());
  }
  void SetUp() override { StartServer(); }
  void TearDown() override {
    service_.OpenGate();
    if (server_) server_->Stop();
  }
  uint16_t port() const { return server_->port(); }

  // The whole answer to one request on a new connection.
  Message Exchange(const std::string& method, const std::string& target,
                   const std::string& body = "") {
    Connection connection(port());
    connection.Send(Request(method, target, body));
    return connection.ReadResponse();
  }
  // The error message of a KServe-style error.
  static std::string ErrorOf(const Message& message) {
    const json body = json::parse(message.body(), nullptr, false);
    if (!body.is_object() || !body.contains("error") || !body["error"].is_string()) return "<none>";
    return body["error"].get<std::string>();
  }

  FakeService service_{Settings(), Models()};
  std::unique_ptr<HttpServer> server_;
};

void ExpectEventStreamHead(const Message& head) {
  EXPECT_EQ(head.result_int(), 200);
  EXPECT_EQ(head[http::field::content_type], "text/event-stream");
  EXPECT_EQ(head[http::field::cache_control], "no-cache");
  EXPECT_TRUE(head.chunked());
}

// ---- the generate extension --------------------------------------------------

TEST_F(GenerateTest, GenerateStreamSendsOneEventPerResponseInOrder) {
  Connection connection(port());
  connection.Post("/v2/models/gen/generate_stream",
                  R"({"id":"g1","text_input":"hello","parameters":{"max_tokens":5}})");
  ASSERT_TRUE(connection.ReadHead());
  ExpectEventStreamHead(connection.message());
  for (int i = 0; i < 5; ++i) {
    std::optional<std::string> event = connection.NextEvent();
    ASSERT_TRUE(event.has_value()) << i;
    const json j = Parse(*event);
    EXPECT_EQ(j["model_name"], "gen");
    EXPECT_EQ(j["model_version"], "1");
    EXPECT_EQ(j["id"], "g1");
    EXPECT_EQ(j["text_output"], "tok" + std::to_string(i) + " ");  // borrowed, spoiled after
    EXPECT_EQ(j["completion_tokens"], i + 1);
    EXPECT_EQ(j["prompt_tokens"], 2);
    EXPECT_EQ(j.size(), 6u) << *event;
  }
  EXPECT_EQ(connection.NextEvent(), std::nullopt);  // the final response had no outputs
  EXPECT_TRUE(connection.complete());
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->streamed);
  EXPECT_EQ(seen->parameters_json, R"({"max_tokens":5})");
  ASSERT_EQ(seen->inputs.size(), 1u);
  EXPECT_EQ(seen->inputs[0].shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(FirstElement(seen->inputs[0]), "hello");
  // The connection serves on after the stream.
  connection.Reset();
  connection.Send(Request("GET", "/v2/health/live", ""));
  EXPECT_EQ(connection.ReadResponse().result_int(), 200);
  EXPECT_TRUE(Eventually([&] { return server_->stats().streams == 0; }));
}

TEST_F(GenerateTest, ConcurrentStreamsEachKeepTheirOrder) {
  constexpr int kStreams = 8;
  std::vector<std::unique_ptr<Connection>> connections;
  for (int s = 0; s < kStreams; ++s) {
    connections.push_back(std::make_unique<Connection>(port()));
    connections.back()->Post(
        "/v2/models/gen/generate_stream",
        R"({"id":")" + std::to_string(s) + R"(","text_input":"x","parameters":{"max_tokens":20}})");
  }
  for (int s = 0; s < kStreams; ++s) {
    Connection& connection = *connections[s];
    ASSERT_TRUE(connection.ReadHead());
    const std::vector<std::string> events = connection.RestOfEvents();
    ASSERT_EQ(events.size(), 20u);
    for (int i = 0; i < 20; ++i) {
      const json j = Parse(events[i]);
      EXPECT_EQ(j["id"], std::to_string(s));
      EXPECT_EQ(j["text_output"], "tok" + std::to_string(i) + " ");
    }
    EXPECT_TRUE(connection.complete());
  }
}

// Reads raw bytes until the chunked body's end, then checks the framing by
// hand: a valid chunk each time, each holding whole events.
TEST_F(GenerateTest, StreamFramingIsChunkedWithWholeEventsAndHttp10IsNot) {
  Connection connection(port());
  connection.Send(Request("POST", "/v2/models/gen/generate_stream",
                          R"({"text_input":"hi","parameters":{"max_tokens":3}})"));
  std::string raw;
  char chunk[4096];
  while (raw.find("\r\n0\r\n\r\n") == std::string::npos) {
    beast::error_code ec;
    const size_t n = connection.socket().read_some(net::buffer(chunk), ec);
    ASSERT_FALSE(ec) << ec.message() << " after " << raw;
    raw.append(chunk, n);
  }
  const size_t head_end = raw.find("\r\n\r\n");
  ASSERT_NE(head_end, std::string::npos);
  const std::string head = raw.substr(0, head_end + 2);
  EXPECT_EQ(head.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << head;
  EXPECT_NE(head.find("\r\nContent-Type: text/event-stream\r\n"), std::string::npos) << head;
  EXPECT_NE(head.find("\r\nCache-Control: no-cache\r\n"), std::string::npos) << head;
  EXPECT_NE(head.find("\r\nTransfer-Encoding: chunked\r\n"), std::string::npos) << head;
  EXPECT_EQ(head.find("Content-Length"), std::string::npos) << head;
  size_t at = head_end + 4;
  std::vector<std::string> events;
  for (;;) {
    const size_t line_end = raw.find("\r\n", at);
    ASSERT_NE(line_end, std::string::npos);
    const size_t size = std::stoul(raw.substr(at, line_end - at), nullptr, 16);
    at = line_end + 2;
    if (size == 0) {
      EXPECT_EQ(raw.substr(at), "\r\n");
      break;
    }
    const std::string data = raw.substr(at, size);
    at += size;
    ASSERT_EQ(raw.substr(at, 2), "\r\n");
    at += 2;
    // Whole events only: "data: {...}\n\n", one or more.
    ASSERT_GE(data.size(), 8u);
    EXPECT_EQ(data.rfind("data: ", 0), 0u) << data;
    EXPECT_EQ(data.substr(data.size() - 2), "\n\n") << data;
    size_t from = 0;
    while (from < data.size()) {
      const size_t end = data.find("\n\n", from);
      ASSERT_NE(end, std::string::npos);
      events.push_back(data.substr(from, end - from));
      from = end + 2;
    }
  }
  ASSERT_EQ(events.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Parse(events[i].substr(6))["text_output"], "tok" + std::to_string(i) + " ");
  }

  // HTTP/1.0 knows no chunks: the events as they are, and the connection closes.
  Connection old(port());
  old.Send(Request("POST", "/v2/models/gen/generate_stream",
                   R"({"text_input":"hi","parameters":{"max_tokens":2}})", "HTTP/1.0"));
  std::string all;
  for (;;) {
    beast::error_code ec;
    const size_t n = old.socket().read_some(net::buffer(chunk), ec);
    all.append(chunk, n);
    if (ec == net::error::eof) break;
    ASSERT_FALSE(ec) << ec.message();
  }
  EXPECT_EQ(all.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << all;
  EXPECT_NE(all.find("\r\nConnection: close\r\n"), std::string::npos) << all;
  EXPECT_EQ(all.find("Transfer-Encoding"), std::string::npos) << all;
  const std::string body = all.substr(all.find("\r\n\r\n") + 4);
  EXPECT_EQ(body.rfind("data: {", 0), 0u) << body;
  EXPECT_NE(body.find(R"("text_output":"tok1 ")"), std::string::npos) << body;
  EXPECT_EQ(body.substr(body.size() - 2), "\n\n");
}

TEST_F(GenerateTest, PipelinedRequestsAfterAStreamAreAnsweredInOrder) {
  Connection connection(port());
  connection.Send(Request("POST", "/v2/models/gen/generate_stream",
                          R"({"text_input":"a","parameters":{"max_tokens":3}})") +
                  Request("POST", "/v2/models/plain/generate", R"({"text_input":"b"})"));
  ASSERT_TRUE(connection.ReadHead());
  EXPECT_EQ(connection.RestOfEvents().size(), 3u);
  EXPECT_TRUE(connection.complete());
  connection.Reset();
  const Message second = connection.ReadResponse();
  EXPECT_EQ(second.result_int(), 200);
  EXPECT_EQ(Parse(second.body())["text_output"], "echo: b");
}

TEST_F(GenerateTest, GenerateAnswersOnceWithTheServiceJoiningAStreamsPieces) {
  for (const char* target : {"/v2/models/gen/generate", "/v2/models/gen/versions/1/generate"}) {
    const Message response = Exchange(
        "POST", target, R"({"id":"j","text_input":"hello","parameters":{"max_tokens":3}})");
    ASSERT_EQ(response.result_int(), 200) << response.body();
    EXPECT_EQ(response[http::field::content_type], "application/json");
    EXPECT_EQ(Parse(response.body()), json::parse(R"({"model_name":"gen","model_version":"1",
      "id":"j","text_output":"tok0 tok1 tok2 ","completion_tokens":3,"prompt_tokens":2})"));
  }
  std::optional<Seen> seen = service_.WaitFinished(2);
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(seen->streamed);  // the service joins the pieces
}

TEST_F(GenerateTest, GenerateMapsKeysToInputsOfTheirDatatypes) {
  const std::string parameters = R"({ "temperature" : 0.5, "nested": {"stop": ["\n", "é"]},
    "custom": true })";
  const Message response =
      Exchange("POST", "/v2/models/typed/generate",
               R"({"text_input":"ab","n":3,"scale":[1.5,2.5,-1],"flag":true,"parameters":)" +
                   parameters + "}");
  ASSERT_EQ(response.result_int(), 200) << response.body();
  EXPECT_EQ(Parse(response.body()), json::parse(R"({"model_name":"typed","model_version":"1",
    "text_output":"ababab","sum":3.0,"flags":true,"list":[1,2,3]})"));
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->parameters_json, parameters);  // its text exactly as sent
  std::map<std::string, const InferTensor*> in;
  for (const InferTensor& input : seen->inputs) in[input.name] = &input;
  ASSERT_EQ(in.size(), 4u);
  EXPECT_EQ(in["text_input"]->shape, (std::vector<int64_t>{1}));
  EXPECT_EQ(FirstElement(*in["text_input"]), "ab");
  EXPECT_EQ(in["n"]->dtype, DType::kI32);
  EXPECT_EQ(Values<int32_t>(*in["n"]), (std::vector<int32_t>{3}));
  EXPECT_EQ(in["scale"]->shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(Values<float>(*in["scale"]), (std::vector<float>{1.5f, 2.5f, -1}));
  EXPECT_EQ(in["flag"]->data.size(), 1u);
  EXPECT_EQ(in["flag"]->data.bytes()[0], std::byte{1});
}

TEST_F(GenerateTest, GenerateErrorsNameWhatIsWrongAndTheServerServesOn) {
  struct Case {
    const char* target;
    std::string body;
    int status;
    const char* says;
  };
  const Case cases[] = {
      {"/v2/models/nope/generate", R"({"text_input":"x"})", 404, "no model 'nope'"},
      {"/v2/models/gen/versions/9/generate_stream", R"({"text_input":"x"})", 404, "version '9'"},
      {"/v2/models/gen/generate", R"({"parameters":{}})", 400, R"(missing input "text_input")"},
      {"/v2/models/gen/generate", R"({"text_input":"x","txt":"y"})", 400, R"(unknown input "txt")"},
      {"/v2/models/typed/generate", R"({"text_input":"x","n":"three","scale":[1],"flag":true})",
       400, R"(input "n" is INT32: expected an integer)"},
      {"/v2/models/typed/generate", R"({"text_input":"x","n":1.5,"scale":[1],"flag":true})", 400,
       R"(input "n" is INT32: expected an integer)"},
      {"/v2/models/typed/generate", R"({"text_input":"x","n":3000000000,"scale":[1],"flag":true})",
       400, "out of the range"},
      {"/v2/models/typed/generate", R"({"text_input":"x","n":1,"scale":[[1]],"flag":true})", 400,
       R"(input "scale": a list of values has one dimension)"},
      {"/v2/models/typed/generate", R"({"text_input":7,"n":1,"scale":[1],"flag":true})", 400,
       R"(input "text_input" is BYTES: expected a string)"},
      {"/v2/models/gen/generate", R"({"text_input":"x","parameters":[1]})", 400,
       "'parameters' must be an object"},
      {"/v2/models/gen/generate", R"({"text_input":"x","id":5})", 400, "'id' must be a string"},
      {"/v2/models/gen/generate", R"({"text_input": "x",)", 400, "invalid JSON in the request"},
      {"/v2/models/gen/generate", R"(["text_input"])", 400, "must be a JSON object"},
      {"/v2/models/gen/generate", "{\"text_input\":\"\xff\xfe\"}", 400,
       "invalid JSON in the request"},
      {"/v2/models/gen/generate", R"({"text_input":"\ud800"})", 400, "invalid JSON in the request"},
      {"/v2/models/gen/generate", R"({"text_input":"x","text_input":"y"})", 400,
       R"(the key "text_input" twice)"},
      {"/v2/models/gen/generate",
       R"({"text_input":"x","parameters":)" + std::string(100, '[') + std::string(100, ']') + "}",
       400, "nests deeper than 64"},
  };
  for (const Case& c : cases) {
    const Message response = Exchange("POST", c.target, c.body);
    EXPECT_EQ(response.result_int(), c.status) << c.target << " " << c.body;
    EXPECT_NE(ErrorOf(response).find(c.says), std::string::npos)
        << c.body << " -> " << response.body();
  }
  EXPECT_EQ(Exchange("GET", "/v2/models/gen/generate").result_int(), 405);
  const Message ok = Exchange("POST", "/v2/models/plain/generate", R"({"text_input":"ok"})");
  EXPECT_EQ(ok.result_int(), 200);
  EXPECT_EQ(Parse(ok.body())["text_output"], "echo: ok");
}

TEST_F(GenerateTest, GenerateStreamOfAModelThatIsNotDecoupledIsOneEvent) {
  Connection connection(port());
  connection.Post("/v2/models/plain/generate_stream", R"({"id":"p","text_input":"once"})");
  ASSERT_TRUE(connection.ReadHead());
  ExpectEventStreamHead(connection.message());
  const std::vector<std::string> events = connection.RestOfEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(Parse(events[0]), json::parse(R"({"model_name":"plain","model_version":"1",
    "id":"p","text_output":"echo: once"})"));
  EXPECT_TRUE(connection.complete());
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(seen->streamed);
}

TEST_F(GenerateTest, AStreamThatBreaksEndsWithAnErrorEvent) {
  Connection connection(port());
  connection.Post("/v2/models/gen/generate_stream", R"({"text_input":"fail"})");
  ASSERT_TRUE(connection.ReadHead());
  const std::vector<std::string> events = connection.RestOfEvents();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(Parse(events[0])["text_output"], "tok0 ");
  EXPECT_EQ(Parse(events[1])["text_output"], "tok1 ");
  EXPECT_EQ(Parse(events[2]), json::parse(R"({"error":"the worker died"})"));
  EXPECT_TRUE(connection.complete());  // the body still ends as HTTP says
  // A failure before any response is a plain error response.
  connection.Reset();
  connection.Post("/v2/models/unready/generate_stream", R"({"text_input":"x"})");
  const Message unready = connection.ReadResponse();
  EXPECT_EQ(unready.result_int(), 503);
  EXPECT_EQ(ErrorOf(unready), "model 'unready' has no worker ready");
}

// ---- OpenAI ------------------------------------------------------------------

json OpenAiError(const Message& message) {
  const json body = Parse(message.body());
  EXPECT_TRUE(body.is_object() && body.contains("error") && body["error"].is_object())
      << message.body();
  if (!body.is_object() || !body.contains("error")) return json::object();
  const json& error = body["error"];
  EXPECT_EQ(error.size(), 4u) << error;
  EXPECT_TRUE(error["message"].is_string()) << error;
  EXPECT_TRUE(error["type"].is_string()) << error;
  return error;
}

TEST_F(GenerateTest, CompletionsAnswerFieldByField) {
  const std::string body = R"({"model":"gen","prompt":"hello","max_tokens":3,"temperature":0.5,
    "top_p":0.9,"stop":["\n","END"],"seed":7,"n":1,"user":"someone","logit_bias":{},
    "stream":false,"presence_penalty":null})";
  const Message response = Exchange("POST", "/v1/completions", body);
  ASSERT_EQ(response.result_int(), 200) << response.body();
  EXPECT_EQ(response[http::field::content_type], "application/json");
  const json j = Parse(response.body());
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u) << j;
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_GT(j["created"].get<int64_t>(), 1'700'000'000);
  EXPECT_EQ(j["model"], "gen");
  EXPECT_EQ(j["choices"], json::parse(R"([{"index":0,"text":"tok0 tok1 tok2 ",
    "finish_reason":"length","logprobs":null}])"));
  EXPECT_EQ(j["usage"],
            json::parse(R"({"prompt_tokens":2,"completion_tokens":3,"total_tokens":5})"));
  EXPECT_EQ(j.size(), 6u) << j;
  std::optional<Seen> seen =
      service_.WaitSeen([&](const Seen& s) { return s.id == j["id"].get<std::string>(); });
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(seen->streamed);
  EXPECT_EQ(Parse(seen->parameters_json), json::parse(R"({"max_tokens":3,"temperature":0.5,
    "top_p":0.9,"stop":["\n","END"],"seed":7})"));
  ASSERT_EQ(seen->inputs.size(), 1u);
  EXPECT_EQ(seen->inputs[0].name, "text_input");
  EXPECT_EQ(seen->inputs[0].shape, (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(FirstElement(seen->inputs[0]), "hello");

  // A list of one prompt; finish_reason "stop" when fewer tokens than
  // max_tokens came, or when the model says so.
  const Message short_answer =
      Exchange("POST", "/v1/completions", R"({"model":"gen","prompt":["short"],"max_tokens":5})");
  ASSERT_EQ(short_answer.result_int(), 200) << short_answer.body();
  EXPECT_EQ(Parse(short_answer.body())["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(Parse(short_answer.body())["choices"][0]["text"], "tok0 tok1 ");
  const Message model_says =
      Exchange("POST", "/v1/completions", R"({"model":"gen","prompt":"stop","max_tokens":2})");
  EXPECT_EQ(Parse(model_says.body())["choices"][0]["finish_reason"], "stop");
  // No parameters given: none passed; a model without token counts has a usage of zeros.
  const Message plain = Exchange("POST", "/v1/completions", R"({"model":"plain","prompt":"p"})");
  ASSERT_EQ(plain.result_int(), 200) << plain.body();
  EXPECT_EQ(Parse(plain.body())["choices"][0]["text"], "echo: p");
  EXPECT_EQ(Parse(plain.body())["usage"]["total_tokens"], 0);
  std::optional<Seen> plain_seen =
      service_.WaitSeen([](const Seen& s) { return s.model == "plain"; });
  ASSERT_TRUE(plain_seen.has_value());
  EXPECT_EQ(plain_seen->parameters_json, "");
  EXPECT_EQ(plain_seen->inputs[0].shape, (std::vector<int64_t>{1}));  // no batching
}

TEST_F(GenerateTest, CompletionsStreamFieldByField) {
  Connection connection(port());
  connection.Post("/v1/completions",
                  R"({"model":"gen","prompt":"hello","max_tokens":3,"stream":true})");
  ASSERT_TRUE(connection.ReadHead());
  ExpectEventStreamHead(connection.message());
  const std::vector<std::string> events = connection.RestOfEvents();
  EXPECT_TRUE(connection.complete());
  ASSERT_EQ(events.size(), 5u);  // 3 pieces, the finish, [DONE]
  const json first = Parse(events[0]);
  const std::string id = first["id"];
  EXPECT_EQ(id.rfind("cmpl-", 0), 0u);
  for (int i = 0; i < 3; ++i) {
    const json chunk = Parse(events[i]);
    EXPECT_EQ(chunk["id"], id);
    EXPECT_EQ(chunk["object"], "text_completion");
    EXPECT_EQ(chunk["created"], first["created"]);
    EXPECT_EQ(chunk["model"], "gen");
    EXPECT_EQ(chunk["choices"], json::parse(R"([{"index":0,"text":"tok)" + std::to_string(i) +
                                            R"( ","finish_reason":null}])"));
    EXPECT_EQ(chunk.size(), 5u) << chunk;
  }
  const json last = Parse(events[3]);
  EXPECT_EQ(last["choices"], json::parse(R"([{"index":0,"text":"","finish_reason":"length"}])"));
  EXPECT_EQ(last["usage"],
            json::parse(R"({"prompt_tokens":2,"completion_tokens":3,"total_tokens":5})"));
  EXPECT_EQ(events[4], "[DONE]");
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->streamed);
}

TEST_F(GenerateTest, ChatPassesTheMessagesAsSentAndAnswersFieldByField) {
  const std::string messages =
      R"([ {"role" : "system", "content":"Be brief."}, {"role":"user","content":"h\u00e9llo \"you\""} ])";
  const Message response =
      Exchange("POST", "/v1/chat/completions", R"({"model":"chat","messages":)" + messages + "}");
  ASSERT_EQ(response.result_int(), 200) << response.body();
  const json j = Parse(response.body());
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u) << j;
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "chat");
  EXPECT_EQ(j["choices"],
            json({{{"index", 0},
                   {"message", {{"role", "assistant"}, {"content", "you said: " + messages}}},
                   {"finish_reason", "stop"}}}));
  EXPECT_EQ(j["usage"],
            json::parse(R"({"prompt_tokens":0,"completion_tokens":0,"total_tokens":0})"));
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  ASSERT_EQ(seen->inputs.size(), 1u);
  EXPECT_EQ(seen->inputs[0].name, "messages");
  EXPECT_EQ(FirstElement(seen->inputs[0]), messages);  // byte for byte
}

TEST_F(GenerateTest, ChatStreamFieldByField) {
  Connection connection(port());
  connection.Post("/v1/chat/completions",
                  R"({"model":"gen","messages":[{"role":"user","content":"x"}],"stream":true,)"
                  R"("max_tokens":2})");
  ASSERT_TRUE(connection.ReadHead());
  // "gen" takes text_input, which a chat does not give.
  EXPECT_EQ(connection.message().result_int(), 400);
  connection.ReadResponse();

  connection.Post("/v1/chat/completions",
                  R"({"model":"chat","messages":[{"role":"user","content":"x"}],"stream":true})");
  ASSERT_TRUE(connection.ReadHead());
  ExpectEventStreamHead(connection.message());
  const std::vector<std::string> events = connection.RestOfEvents();
  EXPECT_TRUE(connection.complete());
  ASSERT_EQ(events.size(), 5u);  // role, two pieces, the finish, [DONE]
  const json role = Parse(events[0]);
  const std::string id = role["id"];
  EXPECT_EQ(id.rfind("chatcmpl-", 0), 0u);
  const char* deltas[] = {R"({"role":"assistant"})", R"({"content":"you said: "})",
                          R"({"content":"[{\"role\":\"user\",\"content\":\"x\"}]"})", "{}"};
  for (int i = 0; i < 4; ++i) {
    const json chunk = Parse(events[i]);
    EXPECT_EQ(chunk["id"], id);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    EXPECT_EQ(chunk["model"], "chat");
    EXPECT_EQ(chunk["created"], role["created"]);
    ASSERT_EQ(chunk["choices"].size(), 1u);
    EXPECT_EQ(chunk["choices"][0]["index"], 0);
    EXPECT_EQ(chunk["choices"][0]["delta"], json::parse(deltas[i])) << events[i];
    EXPECT_EQ(chunk["choices"][0]["finish_reason"], i < 3 ? json() : json("stop"));
    EXPECT_FALSE(chunk.contains("usage")) << "the model gave no token counts";
  }
  EXPECT_EQ(events[4], "[DONE]");
}

TEST_F(GenerateTest, OpenAiErrorsAreInOpenAisFormat) {
  struct Case {
    const char* target;
    std::string body;
    int status;
    const char* type;
    json param;
    const char* says;
  };
  const Case cases[] = {
      {"/v1/completions", R"({"model":"nope","prompt":"x"})", 404, "invalid_request_error", "model",
       "no model 'nope'"},
      {"/v1/completions", R"({"prompt":"x"})", 400, "invalid_request_error", "model",
       "'model' is required"},
      {"/v1/completions", R"({"model":"gen"})", 400, "invalid_request_error", "prompt",
       "'prompt' is required"},
      {"/v1/completions", R"({"model":"gen","prompt":["a","b"]})", 400, "invalid_request_error",
       "prompt", "'prompt' must be a string"},
      {"/v1/completions", R"({"model":"gen","prompt":[1]})", 400, "invalid_request_error", "prompt",
       "'prompt' must be a string"},
      {"/v1/completions", R"({"model":"gen","prompt":"x","n":2})", 400, "invalid_request_error",
       "n", "only 'n': 1"},
      {"/v1/completions", R"({"model":"gen","prompt":"x","max_tokens":0})", 400,
       "invalid_request_error", "max_tokens", "positive integer"},
      {"/v1/completions", R"({"model":"gen","prompt":"x","stop":[1]})", 400,
       "invalid_request_error", "stop", "'stop' must be"},
      {"/v1/completions", R"({"model":"gen","prompt":"x","stream":"yes"})", 400,
       "invalid_request_error", "stream", "'stream' must be"},
      {"/v1/completions", R"({"model":"gen","prompt":"x",)", 400, "invalid_request_error", nullptr,
       "invalid JSON in the request"},
      {"/v1/completions", "{\"model\":\"gen\",\"prompt\":\"\xc3\"}", 400, "invalid_request_error",
       nullptr, "invalid JSON in the request"},
      {"/v1/completions", R"({"model":"vision","prompt":"x"})", 400, "invalid_request_error",
       "model", R"(has no input "text_input", which /v1/completions needs)"},
      {"/v1/chat/completions", R"({"model":"plain","messages":[{"role":"user"}]})", 400,
       "invalid_request_error", "model", R"(has no input "messages")"},
      {"/v1/chat/completions", R"({"model":"chat","messages":[]})", 400, "invalid_request_error",
       "messages", "non-empty list"},
      {"/v1/chat/completions", R"({"model":"chat","messages":[{"content":"x"}]})", 400,
       "invalid_request_error", "messages", "needs a string 'role'"},
      {"/v1/completions", R"({"model":"unready","prompt":"x"})", 503, "server_error", nullptr,
       "no worker ready"},
      {"/v1/completions", R"({"model":"unready","prompt":"x","stream":true})", 503, "server_error",
       nullptr, "no worker ready"},
  };
  for (const Case& c : cases) {
    const Message response = Exchange("POST", c.target, c.body);
    EXPECT_EQ(response.result_int(), c.status) << c.body << " -> " << response.body();
    EXPECT_EQ(response[http::field::content_type], "application/json") << c.body;
    const json error = OpenAiError(response);
    EXPECT_EQ(error["type"], c.type) << c.body;
    EXPECT_EQ(error["param"], c.param) << c.body;
    EXPECT_NE(error["message"].get<std::string>().find(c.says), std::string::npos)
        << c.body << " -> " << error;
    EXPECT_EQ(error["code"], c.status == 404 ? json("model_not_found") : json()) << c.body;
  }
  const Message get = Exchange("GET", "/v1/completions");
  EXPECT_EQ(get.result_int(), 405);
  EXPECT_EQ(get[http::field::allow], "POST");
  EXPECT_EQ(OpenAiError(get)["type"], "invalid_request_error");
  EXPECT_EQ(Exchange("POST", "/v1/models").result_int(), 405);
  // The server serves on.
  EXPECT_EQ(Exchange("POST", "/v1/completions", R"({"model":"plain","prompt":"p"})").result_int(),
            200);
}

TEST_F(GenerateTest, AnOpenAiStreamThatBreaksEndsWithAnErrorEventAndNoDone) {
  Connection connection(port());
  connection.Post("/v1/completions", R"({"model":"gen","prompt":"fail","stream":true})");
  ASSERT_TRUE(connection.ReadHead());
  ExpectEventStreamHead(connection.message());
  const std::vector<std::string> events = connection.RestOfEvents();
  EXPECT_TRUE(connection.complete());
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(Parse(events[0])["choices"][0]["text"], "tok0 ");
  EXPECT_EQ(Parse(events[1])["choices"][0]["text"], "tok1 ");
  EXPECT_EQ(Parse(events[2]), json::parse(R"({"error":{"message":"the worker died",
    "type":"server_error","param":null,"code":null}})"));
}

TEST_F(GenerateTest, ModelsListsTheRepository) {
  const Message response = Exchange("GET", "/v1/models");
  ASSERT_EQ(response.result_int(), 200);
  json expected = {{"object", "list"}, {"data", json::array()}};
  for (const char* name : {"chat", "gen", "plain", "typed", "unready", "vision"}) {
    expected["data"].push_back(
        {{"id", name}, {"object", "model"}, {"created", 0}, {"owned_by", "hearth"}});
  }
  EXPECT_EQ(Parse(response.body()), expected);
}

// ---- clients that go away, fall behind, and the server stopping ------------

TEST_F(GenerateTest, AClientThatDisconnectsMidStreamCancelsItsRequest) {
  for (const char* target : {"/v2/models/gen/generate_stream", "/v1/completions"}) {
    {
      Connection connection(port());
      connection.Post(target, std::string(target).find("v1") != std::string::npos
                                  ? R"({"model":"gen","prompt":"wait","stream":true})"
                                  : R"({"text_input":"wait"})");
      ASSERT_TRUE(connection.ReadHead());
      ASSERT_TRUE(connection.NextEvent().has_value());
    }  // closed mid-stream
  }
  for (size_t n : {size_t{1}, size_t{2}}) {
    std::optional<Seen> seen = service_.WaitFinished(n);
    ASSERT_TRUE(seen.has_value());
    EXPECT_TRUE(seen->cancelled);
    EXPECT_TRUE(seen->refused);  // on_response said stop
    EXPECT_EQ(seen->accepted, 1);
  }
  EXPECT_TRUE(Eventually([&] {
    const HttpStats stats = server_->stats();
    return stats.connections == 0 && stats.requests == 0 && stats.streams == 0;
  }));
}

TEST_F(GenerateTest, AClientThatDisconnectsFromAnAnswerNotStreamedCancelsItToo) {
  {
    Connection connection(port());
    connection.Post("/v1/completions", R"({"model":"gen","prompt":"wait"})");
    ASSERT_TRUE(service_.WaitParked(1));
  }
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(seen->streamed);
  EXPECT_TRUE(seen->cancelled);
}

TEST_F(GenerateTest, ASlowReaderHitsThePerStreamBound) {
  server_->Stop();
  HttpOptions options;
  options.max_stream_buffer_bytes = 256 * 1024;
  StartServer(options);
  Connection connection(port(), 4096);
  connection.Post("/v2/models/gen/generate_stream", R"({"text_input":"big"})");
  // Nothing is read until the model has been told to stop.
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->refused);
  EXPECT_GT(seen->accepted, 0);
  EXPECT_EQ(server_->stats().stream_overflows, 1u);
  // Every piece the model handed over arrives, in order, then the error.
  ASSERT_TRUE(connection.ReadHead());
  const std::vector<std::string> events = connection.RestOfEvents();
  EXPECT_TRUE(connection.complete());
  ASSERT_EQ(events.size(), static_cast<size_t>(seen->accepted) + 1);
  for (int i = 0; i < seen->accepted; ++i) {
    const std::string text = Parse(events[i])["text_output"];
    ASSERT_EQ(text.substr(0, text.find(':')), std::to_string(i));
  }
  const std::string error = Parse(events.back())["error"];
  EXPECT_NE(error.find("did not keep up with the stream: more than 262144 bytes"),
            std::string::npos)
      << error;
}

TEST_F(GenerateTest, AStreamWriteThatStallsPastTheWriteTimeoutClosesAndCancels) {
  server_->Stop();
  HttpOptions options;
  options.idle_timeout = 300ms;                           // also the limit on each write
  options.max_stream_buffer_bytes = uint64_t{256} << 20;  // the deadline, not the bound, ends it
  StartServer(options);
  Connection connection(port(), 4096);
  connection.Post("/v2/models/gen/generate_stream", R"({"text_input":"big"})");
  ASSERT_TRUE(Eventually([&] { return server_->stats().write_timeouts >= 1; }));
  EXPECT_EQ(server_->stats().stream_overflows, 0u);
  ASSERT_TRUE(connection.ReadHead());
  connection.RestOfEvents();
  EXPECT_FALSE(connection.complete());  // cut off
  ASSERT_TRUE(service_.WaitFinished(1).has_value());
  EXPECT_TRUE(Eventually([&] { return server_->stats().streams == 0; }));
}

TEST_F(GenerateTest, BodyLimitsApplyAsToInfer) {
  server_->Stop();
  HttpOptions options;
  options.max_body_bytes = 1024;
  StartServer(options);
  const std::string prompt(2000, 'p');
  const Message openai =
      Exchange("POST", "/v1/completions", R"({"model":"gen","prompt":")" + prompt + "\"}");
  EXPECT_EQ(openai.result_int(), 413);
  EXPECT_NE(OpenAiError(openai)["message"].get<std::string>().find("exceeds the limit of 1024"),
            std::string::npos);
  const Message generate =
      Exchange("POST", "/v2/models/gen/generate", R"({"text_input":")" + prompt + "\"}");
  EXPECT_EQ(generate.result_int(), 413);
  EXPECT_NE(ErrorOf(generate).find("exceeds the limit of 1024"), std::string::npos);
  // Chunked bodies too.
  Connection chunked(port());
  chunked.Send(
      "POST /v2/models/gen/generate_stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
      "chunked\r\n\r\n800\r\n" +
      std::string(2048, ' ') + "\r\n0\r\n\r\n");
  EXPECT_EQ(chunked.ReadResponse().result_int(), 413);
  EXPECT_EQ(Exchange("POST", "/v2/models/plain/generate", R"({"text_input":"ok"})").result_int(),
            200);
}

TEST_F(GenerateTest, StopLetsARunningStreamFinish) {
  Connection connection(port());
  connection.Post("/v2/models/gen/generate_stream",
                  R"({"text_input":"gated","parameters":{"max_tokens":3}})");
  ASSERT_TRUE(connection.ReadHead());
  ASSERT_TRUE(connection.NextEvent().has_value());
  std::thread stopper([&] { server_->Stop(); });
  ASSERT_TRUE(Eventually([&] { return server_->stats().draining; }));
  service_.OpenGate();
  const std::vector<std::string> rest = connection.RestOfEvents();
  EXPECT_EQ(rest.size(), 2u);
  EXPECT_TRUE(connection.complete());
  EXPECT_TRUE(connection.ReadsToClose());
  connection.socket().close();  // ends the server's lingering read at once
  stopper.join();
}

TEST_F(GenerateTest, StopPastTheDrainTimeoutEndsAStreamAndCancelsItsRequest) {
  server_->Stop();
  HttpOptions options;
  options.drain_timeout = 200ms;
  StartServer(options);
  Connection connection(port());
  connection.Post("/v2/models/gen/generate_stream", R"({"text_input":"wait"})");
  ASSERT_TRUE(connection.ReadHead());
  ASSERT_TRUE(connection.NextEvent().has_value());
  server_->Stop();  // returns once the model has stopped
  std::optional<Seen> seen = service_.WaitFinished(1);
  ASSERT_TRUE(seen.has_value());
  EXPECT_TRUE(seen->cancelled);
  EXPECT_TRUE(seen->refused);
  EXPECT_EQ(connection.RestOfEvents().size(), 0u);
  EXPECT_FALSE(connection.complete());  // cut off, not ended
}

}  // namespace
}  // namespace hearth
