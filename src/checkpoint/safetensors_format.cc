#include "checkpoint/safetensors_format.h"

#include <algorithm>
#include <cstdio>

namespace hearth {

std::string QuoteForMessage(std::string_view text) {
  constexpr size_t kMaxBytes = 128;
  size_t end = std::min(text.size(), kMaxBytes);
  // Do not cut a UTF-8 sequence in two.
  while (end < text.size() && end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) {
    --end;
  }
  std::string out = "'";
  for (char c : text.substr(0, end)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7F || c == '\\' || c == '\'') {
      char escaped[5];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", byte);
      out += escaped;
    } else {
      out += c;
    }
  }
  if (end < text.size()) out += "...";
  out += '\'';
  return out;
}

std::string FormatShape(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  out += ']';
  return out;
}

std::string FormatRange(uint64_t begin, uint64_t size) {
  return "[" + std::to_string(begin) + ", " + std::to_string(begin + size) + ")";
}

}  // namespace hearth
