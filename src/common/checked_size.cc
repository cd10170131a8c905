#include "common/checked_size.h"

#include <limits>

namespace hearth {
namespace {

constexpr uint64_t kLimit = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

}  // namespace

Result<uint64_t> ShapeElements(std::span<const int64_t> shape, std::string_view what) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0)
      return InvalidArgument(std::string(what) + ": shape " + ShapeString(shape) +
                             " has a negative dimension");
    auto r = CheckedMul(n, static_cast<uint64_t>(d));
    if (!r || *r > kLimit)
      return InvalidArgument(std::string(what) + ": shape " + ShapeString(shape) +
                             " has more than 2^63 elements");
    n = *r;
  }
  return n;
}

Result<uint64_t> ShapeBytes(DType dtype, std::span<const int64_t> shape, std::string_view what) {
  ASSIGN_OR_RETURN(uint64_t n, ShapeElements(shape, what));
  auto bytes = CheckedMul(n, DTypeSize(dtype));
  if (!bytes || *bytes > kLimit)
    return InvalidArgument(std::string(what) + ": shape " + ShapeString(shape) + " of " +
                           std::string(DTypeName(dtype)) + " is more than 2^63 bytes");
  return *bytes;
}

Result<uint64_t> CountBytes(uint64_t count, uint64_t each, std::string_view what) {
  auto bytes = CheckedMul(count, each);
  if (!bytes || *bytes > kLimit)
    return InvalidArgument(std::string(what) + ": " + std::to_string(count) + " x " +
                           std::to_string(each) + " bytes is more than 2^63 bytes");
  return *bytes;
}

}  // namespace hearth
