// The JSON bodies of the generate extension and the OpenAI-compatible
// endpoints: parsed whole with nlohmann::json (they are small: a prompt, a
// few parameters), strictly, so that every reader of a body reads the same
// thing. Pure functions, thread-safe, never throw.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "hearth/status.h"

namespace hearth {

// Arrays and objects may nest at most this deep (a chat's messages with
// content parts and tool schemas need far less).
inline constexpr size_t kMaxJsonBodyDepth = 64;

// Parses `body` as one JSON value. InvalidArgument, naming the byte where
// it can, for: malformed JSON; invalid UTF-8 in a string (nlohmann checks
// every string, escapes included: a lone surrogate is refused); a NUL byte
// (nlohmann would take it for the end of the input); nesting deeper than
// kMaxJsonBodyDepth; a key that appears twice in one object (readers
// disagree on which one counts).
Result<nlohmann::json> ParseJsonBody(std::string_view body);

// The text of the value of `key` in the top-level object of `json`, exactly
// as it is there (escapes and spacing kept); nullopt if the key is not
// there. `json` must be a document that ParseJsonBody accepted whose root
// is an object. Keys are compared unescaped, as ParseJsonBody reads them.
std::optional<std::string_view> TopLevelValueText(std::string_view json, std::string_view key);

}  // namespace hearth
