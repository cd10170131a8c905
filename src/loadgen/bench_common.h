// What the REST driver (load_generator.cc) and the gRPC driver
// (grpc_load.cc) of `hearth bench` share: the model's tensors as the run
// sends them, random input bytes, the shared-memory slots (system or CUDA),
// and the record every request leaves (samples, errors) with its summary.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "hearth/status.h"
#include "loadgen/load_generator.h"
#include "loadgen/shm_region.h"

namespace hearth::bench {

using Clock = std::chrono::steady_clock;

size_t ElementBytes(const std::string& datatype);  // 0: not a fixed-size type bench sends

struct TensorMetadata {  // as the server's model metadata lists a tensor
  std::string name, datatype;
  std::vector<int64_t> dims;
};

struct TensorSpec {
  std::string name, datatype;
  std::vector<int64_t> shape;  // inputs: the request's shape, batch included
  int64_t elements = 1;
  // Inputs: elements * element size. Requested outputs: the room given to it
  // in shared memory (--output-shared-memory-size, else from the metadata),
  // 0 where it is not known (then only without shared memory).
  uint64_t bytes = 0;
};

struct ModelSpec {
  std::string label;  // "model 'm'" or "model 'm' version v", for messages
  std::vector<TensorSpec> inputs;
  // The outputs the requests name: --output's, else (with shared memory)
  // every output of the metadata; empty: none named, the server sends all.
  std::vector<TensorSpec> outputs;
};

std::string ModelLabel(const BenchOptions& options);

// Checks the metadata against the options (batch against max_batch_size,
// input datatypes and fixed dimensions; with shared memory, that every
// requested output exists and has a known size) and fixes the shapes.
Result<ModelSpec> ResolveModel(const BenchOptions& options, int64_t max_batch,
                               const std::vector<TensorMetadata>& inputs,
                               const std::vector<TensorMetadata>& outputs);

// Random little-endian bytes for `input` (the binary extension's and
// raw_input_contents' layout): normal floats, small non-negative integers,
// random booleans.
std::string RandomInputBytes(const TensorSpec& input, std::mt19937_64& rng);

// ---- shared memory (system or CUDA) ----------------------------------------------

// Registration with the server, over the transport of the run: system
// regions through the systemsharedmemory calls, CUDA regions through the
// cudasharedmemory ones.
class RegionControl {
 public:
  virtual ~RegionControl() = default;
  virtual Status Register(const std::string& name, const RegionHandle& handle) = 0;
  virtual Status Unregister(BenchSharedMemory kind, const std::string& name) = 0;
};

// A control on a connection (REST) or channel (gRPC) of its own to
// options.url over options.transport.
Result<std::unique_ptr<RegionControl>> MakeRegionControl(const BenchOptions& options);

// The body of REST's POST /v2/cudasharedmemory/region/{name}/register, in
// Triton's form: {"raw_handle": {"b64": ...}, "device_id": N, "byte_size": N}.
std::string CudaRegisterBody(const RegionHandle& handle);

// Makes a slot's region of `bytes`, to be registered under `name`.
using RegionFactory =
    std::function<Result<std::unique_ptr<ShmRegion>>(const std::string& name, uint64_t bytes)>;
// The regions options.shared_memory asks for: system objects keyed
// "/<name>", or device memory on options.shared_memory_device.
RegionFactory DefaultRegionFactory(const BenchOptions& options);

struct ShmTensor {
  uint64_t offset = 0;  // in the slot's region
  uint64_t bytes = 0;
};

// One request slot: a region of its own holding its inputs (filled once)
// and room for each requested output. One request at a time uses a slot.
struct ShmSlot {
  std::string region;  // the name it is registered under
  std::unique_ptr<ShmRegion> memory;
  std::vector<ShmTensor> inputs, outputs;  // in ModelSpec's order
  bool first_checked = false;
  Status poison;  // why BeforeRequest could not write the poison (the answer cannot be checked)
  std::vector<std::string> readback;  // per output: what a checked answer left
};

// What an output of a response said about where it is.
struct OutputPlacement {
  std::string name;
  bool in_region = false;  // carried shared_memory_region
  // Carried neither data nor a region: Triton's REST answer for an output
  // written where the request asked (its region); byte_size is then what
  // the answer's datatype and shape come to (0 for BYTES).
  bool where_asked = false;
  std::string region;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  bool inline_data = false;  // carried data (JSON, binary, raw contents)
};

// Owns the slots of a run and their registration: Create makes each slot's
// region with `factory`, fills it, registers it (then tells the region:
// a system object's name is unlinked at once, system_shm.h); the
// destructor unregisters every region it registered before the regions are
// freed, so a failed Create leaves nothing behind on either side. Slots are
// used from many threads, each slot by one request at a time.
class ShmSession {
 public:
  static Result<std::unique_ptr<ShmSession>> Create(const ModelSpec& model,
                                                    const BenchOptions& options, int slots,
                                                    RegionControl* control,
                                                    const RegionFactory& factory,
                                                    std::mt19937_64& rng);
  ~ShmSession();
  ShmSession(const ShmSession&) = delete;
  ShmSession& operator=(const ShmSession&) = delete;

  size_t size() const { return slots_.size(); }
  ShmSlot& slot(size_t i) { return slots_[i]; }
  // Before a request: fills the outputs' room with the poison pattern when
  // this request's answer will be checked (every one with --verify, else the
  // slot's first). A failure is kept in the slot and becomes the request's
  // error in AfterResponse: the request is sent either way.
  void BeforeRequest(ShmSlot& slot) const;
  // After a successful response: each requested output must name the slot's
  // region at its offset, fit its room, carry no inline data and (when
  // checked) have changed the poison. Returns what is wrong, else Ok; a
  // checked response is counted in `record`, and the run's first is copied
  // into its sample.
  Status AfterResponse(ShmSlot& slot, const std::vector<OutputPlacement>& outputs,
                       class RunRecord* record);

 private:
  ShmSession(const ModelSpec& model, const BenchOptions& options, RegionControl* control)
      : model_(model), options_(options), control_(control) {}
  bool Checked(const ShmSlot& slot) const { return options_.verify || !slot.first_checked; }

  const ModelSpec& model_;
  const BenchOptions& options_;
  RegionControl* control_;
  std::vector<ShmSlot> slots_;
  std::vector<std::pair<BenchSharedMemory, std::string>> registered_;
};

// ---- the record of a run --------------------------------------------------------

struct Sample {
  Clock::time_point start;  // scheduled (open loop) or sent (closed loop)
  double latency_ms;
};

// Thread-safe: senders and completion callbacks record concurrently.
class RunRecord {
 public:
  RunRecord(const BenchOptions& options, std::FILE* err) : options_(options), err_(err) {}
  void RecordSample(Clock::time_point start, Clock::time_point done);
  void RecordError(const std::string& message);
  // A response whose outputs were checked in their region; the first
  // becomes the report's sample (when make_sample fails, its error is
  // returned and a later response is asked again).
  Status RecordChecked(const std::function<Result<BenchShmSample>()>& make_sample);
  // Fills requests, errors, latencies and the sample into `report`.
  void Summarize(Clock::time_point measure_begin, Clock::time_point measure_end,
                 BenchReport* report);

 private:
  const BenchOptions& options_;
  std::FILE* err_;
  std::mutex mu_;
  std::vector<Sample> samples_;
  uint64_t errors_ = 0;
  uint64_t checked_ = 0;
  std::vector<std::string> first_errors_;
  std::optional<BenchShmSample> sample_;
};

inline Clock::duration ToDuration(double seconds) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// A name unique to this run, for region names and object keys:
// "hearth-bench-<pid>-<random>".
std::string RunTag();

}  // namespace hearth::bench
