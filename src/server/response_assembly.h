// What the server makes of a worker's answer for each request of a batch:
// the rows of a batched output split per request, Triton's classification
// of an output, and the pieces of a decoupled model's responses joined into
// one answer. Pure functions over bytes the worker wrote, each bounded by
// the tensor it reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/inference_api.h"

namespace hearth {

// Byte ranges of consecutive rows of a slot tensor at `base`, `rows_per_job`
// for each request in turn: fixed-size types by bytes per row, BYTES by
// walking its elements. nullopt when the tensor's own bytes (which the
// worker can still write) no longer hold what its shape says.
std::optional<std::vector<std::span<const std::byte>>> SplitRows(
    const std::byte* base, const control::SlotTensor& t, DType dtype,
    const std::vector<int64_t>& rows_per_job);

// Triton's classification of an output tensor (RequestedOutput::class_count).
// With `labels` (the output's label_filename, read with the config), an
// element whose index has a label answers "value:index:label", as Triton's.
InferTensor Classify(const InferTensor& t, uint32_t count, bool batching,
                     const std::vector<std::string>* labels = nullptr);

// A non-streaming request to a decoupled model is answered once: each BYTES
// output's pieces joined element by element, in order; every other output
// as the last response that held it gave it.
struct JoinedOutput {
  bool seen = false;
  std::vector<int64_t> shape;
  std::vector<std::string> elements;  // BYTES
  std::vector<std::byte> bytes;       // other types
};

// Adds one response's piece of output `spec` to `j` (BYTES: element by
// element; a vector of any length, dims [-1]: after the last piece; any
// other: in its place); InvalidArgument when a BYTES output changes its
// shape between pieces.
Status JoinPiece(JoinedOutput& j, const TensorSpec& spec, const std::vector<int64_t>& shape,
                 std::span<const std::byte> data);

}  // namespace hearth
