// Reading JSON values with simdjson's On-Demand API for the KServe request
// decoder: how messages show a value, what a failed typed read means, and
// checks of values read only to be skipped. On-Demand checks only what it
// is asked to read; SkipChecked and CheckJson are how the decoder makes sure
// malformed JSON anywhere is refused.
#pragma once

#include <simdjson.h>

#include <string>
#include <string_view>

#include "hearth/status.h"

namespace hearth::json_values {

namespace ondemand = simdjson::ondemand;
using simdjson::error_code;

// Deeper nesting is refused as malformed (simdjson's DOM parser refuses past
// 1024 levels); a KServe request needs at most kMaxTensorRank + 3 levels.
inline constexpr int kMaxJsonDepth = 256;

std::string_view Trim(std::string_view text);
// The text of the value `value` is at (only the bracket of an array or object).
std::string_view Token(ondemand::value& value);
// RFC 8259's number: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
bool IsJsonNumber(std::string_view s);
// How messages show a value: its text, or [...] and {...}.
std::string Describe(ondemand::value& value);
// Maps the error of a typed read (get_bool, get_uint64, ...) to
// INCORRECT_TYPE when the value is well-formed JSON that is not of that type
// or does not fit it; other errors are malformed JSON.
error_code TypeFault(ondemand::value& value, error_code error);
// Reads a value it has no use for, checking that it is well-formed JSON.
error_code SkipChecked(ondemand::value& value, int depth);
// Reads the whole document and says where it is malformed, if it is.
Status CheckJson(const char* json, size_t size, size_t capacity);
// The error for malformed JSON.
Status Malformed(error_code error);

}  // namespace hearth::json_values
