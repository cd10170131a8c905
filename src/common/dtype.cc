#include "hearth/dtype.h"

#include <array>

namespace hearth {
namespace {

struct DTypeEntry {
  std::string_view name;
  size_t size;
};

// Indexed by DType. BYTES has no safetensors name and no fixed size.
constexpr std::array<DTypeEntry, kDTypeLimit> kDTypes = {{
    {"F64", 8},
    {"F32", 4},
    {"F16", 2},
    {"BF16", 2},
    {"I64", 8},
    {"I32", 4},
    {"I16", 2},
    {"I8", 1},
    {"U8", 1},
    {"BOOL", 1},
    {"F8_E4M3", 1},
    {"F8_E5M2", 1},
    {"", 0},
    {"U16", 2},
    {"U32", 4},
    {"U64", 8},
}};

}  // namespace

size_t DTypeSize(DType dtype) {
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypes.size() ? kDTypes[i].size : 0;
}

std::string_view DTypeName(DType dtype) {
  if (dtype == DType::kBytes) return "BYTES";
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypes.size() ? kDTypes[i].name : "?";
}

std::optional<uint64_t> TensorBytes(DType dtype, std::span<const int64_t> shape) {
  if (!IsStoredDType(static_cast<int>(dtype))) return std::nullopt;  // BYTES: no fixed size
  uint64_t bytes = DTypeSize(dtype);
  for (int64_t dim : shape) {
    if (dim < 0 || __builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) {
      return std::nullopt;
    }
  }
  return bytes;
}

std::string ShapeString(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::optional<DType> ParseDType(std::string_view name) {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (!kDTypes[i].name.empty() && kDTypes[i].name == name) return static_cast<DType>(i);
  }
  return std::nullopt;
}

}  // namespace hearth
