// A closed-loop HTTP load generator for `hearth serve`: `concurrency`
// connections, each sending binary-tensor requests back to back for
// `seconds`, with random FP32 inputs of shape [batch, dims...].
//
//   serve_load --port 8000 --model mlp --input input --sample-elems 16384 --batch 16
//              --concurrency 8 --seconds 10 [--output argmax]
//
// Prints one line: requests/s (= batches/s), samples/s, latency p50/p90/p99.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace beast = boost::beast;
namespace http = beast::http;
using tcp = boost::asio::ip::tcp;

int main(int argc, char** argv) {
  CLI::App app{"HTTP load generator for hearth serve (binary tensor data)"};
  std::string host = "127.0.0.1", model = "mlp", input = "input", output;
  int port = 8000, batch = 16, concurrency = 4;
  int64_t sample_elems = 0;
  double seconds = 10, warmup = 1;
  app.add_option("--host", host);
  app.add_option("--port", port);
  app.add_option("--model", model);
  app.add_option("--input", input);
  app.add_option("--output", output, "request only this output (binary)");
  app.add_option("--sample-elems", sample_elems, "FP32 elements per sample")->required();
  app.add_option("--batch", batch);
  app.add_option("--concurrency", concurrency);
  app.add_option("--seconds", seconds);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);

  std::string header = R"({"inputs":[{"name":")" + input + R"(","datatype":"FP32","shape":[)" +
                       std::to_string(batch) + "," + std::to_string(sample_elems) +
                       R"(],"parameters":{"binary_data_size":)" +
                       std::to_string(4 * batch * sample_elems) + "}}]";
  if (!output.empty()) header += R"(,"outputs":[{"name":")" + output + R"(","parameters":{"binary_data":true}}])";
  header += "}";
  std::vector<float> x(static_cast<size_t>(batch * sample_elems));
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  for (float& v : x) v = dist(rng);
  std::string body = header;
  body.append(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  const std::string target = "/v2/models/" + model + "/infer";

  std::atomic<bool> measuring{false}, stop{false};
  std::mutex mu;
  std::vector<double> latencies_ms;
  std::atomic<long> errors{0};
  auto worker = [&] {
    try {
      boost::asio::io_context io;
      tcp::resolver resolver(io);
      beast::tcp_stream stream(io);
      stream.connect(resolver.resolve(host, std::to_string(port)));
      stream.socket().set_option(tcp::no_delay(true));
      http::request<http::string_body> req{http::verb::post, target, 11};
      req.set(http::field::host, host);
      req.set(http::field::content_type, "application/octet-stream");
      req.set("Inference-Header-Content-Length", std::to_string(header.size()));
      req.body() = body;
      req.prepare_payload();
      std::vector<double> mine;
      beast::flat_buffer buffer;
      while (!stop) {
        const auto t0 = std::chrono::steady_clock::now();
        http::write(stream, req);
        http::response<http::string_body> res;
        http::read(stream, buffer, res);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (res.result() != http::status::ok) {
          if (errors++ < 3) std::fprintf(stderr, "HTTP %d: %s\n", res.result_int(), res.body().substr(0, 200).c_str());
        } else if (measuring) {
          mine.push_back(ms);
        }
      }
      std::lock_guard lock(mu);
      latencies_ms.insert(latencies_ms.end(), mine.begin(), mine.end());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "connection failed: %s\n", e.what());
      ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < concurrency; ++i) threads.emplace_back(worker);
  std::this_thread::sleep_for(std::chrono::duration<double>(warmup));
  measuring = true;
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  measuring = false;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop = true;
  for (auto& t : threads) t.join();
  std::sort(latencies_ms.begin(), latencies_ms.end());
  auto pct = [&](double p) {
    return latencies_ms.empty() ? 0.0 : latencies_ms[static_cast<size_t>(p * (latencies_ms.size() - 1))];
  };
  const double rps = static_cast<double>(latencies_ms.size()) / elapsed;
  std::printf("serve_load model=%s batch=%d concurrency=%d requests=%zu batches_per_s=%.1f samples_per_s=%.1f "
              "p50_ms=%.3f p90_ms=%.3f p99_ms=%.3f errors=%ld\n",
              model.c_str(), batch, concurrency, latencies_ms.size(), rps, rps * batch, pct(0.5), pct(0.9),
              pct(0.99), errors.load());
  return errors > 0 ? 1 : 0;
}
