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

namespace hearth {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = boost::asio::ip::tcp;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

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

// ---- inputs -----------------------------------------------------------------

struct InputSpec {
  std::string name, datatype;
  std::vector<int64_t> shape;  // the request's shape, batch included
  int64_t elements = 1;
};

size_t ElementBytes(const std::string& datatype) {
  if (datatype == "FP32" || datatype == "INT32") return 4;
  if (datatype == "FP64" || datatype == "INT64") return 8;
  if (datatype == "FP16" || datatype == "BF16" || datatype == "INT16") return 2;
  if (datatype == "INT8" || datatype == "UINT8" || datatype == "BOOL") return 1;
  return 0;
}

// IEEE half from a float in a modest range (the random inputs are); values
// below the half normal range flush to zero.
uint16_t ToHalf(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
  if (exponent <= 0) return static_cast<uint16_t>(sign);
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exponent) << 10) |
                               ((bits >> 13) & 0x3ff));
}

struct PreparedBody {
  std::string body;
  size_t header_length = 0;  // binary only: the JSON header's size
};

template <typename T>
void AppendRaw(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

PreparedBody MakeBody(const std::vector<InputSpec>& inputs, const BenchOptions& options,
                      std::mt19937_64& rng) {
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> small(0, 9);
  std::bernoulli_distribution coin;
  const bool binary = options.protocol == BenchProtocol::kBinary;
  json header = {{"inputs", json::array()}};
  std::string data;
  for (const InputSpec& input : inputs) {
    json tensor = {{"name", input.name}, {"datatype", input.datatype}, {"shape", input.shape}};
    json values = json::array();
    std::string bytes;
    for (int64_t i = 0; i < input.elements; ++i) {
      const std::string& t = input.datatype;
      if (t == "FP32" || t == "FP64" || t == "FP16" || t == "BF16") {
        const float v = normal(rng);
        if (!binary) {
          values.push_back(v);
        } else if (t == "FP32") {
          AppendRaw(bytes, v);
        } else if (t == "FP64") {
          AppendRaw(bytes, static_cast<double>(v));
        } else if (t == "FP16") {
          AppendRaw(bytes, ToHalf(v));
        } else {
          uint32_t bits;
          std::memcpy(&bits, &v, 4);
          AppendRaw(bytes, static_cast<uint16_t>(bits >> 16));
        }
      } else if (t == "BOOL") {
        const bool v = coin(rng);
        if (binary)
          AppendRaw(bytes, static_cast<uint8_t>(v));
        else
          values.push_back(v);
      } else {  // integers: small non-negative values, safe as indices
        const int v = small(rng);
        if (!binary)
          values.push_back(v);
        else if (t == "INT64")
          AppendRaw(bytes, static_cast<int64_t>(v));
        else if (t == "INT32")
          AppendRaw(bytes, static_cast<int32_t>(v));
        else if (t == "INT16")
          AppendRaw(bytes, static_cast<int16_t>(v));
        else if (t == "INT8")
          AppendRaw(bytes, static_cast<int8_t>(v));
        else
          AppendRaw(bytes, static_cast<uint8_t>(v));
      }
    }
    if (binary) {
      tensor["parameters"] = {{"binary_data_size", bytes.size()}};
      data += bytes;
    } else {
      tensor["data"] = std::move(values);
    }
    header["inputs"].push_back(std::move(tensor));
  }
  if (!options.outputs.empty()) {
    header["outputs"] = json::array();
    for (const std::string& name : options.outputs) {
      json output = {{"name", name}};
      if (binary) output["parameters"] = {{"binary_data", true}};
      header["outputs"].push_back(std::move(output));
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

Result<std::vector<InputSpec>> ReadInputs(Connection& connection, const Endpoint& endpoint,
                                          const BenchOptions& options,
                                          const std::string& model_path) {
  http::request<http::string_body> request{http::verb::get, model_path, 11};
  request.set(http::field::host, endpoint.host);
  request.keep_alive(false);
  Result<http::response<http::string_body>> response = connection.RoundTrip(request);
  if (!response.ok()) {
    return Unavailable("cannot reach the server at " + options.url + ": " +
                       response.status().message());
  }
  const std::string label = "model '" + options.model + "'" +
                            (options.version.empty() ? "" : " version " + options.version);
  if (response->result() == http::status::not_found) {
    return NotFound(label + " not found on " + options.url + " (" + ServerMessage(*response) + ")");
  }
  if (response->result() != http::status::ok) {
    return Unavailable("metadata of " + label + " on " + options.url + ": " +
                       ServerMessage(*response));
  }
  json metadata;
  try {
    metadata = json::parse(response->body());
  } catch (const json::exception& e) {
    return InvalidArgument("metadata of " + label + " is not JSON: " + e.what());
  }
  const int64_t max_batch = metadata.value("max_batch_size", int64_t{0});
  if (!metadata.contains("inputs") || !metadata["inputs"].is_array() ||
      metadata["inputs"].empty()) {
    return InvalidArgument("metadata of " + label + " lists no inputs");
  }
  if (max_batch == 0 && options.batch != 1) {
    return InvalidArgument(label + " has no batch dimension; --batch must be 1");
  }
  if (max_batch > 0 && options.batch > max_batch) {
    return InvalidArgument("--batch " + std::to_string(options.batch) + " exceeds " + label +
                           "'s max_batch_size " + std::to_string(max_batch));
  }
  std::vector<InputSpec> inputs;
  try {
    for (const json& tensor : metadata["inputs"]) {
      InputSpec input;
      input.name = tensor.at("name").get<std::string>();
      input.datatype = tensor.at("datatype").get<std::string>();
      if (ElementBytes(input.datatype) == 0) {
        return Unimplemented(
            "input '" + input.name + "' of " + label + " has datatype " + input.datatype +
            "; bench supports FP32, FP64, FP16, BF16, INT8, INT16, INT32, INT64, UINT8 "
            "and BOOL");
      }
      std::vector<int64_t> dims = tensor.at("shape").get<std::vector<int64_t>>();
      if (max_batch > 0) {
        if (dims.empty() || dims.front() != -1) {
          return InvalidArgument("input '" + input.name + "' of batching " + label +
                                 " does not start with the batch dimension -1");
        }
        dims.front() = options.batch;
      }
      for (size_t i = max_batch > 0 ? 1 : 0; i < dims.size(); ++i) {
        if (dims[i] < 0) {
          return Unimplemented("input '" + input.name + "' of " + label +
                               " has a variable dimension; bench needs fixed dims");
        }
      }
      for (int64_t d : dims) input.elements *= d;
      input.shape = std::move(dims);
      inputs.push_back(std::move(input));
    }
  } catch (const json::exception& e) {
    return InvalidArgument("metadata of " + label + ": " + e.what());
  }
  return inputs;
}

// ---- the run ------------------------------------------------------------------

struct Sample {
  Clock::time_point start;  // scheduled (open loop) or sent (closed loop)
  double latency_ms;
};

// What every sender shares: the prepared requests, the counters, the samples.
class RunState {
 public:
  RunState(const BenchOptions& options, Endpoint endpoint,
           std::vector<http::request<http::string_body>> requests, std::FILE* err)
      : options_(options),
        endpoint_(std::move(endpoint)),
        requests_(std::move(requests)),
        err_(err) {}

  const Endpoint& endpoint() const { return endpoint_; }
  const http::request<http::string_body>& NextRequest() {
    return requests_[next_++ % requests_.size()];
  }

  // Sends one request and records it, as a sample or as an error.
  void SendOne(Connection& connection, Clock::time_point start) {
    Result<http::response<http::string_body>> response = connection.RoundTrip(NextRequest());
    const Clock::time_point done = Clock::now();
    if (!response.ok()) {
      RecordError("connection to " + endpoint_.host + ":" + endpoint_.port + ": " +
                  response.status().message());
    } else if (response->result() != http::status::ok) {
      RecordError(ServerMessage(*response));
    } else {
      std::lock_guard lock(mu_);
      samples_.push_back({start, std::chrono::duration<double, std::milli>(done - start).count()});
    }
  }

  void RecordError(const std::string& message) {
    std::lock_guard lock(mu_);
    if (static_cast<int>(first_errors_.size()) < options_.errors_to_print) {
      first_errors_.push_back(message);
      if (err_ != nullptr)
        std::fprintf(err_, "hearth bench: request failed: %s\n", message.c_str());
    }
    ++errors_;
  }

  std::vector<Sample> TakeSamples() {
    std::lock_guard lock(mu_);
    return std::move(samples_);
  }
  uint64_t errors() {
    std::lock_guard lock(mu_);
    return errors_;
  }
  std::vector<std::string> first_errors() {
    std::lock_guard lock(mu_);
    return first_errors_;
  }

 private:
  const BenchOptions& options_;
  Endpoint endpoint_;
  std::vector<http::request<http::string_body>> requests_;
  std::atomic<uint64_t> next_{0};
  std::FILE* err_;
  std::mutex mu_;
  std::vector<Sample> samples_;
  uint64_t errors_ = 0;
  std::vector<std::string> first_errors_;
};

void RunClosedLoop(const BenchOptions& options, RunState& state, Clock::time_point end) {
  std::vector<std::thread> threads;
  for (int i = 0; i < options.concurrency; ++i) {
    threads.emplace_back([&] {
      Connection connection(state.endpoint(), options.timeout_seconds);
      while (Clock::now() < end) state.SendOne(connection, Clock::now());
    });
  }
  for (std::thread& t : threads) t.join();
}

// Open loop: one scheduler thread queues the scheduled send times; senders,
// each with its own connection, take them in order. When a send time comes
// and no sender is idle, the pool grows (up to max_connections); beyond that
// the request waits in the queue and its latency shows the wait.
int RunOpenLoop(const BenchOptions& options, RunState& state, Clock::time_point begin,
                Clock::time_point end, uint64_t* unsent, Clock::time_point measure_begin) {
  std::mutex mu;
  std::condition_variable ready;
  std::deque<Clock::time_point> queue;
  bool stop = false;
  int idle = 0;
  const Clock::time_point drain_deadline =
      end + std::chrono::duration_cast<Clock::duration>(
                std::chrono::duration<double>(std::min(options.timeout_seconds, 2.0)));
  std::vector<std::thread> senders;
  auto sender = [&] {
    Connection connection(state.endpoint(), options.timeout_seconds);
    std::unique_lock lock(mu);
    for (;;) {  // counted idle from creation, so a starting sender is not spawned for again
      ready.wait(lock, [&] { return stop || !queue.empty(); });
      // After the schedule ends, what is queued is still sent, until the drain deadline.
      if (queue.empty() || (stop && Clock::now() >= drain_deadline)) return;
      --idle;
      const Clock::time_point scheduled = queue.front();
      queue.pop_front();
      lock.unlock();
      state.SendOne(connection, scheduled);
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
      senders.emplace_back(sender);
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
        senders.emplace_back(sender);
      }
    }
    ready.notify_one();
    const double seconds = options.arrival == BenchArrival::kPoisson ? gap(rng) : interval;
    next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
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

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  // Nearest rank: the smallest value with at least p of the samples at or below it.
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(sorted.size())));
  return sorted[std::clamp<size_t>(rank, 1, sorted.size()) - 1];
}

}  // namespace

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
  ASSIGN_OR_RETURN(Endpoint endpoint, ParseUrl(options.url));

  std::string model_path = "/v2/models/" + options.model;
  if (!options.version.empty()) model_path += "/versions/" + options.version;
  Connection probe(endpoint, options.timeout_seconds);
  ASSIGN_OR_RETURN(std::vector<InputSpec> inputs, ReadInputs(probe, endpoint, options, model_path));

  std::mt19937_64 rng(options.seed);
  std::vector<http::request<http::string_body>> requests;
  for (int i = 0; i < options.distinct_bodies; ++i) {
    PreparedBody prepared = MakeBody(inputs, options, rng);
    http::request<http::string_body> request{http::verb::post, model_path + "/infer", 11};
    request.set(http::field::host, endpoint.host);
    request.keep_alive(true);
    if (options.protocol == BenchProtocol::kBinary) {
      request.set(http::field::content_type, "application/octet-stream");
      request.set("Inference-Header-Content-Length", std::to_string(prepared.header_length));
    } else {
      request.set(http::field::content_type, "application/json");
    }
    request.body() = std::move(prepared.body);
    request.prepare_payload();
    requests.push_back(std::move(request));
  }

  BenchReport report;
  report.url = options.url;
  report.model = options.model;
  report.version = options.version;
  report.protocol = options.protocol == BenchProtocol::kBinary ? "binary" : "json";
  report.batch = options.batch;
  report.request_rate = options.request_rate;
  RunState state(options, endpoint, std::move(requests), err);
  const Clock::time_point begin = Clock::now();
  const auto to_duration = [](double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  const Clock::time_point measure_begin = begin + to_duration(options.warmup);
  const Clock::time_point measure_end = measure_begin + to_duration(options.seconds);
  if (options.request_rate > 0) {
    report.mode = "request_rate";
    report.arrival = options.arrival == BenchArrival::kPoisson ? "poisson" : "constant";
    report.concurrency =
        RunOpenLoop(options, state, begin, measure_end, &report.unsent, measure_begin);
  } else {
    report.mode = "concurrency";
    report.concurrency = options.concurrency;
    RunClosedLoop(options, state, measure_end);
  }

  std::vector<double> latencies;
  double sum = 0;
  for (const Sample& s : state.TakeSamples()) {
    if (s.start < measure_begin || s.start >= measure_end) continue;
    latencies.push_back(s.latency_ms);
    sum += s.latency_ms;
  }
  std::sort(latencies.begin(), latencies.end());
  report.seconds = options.seconds;
  report.requests = latencies.size();
  report.errors = state.errors();
  report.first_errors = state.first_errors();
  report.requests_per_s = static_cast<double>(report.requests) / report.seconds;
  report.inferences_per_s = report.requests_per_s * report.batch;
  if (!latencies.empty()) {
    report.latency_ms = {Percentile(latencies, 0.50), Percentile(latencies, 0.90),
                         Percentile(latencies, 0.99), latencies.back(),
                         sum / static_cast<double>(latencies.size())};
  }
  return report;
}

std::string ReportJson(const BenchReport& report) {
  json out = {{"url", report.url},
              {"model", report.model},
              {"version", report.version},
              {"mode", report.mode},
              {"protocol", report.protocol},
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
                         ? std::string(rate) + " req/s (" + report.arrival + " arrivals, " +
                               std::to_string(report.concurrency) + " connections)"
                         : std::to_string(report.concurrency) + " connections (closed loop)";
  std::snprintf(buffer, sizeof(buffer),
                "model        %s%s @ %s\n"
                "load         %s, batch %d, %s protocol, %.1f s measured\n"
                "requests     %llu   errors %llu%s\n"
                "throughput   %.1f requests/s   %.1f inferences/s\n"
                "latency ms   p50 %.3f   p90 %.3f   p99 %.3f   max %.3f   mean %.3f\n",
                report.model.c_str(), report.version.empty() ? "" : (" v" + report.version).c_str(),
                report.url.c_str(), load.c_str(), report.batch, report.protocol.c_str(),
                report.seconds, static_cast<unsigned long long>(report.requests),
                static_cast<unsigned long long>(report.errors),
                report.unsent > 0 ? ("   unsent " + std::to_string(report.unsent)).c_str() : "",
                report.requests_per_s, report.inferences_per_s, report.latency_ms.p50,
                report.latency_ms.p90, report.latency_ms.p99, report.latency_ms.max,
                report.latency_ms.mean);
  return buffer;
}

}  // namespace hearth
