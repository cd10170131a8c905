// CUDA backends against the CPU backends on the same weights and inputs.
// The weights are copied to the GPU with cudart (as the store's arena would
// hold them); the backends come from libhearth_backends_cuda.so through
// CreateBackend. Every test skips when no CUDA device can be used.
//
// Tolerances (|cuda - cpu| <= atol + rtol * |cpu|), per weight dtype:
//  - F32 (TF32 off): both accumulate in f32, only the order differs; the
//    error grows like sqrt(K) ulps, so atol = rtol = 1e-4 * sqrt(K / 64),
//    K = max(IN, H) (1e-4 at K = 64, 8e-4 at K = 4096), far above the
//    expected ~1e-6 and far below any layout or bias bug.
//  - F16: the GPU rounds the input and the hidden activation to f16
//    (2^-11 relative each) where the CPU keeps f32: 2e-2.
//  - BF16: the same with bf16 (2^-8 relative): 5e-2.
// The argmax must match wherever the CPU's top-2 logits differ by more than
// the tolerance.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <random>

#include "backends/backend.h"
#include "backends/cuda/skinny_gemm.h"
#include "hearth/arena.h"
#include "test_models.h"

namespace hearth {
namespace {

constexpr int kMaxBatch = 16;

#define ASSERT_CUDA(expr)                                                  \
  do {                                                                     \
    cudaError_t e_ = (expr);                                               \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

// Device copies of host tensors, freed at the end of the test.
class DeviceWeights {
 public:
  ~DeviceWeights() {
    for (void* p : allocations_) cudaFree(p);
  }
  void Add(const testing::HostTensor& t) {
    void* p = nullptr;
    ASSERT_CUDA(cudaMalloc(&p, t.bytes.size()));
    allocations_.push_back(p);
    ASSERT_CUDA(cudaMemcpy(p, t.bytes.data(), t.bytes.size(), cudaMemcpyHostToDevice));
    TensorView v = t.View();
    v.data = p;
    v.device = Device::Cuda(0);
    views_.push_back(v);
  }
  const std::vector<TensorView>& views() const { return views_; }

 private:
  std::vector<void*> allocations_;
  std::vector<TensorView> views_;
};

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  }
};

struct MlpCase {
  DType dtype;
  int64_t in, hidden, out;
  bool tf32 = false;
  const char* gemm = "auto";  // the backend's gemm parameter
  int max_batch = kMaxBatch;
};

void PrintTo(const MlpCase& c, std::ostream* os) {
  *os << DTypeName(c.dtype) << " " << c.in << "x" << c.hidden << "x" << c.out
      << (c.tf32 ? " tf32" : "") << " gemm " << c.gemm << " max batch " << c.max_batch;
}

class MlpCudaTest : public CudaTest, public ::testing::WithParamInterface<MlpCase> {};

TEST_P(MlpCudaTest, MatchesCpu) {
  const MlpCase c = GetParam();
  const testing::MlpModel model(c.in, c.hidden, c.out, c.dtype, 42);
  DeviceWeights gpu;
  for (const auto& t : model.tensors) ASSERT_NO_FATAL_FAILURE(gpu.Add(t));

  BackendOptions options;
  options.max_batch_size = c.max_batch;
  options.allow_tf32 = c.tf32;
  options.parameters["gemm"] = c.gemm;
  auto cuda = CreateBackend("mlp", gpu.views(), Device::Cuda(0), options);
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  auto cpu = CreateBackend("mlp", model.Views(), Device::Host(), options);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  EXPECT_GE((*cuda)->device_memory_bytes(), uint64_t{8} << 20);  // at least the 8 MiB workspace
  EXPECT_EQ((*cuda)->outputs().size(), 2u);

  const double k = static_cast<double>(std::max(c.in, c.hidden));
  double tolerance = c.dtype == DType::kF16    ? 2e-2
                     : c.dtype == DType::kBF16 ? 5e-2
                                               : 1e-4 * std::sqrt(k / 64);
  if (c.tf32) tolerance = 5e-3 * std::sqrt(k / 64);  // 10-bit mantissas, like f16

  std::mt19937_64 rng(99);
  std::vector<int64_t> batches{1, 7, 16, 7};  // 7 twice: the cached plan is reused
  if (c.max_batch > 32) batches.insert(batches.end(), {33, c.max_batch});  // several skinny passes
  for (int64_t batch : batches) {
    const auto x = testing::RandomValues(rng, static_cast<size_t>(batch * c.in), 1.0f);
    std::vector<float> logits_gpu(static_cast<size_t>(batch * c.out)),
        logits_cpu(logits_gpu.size());
    std::vector<int64_t> argmax_gpu(static_cast<size_t>(batch), -1),
        argmax_cpu(argmax_gpu.size(), -1);
    const void* in[] = {x.data()};
    void* out_gpu[] = {logits_gpu.data(), argmax_gpu.data()};
    void* out_cpu[] = {logits_cpu.data(), argmax_cpu.data()};
    Status s = (*cuda)->Run(batch, in, out_gpu);
    ASSERT_TRUE(s.ok()) << s.ToString();
    ASSERT_TRUE((*cpu)->Run(batch, in, out_cpu).ok());

    double worst = 0;
    for (size_t i = 0; i < logits_cpu.size(); ++i) {
      const double err = std::abs(double{logits_gpu[i]} - logits_cpu[i]);
      worst = std::max(worst, err);
      ASSERT_LE(err, tolerance * (1 + std::abs(logits_cpu[i])))
          << "batch " << batch << " row " << i / static_cast<size_t>(c.out) << " col "
          << i % static_cast<size_t>(c.out) << ": cuda " << logits_gpu[i] << " cpu "
          << logits_cpu[i];
    }
    int clear_rows = 0;
    for (int64_t r = 0; r < batch; ++r) {
      auto [best, clear] = testing::ClearArgmax(logits_cpu, r, c.out, tolerance * 2);
      EXPECT_EQ(argmax_cpu[static_cast<size_t>(r)], best);
      if (!clear) continue;
      ++clear_rows;
      EXPECT_EQ(argmax_gpu[static_cast<size_t>(r)], best) << "batch " << batch << " row " << r;
    }
    ::testing::Test::RecordProperty("max_abs_error_batch_" + std::to_string(batch),
                                    std::to_string(worst));
    std::printf(
        "batch %lld: max |cuda - cpu| = %.3g (tolerance %.3g), %d/%lld rows with a clear argmax\n",
        static_cast<long long>(batch), worst, tolerance, clear_rows, static_cast<long long>(batch));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MlpCudaTest,
                         ::testing::Values(MlpCase{DType::kF32, 64, 256, 32},
                                           MlpCase{DType::kF16, 64, 256, 32},
                                           MlpCase{DType::kBF16, 64, 256, 32},
                                           MlpCase{DType::kF32, 1024, 4096, 1000},
                                           MlpCase{DType::kF16, 1024, 4096, 1000},
                                           MlpCase{DType::kBF16, 1024, 4096, 1000},
                                           MlpCase{DType::kF32, 1024, 4096, 1000, true},
                                           MlpCase{DType::kF32, 37, 61, 5},
                                           MlpCase{DType::kF32, 1024, 4096, 1000, false, "cublaslt"},
                                           MlpCase{DType::kF32, 1024, 4096, 1000, false, "skinny", 70},
                                           MlpCase{DType::kF32, 4100, 36, 13, false, "skinny", 40}),
                         [](const auto& p) {
                           const MlpCase& c = p.param;
                           return std::string(DTypeName(c.dtype)) + "_" + std::to_string(c.in) +
                                  "x" + std::to_string(c.hidden) + "x" + std::to_string(c.out) +
                                  (c.tf32 ? "_TF32" : "") + "_" + c.gemm + "_" +
                                  std::to_string(c.max_batch);
                         });

TEST_F(CudaTest, SkinnyGemmRefusesWhatItCannotRun) {
  const testing::MlpModel model(37, 61, 5, DType::kF32, 1);  // 37 is not a multiple of 4
  DeviceWeights gpu;
  for (const auto& t : model.tensors) ASSERT_NO_FATAL_FAILURE(gpu.Add(t));
  BackendOptions options;
  options.parameters["gemm"] = "skinny";
  auto cuda = CreateBackend("mlp", gpu.views(), Device::Cuda(0), options);
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("gemm: skinny needs"), std::string::npos)
      << cuda.status().ToString();
  options.parameters["gemm"] = "fastest";
  cuda = CreateBackend("mlp", gpu.views(), Device::Cuda(0), options);
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("'fastest' is not auto, cublaslt or skinny"),
            std::string::npos)
      << cuda.status().ToString();
}

// The kernel alone against a double-precision reference: row counts of one
// and several passes, feature counts that are not multiples of the features
// per warp, k not a multiple of the 256 floats one step takes, with and
// without bias and ReLU, every features-per-warp variant.
TEST_F(CudaTest, SkinnyGemmMatchesDoubleReference) {
  std::mt19937_64 rng(17);
  struct Shape {
    int64_t n, k;
  };
  for (const Shape shape : {Shape{1, 4}, Shape{13, 260}, Shape{67, 1028}, Shape{130, 4096}}) {
    const int64_t max_rows = 70;
    const auto x = testing::RandomValues(rng, static_cast<size_t>(max_rows * shape.k), 1.0f);
    const auto w = testing::RandomValues(rng, static_cast<size_t>(shape.n * shape.k), 1.0f);
    const auto bias = testing::RandomValues(rng, static_cast<size_t>(shape.n), 1.0f);
    DeviceWeights buffers;
    auto copy = [&](const char* name, const std::vector<float>& v) {
      buffers.Add(testing::MakeTensor(name, DType::kF32, {static_cast<int64_t>(v.size())}, v));
      if (HasFatalFailure()) return static_cast<float*>(nullptr);
      return static_cast<float*>(const_cast<void*>(buffers.views().back().data));
    };
    float* dx = copy("x", x);
    float* dw = copy("w", w);
    float* db = copy("bias", bias);
    float* dy = copy("y", std::vector<float>(static_cast<size_t>(max_rows * shape.n)));
    ASSERT_FALSE(HasFatalFailure());
    for (int64_t rows : {1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 70}) {
      for (int per_warp : {0, 2, 4, 8}) {
        for (bool with_bias_relu : {false, true}) {
          cuda::SkinnyGemmArgs a{dx, dw, with_bias_relu ? db : nullptr, dy, rows, shape.n,
                                 shape.k, with_bias_relu};
          ASSERT_CUDA(cudaMemset(dy, 0xff, static_cast<size_t>(max_rows * shape.n) * 4));  // NaNs
          ASSERT_CUDA(cuda::LaunchSkinnyGemmF32(a, per_warp, nullptr));
          std::vector<float> y(static_cast<size_t>(max_rows * shape.n));
          ASSERT_CUDA(cudaMemcpy(y.data(), dy, y.size() * 4, cudaMemcpyDeviceToHost));
          const double tolerance = 1e-5 * std::sqrt(static_cast<double>(shape.k));
          for (int64_t m = 0; m < max_rows; ++m) {
            for (int64_t n = 0; n < shape.n; ++n) {
              const float got = y[static_cast<size_t>(m * shape.n + n)];
              if (m >= rows) {  // rows past the batch are left alone
                ASSERT_TRUE(std::isnan(got)) << "row " << m << " of " << rows << " written";
                continue;
              }
              double want = with_bias_relu ? bias[static_cast<size_t>(n)] : 0.0;
              for (int64_t k = 0; k < shape.k; ++k) {
                want += double{x[static_cast<size_t>(m * shape.k + k)]} *
                        w[static_cast<size_t>(n * shape.k + k)];
              }
              if (with_bias_relu) want = std::max(want, 0.0);
              ASSERT_NEAR(got, want, tolerance * (1 + std::abs(want)))
                  << "n " << shape.n << " k " << shape.k << " rows " << rows << " per warp "
                  << per_warp << " bias+relu " << with_bias_relu << " at (" << m << ", " << n
                  << ")";
            }
          }
        }
      }
    }
    // Unsupported shapes are refused, not run.
    cuda::SkinnyGemmArgs odd{dx, dw, nullptr, dy, 1, shape.n, 6, false};
    EXPECT_EQ(cuda::LaunchSkinnyGemmF32(odd, 0, nullptr), cudaErrorInvalidValue);
    cuda::SkinnyGemmArgs unaligned{dx + 1, dw, nullptr, dy, 1, shape.n, shape.k, false};
    EXPECT_EQ(cuda::LaunchSkinnyGemmF32(unaligned, 0, nullptr), cudaErrorInvalidValue);
    cuda::SkinnyGemmArgs fine{dx, dw, nullptr, dy, 1, shape.n, shape.k, false};
    EXPECT_EQ(cuda::LaunchSkinnyGemmF32(fine, 3, nullptr), cudaErrorInvalidValue);
  }
}

// A sticky fault (fault injection's cuda_illegal_address) makes the next Run
// fail with DeviceLost, which tells the worker to exit. It poisons the
// process's context, so it runs in a child (a fresh exec of this test).
void RunAfterInjectedFault(const char* kind) {
  std::string why;
  if (!CudaAvailable(&why)) std::_Exit(2);
  const testing::MlpModel model(64, 256, 32, DType::kF32, 3);
  DeviceWeights gpu;
  for (const auto& t : model.tensors) gpu.Add(t);
  BackendOptions options;
  options.max_batch_size = 4;
  std::unique_ptr<Backend> backend;
  if (std::string_view(kind) == "mlp") {
    backend = std::move(CreateBackend("mlp", gpu.views(), Device::Cuda(0), options)).value();
  } else {
    const auto w = testing::MakeTensor("weight", DType::kF32, {64}, std::vector<float>(64, 1.0f));
    DeviceWeights scale;
    scale.Add(w);
    backend = std::move(CreateBackend("scale", scale.views(), Device::Cuda(0), options)).value();
  }
  const std::vector<float> x(4 * 64, 0.5f);
  std::vector<float> out0(4 * 64);
  std::vector<int64_t> out1(4);
  const void* in[] = {x.data()};
  void* out[] = {out0.data(), out1.data()};
  std::span<void* const> outs(out, std::string_view(kind) == "mlp" ? 2 : 1);
  if (!backend->Run(1, in, outs).ok()) std::_Exit(4);  // healthy before the fault
  if (!backend->InjectDeviceFault().ok()) std::_Exit(5);
  const Status s = backend->Run(1, in, outs);
  std::fprintf(stderr, "after the fault: %s\n", s.ToString().c_str());
  std::_Exit(s.code() == StatusCode::kDeviceLost ? 3 : 6);
}

TEST_F(CudaTest, InjectedIllegalAddressIsDeviceLost) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child re-executes: no CUDA across fork
  EXPECT_EXIT(RunAfterInjectedFault("mlp"), ::testing::ExitedWithCode(3),
              "DEVICE_LOST.*cudaErrorIllegalAddress");
  EXPECT_EXIT(RunAfterInjectedFault("scale"), ::testing::ExitedWithCode(3),
              "DEVICE_LOST.*cudaErrorIllegalAddress");
}

TEST_F(CudaTest, MlpArgmaxTiesGiveTheFirstIndex) {
  testing::MlpModel model(4, 3, 5, DType::kF32, 1);
  model.tensors[2] =
      testing::MakeTensor("head.weight", DType::kF32, {5, 3}, std::vector<float>(15, 0.0f));
  model.tensors[3] =
      testing::MakeTensor("head.bias", DType::kF32, {5}, {0.5f, 2.0f, -1.0f, 2.0f, 2.0f});
  DeviceWeights gpu;
  for (const auto& t : model.tensors) ASSERT_NO_FATAL_FAILURE(gpu.Add(t));
  BackendOptions options;
  options.max_batch_size = 4;
  auto cuda = CreateBackend("mlp", gpu.views(), Device::Cuda(0), options);
  ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
  const std::vector<float> x(12, 0.25f);
  std::vector<float> logits(15);
  std::vector<int64_t> argmax(3, -1);
  const void* in[] = {x.data()};
  void* out[] = {logits.data(), argmax.data()};
  ASSERT_TRUE((*cuda)->Run(3, in, out).ok());
  EXPECT_EQ(argmax, (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(logits[3], 2.0f);
  // Out-of-range batches are refused.
  EXPECT_EQ((*cuda)->Run(5, in, out).code(), StatusCode::kInvalidArgument);
}

TEST_F(CudaTest, ScaleMatchesCpu) {
  std::mt19937_64 rng(5);
  for (int64_t n : {1, 33, 100000}) {
    const auto w = testing::MakeTensor("weight", DType::kF32, {n},
                                       testing::RandomValues(rng, static_cast<size_t>(n), 1.0f));
    DeviceWeights gpu;
    ASSERT_NO_FATAL_FAILURE(gpu.Add(w));
    BackendOptions options;
    options.max_batch_size = kMaxBatch;
    auto cuda = CreateBackend("scale", gpu.views(), Device::Cuda(0), options);
    ASSERT_TRUE(cuda.ok()) << cuda.status().ToString();
    auto cpu = CreateBackend("scale", {w.View()}, Device::Host(), options);
    ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
    for (int64_t batch : {1, 7, 16}) {
      const auto x = testing::RandomValues(rng, static_cast<size_t>(batch * n), 1.0f);
      std::vector<float> y_gpu(static_cast<size_t>(batch)), y_cpu(y_gpu.size());
      const void* in[] = {x.data()};
      void* out_gpu[] = {y_gpu.data()};
      void* out_cpu[] = {y_cpu.data()};
      Status s = (*cuda)->Run(batch, in, out_gpu);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE((*cpu)->Run(batch, in, out_cpu).ok());
      const double tolerance = 1e-5 * std::sqrt(static_cast<double>(n)) + 1e-6;
      for (size_t r = 0; r < y_cpu.size(); ++r) {
        EXPECT_NEAR(y_gpu[r], y_cpu[r], tolerance)
            << "n " << n << " batch " << batch << " row " << r;
      }
    }
  }
}

TEST_F(CudaTest, RegisterHostMemory) {
  std::vector<float> buffer(1 << 20);
  Status s = RegisterHostMemory(Device::Cuda(0), buffer.data(), buffer.size() * sizeof(float));
  ASSERT_TRUE(s.ok()) << s.ToString();
  unsigned int flags = 0;
  EXPECT_EQ(cudaHostGetFlags(&flags, buffer.data()), cudaSuccess);
  s = UnregisterHostMemory(Device::Cuda(0), buffer.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  // Unregistering twice is an error that names the call.
  s = UnregisterHostMemory(Device::Cuda(0), buffer.data());
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("cudaHostUnregister"), std::string::npos) << s.ToString();
}

TEST_F(CudaTest, WeightsOnTheHostAreRejected) {
  const testing::MlpModel model(8, 8, 8, DType::kF32, 1);
  auto cuda = CreateBackend("mlp", model.Views(), Device::Cuda(0), BackendOptions{});
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("is on cpu"), std::string::npos)
      << cuda.status().ToString();
}

}  // namespace
}  // namespace hearth
