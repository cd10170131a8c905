#include "http/http_server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <future>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio/dispatch.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <spdlog/spdlog.h>

#include "http/kserve_codec.h"

namespace hearth {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

constexpr uint32_t kHeaderLimit = 16 * 1024;
// After an error response that closes the connection, unread request bytes are
// drained for this long so that closing does not reset the connection (which
// can destroy the response before the client reads it).
constexpr std::chrono::seconds kLingerTime{2};
constexpr std::chrono::milliseconds kAcceptRetry{100};

// State the sessions share with the server. Owned by HttpServer::Impl, which
// outlives every handler that runs (Stop() joins the I/O threads first).
struct ServerCore {
  InferenceService* service = nullptr;
  HttpOptions options;
  std::atomic<bool> stopping{false};
  std::mutex mutex;
  std::condition_variable idle;
  uint64_t in_flight = 0;  // infers given to the service whose response is not yet written
};

// Counts one infer as in flight for as long as it lives.
class InFlightInfer {
 public:
  explicit InFlightInfer(ServerCore* core) : core_(core) {
    std::lock_guard lock(core_->mutex);
    ++core_->in_flight;
  }
  ~InFlightInfer() {
    std::lock_guard lock(core_->mutex);
    --core_->in_flight;
    core_->idle.notify_all();
  }
  InFlightInfer(const InFlightInfer&) = delete;
  InFlightInfer& operator=(const InFlightInfer&) = delete;

 private:
  ServerCore* core_;
};

Response MakeResponse(http::status status, unsigned version, bool keep_alive, std::string body,
                      std::string_view content_type) {
  Response response(status, version);
  response.set(http::field::server, "hearth");
  if (!content_type.empty()) response.set(http::field::content_type, content_type);
  response.keep_alive(keep_alive);
  response.body() = std::move(body);
  response.prepare_payload();
  return response;
}

Response ErrorResponse(int status, std::string_view message, unsigned version, bool keep_alive) {
  Response response = MakeResponse(static_cast<http::status>(status), version, keep_alive,
                                   ErrorJson(message), "application/json");
  if (status == 503) response.set(http::field::retry_after, "1");
  return response;
}

Response StatusResponse(const Status& status, unsigned version, bool keep_alive) {
  return ErrorResponse(HttpStatusFor(status.code()), status.message(), version, keep_alive);
}

std::optional<std::string> PercentDecode(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    if (i + 2 >= text.size()) return std::nullopt;
    auto hex = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    const int high = hex(text[i + 1]);
    const int low = hex(text[i + 2]);
    if (high < 0 || low < 0) return std::nullopt;
    out += static_cast<char>(high * 16 + low);
    i += 2;
  }
  return out;
}

struct Route {
  enum class Kind { kNone, kLive, kReady, kServer, kModel, kModelReady, kInfer, kMetrics };
  Kind kind = Kind::kNone;
  std::string model;
  std::string version;
  http::verb method() const { return kind == Kind::kInfer ? http::verb::post : http::verb::get; }
};

// nullopt: the path is not percent-encoded correctly.
std::optional<Route> ParseRoute(std::string_view target) {
  target = target.substr(0, target.find('?'));
  std::vector<std::string> segments;
  while (!target.empty()) {
    const size_t slash = target.find('/');
    const std::string_view segment = target.substr(0, slash);
    if (!segment.empty()) {
      std::optional<std::string> decoded = PercentDecode(segment);
      if (!decoded.has_value()) return std::nullopt;
      segments.push_back(std::move(*decoded));
    }
    if (slash == std::string_view::npos) break;
    target.remove_prefix(slash + 1);
  }
  Route route;
  const size_t n = segments.size();
  if (n == 1 && segments[0] == "metrics") {
    route.kind = Route::Kind::kMetrics;
    return route;
  }
  if (n == 0 || segments[0] != "v2") return route;
  if (n == 1) {
    route.kind = Route::Kind::kServer;
  } else if (n == 3 && segments[1] == "health") {
    if (segments[2] == "live") route.kind = Route::Kind::kLive;
    if (segments[2] == "ready") route.kind = Route::Kind::kReady;
  } else if (n >= 3 && segments[1] == "models") {
    route.model = segments[2];
    size_t rest = 3;
    if (n >= 5 && segments[3] == "versions") {
      route.version = segments[4];
      rest = 5;
    }
    if (n == rest) {
      route.kind = Route::Kind::kModel;
    } else if (n == rest + 1 && segments[rest] == "ready") {
      route.kind = Route::Kind::kModelReady;
    } else if (n == rest + 1 && segments[rest] == "infer") {
      route.kind = Route::Kind::kInfer;
    }
  }
  return route;
}

bool IsHttpParseError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category();
}

// One connection. Owned by the handlers pending on it (and, while the service
// runs an infer for it, by the infer's `done`); all its handlers run on the
// connection's strand.
// Bodies at least this large are read by ReadLargeBody. Measured with one
// sample of 16384 floats (a 64 KiB body, one connection): 1.32 ms per
// request through Beast's parser, 0.62 ms read directly.
constexpr uint64_t kDirectBodyBytes = 16 * 1024;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, ServerCore* core) : stream_(std::move(socket)), core_(core) {}

  void Start() {
    net::dispatch(stream_.get_executor(),
                  beast::bind_front_handler(&Session::ReadHeader, shared_from_this()));
  }

 private:
  void ReadHeader() {
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    parser_->body_limit(core_->options.max_body_bytes);
    stream_.expires_after(core_->options.idle_timeout);
    http::async_read_header(stream_, buffer_, *parser_,
                            beast::bind_front_handler(&Session::OnHeader, shared_from_this()));
  }

  void OnHeader(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    const auto& request = parser_->get();
    const auto expect = request[http::field::expect];
    if (beast::iequals(expect, "100-continue")) {
      continue_.emplace(http::status::continue_, request.version());
      http::async_write(stream_, *continue_,
                        [self = shared_from_this()](beast::error_code write_ec, size_t) {
                          if (write_ec) return self->Close();
                          self->ReadBody();
                        });
      return;
    }
    ReadBody();
  }

  void ReadBody() {
    stream_.expires_after(core_->options.idle_timeout);
    const auto length = parser_->content_length();
    if (length && *length >= kDirectBodyBytes && !parser_->chunked()) return ReadLargeBody(*length);
    // Room for the JSON parser to read past the end (kRequestBodyPadding):
    // with it, the body is parsed where it lies. Beast's own reserve of
    // Content-Length bytes is then a no-op.
    if (length && *length <= core_->options.max_body_bytes) {
      parser_->get().body().reserve(*length + kRequestBodyPadding);
    }
    http::async_read(stream_, buffer_, *parser_,
                     beast::bind_front_handler(&Session::OnRead, shared_from_this()));
  }

  // A large body (binary tensors) is read in one operation straight into its
  // final string: Beast's parser would read it 64 KiB at a time, re-arming
  // the stream's timer for each read, which costs more than the copy itself.
  void ReadLargeBody(uint64_t length) {
    body_.clear();
    const size_t already = std::min<size_t>(buffer_.size(), length);
    body_.reserve(length + kRequestBodyPadding);  // see ReadBody
    body_.resize(length);
    net::buffer_copy(net::buffer(body_.data(), already), buffer_.data());
    buffer_.consume(already);
    net::async_read(stream_, net::buffer(body_.data() + already, length - already),
                    [self = shared_from_this()](beast::error_code ec, size_t) {
                      if (ec) return self->OnReadError(ec);
                      self->stream_.expires_never();
                      Request request = self->parser_->release();
                      self->parser_.reset();
                      request.body() = std::move(self->body_);
                      self->Handle(std::move(request));
                    });
  }

  void OnRead(beast::error_code ec, size_t /*bytes*/) {
    if (ec) return OnReadError(ec);
    stream_.expires_never();
    Request request = parser_->release();
    parser_.reset();
    Handle(std::move(request));
  }

  void Handle(Request request) {
    const unsigned version = request.version();
    try {
      Dispatch(std::move(request));
    } catch (const std::exception& e) {
      // Handlers check what they use; this catches allocation failures and
      // any service method that throws against its contract.
      spdlog::error("http: request failed: {}", e.what());
      Send(ErrorResponse(500, std::string("internal error: ") + e.what(), version, false));
    }
  }

  void OnReadError(beast::error_code ec) {
    if (ec == http::error::body_limit) {
      return Send(ErrorResponse(413,
                                "request body exceeds the limit of " +
                                    std::to_string(core_->options.max_body_bytes) + " bytes",
                                11, false));
    }
    if (ec == http::error::header_limit) {
      return Send(ErrorResponse(
          400, "request header exceeds the limit of " + std::to_string(kHeaderLimit) + " bytes",
          11, false));
    }
    // A client that closed between or in the middle of requests, a timeout, a
    // reset: nothing to answer.
    if (ec == http::error::end_of_stream || ec == http::error::partial_message ||
        !IsHttpParseError(ec)) {
      return Close();
    }
    Send(ErrorResponse(400, "malformed HTTP request: " + ec.message(), 11, false));
  }

  void Dispatch(Request request) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    const std::optional<Route> route = ParseRoute(request.target());
    if (!route.has_value()) {
      return Send(ErrorResponse(400, "bad percent-encoding in the path", version, keep_alive));
    }
    if (route->kind == Route::Kind::kNone) {
      return Send(ErrorResponse(404, "no such endpoint: " + std::string(request.target()), version,
                                keep_alive));
    }
    if (request.method() != route->method()) {
      Response response =
          ErrorResponse(405,
                        "method " + std::string(request.method_string()) + " is not allowed on " +
                            std::string(request.target()),
                        version, keep_alive);
      response.set(http::field::allow, route->method() == http::verb::post ? "POST" : "GET");
      return Send(std::move(response));
    }
    InferenceService& service = *core_->service;
    auto health = [&](bool ok) {
      return MakeResponse(ok ? http::status::ok : http::status::service_unavailable, version,
                          keep_alive, "", "");
    };
    switch (route->kind) {
      case Route::Kind::kLive:
        return Send(health(service.Live()));
      case Route::Kind::kReady:
        return Send(health(service.Ready()));
      case Route::Kind::kServer:
        return Send(MakeResponse(
            http::status::ok, version, keep_alive,
            ServerMetadataJson(service.ServerName(), service.ServerVersion(), service.Extensions()),
            "application/json"));
      case Route::Kind::kModel: {
        Result<ModelMetadata> metadata = service.Metadata(route->model, route->version);
        if (!metadata.ok()) return Send(StatusResponse(metadata.status(), version, keep_alive));
        return Send(MakeResponse(http::status::ok, version, keep_alive,
                                 ModelMetadataJson(*metadata), "application/json"));
      }
      case Route::Kind::kModelReady: {
        Result<bool> ready = service.ModelReady(route->model, route->version);
        if (!ready.ok()) return Send(StatusResponse(ready.status(), version, keep_alive));
        return Send(health(*ready));
      }
      case Route::Kind::kInfer:
        return StartInfer(std::move(request), *route);
      case Route::Kind::kMetrics:
        return Send(MakeResponse(http::status::ok, version, keep_alive, service.MetricsText(),
                                 "text/plain; version=0.0.4"));
      case Route::Kind::kNone:
        break;
    }
  }

  void StartInfer(Request request, const Route& route) {
    const unsigned version = request.version();
    const bool keep_alive = request.keep_alive();
    if (core_->stopping.load()) {
      return Send(ErrorResponse(503, "the server is stopping", version, keep_alive));
    }
    std::optional<uint64_t> json_length;
    if (const auto it = request.find("Inference-Header-Content-Length"); it != request.end()) {
      Result<uint64_t> parsed = ParseJsonLength(it->value());
      if (!parsed.ok()) return Send(StatusResponse(parsed.status(), version, keep_alive));
      json_length = *parsed;
    }
    // The body moves into the parsed request: its binary inputs are views
    // into it, which keep it alive until the service is done with them.
    Result<InferRequest> infer =
        ParseInferRequest(std::move(request.body()), json_length, route.model, route.version);
    request = {};
    if (!infer.ok()) return Send(StatusResponse(infer.status(), version, keep_alive));
    Result<ModelMetadata> metadata = core_->service->Metadata(route.model, route.version);
    if (!metadata.ok()) return Send(StatusResponse(metadata.status(), version, keep_alive));
    if (Status valid = ValidateInferRequest(*infer, *metadata); !valid.ok()) {
      return Send(StatusResponse(valid, version, keep_alive));
    }
    OutputSelection selection = SelectionOf(*infer);
    in_flight_.emplace(core_);
    // `done` may run on any thread, even inside Infer. The outputs it gets
    // may be borrowed from the service (the worker's slot) and valid only
    // until it returns: it encodes them into the response body right there,
    // one copy, and moves only the finished response onto this connection's
    // strand.
    core_->service->Infer(
        std::move(*infer), [self = shared_from_this(), selection = std::move(selection), version,
                            keep_alive](Result<InferResponse> result) mutable {
          if (self == nullptr) return;  // a second call, against the contract
          std::optional<Response> response;
          try {
            response = InferResponseMessage(result, selection, version, keep_alive);
          } catch (const std::exception& e) {
            // Out of memory: answered below without a body built here. Nothing
            // may throw into the service's thread.
            spdlog::error("http: encoding a response failed: {}", e.what());
          }
          auto executor = self->stream_.get_executor();
          net::post(executor, [self = std::move(self), response = std::move(response), version,
                               keep_alive]() mutable {
            if (!response.has_value()) {
              return self->Send(ErrorResponse(500, "internal error: cannot encode the response",
                                              version, keep_alive));
            }
            self->Send(std::move(*response));
          });
        });
  }

  // The HTTP response to an infer; reads the outputs' bytes, so it runs
  // inside `done`.
  static Response InferResponseMessage(const Result<InferResponse>& result,
                                       const OutputSelection& selection, unsigned version,
                                       bool keep_alive) {
    if (!result.ok()) return StatusResponse(result.status(), version, keep_alive);
    Result<EncodedInferResponse> encoded = EncodeInferResponse(*result, selection);
    if (!encoded.ok()) return StatusResponse(encoded.status(), version, keep_alive);
    const bool binary = encoded->json_length.has_value();
    Response response =
        MakeResponse(http::status::ok, version, keep_alive, std::move(encoded->body),
                     binary ? "application/octet-stream" : "application/json");
    if (binary) {
      response.set("Inference-Header-Content-Length", std::to_string(*encoded->json_length));
    }
    return response;
  }

  void Send(Response response) {
    response_ = std::make_unique<Response>(std::move(response));
    stream_.expires_after(core_->options.idle_timeout);
    http::async_write(stream_, *response_,
                      beast::bind_front_handler(&Session::OnWrite, shared_from_this()));
  }

  void OnWrite(beast::error_code ec, size_t /*bytes*/) {
    const bool close = response_->need_eof();
    response_.reset();
    in_flight_.reset();
    if (ec) return Close();
    if (close) return LingeringClose();
    ReadHeader();
  }

  void LingeringClose() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTime);
    Drain();
  }

  void Drain() {
    stream_.async_read_some(net::buffer(drain_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec) return self->Close();
                              self->Drain();
                            });
  }

  void Close() {
    in_flight_.reset();
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  ServerCore* core_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::string body_;  // a large body being read directly
  std::optional<http::response<http::empty_body>> continue_;
  std::unique_ptr<Response> response_;
  std::optional<InFlightInfer> in_flight_;
  std::array<char, 4096> drain_{};
};

}  // namespace

class HttpServer::Impl {
 public:
  Impl(InferenceService* service, HttpOptions options)
      : runtime_(std::make_unique<Runtime>(options.threads)) {
    core_.service = service;
    core_.options = std::move(options);
  }

  ~Impl() { Stop(); }

  Status Start() {
    if (started_) return FailedPrecondition("HttpServer::Start called twice");
    started_ = true;
    const HttpOptions& options = core_.options;
    beast::error_code ec;
    tcp::resolver resolver(runtime_->io);
    const auto endpoints = resolver.resolve(options.host, std::to_string(options.port),
                                            tcp::resolver::passive | tcp::resolver::numeric_service,
                                            ec);
    if (ec || endpoints.empty()) {
      return InvalidArgument("cannot resolve host '" + options.host + "': " + ec.message());
    }
    const tcp::endpoint endpoint = endpoints.begin()->endpoint();
    // Opened here rather than by Asio, which does not set close-on-exec.
    const int fd = ::socket(endpoint.protocol().family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK,
                            IPPROTO_TCP);
    if (fd < 0) return ErrnoError("socket", errno);
    runtime_->acceptor.assign(endpoint.protocol(), fd, ec);
    if (ec) {
      ::close(fd);
      return Internal("cannot adopt the listening socket: " + ec.message());
    }
    runtime_->acceptor.set_option(net::socket_base::reuse_address(true), ec);
    runtime_->acceptor.bind(endpoint, ec);
    if (ec) {
      return Unavailable("cannot bind " + options.host + ":" + std::to_string(options.port) +
                         ": " + ec.message());
    }
    runtime_->acceptor.listen(net::socket_base::max_listen_connections, ec);
    if (ec) return Unavailable("cannot listen on " + options.host + ": " + ec.message());
    port_ = runtime_->acceptor.local_endpoint(ec).port();
    WaitForConnection();
    for (int i = 0; i < options.threads; ++i) {
      threads_.emplace_back([this] { RunIo(); });
    }
    return Status::Ok();
  }

  void Stop() {
    if (!started_ || stopped_) return;
    stopped_ = true;
    core_.stopping.store(true);
    if (!threads_.empty()) {
      std::promise<void> closed;
      net::post(runtime_->acceptor.get_executor(), [this, &closed] {
        beast::error_code ignored;
        runtime_->acceptor.close(ignored);
        runtime_->accept_retry.cancel();
        closed.set_value();
      });
      closed.get_future().wait();
      std::unique_lock lock(core_.mutex);
      core_.idle.wait(lock, [this] { return core_.in_flight == 0; });
    }
    runtime_->work.reset();
    runtime_->io.stop();
    for (std::thread& thread : threads_) thread.join();
    threads_.clear();
    runtime_.reset();
  }

  uint16_t port() const { return port_; }

 private:
  void RunIo() {
    for (;;) {
      try {
        runtime_->io.run();
        return;
      } catch (const std::exception& e) {
        spdlog::error("http: I/O thread caught: {}", e.what());
      }
    }
  }

  // Accepts with accept4(SOCK_CLOEXEC) once the listening socket is readable.
  void WaitForConnection() {
    runtime_->acceptor.async_wait(tcp::acceptor::wait_read, [this](beast::error_code ec) {
      if (ec || !runtime_->acceptor.is_open()) return;
      AcceptReady();
    });
  }

  void AcceptReady() {
    for (;;) {
      const int fd = ::accept4(runtime_->acceptor.native_handle(), nullptr, nullptr,
                               SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        const int error = errno;
        if (error == EINTR || error == ECONNABORTED) continue;
        if (error == EAGAIN || error == EWOULDBLOCK) break;
        // Out of descriptors or memory: try again shortly rather than spin.
        spdlog::warn("http: accept failed: {}", std::strerror(error));
        runtime_->accept_retry.expires_after(kAcceptRetry);
        runtime_->accept_retry.async_wait([this](beast::error_code ec) {
          if (!ec && runtime_->acceptor.is_open()) WaitForConnection();
        });
        return;
      }
      tcp::socket socket(net::make_strand(runtime_->io));
      beast::error_code ec;
      socket.assign(runtime_->acceptor.local_endpoint(ec).protocol(), fd, ec);
      if (ec) {
        ::close(fd);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);
      std::make_shared<Session>(std::move(socket), &core_)->Start();
    }
    WaitForConnection();
  }

  // The I/O context and what runs on it. Stop() destroys it after joining the
  // threads, which destroys the pending handlers and with them every session
  // and connection.
  struct Runtime {
    explicit Runtime(int threads)
        : io(threads),
          acceptor(net::make_strand(io)),
          accept_retry(acceptor.get_executor()),
          work(net::make_work_guard(io)) {}
    net::io_context io;  // first: outlives the objects that use it
    tcp::acceptor acceptor;  // its handlers run on its own strand
    net::steady_timer accept_retry;
    net::executor_work_guard<net::io_context::executor_type> work;
  };

  ServerCore core_;  // outlives runtime_: handlers destroyed with it may refer to it
  std::unique_ptr<Runtime> runtime_;
  std::vector<std::thread> threads_;
  uint16_t port_ = 0;
  bool started_ = false;
  bool stopped_ = false;
};

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() = default;

Result<std::unique_ptr<HttpServer>> HttpServer::Create(InferenceService* service,
                                                       HttpOptions options) {
  if (service == nullptr) return InvalidArgument("HttpServer needs a service");
  if (options.threads < 1 || options.threads > 1024) {
    return InvalidArgument("HttpOptions.threads must be 1..1024, got " +
                           std::to_string(options.threads));
  }
  if (options.max_body_bytes == 0) return InvalidArgument("HttpOptions.max_body_bytes is 0");
  if (options.idle_timeout.count() <= 0) {
    return InvalidArgument("HttpOptions.idle_timeout must be positive");
  }
  return std::unique_ptr<HttpServer>(
      new HttpServer(std::make_unique<Impl>(service, std::move(options))));
}

Status HttpServer::Start() { return impl_->Start(); }

void HttpServer::Stop() { impl_->Stop(); }

uint16_t HttpServer::port() const { return impl_->port(); }

}  // namespace hearth
