// JSON as the checkpoint files need it read: nlohmann::json, refusing a NUL
// byte (its lexer takes one for the end of the input and would ignore what
// follows), duplicate keys (nlohmann keeps the last, other readers the
// first, so a document with duplicates means different things to
// different readers), and nesting deeper than kMaxStrictJsonDepth (which
// bounds what a document of nothing but '[' can take).
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "hearth/status.h"

namespace hearth {

inline constexpr size_t kMaxStrictJsonDepth = 64;

struct StrictJsonErrors {
  // Any error but a duplicate key, as "invalid JSON: ..." or "JSON nests
  // deeper than 64 levels".
  std::function<Status(std::string_view what)> invalid;
  // The first duplicate key: `depth` 1 for a key of the top-level object,
  // `top_key` the top-level key it is under (empty at depth 1).
  std::function<Status(size_t depth, const std::string& top_key, const std::string& key)> duplicate;
};

Result<nlohmann::json> ParseStrictJson(std::string_view text, const StrictJsonErrors& errors);

}  // namespace hearth
