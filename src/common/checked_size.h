// Checked arithmetic for sizes and deadlines that come from outside: request
// shapes, configs, peers. Every `shape x element size` and every
// `count x per-item bytes` that a client or a file can influence goes through
// these; an overflow is an error naming what overflowed, never a wrapped value.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth {

inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// Rounds up to a multiple of `align` (a power of two); nullopt on overflow.
inline std::optional<uint64_t> CheckedAlignUp(uint64_t v, uint64_t align) {
  auto r = CheckedAdd(v, align - 1);
  if (!r) return std::nullopt;
  return *r & ~(align - 1);
}

// Elements of `shape`: the product of its dimensions. InvalidArgument naming
// `what` for a negative dimension or a product past 2^63.
Result<uint64_t> ShapeElements(std::span<const int64_t> shape, std::string_view what);

// Bytes of a tensor of `dtype` and `shape` (element size x ShapeElements),
// the same errors; also past 2^63 bytes.
Result<uint64_t> ShapeBytes(DType dtype, std::span<const int64_t> shape, std::string_view what);

// `count` items of `each` bytes; InvalidArgument naming `what` on overflow.
Result<uint64_t> CountBytes(uint64_t count, uint64_t each, std::string_view what);

// `start + micros`, saturating at time_point::max() instead of wrapping: a
// timeout too large to represent means "no deadline", never "already past".
template <typename Clock>
typename Clock::time_point SaturatingDeadline(typename Clock::time_point start, uint64_t micros) {
  using Duration = typename Clock::duration;
  const auto max = Clock::time_point::max();
  // How many microseconds still fit between start and the end of time.
  const auto room = std::chrono::duration_cast<std::chrono::microseconds>(max - start).count();
  if (room <= 0 || micros >= static_cast<uint64_t>(room)) return max;
  return start + std::chrono::duration_cast<Duration>(
                     std::chrono::microseconds(static_cast<int64_t>(micros)));
}

}  // namespace hearth
