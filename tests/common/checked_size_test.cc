#include "common/checked_size.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <vector>

namespace hearth {
namespace {

TEST(CheckedSize, ShapeBytesMultiplies) {
  const std::vector<int64_t> shape = {3, 5};
  auto r = ShapeBytes(DType::kF32, shape, "input 'x'");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, 60u);
  const std::vector<int64_t> scalar = {};
  EXPECT_EQ(*ShapeBytes(DType::kI64, scalar, "s"), 8u);
  const std::vector<int64_t> empty = {4, 0, 7};
  EXPECT_EQ(*ShapeBytes(DType::kF16, empty, "e"), 0u);
}

// 2^61 + 1 elements of 8 bytes wrap to 8 in 64 bits: the case a parser once let through.
TEST(CheckedSize, WrappingProductIsAnError) {
  const std::vector<int64_t> shape = {2305843009213693953};
  auto r = ShapeBytes(DType::kI64, shape, "input 'ids'");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("input 'ids'"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("2305843009213693953"), std::string::npos);
  const std::vector<int64_t> two = {int64_t{1} << 32, int64_t{1} << 32};
  EXPECT_FALSE(ShapeElements(two, "t").ok());
  EXPECT_FALSE(ShapeBytes(DType::kU8, two, "t").ok());
}

TEST(CheckedSize, NegativeDimensionIsAnError) {
  const std::vector<int64_t> shape = {4, -1};
  auto r = ShapeElements(shape, "output 'y'");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("negative"), std::string::npos);
}

TEST(CheckedSize, CountBytesAndAlign) {
  EXPECT_EQ(*CountBytes(16, 4096, "slot"), 65536u);
  EXPECT_FALSE(CountBytes(uint64_t{1} << 40, uint64_t{1} << 40, "slot").ok());
  EXPECT_EQ(*CheckedAlignUp(65, 64), 128u);
  EXPECT_FALSE(CheckedAlignUp(std::numeric_limits<uint64_t>::max() - 3, 64).has_value());
  EXPECT_FALSE(CheckedAdd(std::numeric_limits<uint64_t>::max(), 1).has_value());
  EXPECT_EQ(*CheckedMul(1u << 20, 1u << 20), uint64_t{1} << 40);
}

TEST(CheckedSize, DeadlinesSaturate) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  EXPECT_EQ(SaturatingDeadline<Clock>(now, uint64_t{1} << 63), Clock::time_point::max());
  EXPECT_EQ(SaturatingDeadline<Clock>(now, std::numeric_limits<uint64_t>::max()),
            Clock::time_point::max());
  EXPECT_EQ(SaturatingDeadline<Clock>(now, 1500), now + std::chrono::microseconds(1500));
  EXPECT_GT(SaturatingDeadline<Clock>(now, uint64_t{1} << 62), now);
}

}  // namespace
}  // namespace hearth
