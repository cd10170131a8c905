// Internal to the KServe codec (kserve_codec.cc, kserve_request.cc): how it
// writes names and datatypes into JSON and messages, and how it counts
// elements.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/dtype.h"

namespace hearth::kserve {

// A JSON string literal; bytes that are not UTF-8 are replaced.
std::string Quote(std::string_view text);
// The KServe name ("FP32"), or hearth's for types KServe cannot name.
std::string DatatypeString(DType dtype);
// prod(shape); nullopt on a negative dimension or a product past 2^62.
std::optional<uint64_t> ElementCount(const std::vector<int64_t>& shape);
// `input "x"`: how messages name an input.
std::string InputLabel(std::string_view name);

}  // namespace hearth::kserve
