#include "checkpoint/synthetic.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "common/float16.h"
#include "hearth/checkpoint.h"
#include "hearth/checksum.h"
#include "temp_dir.h"

namespace hearth {
namespace {

using ::testing::HasSubstr;
using testing_util::TempDir;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

uint64_t FileDigest(const std::string& path) {
  const std::string bytes = ReadFile(path);
  return BlockDigest(std::as_bytes(std::span(bytes.data(), bytes.size())));
}

// The model's "xxh3-tree" checksum (hearth/checksum.h).
uint64_t TreeChecksum(const Checkpoint& checkpoint) {
  std::vector<uint64_t> digests;
  for (const TensorInfo& tensor : checkpoint.tensors()) {
    for (uint64_t offset = 0; offset < tensor.nbytes; offset += kChecksumBlockBytes) {
      std::vector<std::byte> block(std::min(kChecksumBlockBytes, tensor.nbytes - offset));
      EXPECT_TRUE(checkpoint.Read(tensor, offset, block).ok());
      digests.push_back(BlockDigest(block));
    }
  }
  return CombineBlockDigests(digests);
}

// Decodes every element of a F32, F16 or BF16 tensor.
std::vector<float> ReadFloats(const Checkpoint& checkpoint, const TensorInfo& tensor) {
  std::vector<std::byte> bytes(tensor.nbytes);
  EXPECT_TRUE(checkpoint.Read(tensor, 0, bytes).ok());
  std::vector<float> values(tensor.numel());
  for (size_t i = 0; i < values.size(); ++i) {
    if (tensor.dtype == DType::kF32) {
      uint32_t bits = 0;
      for (int b = 3; b >= 0; --b) bits = (bits << 8) | std::to_integer<uint32_t>(bytes[4 * i + b]);
      values[i] = std::bit_cast<float>(bits);
    } else {
      const auto bits = static_cast<uint16_t>(std::to_integer<uint16_t>(bytes[2 * i]) |
                                              std::to_integer<uint16_t>(bytes[2 * i + 1]) << 8);
      values[i] = tensor.dtype == DType::kF16 ? HalfToFloat(bits) : BFloat16ToFloat(bits);
    }
  }
  return values;
}

TEST(SyntheticMlp, GoldenChecksum) {
  TempDir dir;
  const std::string path = dir.File("mlp.safetensors");
  ASSERT_TRUE(WriteSyntheticMlp(8, 16, 4, DType::kF32, 7, path, 1).ok());
  // Computed once from this implementation. If it changes, every synthetic
  // model hearth ever wrote changes too: only update it on purpose.
  EXPECT_EQ(ChecksumHex(FileDigest(path)), "149b4722a278ce7f");
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(ChecksumHex(TreeChecksum(*checkpoint)), "e09b7b5ecc3a4add");
}

TEST(SyntheticMlp, LayoutMetadataAndValues) {
  TempDir dir;
  for (DType dtype : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const std::string path = dir.File("mlp.safetensors");
    ASSERT_TRUE(WriteSyntheticMlp(24, 40, 3, dtype, 12345, path, 2).ok());
    Result<Checkpoint> checkpoint = Checkpoint::Open(path);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_EQ(checkpoint->metadata(), (std::vector<std::pair<std::string, std::string>>{
                                          {"hearth.model", "mlp"}, {"hearth.seed", "12345"}}));

    struct Expected {
      std::string name;
      std::vector<int64_t> shape;
      int64_t fan_in;
    };
    const Expected expected[] = {
        {"encoder.weight", {40, 24}, 24},
        {"encoder.bias", {40}, 24},
        {"head.weight", {3, 40}, 40},
        {"head.bias", {3}, 40},
    };
    uint64_t offset = 0;
    for (uint64_t k = 0; k < std::size(expected); ++k) {
      const TensorInfo* tensor = checkpoint->Find(expected[k].name);
      ASSERT_NE(tensor, nullptr) << expected[k].name;
      EXPECT_EQ(tensor->dtype, dtype);
      EXPECT_EQ(tensor->shape, expected[k].shape);
      EXPECT_EQ(tensor->offset, offset);
      offset += tensor->nbytes;

      const float bound = SyntheticBound(expected[k].fan_in);
      EXPECT_EQ(bound, 1.0f / std::sqrt(static_cast<float>(expected[k].fan_in)));
      const std::vector<float> values = ReadFloats(*checkpoint, *tensor);
      for (size_t i = 0; i < values.size(); ++i) {
        float want = SyntheticValue(12345, k, i, bound);
        ASSERT_GE(want, -bound);
        ASSERT_LT(want, bound);
        if (dtype == DType::kF16) want = HalfToFloat(FloatToHalf(want));
        if (dtype == DType::kBF16) want = BFloat16ToFloat(FloatToBFloat16(want));
        ASSERT_EQ(values[i], want) << expected[k].name << "[" << i << "]";
      }
    }
  }
}

TEST(SyntheticScale, ValuesSpreadUniformlyOverMinusOneToOne) {
  TempDir dir;
  const std::string path = dir.File("scale.safetensors");
  ASSERT_TRUE(WriteSyntheticScale(100000, 3, path, 1).ok());
  Result<Checkpoint> checkpoint = Checkpoint::Open(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->tensors().size(), 1u);
  const TensorInfo& weight = checkpoint->tensors()[0];
  EXPECT_EQ(weight.name, "weight");
  EXPECT_EQ(weight.dtype, DType::kF32);
  EXPECT_EQ(weight.shape, std::vector<int64_t>{100000});
  EXPECT_EQ(checkpoint->metadata(), (std::vector<std::pair<std::string, std::string>>{
                                        {"hearth.model", "scale"}, {"hearth.seed", "3"}}));

  const std::vector<float> values = ReadFloats(*checkpoint, weight);
  double sum = 0;
  int below_half = 0;
  for (float v : values) {
    ASSERT_GE(v, -1.0f);
    ASSERT_LT(v, 1.0f);
    sum += v;
    below_half += v < -0.5f;
  }
  EXPECT_LT(*std::min_element(values.begin(), values.end()), -0.999f);
  EXPECT_GT(*std::max_element(values.begin(), values.end()), 0.999f);
  EXPECT_NEAR(sum / values.size(), 0.0, 0.01);
  EXPECT_NEAR(below_half / static_cast<double>(values.size()), 0.25, 0.01);
}

TEST(Synthetic, SameBytesForAnyThreadCount) {
  TempDir dir;
  // 36 MB: three write chunks, so that threads really split the work.
  ASSERT_TRUE(WriteSyntheticScale(9'000'000, 42, dir.File("one"), 1).ok());
  ASSERT_TRUE(WriteSyntheticScale(9'000'000, 42, dir.File("four"), 4).ok());
  EXPECT_TRUE(ReadFile(dir.File("one")) == ReadFile(dir.File("four")));

  ASSERT_TRUE(WriteSyntheticMlp(1024, 8200, 10, DType::kBF16, 9, dir.File("mlp1"), 1).ok());
  ASSERT_TRUE(WriteSyntheticMlp(1024, 8200, 10, DType::kBF16, 9, dir.File("mlp3"), 3).ok());
  EXPECT_TRUE(ReadFile(dir.File("mlp1")) == ReadFile(dir.File("mlp3")));
}

TEST(Synthetic, SeedAndTensorIndexChangeTheValues) {
  TempDir dir;
  ASSERT_TRUE(WriteSyntheticScale(64, 1, dir.File("a"), 1).ok());
  ASSERT_TRUE(WriteSyntheticScale(64, 2, dir.File("b"), 1).ok());
  Result<Checkpoint> a = Checkpoint::Open(dir.File("a"));
  Result<Checkpoint> b = Checkpoint::Open(dir.File("b"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(ReadFloats(*a, a->tensors()[0]), ReadFloats(*b, b->tensors()[0]));
  EXPECT_NE(SyntheticValue(1, 0, 0, 1.0f), SyntheticValue(1, 1, 0, 1.0f));
}

TEST(Synthetic, RejectsBadArguments) {
  TempDir dir;
  const std::string path = dir.File("m.safetensors");
  struct Case {
    Status status;
    std::string error;
  };
  const Case cases[] = {
      {WriteSyntheticMlp(0, 4, 4, DType::kF32, 1, path, 1),
       "synthetic mlp: in must be positive, got 0"},
      {WriteSyntheticMlp(4, -3, 4, DType::kF32, 1, path, 1), "hidden must be positive, got -3"},
      {WriteSyntheticMlp(4, 4, 0, DType::kF32, 1, path, 1), "out must be positive, got 0"},
      {WriteSyntheticMlp(4, 4, 4, DType::kI32, 1, path, 1),
       "dtype must be F32, F16 or BF16, got I32"},
      {WriteSyntheticMlp(1ll << 40, 1ll << 40, 4, DType::kF32, 1, path, 1),
       "tensor 'encoder.weight': shape [1099511627776, 1099511627776] of F32 overflows"},
      {WriteSyntheticScale(0, 1, path, 1), "synthetic scale: n must be positive, got 0"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), StatusCode::kInvalidArgument) << c.error;
    EXPECT_THAT(c.status.message(), HasSubstr(c.error));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace hearth
