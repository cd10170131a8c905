// Internal to the HTTP front-end's codecs (kserve_codec.cc, kserve_request.cc,
// generate.cc): how they write names, datatypes and tensor elements into
// JSON and messages (sizes: common/checked_size.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hearth/dtype.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth::kserve {

// A JSON string literal; bytes that are not UTF-8 are replaced.
std::string Quote(std::string_view text);
// The KServe name ("FP32"), or hearth's for types KServe cannot name.
std::string DatatypeString(DType dtype);
// `input "x"`: how messages name an input.
std::string InputLabel(std::string_view name);

// Checks an output the service returned: a datatype KServe names, a valid
// shape, and bytes that match it (for BYTES: exactly its shape's number of
// well-formed elements). Its number of elements, or Internal naming it.
Result<uint64_t> CheckOutputTensor(const InferTensor& tensor);
// Appends the `count` elements of a checked tensor as a flat JSON list:
// numbers in their shortest round-trip form (non-finite ones as null),
// booleans, and BYTES elements as strings (see AppendBytesString).
void AppendData(std::string& out, const InferTensor& tensor, uint64_t count);
// One BYTES element as a JSON string: valid UTF-8 as it is, and each byte
// that is not part of a valid UTF-8 sequence as \u00XX (its Latin-1
// character), so that the JSON is always valid.
void AppendBytesString(std::string& out, std::string_view text);

}  // namespace hearth::kserve
