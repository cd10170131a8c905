#include "loadgen/load_generator.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "common/datatype.h"
#include "loadgen/bench_common.h"
#include "loadgen/cuda_shm.h"
#include "loadgen/system_shm.h"
#ifdef HEARTH_HAVE_GRPC
#include "loadgen/grpc_load.h"
#endif

namespace hearth {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = boost::asio::ip::tcp;
using json = nlohmann::json;

struct Endpoint {
  std::string host, port;
};

Result<Endpoint> ParseUrl(const std::string& url) {
  constexpr std::string_view kScheme = "http://";
  if (url.rfind("https://", 0) == 0)
    return InvalidArgument("bad URL '" + url + "': https is not supported");
  if (url.rfind(kScheme, 0) != 0)
    return InvalidArgument("bad URL '" + url + "': expected http://HOST:PORT");
  std::string rest = url.substr(kScheme.size());
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.find('/') != std::string::npos) {
    return InvalidArgument("bad URL '" + url + "': expected http://HOST:PORT without a path");
  }
  Endpoint endpoint;
  size_t colon = rest.rfind(':');
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    const size_t close = rest.find(']');
    if (close == std::string::npos) return InvalidArgument("bad URL '" + url + "': unclosed '['");
    endpoint.host = rest.substr(1, close - 1);
    colon = rest.size() > close + 1 && rest[close + 1] == ':' ? close + 1 : std::string::npos;
    if (close + 1 != rest.size() && colon == std::string::npos) {
      return InvalidArgument("bad URL '" + url + "'");
    }
  } else {
    endpoint.host = rest.substr(0, colon);
  }
  endpoint.port = colon == std::string::npos ? "80" : rest.substr(colon + 1);
  int port = -1;
  const auto [end, ec] =
      std::from_chars(endpoint.port.data(), endpoint.port.data() + endpoint.port.size(), port);
  if (endpoint.host.empty() || ec != std::errc() ||
      end != endpoint.port.data() + endpoint.port.size() || port <= 0 || port > 65535) {
    return InvalidArgument("bad URL '" + url +
                           "': expected http://HOST:PORT with a port in [1, 65535]");
  }
  return endpoint;
}

// One keep-alive HTTP/1.1 connection; reconnects lazily after a failure or a
// server-side close. Owned and used by one thread.
class Connection {
 public:
  Connection(Endpoint endpoint, double timeout_seconds)
      : endpoint_(std::move(endpoint)), timeout_seconds_(timeout_seconds), stream_(io_) {}

  // Sends `request`; on a transport failure returns the error and leaves the
  // connection closed, so the next call reconnects.
  Result<http::response<http::string_body>> RoundTrip(
      const http::request<http::string_body>& request) {
    try {
      if (!open_) Connect();
      http::write(stream_, request);
      http::response<http::string_body> response;
      http::read(stream_, buffer_, response);
      if (!response.keep_alive()) Close();
      return response;
    } catch (const boost::system::system_error& e) {
      Close();
      return Unavailable(e.code().message());  // what() would add Boost's source location
    } catch (const std::exception& e) {
      Close();
      return Unavailable(e.what());
    }
  }

 private:
  void Connect() {
    tcp::resolver resolver(io_);
    stream_.connect(resolver.resolve(endpoint_.host, endpoint_.port));
    stream_.socket().set_option(tcp::no_delay(true));
    // Sync Beast calls ignore tcp_stream's expiry; socket timeouts bound them instead.
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout_seconds_);
    tv.tv_usec = static_cast<suseconds_t>((timeout_seconds_ - std::floor(timeout_seconds_)) * 1e6);
    const int fd = stream_.socket().native_handle();
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    buffer_.clear();
    open_ = true;
  }
  void Close() {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
    buffer_.clear();
    open_ = false;
  }

  Endpoint endpoint_;
  double timeout_seconds_;
  boost::asio::io_context io_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  bool open_ = false;
};

// ---- requests ------------------------------------------------------------------

using bench::Clock;
using bench::ModelSpec;
using bench::OutputPlacement;
using bench::RunRecord;
using bench::ShmSession;
using bench::ShmSlot;
using bench::TensorSpec;

json JsonValues(const TensorSpec& input, std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> small(0, 9);
  std::bernoulli_distribution coin;
  const std::string& t = input.datatype;
  json values = json::array();
  for (int64_t i = 0; i < input.elements; ++i) {
    if (t == "FP32" || t == "FP64" || t == "FP16" || t == "BF16")
      values.push_back(normal(rng));
    else if (t == "BOOL")
      values.push_back(static_cast<bool>(coin(rng)));
    else  // integers: small non-negative values, safe as indices
      values.push_back(small(rng));
  }
  return values;
}

struct PreparedBody {
  std::string body;
  size_t header_length = 0;  // binary only: the JSON header's size
};

// A body with its tensors inline: JSON values, or the binary extension.
PreparedBody MakeBody(const ModelSpec& model, const BenchOptions& options, std::mt19937_64& rng) {
  const bool binary = options.protocol == BenchProtocol::kBinary;
  json header = {{"inputs", json::array()}};
  std::string data;
  for (const TensorSpec& input : model.inputs) {
    json tensor = {{"name", input.name}, {"datatype", input.datatype}, {"shape", input.shape}};
    if (binary) {
      const std::string bytes = bench::RandomInputBytes(input, rng);
      tensor["parameters"] = {{"binary_data_size", bytes.size()}};
      data += bytes;
    } else {
      tensor["data"] = JsonValues(input, rng);
    }
    header["inputs"].push_back(std::move(tensor));
  }
  if (!model.outputs.empty()) {
    header["outputs"] = json::array();
    for (const TensorSpec& output : model.outputs) {
      json entry = {{"name", output.name}};
      if (binary) entry["parameters"] = {{"binary_data", true}};
      header["outputs"].push_back(std::move(entry));
    }
  }
  if (binary) header["parameters"] = {{"binary_data_output", true}};
  PreparedBody prepared;
  prepared.body = header.dump();
  if (binary) {
    prepared.header_length = prepared.body.size();
    prepared.body += data;
  }
  return prepared;
}

json RegionParameters(const std::string& region, uint64_t offset, uint64_t bytes) {
  return {{"shared_memory_region", region},
          {"shared_memory_offset", offset},
          {"shared_memory_byte_size", bytes}};
}

// A JSON body that names the slot's region for every input and output.
std::string MakeShmBody(const ModelSpec& model, const ShmSlot& slot) {
  json header = {{"inputs", json::array()}, {"outputs", json::array()}};
  for (size_t k = 0; k < model.inputs.size(); ++k) {
    const TensorSpec& input = model.inputs[k];
    header["inputs"].push_back(
        {{"name", input.name},
         {"datatype", input.datatype},
         {"shape", input.shape},
         {"parameters", RegionParameters(slot.region, slot.inputs[k].offset, input.bytes)}});
  }
  for (size_t k = 0; k < model.outputs.size(); ++k) {
    header["outputs"].push_back(
        {{"name", model.outputs[k].name},
         {"parameters",
          RegionParameters(slot.region, slot.outputs[k].offset, slot.outputs[k].bytes)}});
  }
  return header.dump();
}

http::request<http::string_body> MakeRequest(const Endpoint& endpoint, const std::string& path,
                                             std::string body, size_t header_length) {
  http::request<http::string_body> request{http::verb::post, path, 11};
  request.set(http::field::host, endpoint.host);
  request.keep_alive(true);
  if (header_length > 0) {
    request.set(http::field::content_type, "application/octet-stream");
    request.set("Inference-Header-Content-Length", std::to_string(header_length));
  } else {
    request.set(http::field::content_type, "application/json");
  }
  request.body() = std::move(body);
  request.prepare_payload();
  return request;
}

std::string ServerMessage(const http::response<http::string_body>& response) {
  std::string text = response.body();
  try {
    const json body = json::parse(text);
    if (body.is_object() && body.contains("error") && body["error"].is_string())
      text = body["error"];
  } catch (const json::exception&) {
  }
  if (text.size() > 300) text = text.substr(0, 300) + "...";
  return "HTTP " + std::to_string(response.result_int()) + ": " + text;
}

StatusCode CodeForHttp(unsigned status) {
  switch (status) {
    case 400:
      return StatusCode::kInvalidArgument;
    case 403:
      return StatusCode::kPermissionDenied;
    case 404:
      return StatusCode::kNotFound;
    case 409:
      return StatusCode::kAlreadyExists;
    case 429:
      return StatusCode::kResourceExhausted;
    case 501:
      return StatusCode::kUnimplemented;
    default:
      return StatusCode::kUnavailable;
  }
}

// Where each output of an answer says it is: a JSON header, with binary
// data after it when Inference-Header-Content-Length says so.
Result<std::vector<OutputPlacement>> ParsePlacements(
    const http::response<http::string_body>& response) {
  std::string_view header = response.body();
  const auto length = response.find("Inference-Header-Content-Length");
  if (length != response.end()) {
    size_t n = 0;
    const std::string_view text = length->value();
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    if (ec != std::errc() || end != text.data() + text.size() || n > header.size())
      return Internal("the answer's Inference-Header-Content-Length is not a size within its body");
    header = header.substr(0, n);
  }
  std::vector<OutputPlacement> placements;
  try {
    const json body = json::parse(header);
    for (const json& output : body.at("outputs")) {
      OutputPlacement placement;
      placement.name = output.at("name").get<std::string>();
      placement.inline_data = output.contains("data");
      if (output.contains("parameters")) {
        const json& parameters = output["parameters"];
        placement.inline_data = placement.inline_data || parameters.contains("binary_data_size");
        if (parameters.contains("shared_memory_region")) {
          placement.in_region = true;
          placement.region = parameters["shared_memory_region"].get<std::string>();
          placement.offset = parameters.value("shared_memory_offset", uint64_t{0});
          placement.byte_size = parameters.at("shared_memory_byte_size").get<uint64_t>();
        }
      }
      if (!placement.inline_data && !placement.in_region) {
        placement.where_asked = true;
        const std::optional<DType> dtype =
            ParseKserveDatatype(output.at("datatype").get<std::string>());
        uint64_t bytes = dtype.has_value() && *dtype != DType::kBytes ? DTypeSize(*dtype) : 0;
        for (const json& d : output.at("shape")) {
          const int64_t n = d.get<int64_t>();
          if (n < 0 || (n > 0 && bytes > (uint64_t{1} << 62) / static_cast<uint64_t>(n)))
            return Internal("output '" + placement.name + "': its shape is not a size");
          bytes *= static_cast<uint64_t>(n);
        }
        placement.byte_size = bytes;
      }
      placements.push_back(std::move(placement));
    }
  } catch (const json::exception& e) {
    return Internal(std::string("the answer is not the JSON of an inference response: ") +
                    e.what());
  }
  return placements;
}

Result<ModelSpec> ReadModel(Connection& connection, const Endpoint& endpoint,
                            const BenchOptions& options, const std::string& model_path) {
  http::request<http::string_body> request{http::verb::get, model_path, 11};
  request.set(http::field::host, endpoint.host);
  request.keep_alive(true);
  Result<http::response<http::string_body>> response = connection.RoundTrip(request);
  if (!response.ok()) {
    return Unavailable("cannot reach the server at " + options.url + ": " +
                       response.status().message());
  }
  const std::string label = bench::ModelLabel(options);
  if (response->result() == http::status::not_found) {
    return NotFound(label + " not found on " + options.url + " (" + ServerMessage(*response) + ")");
  }
  if (response->result() != http::status::ok) {
    return Unavailable("metadata of " + label + " on " + options.url + ": " +
                       ServerMessage(*response));
  }
  try {
    const json metadata = json::parse(response->body());
    const int64_t max_batch = metadata.value("max_batch_size", int64_t{0});
    auto tensors = [&](const char* key) {
      std::vector<bench::TensorMetadata> out;
      if (!metadata.contains(key)) return out;
      for (const json& tensor : metadata.at(key)) {
        out.push_back({tensor.at("name").get<std::string>(),
                       tensor.at("datatype").get<std::string>(),
                       tensor.at("shape").get<std::vector<int64_t>>()});
      }
      return out;
    };
    return bench::ResolveModel(options, max_batch, tensors("inputs"), tensors("outputs"));
  } catch (const json::exception& e) {
    return InvalidArgument("metadata of " + label + " on " + options.url + ": " + e.what());
  }
}

// Registration over REST, on one connection of its own.
class RestRegionControl : public bench::RegionControl {
 public:
  RestRegionControl(Endpoint endpoint, double timeout_seconds)
      : endpoint_(std::move(endpoint)), connection_(endpoint_, timeout_seconds) {}

  Status Register(const std::string& name, const bench::RegionHandle& handle) override {
    if (handle.kind == BenchSharedMemory::kCuda)
      return Post(Path(handle.kind, name, "register"), bench::CudaRegisterBody(handle));
    const json body = {{"key", handle.key}, {"offset", 0}, {"byte_size", handle.byte_size}};
    return Post(Path(handle.kind, name, "register"), body.dump());
  }
  Status Unregister(BenchSharedMemory kind, const std::string& name) override {
    return Post(Path(kind, name, "unregister"), "");
  }

 private:
  Status Post(const std::string& path, std::string body) {
    http::request<http::string_body> request{http::verb::post, path, 11};
    request.set(http::field::host, endpoint_.host);
    request.set(http::field::content_type, "application/json");
    request.keep_alive(true);
    request.body() = std::move(body);
    request.prepare_payload();
    Result<http::response<http::string_body>> response = connection_.RoundTrip(request);
    if (!response.ok()) return response.status();
    if (response->result() != http::status::ok)
      return Status(CodeForHttp(response->result_int()), ServerMessage(*response));
    return Status::Ok();
  }
  static std::string Path(BenchSharedMemory kind, const std::string& name, const char* action) {
    return std::string(kind == BenchSharedMemory::kCuda ? "/v2/cudasharedmemory"
                                                        : "/v2/systemsharedmemory") +
           "/region/" + name + "/" + action;
  }

  Endpoint endpoint_;
  Connection connection_;
};

// ---- the run ------------------------------------------------------------------

// What every sender shares: the prepared requests (inline: a few, cycled;
// shared memory: one per slot), the slots, the record.
class RestRun {
 public:
  RestRun(Endpoint endpoint, std::vector<http::request<http::string_body>> requests,
          const ModelSpec& model, ShmSession* shm, RunRecord& record)
      : endpoint_(std::move(endpoint)),
        requests_(std::move(requests)),
        model_(model),
        shm_(shm),
        record_(record) {}

  const Endpoint& endpoint() const { return endpoint_; }

  // Sends one request from slot `slot` (each slot used by one sender) and
  // records it, as a sample or as an error.
  void SendOne(Connection& connection, size_t slot, Clock::time_point start) {
    ShmSlot* shm_slot = shm_ != nullptr ? &shm_->slot(slot) : nullptr;
    if (shm_slot != nullptr) shm_->BeforeRequest(*shm_slot);
    const http::request<http::string_body>& request =
        shm_slot != nullptr ? requests_[slot] : requests_[next_++ % requests_.size()];
    Result<http::response<http::string_body>> response = connection.RoundTrip(request);
    const Clock::time_point done = Clock::now();
    if (!response.ok()) {
      record_.RecordError("connection to " + endpoint_.host + ":" + endpoint_.port + ": " +
                          response.status().message());
      return;
    }
    if (response->result() != http::status::ok) {
      record_.RecordError(ServerMessage(*response));
      return;
    }
    if (shm_slot != nullptr) {
      Result<std::vector<OutputPlacement>> placements = ParsePlacements(*response);
      Status s = placements.ok() ? shm_->AfterResponse(*shm_slot, *placements, &record_)
                                 : placements.status();
      if (!s.ok()) {
        record_.RecordError(s.message());
        return;
      }
    }
    record_.RecordSample(start, done);
  }

 private:
  Endpoint endpoint_;
  std::vector<http::request<http::string_body>> requests_;
  std::atomic<uint64_t> next_{0};
  const ModelSpec& model_;
  ShmSession* shm_;
  RunRecord& record_;
};

void RunClosedLoop(const BenchOptions& options, RestRun& run, Clock::time_point end) {
  std::vector<std::thread> threads;
  for (int i = 0; i < options.concurrency; ++i) {
    threads.emplace_back([&, slot = static_cast<size_t>(i)] {
      Connection connection(run.endpoint(), options.timeout_seconds);
      while (Clock::now() < end) run.SendOne(connection, slot, Clock::now());
    });
  }
  for (std::thread& t : threads) t.join();
}

// Open loop: one scheduler thread queues the scheduled send times; senders,
// each with its own connection (and slot), take them in order. When a send
// time comes and no sender is idle, the pool grows (up to max_connections);
// beyond that the request waits in the queue and its latency shows the wait.
int RunOpenLoop(const BenchOptions& options, RestRun& run, Clock::time_point begin,
                Clock::time_point end, uint64_t* unsent, Clock::time_point measure_begin) {
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Clock::time_point> queue;
  bool stop = false;
  int idle = 0;
  const Clock::time_point drain_deadline =
      end + bench::ToDuration(std::min(options.timeout_seconds, 2.0));
  std::vector<std::thread> senders;
  auto sender = [&](size_t slot) {
    Connection connection(run.endpoint(), options.timeout_seconds);
    std::unique_lock lock(mu);
    for (;;) {  // counted idle from creation, so a starting sender is not spawned for again
      ready.wait(lock, [&] { return stop || !queue.empty(); });
      // After the schedule ends, what is queued is still sent, until the drain deadline.
      if (queue.empty() || (stop && Clock::now() >= drain_deadline)) return;
      --idle;
      const Clock::time_point scheduled = queue.front();
      queue.pop_front();
      lock.unlock();
      run.SendOne(connection, slot, scheduled);
      lock.lock();
      ++idle;
    }
  };
  std::mt19937_64 rng(options.seed ^ 0x5eedULL);
  std::exponential_distribution<double> gap(options.request_rate);
  const double interval = 1.0 / options.request_rate;
  Clock::time_point next = begin;
  {
    std::lock_guard lock(mu);
    for (int i = 0; i < std::min(4, options.max_connections); ++i) {
      ++idle;
      senders.emplace_back(sender, senders.size());
    }
  }
  while (next < end) {
    std::this_thread::sleep_until(next);
    {
      std::lock_guard lock(mu);
      queue.push_back(next);
      if (idle < static_cast<int>(queue.size()) &&
          static_cast<int>(senders.size()) < options.max_connections) {
        ++idle;
        senders.emplace_back(sender, senders.size());
      }
    }
    ready.notify_one();
    const double seconds = options.arrival == BenchArrival::kPoisson ? gap(rng) : interval;
    next += bench::ToDuration(seconds);
  }
  {
    std::lock_guard lock(mu);
    stop = true;
  }
  ready.notify_all();
  for (std::thread& t : senders) t.join();
  for (const Clock::time_point t : queue) {  // left behind by the drain deadline
    if (t >= measure_begin) ++*unsent;
  }
  return static_cast<int>(senders.size());
}

Result<BenchReport> RunRestBench(const BenchOptions& options, std::FILE* err) {
  ASSIGN_OR_RETURN(Endpoint endpoint, ParseUrl(options.url));
  std::string model_path = "/v2/models/" + options.model;
  if (!options.version.empty()) model_path += "/versions/" + options.version;
  Connection probe(endpoint, options.timeout_seconds);
  ASSIGN_OR_RETURN(const ModelSpec model, ReadModel(probe, endpoint, options, model_path));

  const bool shm = options.shared_memory != BenchSharedMemory::kNone;
  std::mt19937_64 rng(options.seed);
  RestRegionControl control(endpoint, options.timeout_seconds);
  std::unique_ptr<ShmSession> session;
  std::vector<http::request<http::string_body>> requests;
  if (shm) {
    const int slots = options.request_rate > 0 ? options.max_connections : options.concurrency;
    ASSIGN_OR_RETURN(session, ShmSession::Create(model, options, slots, &control,
                                                 bench::DefaultRegionFactory(options), rng));
    for (size_t i = 0; i < session->size(); ++i)
      requests.push_back(
          MakeRequest(endpoint, model_path + "/infer", MakeShmBody(model, session->slot(i)), 0));
  } else {
    for (int i = 0; i < options.distinct_bodies; ++i) {
      PreparedBody prepared = MakeBody(model, options, rng);
      requests.push_back(MakeRequest(endpoint, model_path + "/infer", std::move(prepared.body),
                                     prepared.header_length));
    }
  }

  BenchReport report;
  report.protocol = shm ? "json" : options.protocol == BenchProtocol::kBinary ? "binary" : "json";
  RunRecord record(options, err);
  RestRun run(endpoint, std::move(requests), model, session.get(), record);
  const Clock::time_point begin = Clock::now();
  const Clock::time_point measure_begin = begin + bench::ToDuration(options.warmup);
  const Clock::time_point measure_end = measure_begin + bench::ToDuration(options.seconds);
  if (options.request_rate > 0) {
    report.mode = "request_rate";
    report.concurrency =
        RunOpenLoop(options, run, begin, measure_end, &report.unsent, measure_begin);
  } else {
    report.mode = "concurrency";
    report.concurrency = options.concurrency;
    RunClosedLoop(options, run, measure_end);
  }
  report.batch = options.batch;
  record.Summarize(measure_begin, measure_end, &report);
  return report;
}

}  // namespace

namespace bench {

Result<std::unique_ptr<RegionControl>> MakeRegionControl(const BenchOptions& options) {
  if (options.transport == BenchTransport::kGrpc) {
#ifdef HEARTH_HAVE_GRPC
    return MakeGrpcRegionControl(options);
#else
    return Unimplemented("--transport grpc: this hearth was built without gRPC");
#endif
  }
  ASSIGN_OR_RETURN(Endpoint endpoint, ParseUrl(options.url));
  return std::unique_ptr<RegionControl>(
      new RestRegionControl(std::move(endpoint), options.timeout_seconds));
}

}  // namespace bench

Result<std::string> HttpGet(const std::string& url, const std::string& path,
                            double timeout_seconds) {
  ASSIGN_OR_RETURN(const Endpoint endpoint, ParseUrl(url));
  Connection connection(endpoint, timeout_seconds);
  http::request<http::string_body> request{http::verb::get, path, 11};
  request.set(http::field::host, endpoint.host);
  request.keep_alive(false);
  Result<http::response<http::string_body>> response = connection.RoundTrip(request);
  if (!response.ok())
    return Unavailable("cannot reach the server at " + url + ": " + response.status().message());
  if (response->result() != http::status::ok)
    return Status(CodeForHttp(response->result_int()),
                  "GET " + path + " on " + url + ": " + ServerMessage(*response));
  return std::move(response->body());
}

bool BenchHasGrpc() {
#ifdef HEARTH_HAVE_GRPC
  return true;
#else
  return false;
#endif
}

Result<BenchReport> RunBench(const BenchOptions& options, std::FILE* err) {
  if (options.model.empty()) return InvalidArgument("--model is required");
  if (options.batch < 1) return InvalidArgument("--batch must be at least 1");
  if (!(options.seconds > 0)) return InvalidArgument("--seconds must be positive");
  if (!(options.warmup >= 0)) return InvalidArgument("--warmup must not be negative");
  if (options.request_rate < 0 || !std::isfinite(options.request_rate)) {
    return InvalidArgument("--request-rate must be positive");
  }
  if (options.request_rate == 0 && options.concurrency < 1)
    return InvalidArgument("--concurrency must be at least 1");
  if (options.max_connections < 1) return InvalidArgument("max_connections must be at least 1");
  if (options.distinct_bodies < 1) return InvalidArgument("distinct_bodies must be at least 1");
  if (!(options.timeout_seconds > 0)) return InvalidArgument("timeout must be positive");
  const bool shm = options.shared_memory != BenchSharedMemory::kNone;
  const bool cuda = options.shared_memory == BenchSharedMemory::kCuda;
  if (!shm && options.output_shared_memory_size > 0)
    return InvalidArgument("--output-shared-memory-size needs --shared-memory system or cuda");
  if (!shm && options.verify)
    return InvalidArgument("--verify needs --shared-memory system or cuda");
  if (options.shared_memory_device < 0)
    return InvalidArgument("--shared-memory-device must be a CUDA ordinal (0 or more)");
  if (!cuda && options.shared_memory_device != 0)
    return InvalidArgument("--shared-memory-device needs --shared-memory cuda");
  // Before the server is asked anything: without a GPU this run cannot start.
  if (cuda) {
    RETURN_IF_ERROR(bench::CudaShmUsable(options.shared_memory_device)
                        .WithContext("--shared-memory cuda on cuda:" +
                                     std::to_string(options.shared_memory_device)));
  }

  // The objects' names are unlinked once registered; until then a signal
  // that ends the process must not leave them in /dev/shm. Another run in
  // this process may hold the handlers already, which serves this one too.
  std::optional<ShmSignalCleanup> cleanup;
  if (options.shared_memory == BenchSharedMemory::kSystem) {
    Result<ShmSignalCleanup> installed = ShmSignalCleanup::Install();
    if (installed.ok())
      cleanup.emplace(std::move(*installed));
    else if (installed.status().code() != StatusCode::kFailedPrecondition)
      return installed.status();
  }

  Result<BenchReport> report = [&]() -> Result<BenchReport> {
    if (options.transport == BenchTransport::kGrpc) {
#ifdef HEARTH_HAVE_GRPC
      return bench::RunGrpcBench(options, err);
#else
      return Unimplemented(
          "--transport grpc: this hearth was built without gRPC (configured with "
          "-DHEARTH_GRPC=OFF, or without grpc++, protobuf, protoc and grpc_cpp_plugin); use "
          "--transport rest, or rebuild with Debian's libgrpc++-dev protobuf-compiler-grpc");
#endif
    }
    return RunRestBench(options, err);
  }();
  if (!report.ok()) return report.status();
  report->url = options.url;
  report->model = options.model;
  report->version = options.version;
  report->transport = options.transport == BenchTransport::kGrpc ? "grpc" : "rest";
  report->shared_memory = cuda ? "cuda" : shm ? "system" : "none";
  report->output_shared_memory_size = options.output_shared_memory_size;
  report->shared_memory_device = options.shared_memory_device;
  report->request_rate = options.request_rate;
  if (options.request_rate > 0)
    report->arrival = options.arrival == BenchArrival::kPoisson ? "poisson" : "constant";
  return report;
}

std::string ReportJson(const BenchReport& report) {
  json out = {{"url", report.url},
              {"model", report.model},
              {"version", report.version},
              {"mode", report.mode},
              {"transport", report.transport},
              {"protocol", report.protocol},
              {"shared_memory", report.shared_memory},
              {"concurrency", report.concurrency},
              {"batch", report.batch},
              {"seconds", report.seconds},
              {"requests", report.requests},
              {"errors", report.errors},
              {"requests_per_s", report.requests_per_s},
              {"inferences_per_s", report.inferences_per_s},
              {"latency_ms",
               {{"p50", report.latency_ms.p50},
                {"p90", report.latency_ms.p90},
                {"p99", report.latency_ms.p99},
                {"max", report.latency_ms.max},
                {"mean", report.latency_ms.mean}}}};
  if (report.shared_memory != "none") {
    out["output_shared_memory_size"] = report.output_shared_memory_size;
    out["shm_checked"] = report.shm_checked;
  }
  if (report.shared_memory == "cuda") out["shared_memory_device"] = report.shared_memory_device;
  if (report.mode == "request_rate") {
    out["request_rate"] = report.request_rate;
    out["arrival"] = report.arrival;
    out["unsent"] = report.unsent;
  }
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ReportTable(const BenchReport& report) {
  char buffer[2048];
  char rate[32];
  std::snprintf(rate, sizeof(rate), "%g", report.request_rate);
  std::string load = report.mode == "request_rate"
                         ? std::string(rate) + " req/s (" + report.arrival + " arrivals, at most " +
                               std::to_string(report.concurrency) + " in flight)"
                         : std::to_string(report.concurrency) + " in flight (closed loop)";
  const std::string where =
      report.shared_memory == "cuda"
          ? "CUDA shared memory on cuda:" + std::to_string(report.shared_memory_device)
          : "system shared memory";
  const std::string transport =
      report.transport + " (" + report.protocol + "), " +
      (report.shared_memory != "none"
           ? "tensors in " + where + " (" + std::to_string(report.shm_checked) +
                 " answers checked in their region)"
           : std::string("tensors in the messages"));
  std::snprintf(buffer, sizeof(buffer),
                "model        %s%s @ %s\n"
                "load         %s, batch %d, %.1f s measured\n"
                "transport    %s\n"
                "requests     %llu   errors %llu%s\n"
                "throughput   %.1f requests/s   %.1f inferences/s\n"
                "latency ms   p50 %.3f   p90 %.3f   p99 %.3f   max %.3f   mean %.3f\n",
                report.model.c_str(), report.version.empty() ? "" : (" v" + report.version).c_str(),
                report.url.c_str(), load.c_str(), report.batch, report.seconds, transport.c_str(),
                static_cast<unsigned long long>(report.requests),
                static_cast<unsigned long long>(report.errors),
                report.unsent > 0 ? ("   unsent " + std::to_string(report.unsent)).c_str() : "",
                report.requests_per_s, report.inferences_per_s, report.latency_ms.p50,
                report.latency_ms.p90, report.latency_ms.p99, report.latency_ms.max,
                report.latency_ms.mean);
  return buffer;
}

}  // namespace hearth
