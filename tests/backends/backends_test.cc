// CPU backends against double-precision references, plus weight validation
// and signatures. The CUDA backends are compared with these in
// backends_cuda_test.cc.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backends/backend.h"
#include "test_models.h"

namespace hearth {
namespace {

using testing::HostTensor;
using testing::MakeTensor;
using testing::MlpModel;

struct MlpRun {
  std::vector<float> logits;
  std::vector<int64_t> argmax;
};

MlpRun RunMlp(Backend& backend, const std::vector<float>& x, int64_t batch, int64_t out) {
  MlpRun r{std::vector<float>(static_cast<size_t>(batch * out)),
           std::vector<int64_t>(static_cast<size_t>(batch), -1)};
  const void* in[] = {x.data()};
  void* outs[] = {r.logits.data(), r.argmax.data()};
  Status s = backend.Run(batch, in, outs);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return r;
}

std::unique_ptr<Backend> MustCreate(std::string_view kind, const std::vector<TensorView>& weights,
                                    int max_batch = 8) {
  BackendOptions options;
  options.max_batch_size = max_batch;
  auto backend = CreateBackend(kind, weights, Device::Host(), options);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  return backend.ok() ? std::move(backend).value() : nullptr;
}

class MlpCpuTest : public ::testing::TestWithParam<DType> {};

TEST_P(MlpCpuTest, MatchesDoubleReference) {
  const MlpModel model(37, 64, 19, GetParam(), 7);
  auto backend = MustCreate("mlp", model.Views());
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(backend->device_memory_bytes(), 0u);
  std::mt19937_64 rng(11);
  for (int64_t batch : {1, 5, 8}) {
    const auto x = testing::RandomValues(rng, static_cast<size_t>(batch * model.in), 1.0f);
    const MlpRun got = RunMlp(*backend, x, batch, model.out);
    const std::vector<double> want = model.Reference(x, batch);
    // Only the f32 accumulation order differs from the reference.
    const double tolerance = 1e-5;
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(got.logits[i], want[i], tolerance * (1 + std::abs(want[i])))
          << "batch " << batch << " i " << i;
    }
    for (int64_t r = 0; r < batch; ++r) {
      auto [best, clear] = testing::ClearArgmax(want, r, model.out, 1e-4);
      if (clear) {
        EXPECT_EQ(got.argmax[static_cast<size_t>(r)], best) << "row " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, MlpCpuTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& p) { return std::string(DTypeName(p.param)); });

TEST(MlpCpu, ArgmaxTiesGiveTheFirstIndex) {
  // head.weight = 0, so the logits are head.bias for every input.
  MlpModel model(4, 3, 5, DType::kF32, 1);
  model.tensors[2] = MakeTensor("head.weight", DType::kF32, {5, 3}, std::vector<float>(15, 0.0f));
  model.tensors[3] = MakeTensor("head.bias", DType::kF32, {5}, {0.5f, 2.0f, -1.0f, 2.0f, 2.0f});
  auto backend = MustCreate("mlp", model.Views());
  ASSERT_NE(backend, nullptr);
  const std::vector<float> x(8, 0.25f);
  const MlpRun got = RunMlp(*backend, x, 2, 5);
  EXPECT_EQ(got.argmax, (std::vector<int64_t>{1, 1}));

  model.tensors[3] = MakeTensor("head.bias", DType::kF32, {5}, std::vector<float>(5, -3.0f));
  backend = MustCreate("mlp", model.Views());
  ASSERT_NE(backend, nullptr);
  EXPECT_EQ(RunMlp(*backend, x, 1, 5).argmax[0], 0);
}

TEST(ScaleCpu, MatchesDoubleReference) {
  std::mt19937_64 rng(3);
  const int64_t n = 1000;
  const HostTensor w = MakeTensor("weight", DType::kF32, {n}, testing::RandomValues(rng, n, 1.0f));
  auto backend = MustCreate("scale", {w.View()}, 4);
  ASSERT_NE(backend, nullptr);
  for (int64_t batch : {1, 4}) {
    const auto x = testing::RandomValues(rng, static_cast<size_t>(batch * n), 1.0f);
    std::vector<float> y(static_cast<size_t>(batch));
    const void* in[] = {x.data()};
    void* out[] = {y.data()};
    ASSERT_TRUE(backend->Run(batch, in, out).ok());
    for (int64_t r = 0; r < batch; ++r) {
      double want = 0;
      for (int64_t j = 0; j < n; ++j)
        want += double{x[static_cast<size_t>(r * n + j)]} * w.values[static_cast<size_t>(j)];
      EXPECT_NEAR(y[static_cast<size_t>(r)], want, 1e-4) << "row " << r;
    }
  }
}

TEST(BackendSignature, Mlp) {
  const MlpModel model(6, 4, 3, DType::kBF16, 1);
  auto sig = BackendSignature("mlp", model.Views());
  ASSERT_TRUE(sig.ok()) << sig.status().ToString();
  const auto& [inputs, outputs] = *sig;
  ASSERT_EQ(inputs.size(), 1u);
  EXPECT_EQ(inputs[0].name, "input");
  EXPECT_EQ(inputs[0].dtype, DType::kF32);
  EXPECT_EQ(inputs[0].dims, (std::vector<int64_t>{6}));
  EXPECT_EQ(*inputs[0].bytes_per_sample(), 24u);
  ASSERT_EQ(outputs.size(), 2u);
  EXPECT_EQ(outputs[0].name, "logits");
  EXPECT_EQ(outputs[0].dtype, DType::kF32);
  EXPECT_EQ(outputs[0].dims, (std::vector<int64_t>{3}));
  EXPECT_EQ(outputs[1].name, "argmax");
  EXPECT_EQ(outputs[1].dtype, DType::kI64);
  EXPECT_EQ(outputs[1].dims, (std::vector<int64_t>{1}));
  EXPECT_EQ(*outputs[1].bytes_per_sample(), 8u);
}

TEST(IoSpec, BytesPerSampleOverflowIsAnErrorNamingTheTensor) {
  // 2^62 elements of 8 bytes wrap to 0 in unchecked arithmetic.
  const IoSpec huge{"x", DType::kI64, {int64_t{1} << 31, int64_t{1} << 31}};
  auto bytes = huge.bytes_per_sample();
  ASSERT_FALSE(bytes.ok());
  EXPECT_NE(bytes.status().message().find("'x'"), std::string::npos) << bytes.status().message();
  const IoSpec negative{"y", DType::kF32, {4, -1}};
  EXPECT_FALSE(negative.bytes_per_sample().ok());
  const IoSpec fine{"z", DType::kF16, {3, 5}};
  EXPECT_EQ(*fine.bytes_per_sample(), 30u);
}

TEST(BackendSignature, ScaleAndUnknownKind) {
  const HostTensor w = MakeTensor("weight", DType::kF32, {10}, std::vector<float>(10, 1.0f));
  auto sig = BackendSignature("scale", {w.View()});
  ASSERT_TRUE(sig.ok()) << sig.status().ToString();
  EXPECT_EQ(sig->first.at(0).name, "x");
  EXPECT_EQ(sig->first.at(0).dims, (std::vector<int64_t>{10}));
  EXPECT_EQ(sig->second.at(0).name, "y");
  EXPECT_EQ(sig->second.at(0).dims, (std::vector<int64_t>{1}));
  auto bad = BackendSignature("transformer", {w.View()});
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("transformer"), std::string::npos);
}

// Expects CreateBackend on the CPU and BackendSignature to fail with `code`
// and a message containing every string of `parts`.
void ExpectRejected(std::string_view kind, const std::vector<TensorView>& weights, StatusCode code,
                    const std::vector<std::string>& parts) {
  auto sig = BackendSignature(kind, weights);
  ASSERT_FALSE(sig.ok());
  EXPECT_EQ(sig.status().code(), code) << sig.status().ToString();
  for (const std::string& p : parts) {
    EXPECT_NE(sig.status().message().find(p), std::string::npos)
        << sig.status().ToString() << " lacks " << p;
  }
  auto backend = CreateBackend(kind, weights, Device::Host(), BackendOptions{});
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().ToString(), sig.status().ToString());
}

TEST(BackendWeights, MissingTensor) {
  const MlpModel model(6, 4, 3, DType::kF32, 1);
  auto views = model.Views();
  views.pop_back();
  ExpectRejected("mlp", views, StatusCode::kNotFound, {"head.bias"});
  ExpectRejected("scale", views, StatusCode::kNotFound, {"'weight'"});
}

TEST(BackendWeights, WrongShape) {
  MlpModel model(6, 4, 3, DType::kF32, 1);
  model.tensors[1] = MakeTensor("encoder.bias", DType::kF32, {5}, std::vector<float>(5, 0.0f));
  ExpectRejected("mlp", model.Views(), StatusCode::kInvalidArgument,
                 {"encoder.bias", "[4]", "[5]"});

  MlpModel model2(6, 4, 3, DType::kF32, 1);
  model2.tensors[2] = MakeTensor("head.weight", DType::kF32, {3, 5}, std::vector<float>(15, 0.0f));
  ExpectRejected("mlp", model2.Views(), StatusCode::kInvalidArgument,
                 {"head.weight", "[*,4]", "[3,5]"});

  const HostTensor w = MakeTensor("weight", DType::kF32, {2, 5}, std::vector<float>(10, 0.0f));
  ExpectRejected("scale", {w.View()}, StatusCode::kInvalidArgument, {"weight", "[2,5]"});
}

TEST(BackendWeights, MixedOrUnsupportedDTypes) {
  MlpModel model(6, 4, 3, DType::kF32, 1);
  model.tensors[2] = MakeTensor("head.weight", DType::kF16, {3, 4}, std::vector<float>(12, 0.0f));
  ExpectRejected("mlp", model.Views(), StatusCode::kInvalidArgument, {"head.weight", "F32", "F16"});

  const HostTensor w = MakeTensor("weight", DType::kBF16, {5}, std::vector<float>(5, 0.0f));
  ExpectRejected("scale", {w.View()}, StatusCode::kInvalidArgument, {"weight", "F32", "BF16"});
}

TEST(BackendWeights, ByteSizeMustMatchShape) {
  const MlpModel model(6, 4, 3, DType::kF32, 1);
  auto views = model.Views();
  views[0].nbytes -= 4;
  ExpectRejected("mlp", views, StatusCode::kInvalidArgument, {"encoder.weight", "92 bytes", "96"});
}

TEST(CreateBackend, RejectsWeightsOnAnotherDeviceAndBadOptions) {
  const MlpModel model(6, 4, 3, DType::kF32, 1);
  BackendOptions options;
  // Host weights for a CUDA backend: rejected before any GPU or library is touched.
  auto cuda = CreateBackend("mlp", model.Views(), Device::Cuda(0), options);
  ASSERT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(cuda.status().message().find("encoder.weight"), std::string::npos)
      << cuda.status().ToString();
  options.max_batch_size = 0;
  auto zero = CreateBackend("mlp", model.Views(), Device::Host(), options);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

TEST(RegisterHostMemory, NoOpOnHost) {
  std::vector<float> buffer(1024);
  EXPECT_TRUE(RegisterHostMemory(Device::Host(), buffer.data(), 4096).ok());
  EXPECT_TRUE(UnregisterHostMemory(Device::Host(), buffer.data()).ok());
}

}  // namespace
}  // namespace hearth
