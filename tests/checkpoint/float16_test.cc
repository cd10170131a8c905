#include "common/float16.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>

namespace hearth {
namespace {

static_assert(FloatToHalf(1.0f) == 0x3C00 && HalfToFloat(0x3C00) == 1.0f);
static_assert(FloatToBFloat16(1.0f) == 0x3F80 && BFloat16ToFloat(0x3F80) == 1.0f);

float FromBits(uint32_t bits) { return std::bit_cast<float>(bits); }

// Rounds a finite float to a binary format with `fraction_bits` stored
// mantissa bits, smallest normal exponent `min_exponent` and largest finite
// value `max_finite`, to nearest with ties to even, in double arithmetic: an
// implementation independent of the bit tricks under test.
double ReferenceRound(float value, int fraction_bits, int min_exponent, double max_finite) {
  const double x = value;
  if (x == 0) return x;
  const int exponent = std::max(std::ilogb(x), min_exponent);
  const double ulp = std::ldexp(1.0, exponent - fraction_bits);
  double rounded = std::nearbyint(std::fabs(x) / ulp) * ulp;
  if (rounded > max_finite) rounded = std::numeric_limits<double>::infinity();
  return std::copysign(rounded, x);
}

double ReferenceHalf(float value) { return ReferenceRound(value, 10, -14, 65504.0); }
double ReferenceBFloat16(float value) {
  return ReferenceRound(value, 7, -126, static_cast<double>(FromBits(0x7F7F0000u)));
}

void ExpectSameValue(double actual, double expected, float input) {
  EXPECT_EQ(actual, expected) << "input " << std::hexfloat << input;
  EXPECT_EQ(std::signbit(actual), std::signbit(expected)) << "input " << std::hexfloat << input;
}

TEST(Float16, KnownHalfValues) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3C00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xC000);
  EXPECT_EQ(FloatToHalf(0.5f), 0x3800);
  EXPECT_EQ(FloatToHalf(0.1f), 0x2E66);
  EXPECT_EQ(FloatToHalf(3.14159265f), 0x4248);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(0x1p-14f), 0x0400);    // smallest normal
  EXPECT_EQ(FloatToHalf(0x1p-24f), 0x0001);    // smallest subnormal
  EXPECT_EQ(FloatToHalf(0x3FFp-24f), 0x03FF);  // largest subnormal

  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0400), 0x1p-14f);
  EXPECT_EQ(HalfToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x8001), -0x1p-24f);
  EXPECT_EQ(HalfToFloat(0x03FF), 0x3FFp-24f);
  EXPECT_EQ(HalfToFloat(0x0200), 0x1p-15f);
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

TEST(Float16, HalfRoundsTiesToEven) {
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f), 0x3C00);             // tie, 0x3C00 is even
  EXPECT_EQ(FloatToHalf(1.0f + 0x3p-11f), 0x3C02);             // tie, 0x3C02 is even
  EXPECT_EQ(FloatToHalf(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);  // just above the tie
  EXPECT_EQ(FloatToHalf(2.0f - 0x1p-11f), 0x4000);             // tie that carries into the exponent
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie between 65504 and 2^16 rounds to infinity
  EXPECT_EQ(FloatToHalf(-65520.0f), 0xFC00);
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);  // tie between 0 and 2^-24
  EXPECT_EQ(FloatToHalf(-0x1p-25f), 0x8000);
  EXPECT_EQ(FloatToHalf(0x1.000002p-25f), 0x0001);  // just above it
  EXPECT_EQ(FloatToHalf(0x3p-25f), 0x0002);         // tie between 1 and 2 ulps
  EXPECT_EQ(FloatToHalf(0x5p-25f), 0x0002);         // tie between 2 and 3 ulps
  EXPECT_EQ(FloatToHalf(0x7FFp-25f), 0x0400);       // largest subnormal rounds up to normal
  EXPECT_EQ(FloatToHalf(0x1p-30f), 0x0000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(Float16, HalfInfinityAndNaN) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToHalf(kInf), 0x7C00);
  EXPECT_EQ(FloatToHalf(-kInf), 0xFC00);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::max()), 0x7C00);
  EXPECT_EQ(HalfToFloat(0x7C00), kInf);
  EXPECT_EQ(HalfToFloat(0xFC00), -kInf);

  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FBFFFFFu, 0xFF800001u}) {
    const uint16_t half = FloatToHalf(FromBits(nan));
    EXPECT_EQ(half & 0x7C00, 0x7C00) << std::hex << nan;
    EXPECT_NE(half & 0x03FF, 0) << std::hex << nan << " must stay a NaN";
    EXPECT_EQ(half & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
  }
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7C01)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0xFFFF)));
}

TEST(Float16, EveryHalfSurvivesARoundTrip) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto half = static_cast<uint16_t>(bits);
    const float value = HalfToFloat(half);
    if ((half & 0x7C00) == 0x7C00 && (half & 0x03FF) != 0) {
      ASSERT_TRUE(std::isnan(value)) << std::hex << bits;
      ASSERT_EQ(FloatToHalf(value), half | 0x0200) << std::hex << bits;  // quieted
      continue;
    }
    ASSERT_EQ(FloatToHalf(value), half) << std::hex << bits;
    if (!std::isinf(value)) {
      ASSERT_EQ(static_cast<double>(value), ReferenceHalf(value));
    }
  }
}

TEST(Float16, HalfMatchesReferenceRounding) {
  // Midpoints between neighbouring halves and the floats either side of them.
  for (uint32_t bits = 0; bits < 0x7C00; ++bits) {
    const double low = HalfToFloat(static_cast<uint16_t>(bits));
    const double high = bits + 1 < 0x7C00 ? HalfToFloat(static_cast<uint16_t>(bits + 1)) : 65536.0;
    const auto mid = static_cast<float>((low + high) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      ExpectSameValue(HalfToFloat(FloatToHalf(f)), ReferenceHalf(f), f);
      ExpectSameValue(HalfToFloat(FloatToHalf(-f)), ReferenceHalf(-f), -f);
    }
    if (::testing::Test::HasFailure()) return;
  }
  // A spread over all finite floats.
  for (uint64_t bits = 0; bits < 0x100000000ull; bits += 997) {
    const float f = FromBits(static_cast<uint32_t>(bits));
    if (std::isnan(f)) continue;
    ExpectSameValue(HalfToFloat(FloatToHalf(f)), ReferenceHalf(f), f);
    if (::testing::Test::HasFailure()) return;
  }
}

#ifdef __FLT16_MANT_DIG__
TEST(Float16, HalfMatchesTheCompilersConversion) {
  for (uint64_t bits = 0; bits < 0x100000000ull; bits += 1013) {
    const float f = FromBits(static_cast<uint32_t>(bits));
    if (std::isnan(f)) continue;
    const auto expected = std::bit_cast<uint16_t>(static_cast<_Float16>(f));
    ASSERT_EQ(FloatToHalf(f), expected) << std::hexfloat << f;
  }
}
#endif

TEST(BFloat16, KnownValuesAndTies) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xC000);
  EXPECT_EQ(FloatToBFloat16(3.14159265f), 0x4049);
  EXPECT_EQ(FloatToBFloat16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f), 0x3F80);  // tie, even below
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x3p-8f), 0x3F82);  // tie, even above
  EXPECT_EQ(FloatToBFloat16(1.0f + 0x1p-8f + 0x1p-23f), 0x3F81);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to infinity
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00018000u)), 0x0002);  // subnormal tie to even
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00008000u)), 0x0000);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(BFloat16ToFloat(0x0001), FromBits(0x00010000u));
}

TEST(BFloat16, NaNStaysNaN) {
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u}) {
    const uint16_t b = FloatToBFloat16(FromBits(nan));
    EXPECT_TRUE(std::isnan(BFloat16ToFloat(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
  }
}

TEST(BFloat16, EveryValueSurvivesARoundTripAndMatchesReference) {
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const auto b = static_cast<uint16_t>(bits);
    const float value = BFloat16ToFloat(b);
    if (std::isnan(value)) continue;
    ASSERT_EQ(FloatToBFloat16(value), b) << std::hex << bits;
  }
  for (uint64_t bits = 0; bits < 0x100000000ull; bits += 997) {
    const float f = FromBits(static_cast<uint32_t>(bits));
    if (std::isnan(f)) continue;
    ExpectSameValue(BFloat16ToFloat(FloatToBFloat16(f)), ReferenceBFloat16(f), f);
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace
}  // namespace hearth
