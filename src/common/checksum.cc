#include "hearth/checksum.h"

#include <xxhash.h>

#include <cstdio>
#include <cstring>

namespace hearth {
#if defined(__x86_64__) && !defined(__AVX2__)
namespace internal {
uint64_t BlockDigestAvx2(const void* data, size_t len);
}  // namespace internal

uint64_t BlockDigest(std::span<const std::byte> block) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 ? internal::BlockDigestAvx2(block.data(), block.size())
              : XXH3_64bits(block.data(), block.size());
}
#else
uint64_t BlockDigest(std::span<const std::byte> block) {
  return XXH3_64bits(block.data(), block.size());
}
#endif

uint64_t CombineBlockDigests(std::span<const uint64_t> digests) {
  std::vector<unsigned char> bytes(digests.size() * 8);
  for (size_t i = 0; i < digests.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<unsigned char>(digests[i] >> (8 * b));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

std::string ChecksumHex(uint64_t checksum) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(checksum));
  return text;
}

}  // namespace hearth
