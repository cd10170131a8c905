#include "hearth/checksum.h"

#include <xxhash.h>

#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace hearth {
namespace {

// BlockDigest may run a build of XXH3 for AVX2; it must equal the portable one.
TEST(Checksum, BlockDigestIsXxh3ForEverySize) {
  std::mt19937_64 rng(11);
  std::vector<std::byte> data(3 << 20);
  for (auto& b : data) b = std::byte(rng());
  for (size_t n : {0ul, 1ul, 3ul, 16ul, 17ul, 128ul, 129ul, 240ul, 241ul, 1000ul, 4096ul, 65537ul,
                   1ul << 20, (3ul << 20) - 5}) {
    EXPECT_EQ(BlockDigest(std::span(data.data(), n)), XXH3_64bits(data.data(), n)) << n;
  }
}

TEST(Checksum, CombineIsXxh3OfLittleEndianDigests) {
  const uint64_t digests[2] = {0x0102030405060708ull, 0x1112131415161718ull};
  const unsigned char le[16] = {8,    7,    6,    5,    4,    3,    2,    1,
                                0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11};
  EXPECT_EQ(CombineBlockDigests(digests), XXH3_64bits(le, sizeof le));
  EXPECT_EQ(ChecksumHex(0xabcull), "0000000000000abc");
}

}  // namespace
}  // namespace hearth
