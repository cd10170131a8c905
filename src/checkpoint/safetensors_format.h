// Pieces of the safetensors format shared by the reader and the writer: the
// byte order of the length prefix, and how
// names, shapes and byte ranges are spelled in error messages.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "hearth/dtype.h"

namespace hearth {

inline uint64_t LoadLittleEndian64(const unsigned char* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

inline void StoreLittleEndian64(uint64_t value, unsigned char* bytes) {
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(value >> (8 * i));
}

// 'text' for an error message: control bytes escaped, cut after 128 bytes.
std::string QuoteForMessage(std::string_view text);
// "[2, 3, 4]"
std::string FormatShape(std::span<const int64_t> shape);
// "[begin, begin + size)"
std::string FormatRange(uint64_t begin, uint64_t size);

}  // namespace hearth
