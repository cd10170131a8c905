// The two kinds of arena behind hearth/arena.h. Arena::Create and
// ArenaMapping::Map dispatch here on the device kind; nothing outside
// src/memory should need this header.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hearth/arena.h"

namespace hearth {

Result<std::unique_ptr<Arena>> CreateHostArena(uint64_t size);
#ifdef _WIN32
Result<std::unique_ptr<ArenaMapping>> MapHostArena(uint64_t handle, uint64_t size);
#else
Result<std::unique_ptr<ArenaMapping>> MapHostArena(UniqueFd fd, uint64_t size);
#endif

// Without HEARTH_HAVE_CUDA these return Unavailable("built without CUDA support").
Result<std::unique_ptr<Arena>> CreateCudaArena(int device, uint64_t size);
#ifdef _WIN32
// Takes `handle` (an NT handle of this process): closed on every return.
Result<std::unique_ptr<ArenaMapping>> MapCudaArena(uint64_t handle, int device, uint64_t size);
#else
Result<std::unique_ptr<ArenaMapping>> MapCudaArena(UniqueFd fd, int device, uint64_t size);
#endif

// Rounds `value` up to a multiple of `alignment` (a power of two); false on overflow.
inline bool AlignUp(uint64_t value, uint64_t alignment, uint64_t* out) {
  uint64_t mask = alignment - 1;
  if (value > UINT64_MAX - mask) return false;
  *out = (value + mask) & ~mask;
  return true;
}

// Rounds `value` up to a multiple of `multiple` (> 0, any value); false on overflow.
inline bool RoundUpToMultiple(uint64_t value, uint64_t multiple, uint64_t* out) {
  uint64_t rem = value % multiple;
  if (rem == 0) {
    *out = value;
    return true;
  }
  if (value > UINT64_MAX - (multiple - rem)) return false;
  *out = value + (multiple - rem);
  return true;
}

// Whether [offset, offset + len) lies within [0, size), without overflow.
inline bool RangeWithin(uint64_t offset, uint64_t len, uint64_t size) {
  return offset <= size && len <= size - offset;
}

// The checks every ArenaWriter::Begin makes of the chunk it is asked for.
inline Status CheckWriterChunk(uint64_t offset, uint64_t len, uint64_t max_chunk, uint64_t size,
                               const char* arena_kind) {
  if (len > max_chunk) {
    return InvalidArgument("chunk of " + std::to_string(len) + " bytes exceeds the writer's " +
                           std::to_string(max_chunk) + "-byte maximum");
  }
  if (!RangeWithin(offset, len, size)) {
    return InvalidArgument("bytes [" + std::to_string(offset) + ", +" + std::to_string(len) +
                           ") lie outside the " + std::to_string(size) + "-byte " + arena_kind);
  }
  return Status::Ok();
}

}  // namespace hearth
