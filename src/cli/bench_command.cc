// `hearth bench`: drives a KServe v2 server (REST or gRPC) with random
// requests and reports throughput and latency.
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "loadgen/load_generator.h"

namespace hearth::cli {
namespace {

// Runs the benchmark and prints its report (a table, or JSON).
int BenchAndReport(const BenchOptions& options, bool as_json) {
  signal(SIGPIPE, SIG_IGN);
  Result<BenchReport> report = RunBench(options, stderr);
  if (!report.ok()) return Fail(report.status());
  const std::string text = as_json ? ReportJson(*report) + "\n" : ReportTable(*report);
  std::fputs(text.c_str(), stdout);
  if (report->errors > 0) {
    std::fprintf(stderr, "hearth bench: %llu requests failed\n",
                 static_cast<unsigned long long>(report->errors));
    return 1;
  }
  if (report->requests == 0) {
    std::fprintf(stderr, "hearth bench: no request completed in the measured window\n");
    return 1;
  }
  return 0;
}

// What the command line sets.
struct BenchFlags {
  BenchOptions options;
  std::string protocol = "binary", arrival = "poisson";
  std::string transport = "rest", shared_memory = "none";
  bool json = false;
};

int RunBenchCommand(BenchFlags& f) {
  f.options.protocol = f.protocol == "json" ? BenchProtocol::kJson : BenchProtocol::kBinary;
  f.options.arrival = f.arrival == "constant" ? BenchArrival::kConstant : BenchArrival::kPoisson;
  f.options.transport = f.transport == "grpc" ? BenchTransport::kGrpc : BenchTransport::kRest;
  f.options.shared_memory = f.shared_memory == "system" ? BenchSharedMemory::kSystem
                            : f.shared_memory == "cuda" ? BenchSharedMemory::kCuda
                                                        : BenchSharedMemory::kNone;
  return BenchAndReport(f.options, f.json);
}

}  // namespace

Subcommand AddBenchCommand(CLI::App& app) {
  auto* bench = app.add_subcommand(
      "bench",
      "drive a KServe v2 server (REST or gRPC) with random requests and report throughput and "
      "latency");
  auto flags = std::make_shared<BenchFlags>();
  BenchFlags& f = *flags;
  bench
      ->add_option("--url", f.options.url,
                   "rest: http://HOST:PORT of the server; grpc: HOST:PORT (or grpc://HOST:PORT) "
                   "of its gRPC port")
      ->required();
  bench
      ->add_option("--transport", f.transport,
                   "rest (KServe v2 over HTTP/1.1) or grpc (inference.GRPCInferenceService/"
                   "ModelInfer; needs a hearth built with gRPC)")
      ->check(CLI::IsMember({"rest", "grpc"}))
      ->capture_default_str();
  bench
      ->add_option("--shared-memory", f.shared_memory,
                   "none (tensors in the messages), system (as perf_analyzer: inputs and "
                   "outputs in POSIX shared-memory regions registered with the server, one per "
                   "request in flight) or cuda (the same in device memory of this process, "
                   "registered by its CUDA IPC handle; needs a GPU)")
      ->check(CLI::IsMember({"none", "system", "cuda"}))
      ->capture_default_str();
  bench
      ->add_option("--shared-memory-device", f.options.shared_memory_device,
                   "with --shared-memory cuda: the GPU (CUDA ordinal) holding the regions")
      ->capture_default_str();
  bench->add_option("--output-shared-memory-size", f.options.output_shared_memory_size,
                    "with --shared-memory system or cuda: bytes of room per output (default: "
                    "the output's size from the model's metadata)");
  bench->add_flag("--verify", f.options.verify,
                  "with --shared-memory system or cuda: check that every response wrote its "
                  "outputs into the region (default: each slot's first)");
  bench->add_option("--model", f.options.model, "model name")->required();
  bench->add_option("--version", f.options.version, "model version (default: the server's choice)");
  auto* concurrency_option =
      bench
          ->add_option("--concurrency", f.options.concurrency,
                       "closed loop: N requests in flight, each sent when the last returned")
          ->capture_default_str();
  bench
      ->add_option("--request-rate", f.options.request_rate,
                   "open loop: R requests/s; latency counts from each request's scheduled time")
      ->excludes(concurrency_option);
  bench
      ->add_option("--arrival", f.arrival,
                   "open loop arrivals: poisson or constant (evenly spaced)")
      ->check(CLI::IsMember({"poisson", "constant"}))
      ->capture_default_str();
  bench
      ->add_option("--max-connections", f.options.max_connections,
                   "open loop: at most this many requests in flight (rest: connections)")
      ->capture_default_str();
  bench->add_option("--batch", f.options.batch, "batch size of every request")
      ->capture_default_str();
  bench->add_option("--seconds", f.options.seconds, "measured duration")->capture_default_str();
  bench->add_option("--warmup", f.options.warmup, "unmeasured seconds before it")
      ->capture_default_str();
  bench
      ->add_option("--protocol", f.protocol,
                   "rest bodies: binary (tensor data after a JSON header) or json; with "
                   "shared memory the body is JSON either way")
      ->check(CLI::IsMember({"binary", "json"}))
      ->capture_default_str();
  bench->add_option("--output", f.options.outputs, "request only these outputs (default: all)");
  bench->add_option("--seed", f.options.seed, "random seed for inputs and arrivals")
      ->capture_default_str();
  bench->add_flag("--json", f.json, "print one JSON object instead of a table");
  return {bench, [flags] { return RunBenchCommand(*flags); }};
}

}  // namespace hearth::cli
