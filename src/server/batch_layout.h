// How a batch of requests lies in a worker's slot: where each input's rows
// and each output of known size go, which bytes the server copies into the
// slot, and which come from or go to clients' CUDA shared-memory regions
// (the worker copies those device to device). Pure: no slot, no I/O, no
// CUDA, so that it is tested without a worker or a GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/job_queue.h"

namespace hearth {

// What of a model the layout depends on.
struct BatchModel {
  std::span<const TensorSpec> inputs, outputs;
  bool batching = false;   // max_batch_size > 0: tensors have a batch dimension
  bool decoupled = false;  // outputs are placed by the worker, response by response
};

// Bytes of one request's input that the server copies into the slot.
struct HostCopy {
  uint64_t slot_offset = 0;
  std::span<const std::byte> bytes;  // the request's (it outlives the batch)
};

// Where one request's share of a placed output lies in the slot.
struct OutputShare {
  uint64_t slot_offset = 0;  // meaningless for a share in a CUDA region
  uint64_t bytes = 0;
};

struct BatchLayout {
  // Everything of the run message but `seq` and `slot_bytes`: the inputs'
  // and placed outputs' places, the free room's start, and the CUDA
  // regions (each once, however many requests name it) and copies.
  control::Run run;
  std::vector<HostCopy> host_copies;
  // Per output: true where output i of job j goes to a CUDA region: its
  // bytes are written there by the worker, and never read from the slot.
  std::vector<std::vector<bool>> output_in_cuda;  // [job][output]
  // Per placed output, each request's share: [job][output] (all zero for an
  // output the worker places).
  std::vector<std::vector<OutputShare>> output_shares;
};

// The bytes of an input: its data's, or, in a CUDA region, the byte_size
// it names there.
uint64_t SlotBytesOf(const InferTensor& input);

// A batch of several requests holds at most so many bytes in CUDA regions:
// a worker that takes device addresses stages a merged batch's tensors in
// device memory it keeps (a request alone is taken where it lies).
inline constexpr uint64_t kMaxMergedRegionBytes = 256ull << 20;

// How many of `jobs`, from the first, one run can hold within
// control::kMaxRunRegions distinct CUDA regions, control::kMaxDeviceCopies
// copies, `max_input_bytes` of inputs and, with more than one,
// `max_region_bytes` in CUDA regions (inputs' and outputs'); at least 1 (a
// request that alone is over them fails alone: LayOutBatch, or the slot's
// limit).
size_t JobsThatFit(std::span<const std::shared_ptr<Job>> jobs,
                   uint64_t max_input_bytes = control::kMaxSlotBytes,
                   uint64_t max_region_bytes = kMaxMergedRegionBytes);

// Lays out `jobs` (checked by the server against the model: each has every
// input, of the batch's shape; each CUDA output of a fixed size, the room
// for it checked): each input's rows request after request, then each
// output whose size the server knows. `compact`: for a worker that takes
// device addresses, bytes in CUDA regions get no room in the slot
// (control::Run::compact). InvalidArgument when an output's size
// overflows, or when the jobs are over the run's limits.
Result<BatchLayout> LayOutBatch(const BatchModel& model, std::span<const std::shared_ptr<Job>> jobs,
                                bool compact = false);

// The slot a run starts with: its inputs and the outputs the server
// places, and room for those the worker places, if any: half as much again
// as the rest, at least 64 KiB (it grows on demand when that is not enough).
uint64_t InitialSlotBytes(const control::Run& run);

}  // namespace hearth
