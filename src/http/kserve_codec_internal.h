// Internal to the KServe codec (kserve_codec.cc, kserve_request.cc): how it
// writes names and datatypes into JSON and messages (sizes: common/checked_size.h).
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
// `input "x"`: how messages name an input.
std::string InputLabel(std::string_view name);

}  // namespace hearth::kserve
