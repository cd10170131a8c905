// The names each protocol gives hearth's element types: KServe v2 ("FP32",
// "BYTES") and Triton's model configuration ("TYPE_FP32", "TYPE_STRING").
// One table, so that the front-ends and the config parser never disagree.
// The F8 types have neither name; BYTES (DType::kBytes) exists only in
// requests, responses and model signatures, never in checkpoints.
#pragma once

#include <optional>
#include <string_view>

#include "hearth/dtype.h"

namespace hearth {

// "" where the type has no KServe name.
std::string_view KserveDatatypeName(DType dtype);
// Exact and case-sensitive; nullopt if unknown.
std::optional<DType> ParseKserveDatatype(std::string_view name);

// "" where the type has no config name.
std::string_view TritonDataTypeName(DType dtype);
std::optional<DType> ParseTritonDataType(std::string_view name);

}  // namespace hearth
