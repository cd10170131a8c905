#include "common/datatype.h"

#include <array>

namespace hearth {
namespace {

struct Names {
  DType dtype;
  std::string_view kserve;
  std::string_view triton;
};

constexpr std::array<Names, 14> kNames = {{
    {DType::kBool, "BOOL", "TYPE_BOOL"},
    {DType::kU8, "UINT8", "TYPE_UINT8"},
    {DType::kU16, "UINT16", "TYPE_UINT16"},
    {DType::kU32, "UINT32", "TYPE_UINT32"},
    {DType::kU64, "UINT64", "TYPE_UINT64"},
    {DType::kI8, "INT8", "TYPE_INT8"},
    {DType::kI16, "INT16", "TYPE_INT16"},
    {DType::kI32, "INT32", "TYPE_INT32"},
    {DType::kI64, "INT64", "TYPE_INT64"},
    {DType::kF16, "FP16", "TYPE_FP16"},
    {DType::kBF16, "BF16", "TYPE_BF16"},
    {DType::kF32, "FP32", "TYPE_FP32"},
    {DType::kF64, "FP64", "TYPE_FP64"},
    {DType::kBytes, "BYTES", "TYPE_STRING"},
}};

}  // namespace

std::string_view KserveDatatypeName(DType dtype) {
  for (const Names& n : kNames)
    if (n.dtype == dtype) return n.kserve;
  return {};
}

std::optional<DType> ParseKserveDatatype(std::string_view name) {
  for (const Names& n : kNames)
    if (n.kserve == name) return n.dtype;
  return std::nullopt;
}

std::string_view TritonDataTypeName(DType dtype) {
  for (const Names& n : kNames)
    if (n.dtype == dtype) return n.triton;
  return {};
}

std::optional<DType> ParseTritonDataType(std::string_view name) {
  for (const Names& n : kNames)
    if (n.triton == name) return n.dtype;
  return std::nullopt;
}

}  // namespace hearth
