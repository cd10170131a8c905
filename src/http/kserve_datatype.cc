// KServe v2 datatype names for hearth's element types (declared in
// src/server/inference_api.h). The F8 types have no KServe name.
#include <array>
#include <optional>
#include <string_view>

#include "server/inference_api.h"

namespace hearth {
namespace {

struct KserveName {
  DType dtype;
  std::string_view name;
};

constexpr std::array<KserveName, 10> kKserveNames = {{
    {DType::kBool, "BOOL"},
    {DType::kU8, "UINT8"},
    {DType::kI8, "INT8"},
    {DType::kI16, "INT16"},
    {DType::kI32, "INT32"},
    {DType::kI64, "INT64"},
    {DType::kF16, "FP16"},
    {DType::kBF16, "BF16"},
    {DType::kF32, "FP32"},
    {DType::kF64, "FP64"},
}};

}  // namespace

std::string_view KserveDatatypeName(DType dtype) {
  for (const KserveName& entry : kKserveNames) {
    if (entry.dtype == dtype) return entry.name;
  }
  return {};
}

std::optional<DType> ParseKserveDatatype(std::string_view name) {
  for (const KserveName& entry : kKserveNames) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

}  // namespace hearth
