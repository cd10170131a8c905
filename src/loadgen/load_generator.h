// A load generator for a KServe v2 REST server (`hearth bench`), in the
// spirit of Triton's perf_analyzer.
//
// RunBench reads the model's metadata, prepares a few random request bodies
// for every input, then drives the server either closed loop (`concurrency`
// connections, each sending back to back) or open loop (`request_rate`
// requests per second, Poisson or evenly spaced arrivals, over a pool of
// keep-alive connections that grows as needed). In open loop a request's
// latency runs from its *scheduled* send time, so queueing in the client
// (the server being slower than the rate) shows up in the percentiles.
//
// RunBench blocks for warmup + seconds and is not reentrant-safe with respect
// to the `err` stream only (it writes the first few failures there).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "hearth/status.h"

namespace hearth {

enum class BenchProtocol { kBinary, kJson };
enum class BenchArrival { kPoisson, kConstant };

struct BenchOptions {
  std::string url;  // http://HOST:PORT (a trailing '/' is allowed; no path, no https)
  std::string model;
  std::string version;      // empty: the server's choice
  int concurrency = 1;      // closed loop: connections sending back to back
  double request_rate = 0;  // > 0: open loop at this many requests/s instead
  BenchArrival arrival = BenchArrival::kPoisson;
  int max_connections = 256;  // open loop: the pool grows up to this
  int batch = 1;              // must be 1 for a model without a batch dimension
  double seconds = 10;        // measured window
  double warmup = 1;          // sent but not measured
  BenchProtocol protocol = BenchProtocol::kBinary;
  std::vector<std::string> outputs;  // empty: all outputs
  int distinct_bodies = 8;           // random request bodies, cycled
  uint64_t seed = 1;
  double timeout_seconds = 30;  // per socket read/write
  int errors_to_print = 3;      // the first few failures go to `err`
};

struct BenchLatency {
  double p50 = 0, p90 = 0, p99 = 0, max = 0, mean = 0;  // milliseconds
};

struct BenchReport {
  std::string url, model, version;
  std::string mode;      // "concurrency" or "request_rate"
  std::string protocol;  // "binary" or "json"
  std::string arrival;   // open loop only: "poisson" or "constant"
  int concurrency = 0;   // closed loop: N; open loop: connections the pool grew to
  double request_rate = 0;
  int batch = 1;
  double seconds = 0;     // the measured window, as it really ran
  uint64_t requests = 0;  // successful requests whose (scheduled) start fell in the window
  uint64_t errors = 0;    // failed requests or connections, warmup included
  uint64_t unsent = 0;    // open loop: scheduled in the window, still queued 2 s after it ends
  double requests_per_s = 0;
  double inferences_per_s = 0;  // requests_per_s * batch
  BenchLatency latency_ms;
  std::vector<std::string> first_errors;
};

// Runs the benchmark. A bad option, a bad URL, an unreachable server, an
// unknown model or an unsupported input datatype is an error; failed requests
// during the run are not (they are counted in the report).
Result<BenchReport> RunBench(const BenchOptions& options, std::FILE* err = stderr);

// One JSON object, one line.
std::string ReportJson(const BenchReport& report);
// A human-readable table.
std::string ReportTable(const BenchReport& report);

}  // namespace hearth
