// Triton's classification of an output: the top entries of each row as
// BYTES "value:index", largest first.
#include <cstring>
#include <string>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"
#include "server/response_assembly.h"

namespace hearth {
namespace {

std::vector<std::string> Elements(const InferTensor& t) {
  std::vector<std::string> out;
  const std::byte* p = t.data.data();
  for (size_t at = 0; at + 4 <= t.data.size();) {
    uint32_t len;
    std::memcpy(&len, p + at, 4);
    out.emplace_back(reinterpret_cast<const char*>(p + at + 4), len);
    at += 4 + len;
  }
  return out;
}

template <typename T>
InferTensor Tensor(DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  InferTensor t;
  t.name = "logits";
  t.dtype = dtype;
  t.shape = std::move(shape);
  std::vector<std::byte> bytes(values.size() * sizeof(T));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  t.data = std::move(bytes);
  return t;
}

TEST(Classify, EachRowsLargestEntriesFirstWithTheirIndex) {
  const InferTensor t = Tensor<float>(DType::kF32, {2, 4},
                                      {0.1f, 0.7f, 0.2f, 0.7f,  //
                                       -1.f, -3.f, 5.f, 0.f});
  const InferTensor c = Classify(t, 2, /*batching=*/true);
  EXPECT_EQ(c.dtype, DType::kBytes);
  EXPECT_EQ(c.shape, (std::vector<int64_t>{2, 2}));
  // A tie: the lower index first.
  EXPECT_EQ(Elements(c),
            (std::vector<std::string>{"0.700000:1", "0.700000:3", "5.000000:2", "0.000000:3"}));
}

TEST(Classify, ACountPastTheRowIsTheWholeRowAndOtherTypesWork) {
  const InferTensor t = Tensor<int64_t>(DType::kI64, {3}, {4, -2, 9});
  const InferTensor c = Classify(t, 10, /*batching=*/false);
  EXPECT_EQ(c.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(Elements(c), (std::vector<std::string>{"9.000000:2", "4.000000:0", "-2.000000:1"}));
  const InferTensor h =
      Tensor<uint16_t>(DType::kF16, {1, 2}, {FloatToHalf(0.5f), FloatToHalf(2.0f)});
  EXPECT_EQ(Elements(Classify(h, 1, true)), (std::vector<std::string>{"2.000000:1"}));
}

}  // namespace
}  // namespace hearth
