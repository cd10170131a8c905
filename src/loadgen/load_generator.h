// A load generator for a KServe v2 server (`hearth bench`), in the spirit
// of Triton's perf_analyzer: over REST (HTTP/1.1, JSON or the binary
// extension) or gRPC (inference.GRPCInferenceService/ModelInfer, when this
// hearth is built with gRPC), with tensors in the requests or in system
// shared memory.
//
// RunBench reads the model's metadata, prepares a few random requests,
// then drives the server either closed loop (`concurrency` requests in
// flight, each slot sending back to back) or open loop (`request_rate`
// requests per second, Poisson or evenly spaced arrivals, over at most
// `max_connections` requests in flight). In open loop a request's latency
// runs from its *scheduled* send time, so queueing in the client (the
// server being slower than the rate) shows up in the percentiles.
//
// REST runs one thread per keep-alive connection. gRPC runs grpc++'s
// callback API: no thread per request; one channel (HTTP/2 connection) per
// 100 requests in flight, under hearth's 128 streams per connection.
//
// With shared memory, each request slot (one per request in flight) gets a
// region of its own holding its inputs, filled once, and room for its
// outputs: kSystem, a POSIX shared-memory object (system_shm.h: its name is
// unlinked once the server has registered it, so none is left behind),
// registered by its key; kCuda, device memory of this process on GPU
// `shared_memory_device` (cuda_shm.h), registered by its CUDA IPC handle.
// Every request names its inputs and outputs in its slot's region
// (shared_memory_region, _offset, _byte_size), and no tensor byte travels
// in the request or response. Every response is checked to name the region
// and carry no inline data; the slot's first response (with `verify`, every
// response) must also have overwritten the poison the outputs' room was
// filled with. The regions are unregistered at the end.
//
// RunBench blocks for warmup + seconds and is not reentrant-safe with respect
// to the `err` stream only (it writes the first few failures there).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "hearth/status.h"

namespace hearth {

enum class BenchProtocol { kBinary, kJson };  // REST bodies; gRPC is always protobuf
enum class BenchTransport { kRest, kGrpc };
enum class BenchSharedMemory { kNone, kSystem, kCuda };
enum class BenchArrival { kPoisson, kConstant };

struct BenchOptions {
  // REST: http://HOST:PORT (a trailing '/' is allowed; no path, no https).
  // gRPC: HOST:PORT or grpc://HOST:PORT ([V6]:PORT for IPv6).
  std::string url;
  BenchTransport transport = BenchTransport::kRest;
  BenchSharedMemory shared_memory = BenchSharedMemory::kNone;
  // Room per output in shared memory, bytes; 0: the output's size from the
  // model's metadata (which must then have fixed dimensions).
  uint64_t output_shared_memory_size = 0;
  int shared_memory_device = 0;  // kCuda: the CUDA ordinal of the GPU holding the regions
  bool verify = false;  // shared memory: check every response's outputs, not only the first
  std::string model;
  std::string version;      // empty: the server's choice
  int concurrency = 1;      // closed loop: requests in flight, each slot back to back
  double request_rate = 0;  // > 0: open loop at this many requests/s instead
  BenchArrival arrival = BenchArrival::kPoisson;
  int max_connections = 256;  // open loop: at most this many requests in flight
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

// The first response of a shared-memory run whose outputs were checked:
// its slot's input bytes and the output bytes as the server left them in
// the region, so that a caller can check the model's answer.
struct BenchTensorBytes {
  std::string name;
  std::string bytes;
};
struct BenchShmSample {
  std::vector<BenchTensorBytes> inputs, outputs;
};

struct BenchReport {
  std::string url, model, version;
  std::string mode;           // "concurrency" or "request_rate"
  std::string transport;      // "rest" or "grpc"
  std::string protocol;       // REST: "binary" or "json" (shared memory: "json"); gRPC: "protobuf"
  std::string shared_memory;  // "none", "system" or "cuda"
  uint64_t output_shared_memory_size = 0;  // shared memory: room per output (0: each output's size)
  int shared_memory_device = 0;            // cuda: the GPU
  std::string arrival;                     // open loop only: "poisson" or "constant"
  int concurrency = 0;  // closed loop: N; open loop: most requests in flight (REST: connections)
  double request_rate = 0;
  int batch = 1;
  double seconds = 0;     // the measured window, as it really ran
  uint64_t requests = 0;  // successful requests whose (scheduled) start fell in the window
  uint64_t errors = 0;    // failed requests or connections, warmup included
  uint64_t unsent = 0;    // open loop: scheduled in the window, still queued 2 s after it ends
  double requests_per_s = 0;
  double inferences_per_s = 0;  // requests_per_s * batch
  BenchLatency latency_ms;
  uint64_t shm_checked = 0;  // responses whose outputs were checked in their region
  std::vector<std::string> first_errors;
  std::optional<BenchShmSample> shm_sample;  // shared memory: see above
};

// GETs `path` from the server at `url` (http://HOST:PORT, as bench takes
// it) on a connection of its own: the body of a 200; for anything else an
// error naming the URL (the server's status and message, or why it cannot
// be reached). For `hearth status --url`.
Result<std::string> HttpGet(const std::string& url, const std::string& path,
                            double timeout_seconds = 10);

// Whether this hearth was built with gRPC (BenchTransport::kGrpc works).
bool BenchHasGrpc();

// Runs the benchmark. A bad option, a bad URL, an unreachable server, an
// unknown model, an unsupported input datatype, a region the server refuses,
// gRPC in a hearth built without it and CUDA shared memory where no GPU can
// hold it (checked first, before the server is asked anything) are errors;
// failed requests during
// the run are not (they are counted in the report; so is a response whose
// outputs are not where the request put them).
Result<BenchReport> RunBench(const BenchOptions& options, std::FILE* err = stderr);

// One JSON object, one line.
std::string ReportJson(const BenchReport& report);
// A human-readable table.
std::string ReportTable(const BenchReport& report);

}  // namespace hearth
