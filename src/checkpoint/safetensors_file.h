// Reading one safetensors file of a checkpoint: shared by the header reader
// (safetensors_reader.cc) and Checkpoint (checkpoint.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/checkpoint.h"

namespace hearth {

// Reads up to `size` bytes at `offset`, retrying EINTR and short reads.
// Returns fewer bytes only at end of file.
Result<size_t> PreadFull(int fd, void* buffer, size_t size, uint64_t offset,
                         const std::string& path);

// `subject` is empty or "tensor 'name': ".
Status TruncatedError(const std::string& path, std::string_view subject, uint64_t offset,
                      uint64_t size, size_t got, uint64_t file_size);

// Reads and validates the header of `file`, whose fd, path and size are set;
// fills its data_start, metadata and tensor_count and appends its tensors
// (sorted by name, `shard` set) to `tensors`. With `header_budget`, a header
// longer than what it has left fails with kResourceExhausted; what the header
// takes is subtracted.
Status ReadSafetensorsHeader(CheckpointFile& file, uint32_t shard, uint64_t* header_budget,
                             std::vector<TensorInfo>* tensors);

}  // namespace hearth
