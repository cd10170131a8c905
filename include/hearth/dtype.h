// Element types of tensors, named as safetensors names them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace hearth {

enum class DType : uint8_t {
  kF64 = 0,
  kF32,
  kF16,
  kBF16,
  kI64,
  kI32,
  kI16,
  kI8,
  kU8,
  kBool,
  kF8E4M3,
  kF8E5M2,
  // Variable-length byte strings (KServe BYTES): in requests, responses and
  // model signatures only, never in a checkpoint or an arena. Size 0, and
  // refused by IsStoredDType, so that every check of a stored tensor's dtype
  // refuses it.
  kBytes,
  kU16,
  kU32,
  kU64,
};
// One past the largest DType value.
inline constexpr int kDTypeLimit = 16;
// Whether a number is a DType, BYTES included.
constexpr bool IsDType(int value) { return value >= 0 && value < kDTypeLimit; }
// Whether a number is a dtype a stored tensor may have: every DType but BYTES.
constexpr bool IsStoredDType(int value) {
  return IsDType(value) && value != static_cast<int>(DType::kBytes);
}

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors name: "F32", "BF16", "F8_E4M3", ...
std::string_view DTypeName(DType dtype);
// Parses a safetensors dtype name (exact, case-sensitive); nullopt if unknown.
std::optional<DType> ParseDType(std::string_view name);

// Bytes of a tensor: element size x prod(shape). nullopt for a negative
// dimension or a product that overflows 64 bits.
std::optional<uint64_t> TensorBytes(DType dtype, std::span<const int64_t> shape);
// "[2,3]": how error messages write a shape.
std::string ShapeString(std::span<const int64_t> shape);

}  // namespace hearth
