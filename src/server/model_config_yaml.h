// What reading a model's config.yaml takes, shared by the files that read
// its parts (server/model_config.cc, server/sequence_config.cc): where an
// error is, and checked conversions of single values.
#pragma once

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "hearth/status.h"

namespace hearth::config_yaml {

struct Ctx {
  std::string file;
  // A config.pbtxt read as YAML (model_config_pbtxt.h): where each line of
  // the YAML came from in the file, which errors name instead of the line.
  const std::vector<std::string>* origins = nullptr;

  // "FILE:LINE" for yaml-cpp's 0-based `line` (-1: none).
  std::string Where(int line) const {
    if (origins == nullptr) return file + ":" + std::to_string(line >= 0 ? line + 1 : 0);
    if (line >= 0 && static_cast<size_t>(line) < origins->size() && !(*origins)[line].empty())
      return file + ":" + (*origins)[line];
    return file;
  }
  Status Error(const YAML::Node& node, const std::string& field, const std::string& what) const {
    return InvalidArgument(Where(node.Mark().line) + ": " + field + ": " + what);
  }
};

// A value as it may appear in a message: quoted, at most 64 characters.
inline std::string Quote(std::string_view text) {
  if (text.size() > 64) return "'" + std::string(text.substr(0, 61)) + "...'";
  return "'" + std::string(text) + "'";
}

inline Result<std::string> String(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsScalar()) return c.Error(n, field, "must be a single value");
  return n.Scalar();
}

// Decimal digits only, checked: no wrap-around ("-1" is not 2^64-1), no
// exponent or hex forms, out of range is an error.
template <typename T>
Result<T> Number(const Ctx& c, const YAML::Node& n, const std::string& field) {
  if (!n.IsScalar()) return c.Error(n, field, "must be a single value");
  const std::string& text = n.Scalar();
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec == std::errc::result_out_of_range)
    return c.Error(n, field, Quote(text) + " is out of range");
  if (ec != std::errc() || end != text.data() + text.size())
    return c.Error(n, field, Quote(text) + " is not a valid value");
  if constexpr (std::is_floating_point_v<T>) {
    if (!std::isfinite(value)) return c.Error(n, field, Quote(text) + " is not a finite number");
  }
  return value;
}

// A map key: a single value (a list or a map as a key is an error, not an abort).
inline Result<std::string> Key(const Ctx& c, const YAML::Node& key, const std::string& field) {
  if (!key.IsScalar()) return c.Error(key, field, "keys must be single values");
  return key.Scalar();
}

inline Result<std::vector<int64_t>> Dims(const Ctx& c, const YAML::Node& n,
                                         const std::string& field) {
  if (!n.IsSequence() || n.size() == 0)
    return c.Error(n, field, "must be a non-empty list of positive integers (-1: any size)");
  std::vector<int64_t> dims;
  for (const auto& d : n) {
    ASSIGN_OR_RETURN(int64_t v, Number<int64_t>(c, d, field));
    if (v <= 0 && v != -1)
      return c.Error(d, field,
                     "dimension " + std::to_string(v) + " must be positive, or -1 for any size");
    dims.push_back(v);
  }
  return dims;
}

}  // namespace hearth::config_yaml
