// Host launchers of cuda_write_probe's kernels. Each runs on `device` through
// the CUDA runtime (which shares the primary context ArenaMapping::Map made
// current) and returns "" on success or "cudaErrorName: text" on failure.
#pragma once

#include <cstdint>
#include <string>

namespace hearth::probe {

// Writes one byte in every 4 KiB page of [data, data + size).
std::string WriteThroughMapping(int device, const void* data, uint64_t size);

// Sums the bytes of [data, data + size) into *sum.
std::string SumThroughMapping(int device, const void* data, uint64_t size, uint64_t* sum);

// The per-thread stack size (cudaLimitStackSize) of `device`'s context.
std::string StackSizeLimit(int device, uint64_t* bytes);

}  // namespace hearth::probe
