// The CUDA llm executor (cuda/llm_executor.h) and its kernels
// (cuda/llm_kernels.h): each kernel against a float32/float64 loop written
// here, the sampling kernel against SampleToken (the host draw every executor
// shares), and the executor against the CPU executor on the same random
// bf16 and f16 models, and against itself composed differently, bit for bit:
// chunked prefill, a batch against each sequence alone, graph-captured decode
// against eager decode (the batch invariance resumed streams rely on).
// Every test skips when no CUDA device can be used.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backends/cuda/llm_executor.h"
#include "backends/cuda/llm_gemm.h"
#include "backends/cuda/llm_kernels.h"
#include "backends/cuda/tc_gemm.h"
#include "backends/llm/llm_model.h"
#include "backends/llm/plan_cache.h"
#include "common/float16.h"
#include "hearth/arena.h"
#include "llm_test_model.h"

namespace hearth::llm {
namespace {

using cuda::AttnCombineRow;
using cuda::AttnPlan;
using cuda::AttnSeq;
using cuda::AttnShape;
using cuda::AttnStep;
using cuda::AttnWorkItem;

#define ASSERT_CUDA(expr)                                                  \
  do {                                                                     \
    cudaError_t e_ = (expr);                                               \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

// ---- Host helpers.

const char* EngineName(GemmEngine e) {
  return e == GemmEngine::kOwn ? "OwnGemm" : e == GemmEngine::kCublasLt ? "CublasLt" : "";
}

uint16_t To16(float v, bool bf16) { return bf16 ? FloatToBFloat16(v) : FloatToHalf(v); }
float From16(uint16_t h, bool bf16) { return bf16 ? BFloat16ToFloat(h) : HalfToFloat(h); }
// A NaN of the 16-bit type: what outputs are poisoned with before a kernel
// runs, so that an element it fails to write shows.
uint16_t Nan16(bool bf16) { return bf16 ? 0x7FC0 : 0x7E00; }

std::vector<uint16_t> Random16(std::mt19937_64& rng, size_t n, float scale, bool bf16) {
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = To16(d(rng), bf16);
  return v;
}

// cudaMalloc'ed memory, freed at the end of the test.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&p_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  template <typename T>
  explicit DeviceMemory(const std::vector<T>& host) : DeviceMemory(host.size() * sizeof(T)) {
    EXPECT_EQ(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  DeviceMemory(DeviceMemory&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~DeviceMemory() {
    if (p_ != nullptr) cudaFree(p_);
  }
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(p_);
  }
  template <typename T>
  std::vector<T> Read(size_t n) const {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), p_, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  void* p_ = nullptr;
};

// The workspace of hearth's GEMM kernel, and launch arguments that use it
// whole.
struct TcScratch {
  DeviceMemory workspace{cuda::kTcMaxWorkspaceBytes};
  cuda::TcGemmArgs Args(const cuda::TcGemmShape& shape, bool bf16, const DeviceMemory& x,
                        const DeviceMemory& w, void* y, int64_t m) const {
    cuda::TcGemmArgs a;
    a.shape = shape;
    a.bf16 = bf16;
    a.x = x.get();
    a.w = w.get();
    a.y = y;
    a.m = m;
    a.workspace = workspace.get<float>();
    a.workspace_bytes = cuda::kTcMaxWorkspaceBytes;
    return a;
  }
  // The bf16 product of one weight at m rows into y, with workspace_bytes of
  // the workspace: y's m rows, filled with 0xFF first (a value left
  // unwritten shows).
  std::vector<uint16_t> Rows(const cuda::TcGemmShape& shape, const DeviceMemory& x,
                             const DeviceMemory& w, const DeviceMemory& y, int64_t m,
                             uint64_t workspace_bytes = cuda::kTcMaxWorkspaceBytes) const {
    cuda::TcGemmArgs a = Args(shape, true, x, w, y.get(), m);
    a.workspace_bytes = workspace_bytes;
    const auto values = static_cast<size_t>(m * shape.n);
    EXPECT_EQ(cudaMemset(y.get(), 0xFF, values * 2), cudaSuccess);
    EXPECT_EQ(cuda::LaunchTcGemm(a, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return y.Read<uint16_t>(values);
  }
};

// A GEMM shape over buffers of the test (w its weight, x and y its scratch).
GemmShapeSpec TestShape(const char* name, int64_t n, int64_t k, int64_t max_m,
                        const DeviceMemory& w, const DeviceMemory& x, const DeviceMemory& y) {
  GemmShapeSpec spec;
  spec.name = name;
  spec.n = n;
  spec.k = k;
  spec.max_m = max_m;
  spec.weights = {w.get()};
  spec.x_scratch = x.get();
  spec.y_scratch = y.get();
  return spec;
}

class LlmCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!CudaAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
    ASSERT_CUDA(cudaSetDevice(0));
  }
};

// ---- RMSNorm fused with the residual add.

TEST_F(LlmCudaTest, AddRmsNormMatchesCpu) {
  for (const bool bf16 : {true, false}) {
    for (const int64_t hidden : {256, 2048, 8200}) {
      SCOPED_TRACE((bf16 ? "bf16 hidden " : "f16 hidden ") + std::to_string(hidden));
      std::mt19937_64 rng(static_cast<uint64_t>(hidden) + bf16);
      const int rows = 5;
      const float eps = 1e-5f;
      std::uniform_real_distribution<float> d(-2.0f, 2.0f);
      std::vector<float> resid(static_cast<size_t>(rows * hidden));
      for (float& x : resid) x = d(rng);
      const auto delta = Random16(rng, resid.size(), 1.0f, bf16);
      std::vector<uint16_t> weight(static_cast<size_t>(hidden));
      for (auto& w : weight) w = To16(1.0f + 0.2f * d(rng), bf16);
      DeviceMemory r(resid), dl(delta), w(weight);
      DeviceMemory out(std::vector<uint16_t>(resid.size(), Nan16(bf16)));
      // With a gather: rows 3 and 1, resid left as it is.
      const std::vector<int32_t> gather = {3, 1};
      DeviceMemory g(gather), gathered(std::vector<uint16_t>(2 * hidden, Nan16(bf16)));
      ASSERT_CUDA(cuda::LaunchAddRmsNorm(r.get<float>(), dl.get(), w.get(), g.get<int32_t>(), 2,
                                         hidden, eps, bf16, gathered.get(), nullptr));
      ASSERT_CUDA(cuda::LaunchAddRmsNorm(r.get<float>(), dl.get(), w.get(), nullptr, rows, hidden,
                                         eps, bf16, out.get(), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const auto new_resid = r.Read<float>(resid.size());
      const auto y = out.Read<uint16_t>(resid.size());
      const auto yg = gathered.Read<uint16_t>(2 * static_cast<size_t>(hidden));
      for (int i = 0; i < rows; ++i) {
        std::vector<float> x(static_cast<size_t>(hidden));
        double ss = 0;
        for (int64_t j = 0; j < hidden; ++j) {
          const size_t at = static_cast<size_t>(i * hidden + j);
          x[static_cast<size_t>(j)] = resid[at] + From16(delta[at], bf16);
          ss += static_cast<double>(x[static_cast<size_t>(j)]) * x[static_cast<size_t>(j)];
          // The same float addition: the same bits.
          ASSERT_EQ(new_resid[at], x[static_cast<size_t>(j)]) << "row " << i << " at " << j;
        }
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(hidden) + eps);
        for (int64_t j = 0; j < hidden; ++j) {
          const double want =
              From16(weight[static_cast<size_t>(j)], bf16) * (x[static_cast<size_t>(j)] * inv);
          const float got = From16(y[static_cast<size_t>(i * hidden + j)], bf16);
          // One rounding to the 16-bit type (2^-8 or 2^-11 relative), plus rsqrtf.
          ASSERT_NEAR(got, want, (bf16 ? 8e-3 : 1.5e-3) * std::fabs(want) + 1e-5)
              << "row " << i << " at " << j;
          for (int k = 0; k < 2; ++k) {
            if (gather[static_cast<size_t>(k)] != i) continue;
            ASSERT_EQ(yg[static_cast<size_t>(k * hidden + j)],
                      y[static_cast<size_t>(i * hidden + j)])
                << "gathered row " << k;
          }
        }
      }
    }
  }
}

TEST_F(LlmCudaTest, EmbedGathersRowsExactly) {
  std::mt19937_64 rng(3);
  const int64_t vocab = 50, hidden = 128;
  const auto table = Random16(rng, static_cast<size_t>(vocab * hidden), 1.0f, true);
  const std::vector<int32_t> tokens = {7, 0, 49, 7};
  DeviceMemory t(table), tk(tokens), out(std::vector<float>(tokens.size() * hidden, NAN));
  ASSERT_CUDA(
      cuda::LaunchEmbed(tk.get<int32_t>(), 4, t.get(), hidden, true, out.get<float>(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const auto check = [&](const std::vector<int32_t>& want) {
    const auto x = out.Read<float>(want.size() * hidden);
    for (size_t r = 0; r < want.size(); ++r) {
      for (int64_t j = 0; j < hidden; ++j) {
        ASSERT_EQ(x[r * hidden + static_cast<size_t>(j)],
                  BFloat16ToFloat(table[static_cast<size_t>(want[r] * hidden + j)]))
            << "row " << r;
      }
    }
  };
  check(tokens);
  // Rows 1 and 3 feed tokens drawn on the device (a step after the one that
  // drew them); the placeholders in `tokens` are not read for them.
  const std::vector<int32_t> drawn = {3, 11, 42}, feed = {-1, 2, -1, 0};
  DeviceMemory dd(drawn), df(feed);
  ASSERT_CUDA(cuda::LaunchEmbed(tk.get<int32_t>(), 4, t.get(), hidden, true, out.get<float>(),
                                nullptr, df.get<int32_t>(), dd.get<int32_t>()));
  ASSERT_CUDA(cudaDeviceSynchronize());
  check({7, 42, 49, 3});
}

// ---- GEMMs: y = x w^T with one cuBLASLt algorithm per shape, a row's bits
// the same whatever the row count (what batch invariance rests on).

TEST_F(LlmCudaTest, GemmRowsDoNotDependOnTheRowCount) {
  struct Case {
    int64_t n, k;
    bool bias, f32_out, time, split_k;
  };
  const int64_t max_m = 300;
  for (const GemmEngine engine : {GemmEngine::kCublasLt, GemmEngine::kOwn}) {
    SCOPED_TRACE(EngineName(engine));
    for (const bool bf16 : {true, false}) {
      for (const Case c :
           {Case{2048, 2048, false, false, true, true}, Case{512, 2048, true, false, true, true},
            Case{8192, 2048, false, false, false, true},
            Case{2048, 8192, false, false, true, false},
            Case{1000, 256, false, true, true, true}}) {
        SCOPED_TRACE(std::string(bf16 ? "bf16 " : "f16 ") + std::to_string(c.n) + "x" +
                     std::to_string(c.k) + (c.bias ? " bias" : "") + (c.f32_out ? " f32" : "") +
                     (c.time ? " timed" : "") + (c.split_k ? " split-k" : ""));
        std::mt19937_64 rng(static_cast<uint64_t>(c.n * 7 + c.k) + bf16);
        const float w_scale = 1.0f / std::sqrt(static_cast<float>(c.k));
        const auto w = Random16(rng, static_cast<size_t>(c.n * c.k), w_scale, bf16);
        const auto bias = Random16(rng, static_cast<size_t>(c.n), 0.5f, bf16);
        const auto x = Random16(rng, static_cast<size_t>(max_m * c.k), 1.0f, bf16);
        const size_t y_elem = c.f32_out ? 4 : 2;
        DeviceMemory dw(w), db(bias), dx(x), dy(static_cast<size_t>(max_m * c.n) * y_elem);
        cudaStream_t stream = nullptr;
        ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        uint64_t bytes = 0;
        auto set = GemmSet::Create(bf16, stream, &bytes);
        ASSERT_TRUE(set.ok()) << set.status().ToString();
        GemmShapeSpec spec = TestShape("test", c.n, c.k, max_m, dw, dx, dy);
        spec.bias = c.bias;
        spec.f32_out = c.f32_out;
        if (c.bias) spec.biases = {db.get()};
        GemmTuning tuning;
        tuning.time_candidates = c.time;
        tuning.allow_split_k = c.split_k;
        tuning.timed_rows = {8, 64};
        tuning.engine = engine;
        auto shape = (*set)->AddShape(spec, tuning);
        ASSERT_TRUE(shape.ok()) << shape.status().ToString();
        SCOPED_TRACE((*set)->Describe());
        EXPECT_EQ((*set)->own_shapes(), engine == GemmEngine::kOwn ? 1 : 0);
        auto run = [&](int64_t m) {
          EXPECT_EQ(
              cudaMemsetAsync(dy.get(), 0xFF, static_cast<size_t>(max_m * c.n) * y_elem, stream),
              cudaSuccess);
          const Status st =
              (*set)->Run(*shape, dw.get(), c.bias ? db.get() : nullptr, dx.get(), dy.get(), m);
          EXPECT_TRUE(st.ok()) << st.ToString();
          EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
          return dy.Read<uint8_t>(static_cast<size_t>(m * c.n) * y_elem);
        };
        const auto full = run(max_m);
        // Against a float64 loop: the layout (row-major x, w and y) is right.
        for (int64_t r : {int64_t{0}, int64_t{1}, max_m - 1}) {
          for (int64_t j = 0; j < c.n; j += 97) {
            double want = c.bias ? From16(bias[static_cast<size_t>(j)], bf16) : 0.0;
            for (int64_t i = 0; i < c.k; ++i) {
              want += static_cast<double>(From16(x[static_cast<size_t>(r * c.k + i)], bf16)) *
                      From16(w[static_cast<size_t>(j * c.k + i)], bf16);
            }
            const size_t at = static_cast<size_t>(r * c.n + j);
            float got = 0;
            if (c.f32_out) {
              std::memcpy(&got, full.data() + 4 * at, 4);
            } else {
              uint16_t h = 0;
              std::memcpy(&h, full.data() + 2 * at, 2);
              got = From16(h, bf16);
            }
            ASSERT_NEAR(got, want, 1e-2 * std::fabs(want) + 2e-3) << "row " << r << " column " << j;
          }
        }
        for (const int64_t m : {1, 2, 3, 7, 16, 64, 65, 128, 255}) {
          const auto part = run(m);
          ASSERT_TRUE(std::equal(part.begin(), part.end(), full.begin()))
              << "the first " << m << " rows differ from the same rows among " << max_m;
        }
        set->reset();
        cudaStreamDestroy(stream);
      }
    }
  }
}

// The engine and algorithm a timed set chose are kept in the plan cache and
// read back by the next set (whichever engine won); a set held to cuBLASLt
// keeps its choice apart, neither reading nor replacing them.
TEST_F(LlmCudaTest, GemmChoiceIsKeptInThePlanCache) {
  const int64_t n = 2048, k = 2048, max_m = 8;
  std::mt19937_64 rng(5);
  const auto w = Random16(rng, static_cast<size_t>(n * k), 0.02f, true);
  DeviceMemory dw(w), dx(static_cast<size_t>(max_m * k) * 2),
      dy(static_cast<size_t>(max_m * n) * 2);
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A folder of our own (mkdtemp: 0700), as the cache requires.
  std::string folder = ::testing::TempDir() + "/hearth-gemm-plans-XXXXXX";
  ASSERT_NE(mkdtemp(folder.data()), nullptr) << std::strerror(errno);
  auto cache = PlanCache::Open(folder + "/gemm-plans");
  ASSERT_TRUE(cache.ok()) << cache.status().ToString();
  const GemmShapeSpec spec = TestShape("q_proj", n, k, max_m, dw, dx, dy);
  struct Chosen {
    int own = -1, cached = -1;
    std::string described;
  };
  const auto add = [&](GemmEngine engine) {
    uint64_t bytes = 0;
    auto set = GemmSet::Create(true, stream, &bytes);
    EXPECT_TRUE(set.ok()) << set.status().ToString();
    if (!set.ok()) return Chosen{};
    GemmTuning tuning;
    tuning.engine = engine;
    tuning.timed_rows = {1, 4};
    tuning.cache = &*cache;
    const auto shape = (*set)->AddShape(spec, tuning);
    EXPECT_TRUE(shape.ok()) << shape.status().ToString();
    return Chosen{(*set)->own_shapes(), (*set)->cached_shapes(), (*set)->Describe()};
  };
  const Chosen first = add(GemmEngine::kAny);
  EXPECT_EQ(first.cached, 0);
  const Chosen again = add(GemmEngine::kAny);
  EXPECT_EQ(again.cached, 1);
  EXPECT_EQ(again.own, first.own);
  EXPECT_EQ(again.described, first.described);
  const Chosen held = add(GemmEngine::kCublasLt);
  EXPECT_EQ(held.cached, 0);
  EXPECT_EQ(held.own, 0);
  // A set held to cuBLASLt keeps its own choice, which the next one reads.
  const Chosen held_again = add(GemmEngine::kCublasLt);
  EXPECT_EQ(held_again.cached, 1);
  EXPECT_EQ(held_again.described, held.described);
  const Chosen after = add(GemmEngine::kAny);
  EXPECT_EQ(after.cached, 1);
  EXPECT_EQ(after.described, first.described) << "the held set replaced the kept choice";
  cudaStreamDestroy(stream);
  std::filesystem::remove_all(folder);
}

// hearth's GEMM kernel refuses shapes it cannot run, naming why; cuBLASLt
// takes them when either engine may run, or when hearth's is only preferred.
TEST_F(LlmCudaTest, OwnGemmRefusesShapesItCannotRun) {
  const int64_t n = 96, k = 100, max_m = 4;
  DeviceMemory dw(static_cast<size_t>(n * k) * 2), dx(static_cast<size_t>(max_m * k) * 2),
      dy(static_cast<size_t>(max_m * n) * 2);
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t bytes = 0;
  auto set = GemmSet::Create(true, stream, &bytes);
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  const GemmShapeSpec spec = TestShape("odd", n, k, max_m, dw, dx, dy);
  GemmTuning tuning;
  tuning.engine = GemmEngine::kOwn;
  const auto refused = (*set)->AddShape(spec, tuning);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("multiple of 64"), std::string::npos)
      << refused.status().ToString();
  tuning.engine = GemmEngine::kAny;
  const auto taken = (*set)->AddShape(spec, tuning);
  ASSERT_TRUE(taken.ok()) << taken.status().ToString();
  EXPECT_EQ((*set)->own_shapes(), 0);
  // hearth's kernel first: cuBLASLt takes what it cannot run.
  tuning.engine = GemmEngine::kOwnFirst;
  const auto fallen_back = (*set)->AddShape(spec, tuning);
  ASSERT_TRUE(fallen_back.ok()) << fallen_back.status().ToString();
  EXPECT_EQ((*set)->own_shapes(), 0);
  DeviceMemory w2(128 * 128 * 2), x2(static_cast<size_t>(max_m) * 128 * 2),
      y2(static_cast<size_t>(max_m) * 128 * 2);
  const auto own = (*set)->AddShape(TestShape("even", 128, 128, max_m, w2, x2, y2), tuning);
  ASSERT_TRUE(own.ok()) << own.status().ToString();
  EXPECT_EQ((*set)->own_shapes(), 1);
  set->reset();
  cudaStreamDestroy(stream);
}

// hearth's kernel at many rows spreads a shape with few tiles over groups of
// parts as its workspace allows; the bits are those of one group, and of the
// few-rows mode for the same rows.
TEST_F(LlmCudaTest, OwnGemmGroupsOfPartsGiveTheSameBits) {
  const int64_t n = 512, k = 4096, max_m = 200;
  const cuda::TcGemmShape shape{n, k, 1};
  ASSERT_GT(cuda::TcGemmSplits(shape), 2);
  std::mt19937_64 rng(5);
  const auto w = Random16(rng, static_cast<size_t>(n * k), 1.0f / 64, true);
  const auto x = Random16(rng, static_cast<size_t>(max_m * k), 1.0f, true);
  DeviceMemory dw(w), dx(x), dy(static_cast<size_t>(max_m * n) * 2);
  const TcScratch scratch;
  const auto run = [&](int64_t m, uint64_t workspace_bytes) {
    return scratch.Rows(shape, dx, dw, dy, m, workspace_bytes);
  };
  // One group (no workspace) against as many as the full workspace allows.
  const auto one_group = run(max_m, 0);
  const auto groups = run(max_m, cuda::kTcMaxWorkspaceBytes);
  EXPECT_EQ(one_group, groups);
  const auto few = run(cuda::kTcSplitRows, cuda::kTcMaxWorkspaceBytes);
  EXPECT_TRUE(std::equal(few.begin(), few.end(), groups.begin()));
  // Up to 128 rows the tiles stream through more stages; the same bits.
  const auto deep = run(100, cuda::kTcMaxWorkspaceBytes);
  EXPECT_TRUE(std::equal(deep.begin(), deep.end(), groups.begin()));
  // A workspace size without a workspace is refused.
  cuda::TcGemmArgs bad = scratch.Args(shape, true, dx, dw, dy.get(), max_m);
  bad.workspace = nullptr;
  EXPECT_EQ(cuda::LaunchTcGemm(bad, nullptr), cudaErrorInvalidValue);
}

// A part of k longer than one round of loads, its last round short (9
// blocks of 64, 4 a round): the few-rows mode gives the bits of the
// many-rows one, and the products.
TEST_F(LlmCudaTest, OwnGemmLongPartsInRoundsGiveTheTileBits) {
  const int64_t n = 16384, k = 576, max_m = 100;
  const cuda::TcGemmShape shape{n, k, 1};
  ASSERT_EQ(cuda::TcGemmSplits(shape), 1);
  std::mt19937_64 rng(9);
  const auto w = Random16(rng, static_cast<size_t>(n * k), 1.0f / 32, true);
  const auto x = Random16(rng, static_cast<size_t>(max_m * k), 1.0f, true);
  DeviceMemory dw(w), dx(x), dy(static_cast<size_t>(max_m * n) * 2);
  const TcScratch scratch;
  const auto tiles = scratch.Rows(shape, dx, dw, dy, max_m);
  for (const int64_t m : {int64_t{1}, int64_t{5}, cuda::kTcSplitRows}) {
    const auto few = scratch.Rows(shape, dx, dw, dy, m);
    ASSERT_TRUE(std::equal(few.begin(), few.end(), tiles.begin())) << m << " rows";
  }
  for (const int64_t r : {int64_t{0}, int64_t{4}})
    for (int64_t j = 0; j < n; j += 1021) {
      double want = 0.0;
      for (int64_t i = 0; i < k; ++i)
        want += static_cast<double>(From16(x[static_cast<size_t>(r * k + i)], true)) *
                From16(w[static_cast<size_t>(j * k + i)], true);
      ASSERT_NEAR(From16(tiles[static_cast<size_t>(r * n + j)], true), want,
                  1e-2 * std::fabs(want) + 2e-3)
          << "row " << r << " column " << j;
    }
}

// A pair of weights as one strided batch (k_proj and v_proj, gate_proj and
// up_proj, packed in one arena): each output is its own weight's product,
// with its own bias, and a row's bits do not depend on the row count.
TEST_F(LlmCudaTest, PairedGemmsAreTwoProductsInOneLaunch) {
  const bool bf16 = true;
  for (const GemmEngine engine : {GemmEngine::kCublasLt, GemmEngine::kOwn})
    for (const bool bias : {false, true}) {
      SCOPED_TRACE(std::string(bias ? "with biases " : "without biases ") + EngineName(engine));
      const int64_t n = 512, k = 1024, max_m = 128;
      // The second weight 3 matrices past the first (others lie between, as in an arena).
      const int64_t w_stride = 3 * n * k, b_stride = 2 * n, y_stride = max_m * n;
      std::mt19937_64 rng(42 + bias);
      const auto w = Random16(rng, static_cast<size_t>(w_stride + n * k), 0.03f, bf16);
      const auto b = Random16(rng, static_cast<size_t>(b_stride + n), 0.5f, bf16);
      const auto x = Random16(rng, static_cast<size_t>(max_m * k), 1.0f, bf16);
      DeviceMemory dw(w), db(b), dx(x), dy(static_cast<size_t>(2 * y_stride) * 2);
      cudaStream_t stream = nullptr;
      ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      uint64_t bytes = 0;
      auto set = GemmSet::Create(bf16, stream, &bytes);
      ASSERT_TRUE(set.ok()) << set.status().ToString();
      GemmShapeSpec spec = TestShape("pair", n, k, max_m, dw, dx, dy);
      spec.bias = bias;
      if (bias) spec.biases = {db.get()};
      spec.batch = 2;
      spec.weight_stride = w_stride;
      spec.bias_stride = bias ? b_stride : 0;
      spec.y_stride = y_stride;
      GemmTuning tuning;
      tuning.timed_rows = {8};
      tuning.engine = engine;
      auto shape = (*set)->AddShape(spec, tuning);
      ASSERT_TRUE(shape.ok()) << shape.status().ToString();
      auto run = [&](int64_t m) {
        EXPECT_EQ(cudaMemsetAsync(dy.get(), 0xFF, static_cast<size_t>(2 * y_stride) * 2, stream),
                  cudaSuccess);
        const Status st =
            (*set)->Run(*shape, dw.get(), bias ? db.get() : nullptr, dx.get(), dy.get(), m);
        EXPECT_TRUE(st.ok()) << st.ToString();
        EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        return dy.Read<uint16_t>(static_cast<size_t>(2 * y_stride));
      };
      const auto full = run(max_m);
      for (int64_t pair = 0; pair < 2; ++pair) {
        for (int64_t r : {int64_t{0}, max_m - 1}) {
          for (int64_t j = 0; j < n; j += 37) {
            double want = bias ? From16(b[static_cast<size_t>(pair * b_stride + j)], bf16) : 0.0;
            for (int64_t i = 0; i < k; ++i)
              want += static_cast<double>(From16(x[static_cast<size_t>(r * k + i)], bf16)) *
                      From16(w[static_cast<size_t>(pair * w_stride + j * k + i)], bf16);
            const float got = From16(full[static_cast<size_t>(pair * y_stride + r * n + j)], bf16);
            ASSERT_NEAR(got, want, 1e-2 * std::fabs(want) + 2e-3)
                << "weight " << pair << " row " << r << " column " << j;
          }
        }
      }
      for (const int64_t m : {1, 3, 64}) {
        const auto part = run(m);
        for (int64_t pair = 0; pair < 2; ++pair) {
          const auto at = static_cast<std::ptrdiff_t>(pair * y_stride);
          ASSERT_TRUE(std::equal(part.begin() + at, part.begin() + at + m * n, full.begin() + at))
              << "weight " << pair << ": the first " << m << " rows differ among " << max_m;
        }
      }
      set->reset();
      cudaStreamDestroy(stream);
    }
}

// The SwiGLU epilogue of hearth's kernel (gate_proj and up_proj as a pair at
// up to kTcSplitRows rows) gives the bits of the pair's two products followed
// by a SwiGLU launch, with k in one part (n 8192), 4 (2048) and 8 (256), in
// bf16 and f16.
TEST_F(LlmCudaTest, OwnGemmSwiGluEpilogueEqualsPairThenSwiGlu) {
  for (const bool bf16 : {true, false})
    for (const int64_t n : {int64_t{8192}, int64_t{2048}, int64_t{256}}) {
      const int64_t k = 1024;
      const cuda::TcGemmShape shape{n, k, 2};
      SCOPED_TRACE(std::string(bf16 ? "bf16 " : "f16 ") + "n " + std::to_string(n) + ", " +
                   std::to_string(cuda::TcGemmSplits(shape)) + " parts");
      const int64_t max_m = cuda::kTcSplitRows, w_stride = 2 * n * k, y_stride = max_m * n;
      std::mt19937_64 rng(61 + n);
      const auto w = Random16(rng, static_cast<size_t>(w_stride + n * k), 0.05f, bf16);
      const auto x = Random16(rng, static_cast<size_t>(max_m * k), 1.0f, bf16);
      DeviceMemory dw(w), dx(x), pair(static_cast<size_t>(2 * y_stride) * 2),
          fused(static_cast<size_t>(y_stride) * 2);
      const TcScratch scratch;
      const auto args = [&](int64_t m, void* y) {
        cuda::TcGemmArgs a = scratch.Args(shape, bf16, dx, dw, y, m);
        a.w_stride = w_stride;
        a.y_stride = y_stride;
        return a;
      };
      for (const int64_t m : {1, 3, 8, 9, 16}) {
        SCOPED_TRACE("rows " + std::to_string(m));
        ASSERT_CUDA(cudaMemset(fused.get(), 0xFF, static_cast<size_t>(y_stride) * 2));
        ASSERT_EQ(cuda::LaunchTcGemm(args(m, pair.get()), nullptr), cudaSuccess);
        ASSERT_EQ(cuda::LaunchSwiGlu(pair.get(), static_cast<uint16_t*>(pair.get()) + y_stride,
                                     pair.get(), m * n, bf16, nullptr),
                  cudaSuccess);
        cuda::TcGemmArgs a = args(m, fused.get());
        a.swiglu = true;
        ASSERT_EQ(cuda::LaunchTcGemm(a, nullptr), cudaSuccess);
        ASSERT_CUDA(cudaDeviceSynchronize());
        const auto want = pair.Read<uint16_t>(static_cast<size_t>(m * n));
        const auto got = fused.Read<uint16_t>(static_cast<size_t>(m * n));
        ASSERT_EQ(got, want);
        // Not all zeros or copies of one value: the products were computed.
        EXPECT_GT(std::set<uint16_t>(got.begin(), got.end()).size(), static_cast<size_t>(n / 4));
      }
      // Refused: more rows than the split mode's, a batch of one, a bias.
      cuda::TcGemmArgs bad = args(cuda::kTcSplitRows + 1, fused.get());
      bad.swiglu = true;
      EXPECT_EQ(cuda::LaunchTcGemm(bad, nullptr), cudaErrorInvalidValue);
      bad = args(1, fused.get());
      bad.swiglu = true;
      bad.shape.batch = 1;
      EXPECT_EQ(cuda::LaunchTcGemm(bad, nullptr), cudaErrorInvalidValue);
      bad = args(1, fused.get());
      bad.swiglu = true;
      bad.bias = dx.get();
      EXPECT_EQ(cuda::LaunchTcGemm(bad, nullptr), cudaErrorInvalidValue);
    }
}

// q_proj (with a bias) and a k/v pair in one launch give each product's bits
// of its own launch; a group is refused where the entries' rows or types
// differ, where it has too many rows, or where two entries share workspace.
TEST_F(LlmCudaTest, OwnGemmGroupEqualsSeparateLaunches) {
  for (const bool bf16 : {true, false}) {
    SCOPED_TRACE(bf16 ? "bf16" : "f16");
    const int64_t k = 2048, nq = 2048, nkv = 512, max_m = cuda::kTcSplitRows;
    const cuda::TcGemmShape q_shape{nq, k, 1}, kv_shape{nkv, k, 2};
    ASSERT_GT(cuda::TcGemmSplits(q_shape), 1);
    ASSERT_GT(cuda::TcGemmSplits(kv_shape), 1);
    std::mt19937_64 rng(83);
    const auto wq = Random16(rng, static_cast<size_t>(nq * k), 0.03f, bf16);
    const auto bq = Random16(rng, static_cast<size_t>(nq), 0.5f, bf16);
    const int64_t kv_stride = 3 * nkv * k;
    const auto wkv = Random16(rng, static_cast<size_t>(kv_stride + nkv * k), 0.03f, bf16);
    const auto x = Random16(rng, static_cast<size_t>(max_m * k), 1.0f, bf16);
    DeviceMemory dwq(wq), dbq(bq), dwkv(wkv), dx(x), yq(static_cast<size_t>(max_m * nq) * 2),
        ykv(static_cast<size_t>(2 * max_m * nkv) * 2);
    const TcScratch scratch;
    const auto q_args = [&](int64_t m) {
      cuda::TcGemmArgs a = scratch.Args(q_shape, bf16, dx, dwq, yq.get(), m);
      a.bias = dbq.get();
      return a;
    };
    const auto kv_args = [&](int64_t m) {
      cuda::TcGemmArgs a = scratch.Args(kv_shape, bf16, dx, dwkv, ykv.get(), m);
      a.w_stride = kv_stride;
      a.y_stride = max_m * nkv;
      return a;
    };
    const auto read = [&] {
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto q = yq.Read<uint16_t>(static_cast<size_t>(max_m * nq));
      const auto kv = ykv.Read<uint16_t>(static_cast<size_t>(2 * max_m * nkv));
      q.insert(q.end(), kv.begin(), kv.end());
      return q;
    };
    const auto clear = [&] {
      EXPECT_EQ(cudaMemset(yq.get(), 0xFF, static_cast<size_t>(max_m * nq) * 2), cudaSuccess);
      EXPECT_EQ(cudaMemset(ykv.get(), 0xFF, static_cast<size_t>(2 * max_m * nkv) * 2), cudaSuccess);
    };
    for (const int64_t m : {1, 5, 16}) {
      SCOPED_TRACE("rows " + std::to_string(m));
      clear();
      ASSERT_EQ(cuda::LaunchTcGemm(q_args(m), nullptr), cudaSuccess);
      ASSERT_EQ(cuda::LaunchTcGemm(kv_args(m), nullptr), cudaSuccess);
      const auto apart = read();
      clear();
      const cuda::TcGemmArgs group[] = {q_args(m), kv_args(m)};
      ASSERT_EQ(cuda::LaunchTcGemmGroup(group, nullptr), cudaSuccess);
      const auto together = read();
      ASSERT_EQ(together, apart);
      // The rows up to m written, the rows past it left alone.
      EXPECT_NE(together[0], 0xFFFF);
      if (m < max_m) {
        EXPECT_EQ(together[static_cast<size_t>(m * nq)], 0xFFFF);
      }
    }
    const cuda::TcGemmArgs too_many_rows[] = {q_args(max_m + 1), kv_args(max_m + 1)};
    EXPECT_EQ(cuda::LaunchTcGemmGroup(too_many_rows, nullptr), cudaErrorInvalidValue);
    const cuda::TcGemmArgs mixed_rows[] = {q_args(2), kv_args(3)};
    EXPECT_EQ(cuda::LaunchTcGemmGroup(mixed_rows, nullptr), cudaErrorInvalidValue);
    cuda::TcGemmArgs f32 = kv_args(2);
    f32.f32_out = true;
    const cuda::TcGemmArgs with_f32[] = {q_args(2), f32};
    EXPECT_EQ(cuda::LaunchTcGemmGroup(with_f32, nullptr), cudaErrorInvalidValue);
    EXPECT_EQ(cuda::LaunchTcGemmGroup({}, nullptr), cudaErrorInvalidValue);
  }
}

// ---- RoPE fused with the KV cache write.

TEST_F(LlmCudaTest, RopeKvWriteMatchesCpu) {
  ModelConfig config;
  config.rope_theta = 500000.0;
  config.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};  // Llama 3.2's
  for (const bool bf16 : {true, false}) {
    for (const int d : {64, 128}) {
      SCOPED_TRACE((bf16 ? "bf16 head_dim " : "f16 head_dim ") + std::to_string(d));
      config.head_dim = d;
      const std::vector<double> inv64 = config.InverseFrequencies();
      const std::vector<float> inv(inv64.begin(), inv64.end());
      const int nq = 4, nk = 2, block_size = 5, blocks = 7, half = d / 2;
      const std::vector<int32_t> positions = {0, 1, 17, 4095, 100000, 3};
      // Slots scattered over the blocks; token 5 is a padding row (-1).
      const std::vector<int32_t> slots = {33, 2, 17, 34, 0, -1};
      const int tokens = static_cast<int>(positions.size());
      std::mt19937_64 rng(static_cast<uint64_t>(d) + bf16);
      const auto q = Random16(rng, static_cast<size_t>(tokens * nq * d), 1.0f, bf16);
      const auto k = Random16(rng, static_cast<size_t>(tokens * nk * d), 1.0f, bf16);
      const auto v = Random16(rng, static_cast<size_t>(tokens * nk * d), 1.0f, bf16);
      const size_t cache_elems = static_cast<size_t>(blocks * nk * block_size * d);
      DeviceMemory dq(q), dk(k), dv(v), dpos(positions), dslots(slots), dinv(inv);
      DeviceMemory kc(std::vector<uint16_t>(cache_elems, Nan16(bf16)));
      DeviceMemory vc(std::vector<uint16_t>(cache_elems, Nan16(bf16)));
      const cuda::RopeKvArgs a{dq.get(),
                               dk.get(),
                               dv.get(),
                               dpos.get<int32_t>(),
                               dslots.get<int32_t>(),
                               dinv.get<float>(),
                               kc.get(),
                               vc.get(),
                               tokens,
                               nq,
                               nk,
                               d,
                               block_size,
                               bf16};
      ASSERT_CUDA(cuda::LaunchRopeKvWrite(a, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const auto q_out = dq.Read<uint16_t>(q.size());
      const auto k_cache = kc.Read<uint16_t>(cache_elems);
      const auto v_cache = vc.Read<uint16_t>(cache_elems);
      std::vector<bool> written(cache_elems, false);
      const double tol = bf16 ? 1.6e-2 : 2e-3;  // one rounding of values below 1.5
      auto rotate = [&](const std::vector<uint16_t>& x, size_t base, int j, float angle_cos,
                        float angle_sin, bool second) {
        const double x1 = From16(x[base + static_cast<size_t>(j)], bf16);
        const double x2 = From16(x[base + static_cast<size_t>(j + half)], bf16);
        return second ? x2 * angle_cos + x1 * angle_sin : x1 * angle_cos - x2 * angle_sin;
      };
      for (int t = 0; t < tokens; ++t) {
        for (int j = 0; j < half; ++j) {
          // As transformers: the angle is a float32 product.
          const float angle =
              static_cast<float>(positions[static_cast<size_t>(t)]) * inv[static_cast<size_t>(j)];
          const auto c = static_cast<float>(std::cos(static_cast<double>(angle)));
          const auto s = static_cast<float>(std::sin(static_cast<double>(angle)));
          for (int h = 0; h < nq; ++h) {
            const size_t base = static_cast<size_t>((t * nq + h) * d);
            for (const bool second : {false, true}) {
              const size_t at = base + static_cast<size_t>(j + (second ? half : 0));
              ASSERT_NEAR(From16(q_out[at], bf16), rotate(q, base, j, c, s, second), tol)
                  << "q token " << t << " head " << h << " dim " << j;
            }
          }
          const int32_t slot = slots[static_cast<size_t>(t)];
          if (slot < 0) continue;
          for (int h = 0; h < nk; ++h) {
            const size_t base = static_cast<size_t>((t * nk + h) * d);
            const size_t cache_base = static_cast<size_t>(
                ((slot / block_size * nk + h) * block_size + slot % block_size) * d);
            for (const bool second : {false, true}) {
              const int dim = j + (second ? half : 0);
              const size_t at = cache_base + static_cast<size_t>(dim);
              ASSERT_NEAR(From16(k_cache[at], bf16), rotate(k, base, j, c, s, second), tol)
                  << "k token " << t << " head " << h << " dim " << dim;
              ASSERT_EQ(v_cache[at], v[base + static_cast<size_t>(dim)]);
              written[at] = true;
            }
          }
        }
      }
      for (size_t i = 0; i < cache_elems; ++i) {
        if (written[i]) continue;
        ASSERT_EQ(k_cache[i], Nan16(bf16)) << "k cache element " << i << " was written";
        ASSERT_EQ(v_cache[i], Nan16(bf16)) << "v cache element " << i << " was written";
      }
    }
  }
}

// ---- SwiGLU.

TEST_F(LlmCudaTest, SwiGluMatchesCpu) {
  for (const bool bf16 : {true, false}) {
    std::mt19937_64 rng(11 + bf16);
    const size_t n = 3 * 1032;
    const auto g = Random16(rng, n, 6.0f, bf16), u = Random16(rng, n, 2.0f, bf16);
    DeviceMemory dg(g), du(u), out(std::vector<uint16_t>(n, Nan16(bf16)));
    ASSERT_CUDA(
        cuda::LaunchSwiGlu(dg.get(), du.get(), out.get(), static_cast<int64_t>(n), bf16, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const auto y = out.Read<uint16_t>(n);
    for (size_t i = 0; i < n; ++i) {
      const double x = From16(g[i], bf16);
      const double want = x / (1.0 + std::exp(-x)) * From16(u[i], bf16);
      ASSERT_NEAR(From16(y[i], bf16), want, (bf16 ? 8e-3 : 1e-3) * std::fabs(want) + 1e-6) << i;
    }
  }
}

// ---- Attention over the paged cache.

// A paged KV cache with random contents at every position the sequences
// hold and NaN everywhere else (read it and the output shows).
struct PagedCache {
  AttnShape shape;
  int32_t num_blocks = 0;
  std::vector<uint16_t> k, v;  // [blocks][kv_heads][block_size][head_dim]
  std::vector<int32_t> tables;
  std::vector<int32_t> table_offsets;  // per sequence

  size_t At(int32_t block, int32_t head, int32_t offset) const {
    return static_cast<size_t>(
        ((int64_t{block} * shape.num_kv_heads + head) * shape.block_size + offset) *
        shape.head_dim);
  }
  std::vector<float> k_float, v_float;  // the same, widened (filled by MakeCache)

  // Key (or value) of sequence s at position p, KV head h.
  const float* Row(const std::vector<float>& cache, int s, int32_t p, int32_t h) const {
    const int32_t block =
        tables[static_cast<size_t>(table_offsets[static_cast<size_t>(s)] + p / shape.block_size)];
    return cache.data() + At(block, h, p % shape.block_size);
  }
};

// Sequences of `contexts` keys, blocks shuffled over a pool with spare blocks.
PagedCache MakeCache(const AttnShape& shape, const std::vector<int32_t>& contexts,
                     std::mt19937_64& rng) {
  PagedCache c;
  c.shape = shape;
  int32_t needed = 0;
  for (int32_t ctx : contexts) needed += (ctx + shape.block_size - 1) / shape.block_size;
  c.num_blocks = needed + 5;
  std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  const size_t elems =
      static_cast<size_t>(c.num_blocks) * shape.num_kv_heads * shape.block_size * shape.head_dim;
  c.k.assign(elems, Nan16(shape.bf16));
  c.v.assign(elems, Nan16(shape.bf16));
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  size_t next = 0;
  for (int32_t ctx : contexts) {
    c.table_offsets.push_back(static_cast<int32_t>(c.tables.size()));
    const int32_t blocks = (ctx + shape.block_size - 1) / shape.block_size;
    for (int32_t b = 0; b < blocks; ++b) c.tables.push_back(ids[next++]);
    for (int32_t p = 0; p < ctx; ++p) {
      const int32_t block = c.tables[c.tables.size() - static_cast<size_t>(blocks) +
                                     static_cast<size_t>(p / shape.block_size)];
      for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
        const size_t at = c.At(block, h, p % shape.block_size);
        for (int32_t i = 0; i < shape.head_dim; ++i) {
          c.k[at + static_cast<size_t>(i)] = To16(d(rng), shape.bf16);
          c.v[at + static_cast<size_t>(i)] = To16(d(rng), shape.bf16);
        }
      }
    }
  }
  for (const uint16_t x : c.k) c.k_float.push_back(From16(x, shape.bf16));
  for (const uint16_t x : c.v) c.v_float.push_back(From16(x, shape.bf16));
  return c;
}

// The attention of `seqs` (q_offset, q_len, start; table_offset filled from
// the cache's sequence `cache_seq[i]`) on the device: [tokens, heads, D].
std::vector<uint16_t> RunAttention(const PagedCache& cache, const DeviceMemory& kc,
                                   const DeviceMemory& vc, const DeviceMemory& q, int32_t tokens,
                                   std::vector<AttnSeq> seqs, const std::vector<int>& cache_seq,
                                   int64_t max_partials, AttnPlan* plan_out = nullptr,
                                   int32_t fold_splits = 1, const cuda::AttnRope* rope = nullptr,
                                   const cuda::L2Prefetch* prefetch = nullptr) {
  const AttnShape& shape = cache.shape;
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].table_offset = cache.table_offsets[static_cast<size_t>(cache_seq[i])];
  }
  AttnPlan plan;
  int64_t total = 0;
  for (const AttnSeq& s : seqs) total += s.q_len;
  const int64_t max_items = cuda::MaxFoldItems(shape, total, static_cast<int64_t>(seqs.size())) +
                            int64_t{shape.num_kv_heads} * 4096;
  EXPECT_TRUE(cuda::PlanPagedAttention(shape, seqs, max_items, max_partials, fold_splits, &plan));
  DeviceMemory dseqs(seqs), dtables(cache.tables), ditems(plan.items), dcombine(plan.combine);
  const AttnStep step{dseqs.get<AttnSeq>(),
                      dtables.get<int32_t>(),
                      ditems.get<AttnWorkItem>(),
                      dcombine.get<AttnCombineRow>(),
                      static_cast<int32_t>(plan.items.size()),
                      static_cast<int32_t>(plan.combine.size())};
  DeviceMemory dstep(std::vector<AttnStep>{step});
  const size_t out_elems = static_cast<size_t>(tokens) * shape.num_heads * shape.head_dim;
  DeviceMemory out(std::vector<uint16_t>(out_elems, Nan16(shape.bf16)));
  DeviceMemory pacc(static_cast<size_t>(std::max<int64_t>(plan.partial_entries, 1)) *
                    shape.head_dim * 4);
  DeviceMemory pml(static_cast<size_t>(std::max<int64_t>(plan.partial_entries, 1)) * 2 * 4);
  int grid = 0;
  EXPECT_EQ(cuda::PrepareAttention(shape, &grid), cudaSuccess);
  EXPECT_GT(grid, 0);
  EXPECT_EQ(cuda::LaunchPagedAttention(shape, q.get(), kc.get(), vc.get(), out.get(),
                                       pacc.get<float>(), pml.get<float>(), dstep.get<AttnStep>(),
                                       grid, nullptr, rope, prefetch),
            cudaSuccess);
  EXPECT_EQ(
      cuda::LaunchAttnCombine(shape, pacc.get<float>(), pml.get<float>(), dstep.get<AttnStep>(),
                              static_cast<int32_t>(plan.combine.size()), out.get(), nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (plan_out != nullptr) *plan_out = plan;
  return out.Read<uint16_t>(out_elems);
}

// A shape's parts follow the most warps a one-row launch may have, counted
// per weight of a batch. At the default 2112 each shape of the 1B and 8B
// Llama steps (q_proj, the k/v pair, o_proj, the gate/up pair, down_proj,
// lm_head) has the parts it had at 2048 warps over a batch's weights, but
// the 1B's gate/up pair, which has 2 instead of 1. At 1024 the 1B's q_proj has
// 4. 0 restores the default. (Host code: runs without a GPU.)
TEST(LlmCudaGemmSplits, FollowTheTargetWarps) {
  struct Restore {
    ~Restore() { cuda::SetTcGemmTargetWarps(0); }
  } restore;
  const auto parts = [](int64_t h, int64_t kv, int64_t im, int64_t vocab) {
    std::vector<int32_t> out;
    for (const cuda::TcGemmShape& s :
         {cuda::TcGemmShape{h, h, 1}, cuda::TcGemmShape{kv, h, 2}, cuda::TcGemmShape{h, h, 1},
          cuda::TcGemmShape{im, h, 2}, cuda::TcGemmShape{h, im, 1}, cuda::TcGemmShape{vocab, h, 1}})
      out.push_back(cuda::TcGemmSplits(s));
    return out;
  };
  const auto one_b = [&] { return parts(2048, 512, 8192, 128256); };
  const auto eight_b = [&] { return parts(4096, 1024, 14336, 128256); };
  EXPECT_EQ(one_b(), (std::vector<int32_t>{8, 8, 8, 2, 8, 1}));
  EXPECT_EQ(eight_b(), (std::vector<int32_t>{4, 8, 4, 1, 4, 1}));
  cuda::SetTcGemmTargetWarps(1024);
  EXPECT_EQ(one_b(), (std::vector<int32_t>{4, 8, 4, 1, 4, 1}));
  cuda::SetTcGemmTargetWarps(0);
  EXPECT_EQ(one_b(), (std::vector<int32_t>{8, 8, 8, 2, 8, 1}));
}

// The host plan alone (no GPU): every (token, head) row of a step gets its
// output from exactly one writer (a fold-path item, or a combine row whose
// partials the split-path items all wrote), within the capacities given.
TEST(LlmCudaAttentionPlan, CoversEveryRowOnce) {
  std::mt19937_64 rng(17);
  for (const AttnShape shape : {AttnShape{8, 2, 64, 16, true}, AttnShape{14, 2, 128, 16, true},
                                AttnShape{64, 1, 128, 16, true}, AttnShape{4, 4, 64, 1, true}}) {
    const int32_t heads = shape.num_heads, group = heads / shape.num_kv_heads;
    const int32_t per_tile = cuda::kAttnTileRows / group;
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<AttnSeq> seqs;
      int32_t tokens = 0;
      const int n = 1 + static_cast<int>(rng() % 9);
      for (int i = 0; i < n; ++i) {
        const int32_t q_len = rng() % 3 == 0 ? 1 + static_cast<int32_t>(rng() % 150)
                                             : 1 + static_cast<int32_t>(rng() % 4);
        const int32_t start = static_cast<int32_t>(rng() % 3000);
        seqs.push_back({tokens, q_len, start, 0});
        tokens += q_len;
      }
      const int64_t min_items = cuda::MaxFoldItems(shape, tokens, n);
      for (const auto& [partials, fold] : std::vector<std::pair<int64_t, int32_t>>{
               {0, 1}, {int64_t{1} << 30, 1}, {3000, 1}, {int64_t{1} << 30, 3}}) {
        AttnPlan plan;
        const int64_t max_items = min_items + (partials > 0 ? 200 : 0);
        ASSERT_TRUE(cuda::PlanPagedAttention(shape, seqs, max_items, partials, fold, &plan));
        ASSERT_LE(static_cast<int64_t>(plan.items.size()), max_items);
        ASSERT_LE(plan.partial_entries, partials);
        std::vector<int> writers(static_cast<size_t>(tokens) * heads, 0);
        std::vector<int> partial_writes(static_cast<size_t>(plan.partial_entries), 0);
        for (const AttnWorkItem& it : plan.items) {
          const AttnSeq& q = seqs[static_cast<size_t>(it.seq)];
          const int32_t positions = std::min(per_tile, q.q_len - it.q_first);
          ASSERT_GT(positions, 0);
          ASSERT_GE(it.split_lo, 0);
          ASSERT_LT(it.split_lo, it.split_hi);
          // No split starts past the tile's last key.
          ASSERT_LT(int64_t{it.split_lo} * cuda::kAttnSplitKeys,
                    int64_t{q.start} + it.q_first + positions);
          for (int32_t r = 0; r < positions * group; ++r) {
            const int32_t qi = it.q_first + r / group, head = it.kv_head * group + r % group;
            if (it.partial_base < 0) {
              // The fold path runs every split of its last row.
              ASSERT_EQ(it.split_lo, 0);
              ASSERT_EQ(it.split_hi, (q.start + it.q_first + positions + cuda::kAttnSplitKeys - 1) /
                                         cuda::kAttnSplitKeys);
              ++writers[static_cast<size_t>(q.q_offset + qi) * heads + static_cast<size_t>(head)];
            } else {
              ASSERT_EQ(it.split_hi, it.split_lo + 1);
              // Split only past `fold` splits.
              ASSERT_GT(int64_t{q.start} + q.q_len, int64_t{fold} * cuda::kAttnSplitKeys);
              const int64_t entry =
                  it.partial_base + (int64_t{it.split_lo} * q.q_len + qi) * heads + head;
              ASSERT_LT(entry, plan.partial_entries);
              ++partial_writes[static_cast<size_t>(entry)];
            }
          }
        }
        for (const AttnCombineRow& c : plan.combine) {
          ++writers[static_cast<size_t>(c.out_row)];
          for (int32_t j = 0; j < c.num_splits; ++j) {
            const int64_t entry = c.entry0 + int64_t{j} * c.split_stride;
            ASSERT_LT(entry, plan.partial_entries);
            ASSERT_EQ(partial_writes[static_cast<size_t>(entry)], 1) << "entry " << entry;
          }
        }
        for (size_t row = 0; row < writers.size(); ++row) {
          ASSERT_EQ(writers[row], 1) << "row " << row << " with " << partials << " partials";
        }
        if (partials == 0) {
          EXPECT_TRUE(plan.combine.empty());
        }
      }
    }
  }
}

// The environment's L2 prefetch setting (no GPU).
TEST(LlmCudaOptions, L2PrefetchSettingIsReadOrRefused) {
  CudaExecutorOptions o;
  const uint64_t default_bytes = o.l2_prefetch_bytes;
  ASSERT_TRUE(ParseL2Prefetch("16", &o).ok());
  EXPECT_EQ(o.l2_prefetch_rows, 16);
  EXPECT_EQ(o.l2_prefetch_bytes, default_bytes);
  ASSERT_TRUE(ParseL2Prefetch("1,9", &o).ok());
  EXPECT_EQ(o.l2_prefetch_rows, 1);
  EXPECT_EQ(o.l2_prefetch_bytes, uint64_t{9} << 20);
  ASSERT_TRUE(ParseL2Prefetch("0", &o).ok());
  EXPECT_EQ(o.l2_prefetch_rows, 0);
  for (const char* bad : {"", "x", "-1", "16,", ",9", "16,9,1", "16,2000", "4097", "1.5", " 16",
                          "16,-1", "99999999999999999999"}) {
    CudaExecutorOptions before;
    before.l2_prefetch_rows = 7;
    const Status s = ParseL2Prefetch(bad, &before);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(s.message().find("HEARTH_LLM_L2_PREFETCH"), std::string::npos) << s.ToString();
    EXPECT_EQ(before.l2_prefetch_rows, 7) << "'" << bad << "' changed the options";
    EXPECT_EQ(before.l2_prefetch_bytes, default_bytes) << "'" << bad << "' changed the options";
  }
}

struct AttnCase {
  int32_t heads, kv_heads, head_dim, block_size;
  bool bf16;
};

std::string Name(const AttnCase& c) {
  return std::to_string(c.heads) + "h" + std::to_string(c.kv_heads) + "kv" +
         std::to_string(c.head_dim) + "d" + std::to_string(c.block_size) + "b_" +
         (c.bf16 ? "bf16" : "f16");
}
void PrintTo(const AttnCase& c, std::ostream* os) { *os << Name(c); }

class LlmCudaAttentionTest : public LlmCudaTest, public ::testing::WithParamInterface<AttnCase> {};

TEST_P(LlmCudaAttentionTest, MatchesFloatLoopAndIsBatchInvariant) {
  const AttnCase p = GetParam();
  const AttnShape shape{p.heads, p.kv_heads, p.head_dim, p.block_size, p.bf16};
  ASSERT_TRUE(cuda::AttentionSupported(shape));
  const int32_t group = p.heads / p.kv_heads;
  std::mt19937_64 rng(static_cast<uint64_t>(p.heads * 1000 + p.head_dim + p.block_size));
  // (start, q_len): a first prefill; decodes within and past the first
  // split; a prefill chunk across several splits; a short chunk at a long
  // context (the split path when it fits one tile); a decode at 1000.
  const std::vector<std::pair<int32_t, int32_t>> shapes = {{0, 40},   {17, 1},   {300, 1},
                                                           {500, 70}, {1000, 3}, {1000, 1}};
  std::vector<int32_t> contexts;
  std::vector<AttnSeq> seqs;
  int32_t tokens = 0;
  for (const auto& [start, q_len] : shapes) {
    contexts.push_back(start + q_len);
    seqs.push_back({tokens, q_len, start, 0});
    tokens += q_len;
  }
  const PagedCache cache = MakeCache(shape, contexts, rng);
  const auto q = Random16(rng, static_cast<size_t>(tokens) * p.heads * p.head_dim, 1.5f, p.bf16);
  DeviceMemory kc(cache.k), vc(cache.v), dq(q);
  std::vector<int> ids(seqs.size());
  std::iota(ids.begin(), ids.end(), 0);

  AttnPlan plan;
  const auto out = RunAttention(cache, kc, vc, dq, tokens, seqs, ids, 1 << 20, &plan);
  EXPECT_FALSE(plan.combine.empty()) << "no sequence took the split path";
  // Reference: softmax(q k / sqrt(D)) v over keys 0..pos, in double.
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  double worst = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int32_t qi = 0; qi < seqs[s].q_len; ++qi) {
      const int32_t pos = seqs[s].start + qi;
      for (int32_t h = 0; h < p.heads; ++h) {
        const size_t q_at = (static_cast<size_t>(seqs[s].q_offset + qi) * p.heads + h) * p.head_dim;
        std::vector<double> q_row(static_cast<size_t>(p.head_dim));
        for (int32_t i = 0; i < p.head_dim; ++i) {
          q_row[static_cast<size_t>(i)] = From16(q[q_at + static_cast<size_t>(i)], p.bf16);
        }
        std::vector<double> scores(static_cast<size_t>(pos + 1));
        double top = -INFINITY;
        for (int32_t j = 0; j <= pos; ++j) {
          const float* k = cache.Row(cache.k_float, static_cast<int>(s), j, h / group);
          double dot = 0;
          for (int32_t i = 0; i < p.head_dim; ++i) dot += q_row[static_cast<size_t>(i)] * k[i];
          scores[static_cast<size_t>(j)] = dot * scale;
          top = std::max(top, dot * scale);
        }
        std::vector<double> want(static_cast<size_t>(p.head_dim), 0.0);
        double sum = 0;
        for (int32_t j = 0; j <= pos; ++j) {
          const double w = std::exp(scores[static_cast<size_t>(j)] - top);
          sum += w;
          const float* v = cache.Row(cache.v_float, static_cast<int>(s), j, h / group);
          for (int32_t i = 0; i < p.head_dim; ++i)
            want[static_cast<size_t>(i)] += w * v[static_cast<size_t>(i)];
        }
        for (int32_t i = 0; i < p.head_dim; ++i) {
          const double got = From16(out[q_at + static_cast<size_t>(i)], p.bf16);
          ASSERT_FALSE(std::isnan(got))
              << "row not written: seq " << s << " q " << qi << " head " << h;
          const double err = std::fabs(got - want[static_cast<size_t>(i)] / sum);
          worst = std::max(worst, err);
          // P rounded to the 16-bit type, and the output once: values are in [-1, 1].
          ASSERT_LT(err, p.bf16 ? 2e-2 : 4e-3)
              << "seq " << s << " q " << qi << " head " << h << " dim " << i;
        }
      }
    }
  }
  RecordProperty("worst_abs_error", std::to_string(worst));

  // Every row on the fold path only (no partials): the same bits.
  AttnPlan fold;
  const auto folded = RunAttention(cache, kc, vc, dq, tokens, seqs, ids, 0, &fold);
  EXPECT_TRUE(fold.combine.empty());
  EXPECT_EQ(folded, out) << "the fold path and the split path differ";

  // An L2 prefetch beside it (three ranges of a 40 MB buffer, more chunks
  // than the grid has threads, the last range not a whole chunk): the same
  // bits. A range not 16-byte aligned, or not a multiple of 16 bytes long,
  // is refused before anything runs.
  DeviceMemory far(size_t{40} << 20);
  cuda::L2Prefetch prefetch;
  prefetch.ptr[0] = far.get<char>() + 16;
  prefetch.bytes[0] = (size_t{24} << 20) - 16;
  prefetch.ptr[2] = far.get<char>() + (size_t{24} << 20);
  prefetch.bytes[2] = (size_t{16} << 20) - 4096 - 48;
  const auto fetched =
      RunAttention(cache, kc, vc, dq, tokens, seqs, ids, 1 << 20, nullptr, 1, nullptr, &prefetch);
  EXPECT_EQ(fetched, out) << "the attention with an L2 prefetch differs";
  int grid = 0;
  ASSERT_EQ(cuda::PrepareAttention(shape, &grid), cudaSuccess);
  for (const auto& [at, bytes] : {std::pair<size_t, uint64_t>{8, 4096}, {0, 4104}}) {
    cuda::L2Prefetch bad;
    bad.ptr[1] = far.get<char>() + at;
    bad.bytes[1] = bytes;
    EXPECT_EQ(cuda::LaunchPagedAttention(shape, dq.get(), kc.get(), vc.get(), nullptr, nullptr,
                                         nullptr, nullptr, grid, nullptr, nullptr, &bad),
              cudaErrorInvalidValue)
        << "offset " << at << ", " << bytes << " bytes";
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The chunk of sequence 3 (positions 500..569) cut in two, and its last
  // row alone as a decode, each in a step of its own and beside others: the
  // same bits as in the whole chunk.
  const size_t row = static_cast<size_t>(p.heads) * p.head_dim;
  const AttnSeq whole = seqs[3];
  const std::vector<AttnSeq> cut = {
      {whole.q_offset, 30, 500, 0}, {whole.q_offset + 30, 40, 530, 0}, seqs[0]};
  const auto chunked = RunAttention(cache, kc, vc, dq, tokens, cut, {3, 3, 0}, 1 << 20);
  const std::vector<AttnSeq> decode = {{whole.q_offset + 69, 1, 569, 0}};
  const auto alone = RunAttention(cache, kc, vc, dq, tokens, decode, {3}, 1 << 20);
  for (int32_t qi = 0; qi < whole.q_len; ++qi) {
    const size_t at = static_cast<size_t>(whole.q_offset + qi) * row;
    ASSERT_TRUE(std::equal(out.begin() + static_cast<ptrdiff_t>(at),
                           out.begin() + static_cast<ptrdiff_t>(at + row),
                           chunked.begin() + static_cast<ptrdiff_t>(at)))
        << "chunked row " << qi;
  }
  const size_t last = static_cast<size_t>(whole.q_offset + 69) * row;
  EXPECT_TRUE(std::equal(out.begin() + static_cast<ptrdiff_t>(last),
                         out.begin() + static_cast<ptrdiff_t>(last + row),
                         alone.begin() + static_cast<ptrdiff_t>(last)))
      << "the decode of position 569 differs from its row in the prefill";
}

// RoPE and the KV write inside the attention (AttnRope) against the RoPE
// launch followed by the attention: the same outputs and the same cache,
// bit for bit, on the split path and on the fold path.
TEST_P(LlmCudaAttentionTest, RopeInsideEqualsTheRopeLaunchBeforeIt) {
  const AttnCase& p = GetParam();
  const AttnShape shape{p.heads, p.kv_heads, p.head_dim, p.block_size, p.bf16};
  const int32_t group = p.heads / p.kv_heads, per_tile = cuda::kAttnTileRows / group;
  std::mt19937_64 rng(static_cast<uint64_t>(p.heads * 1000 + p.head_dim + p.block_size + 1));
  // (start, q_len), each within one tile of query rows: decodes in the first
  // split, at a split's last key and first key, far in; a few tokens across
  // a split boundary.
  std::vector<std::pair<int32_t, int32_t>> shapes = {{0, 1}, {127, 1}, {128, 1}, {1000, 1}};
  if (per_tile >= 3) shapes.push_back({126, 3});
  std::vector<int32_t> contexts;
  std::vector<AttnSeq> seqs;
  int32_t tokens = 0;
  for (const auto& [start, q_len] : shapes) {
    contexts.push_back(start + q_len);
    seqs.push_back({tokens, q_len, start, 0});
    tokens += q_len;
  }
  const PagedCache cache = MakeCache(shape, contexts, rng);
  std::vector<int32_t> positions, slots;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int32_t i = 0; i < seqs[s].q_len; ++i) {
      const int32_t pos = seqs[s].start + i;
      positions.push_back(pos);
      const int32_t block =
          cache.tables[static_cast<size_t>(cache.table_offsets[s] + pos / shape.block_size)];
      slots.push_back(block * shape.block_size + pos % shape.block_size);
    }
  }
  ModelConfig config;
  config.head_dim = p.head_dim;
  config.rope_theta = 500000.0;
  const std::vector<double> inv64 = config.InverseFrequencies();
  const std::vector<float> inv(inv64.begin(), inv64.end());
  const size_t kv_elems = static_cast<size_t>(tokens) * p.kv_heads * p.head_dim;
  const auto q = Random16(rng, static_cast<size_t>(tokens) * p.heads * p.head_dim, 1.5f, p.bf16);
  const auto k = Random16(rng, kv_elems, 1.0f, p.bf16);
  const auto v = Random16(rng, kv_elems, 1.0f, p.bf16);
  DeviceMemory dk(k), dv(v), dpos(positions), dslots(slots), dinv(inv);
  std::vector<int> ids(seqs.size());
  std::iota(ids.begin(), ids.end(), 0);

  for (const int32_t fold : {1, 64}) {
    SCOPED_TRACE(fold == 1 ? "split path" : "fold path");
    // The RoPE launch, then the attention.
    DeviceMemory kc_a(cache.k), vc_a(cache.v), q_a(q);
    const cuda::RopeKvArgs r{q_a.get(),
                             dk.get(),
                             dv.get(),
                             dpos.get<int32_t>(),
                             dslots.get<int32_t>(),
                             dinv.get<float>(),
                             kc_a.get(),
                             vc_a.get(),
                             tokens,
                             p.heads,
                             p.kv_heads,
                             p.head_dim,
                             p.block_size,
                             p.bf16};
    ASSERT_CUDA(cuda::LaunchRopeKvWrite(r, nullptr));
    AttnPlan plan;
    const auto want = RunAttention(cache, kc_a, vc_a, q_a, tokens, seqs, ids, 1 << 20, &plan, fold);
    EXPECT_EQ(plan.combine.empty(), fold > 1);
    // The attention alone, from q as the GEMM wrote it.
    DeviceMemory kc_b(cache.k), vc_b(cache.v), q_b(q);
    const cuda::AttnRope rope{dk.get(), dv.get(), dpos.get<int32_t>(), dslots.get<int32_t>(),
                              dinv.get<float>()};
    const auto got =
        RunAttention(cache, kc_b, vc_b, q_b, tokens, seqs, ids, 1 << 20, nullptr, fold, &rope);
    EXPECT_EQ(got, want) << "the outputs differ";
    EXPECT_EQ(kc_b.Read<uint16_t>(cache.k.size()), kc_a.Read<uint16_t>(cache.k.size()))
        << "the key caches differ";
    EXPECT_EQ(vc_b.Read<uint16_t>(cache.v.size()), vc_a.Read<uint16_t>(cache.v.size()))
        << "the value caches differ";
    EXPECT_EQ(q_b.Read<uint16_t>(q.size()), q) << "the attention wrote q";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LlmCudaAttentionTest,
    ::testing::Values(AttnCase{8, 2, 64, 16, true}, AttnCase{8, 2, 128, 16, true},
                      AttnCase{4, 4, 64, 7, true}, AttnCase{14, 2, 64, 16, true},
                      AttnCase{16, 2, 128, 32, false}, AttnCase{64, 1, 128, 16, true}),
    [](const ::testing::TestParamInfo<AttnCase>& p) { return Name(p.param); });

// ---- Sampling.

// Runs the sampling kernel on rows of logits; a parameter's position is its
// draw position. The scratch is a new one, zeroed, unless one is given.
std::vector<int32_t> Sample(const std::vector<std::vector<float>>& rows,
                            const std::vector<SamplingParams>& params,
                            const std::vector<int64_t>& positions,
                            DeviceMemory* scratch = nullptr) {
  const size_t vocab = rows[0].size();
  std::vector<float> flat;
  std::vector<cuda::SampleRow> p;
  for (size_t i = 0; i < rows.size(); ++i) {
    flat.insert(flat.end(), rows[i].begin(), rows[i].end());
    p.push_back(
        {params[i].temperature, params[i].top_p, params[i].top_k, 1, params[i].seed, positions[i]});
  }
  p.push_back({1.0f, 1.0f, 0, 0, 0, 0});  // an inactive row: -1
  flat.insert(flat.end(), rows[0].begin(), rows[0].end());
  const auto n = static_cast<int32_t>(p.size());
  DeviceMemory dl(flat), dp(p), out(std::vector<int32_t>(p.size(), -7));
  DeviceMemory fresh;
  if (scratch == nullptr) {
    fresh = DeviceMemory(std::vector<uint8_t>(
        static_cast<size_t>(cuda::SampleScratchBytes(n, static_cast<int64_t>(vocab)))));
    scratch = &fresh;
  }
  EXPECT_EQ(
      cuda::LaunchSample(dl.get<float>(), n, static_cast<int64_t>(vocab), dp.get<cuda::SampleRow>(),
                         scratch->get(), out.get<int32_t>(), nullptr),
      cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto tokens = out.Read<int32_t>(p.size());
  EXPECT_EQ(tokens.back(), -1) << "the inactive row";
  tokens.pop_back();
  return tokens;
}

TEST_F(LlmCudaTest, SampleGreedyTakesTheFirstLargest) {
  std::vector<float> l(5000, 0.0f);
  l[4000] = 3.0f;
  l[17] = 3.0f;
  l[4999] = 3.0f;
  std::vector<float> nan = l;
  nan[2500] = NAN;
  EXPECT_EQ(Sample({l, nan}, {{}, {}}, {0, 0}), (std::vector<int32_t>{17, 2500}));
  // top_k 1 is greedy at any temperature and seed where the largest logit
  // is alone; where it is tied, the tied ones are all kept (as on the host)
  // and the draw is the host's, one of them.
  std::vector<float> alone = l;
  alone[4000] = 2.5f;
  alone[4999] = 2.5f;
  std::vector<std::vector<float>> rows;
  std::vector<SamplingParams> params;
  std::vector<int64_t> positions;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    rows.push_back(seed % 2 == 0 ? alone : l);
    params.push_back({0.5f + 0.1f * static_cast<float>(seed), 1.0f, 1, seed});
    positions.push_back(static_cast<int64_t>(seed) * 3);
  }
  const std::vector<int32_t> drawn = Sample(rows, params, positions);
  ASSERT_EQ(drawn.size(), rows.size());
  std::set<int32_t> tied_drawn;
  for (size_t i = 0; i < drawn.size(); ++i) {
    if (i % 2 == 0) {
      EXPECT_EQ(drawn[i], 17) << "row " << i;
    } else {
      EXPECT_TRUE(drawn[i] == 17 || drawn[i] == 4000 || drawn[i] == 4999)
          << "row " << i << ": " << drawn[i];
      EXPECT_EQ(drawn[i], SampleToken(rows[i], params[i], positions[i])) << "row " << i;
      tied_drawn.insert(drawn[i]);
    }
  }
  EXPECT_GT(tied_drawn.size(), 1u) << "20 seeds over three tied logits drew one token only";
}

TEST_F(LlmCudaTest, SampleDrawsWhatSampleTokenDraws) {
  // Random rows and parameters (the top_k and top_p radix selections, their
  // fixed-point mass): the host draw's token, row by row.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const std::vector<int32_t> top_ks = {0, 1, 2, 5, 50, 999, 1000, 5000};
  const std::vector<float> top_ps = {1.0f, 0.95f, 0.9f, 0.5f, 0.1f, 1e-6f};
  for (const int vocab : {1000, 50257, 128256}) {
    std::vector<std::vector<float>> rows;
    std::vector<SamplingParams> params;
    std::vector<int64_t> positions;
    for (int i = 0; i < 96; ++i) {
      std::vector<float> l(static_cast<size_t>(vocab));
      for (float& x : l) x = normal(rng);
      if (i % 7 == 3) l[static_cast<size_t>(i)] = NAN;                   // never drawn
      if (i % 11 == 5) std::fill(l.begin() + 10, l.begin() + 20, l[3]);  // ties
      rows.push_back(std::move(l));
      params.push_back({i % 9 == 0 ? 0.0f : 0.3f + 0.05f * static_cast<float>(i % 30),
                        top_ps[static_cast<size_t>(i) % top_ps.size()],
                        top_ks[static_cast<size_t>(i / 3) % top_ks.size()],
                        static_cast<uint64_t>(i) * 977});
      positions.push_back(i * 13);
    }
    const auto got = Sample(rows, params, positions);
    for (size_t i = 0; i < rows.size(); ++i) {
      EXPECT_EQ(got[i], SampleToken(rows[i], params[i], positions[i]))
          << "vocab " << vocab << " row " << i << " temperature " << params[i].temperature
          << " top_p " << params[i].top_p << " top_k " << params[i].top_k;
    }
  }
}

TEST_F(LlmCudaTest, SampleSpreadsTheFirstPassAndLeavesItsScratchReady) {
  // Rows at a temperature alone are drawn in the first pass, over the row's
  // parts; greedy and top_k rows beside them. One scratch a vocabulary for
  // launches of several row counts, more and fewer (vocabularies of 1 to 32
  // parts, and some not a multiple of 4): every draw is the host's, and after
  // each launch every row's arrival count (its place's first word) is zero.
  std::mt19937_64 rng(17);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const int vocab : {7, 8192, 128256, 300000, 50257}) {
    const int64_t bytes = cuda::SampleScratchBytes(65, vocab);
    DeviceMemory scratch(std::vector<uint8_t>(static_cast<size_t>(bytes)));
    for (const int n : {1, 5, 64, 3}) {
      std::vector<std::vector<float>> rows;
      std::vector<SamplingParams> params;
      std::vector<int64_t> positions;
      for (int i = 0; i < n; ++i) {
        std::vector<float> l(static_cast<size_t>(vocab));
        for (float& x : l) x = normal(rng);
        if (i % 4 == 1) l[static_cast<size_t>(vocab / 2)] = NAN;
        rows.push_back(std::move(l));
        params.push_back({i % 3 == 2 ? 0.0f : 0.6f + 0.1f * static_cast<float>(i % 5), 1.0f,
                          i % 6 == 4 ? 20 : 0, static_cast<uint64_t>(i) * 31 + 7});
        positions.push_back(i * 5 + vocab % 11);
      }
      const auto got = Sample(rows, params, positions, &scratch);
      for (size_t i = 0; i < rows.size(); ++i) {
        EXPECT_EQ(got[i], SampleToken(rows[i], params[i], positions[i]))
            << "vocab " << vocab << " rows " << n << " row " << i;
      }
      const size_t per_row = static_cast<size_t>(cuda::SampleScratchBytes(1, vocab)) / 4;
      const auto words = scratch.Read<uint32_t>(static_cast<size_t>(bytes) / 4);
      for (size_t r = 0; r < 65; ++r) {
        EXPECT_EQ(words[r * per_row], 0u) << "vocab " << vocab << " rows " << n << " row " << r;
      }
    }
  }
}

TEST_F(LlmCudaTest, SampleFoldsTiesAndNansAcrossParts) {
  // A 40000-token row is read in several parts: the first of maxima tied
  // across parts, the first NaN across parts, and a NaN in a later part
  // above a larger number in an earlier one, as on the host.
  const int vocab = 40000;
  std::vector<float> tied(vocab, -1.0f);
  for (const int i : {39990, 25001, 12345, 30000}) tied[static_cast<size_t>(i)] = 5.0f;
  std::vector<float> nans(vocab, 0.0f);
  for (const int i : {33333, 17000, 38000}) nans[static_cast<size_t>(i)] = NAN;
  nans[3] = 100.0f;
  std::vector<float> late_nan(vocab, 0.0f);
  late_nan[5] = 1e30f;
  late_nan[39999] = NAN;
  const std::vector<int32_t> got = Sample({tied, nans, late_nan}, {{}, {}, {}}, {0, 0, 0});
  EXPECT_EQ(got, (std::vector<int32_t>{12345, 17000, 39999}));
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], SampleToken(std::vector<std::vector<float>>{tied, nans, late_nan}[i], {}, 0))
        << "row " << i;
  }
}

TEST_F(LlmCudaTest, SampleTopPKeepsItsSet) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 among 1000 tokens whose others are
  // never drawn (-inf): top_p 0.65 keeps two, 0.75 three.
  std::vector<float> l(1000, -INFINITY);
  l[100] = std::log(0.1f);
  l[7] = std::log(0.4f);
  l[999] = std::log(0.2f);
  l[500] = std::log(0.3f);
  for (const float top_p : {0.65f, 0.75f}) {
    std::vector<std::vector<float>> rows(400, l);
    std::vector<SamplingParams> params(400, SamplingParams{1.0f, top_p, 0, 77});
    std::vector<int64_t> positions(400);
    std::iota(positions.begin(), positions.end(), 0);
    std::map<int32_t, int> count;
    for (int32_t t : Sample(rows, params, positions)) ++count[t];
    EXPECT_GT(count[7], 0);
    EXPECT_GT(count[500], 0);
    EXPECT_EQ(count[100], 0) << "top_p " << top_p;
    if (top_p < 0.7f) {
      EXPECT_EQ(count[999], 0);
    } else {
      EXPECT_GT(count[999], 0);
    }
    EXPECT_EQ(count[7] + count[500] + count[999], 400);
  }
}

TEST_F(LlmCudaTest, SampleIsKeyedBySeedAndPositionAlone) {
  // One row's token does not depend on its place in the batch or the other
  // rows; another position draws anew.
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> row(4096);
  for (float& x : row) x = normal(rng);
  const SamplingParams p{1.0f, 0.9f, 40, 1234};
  const int32_t alone = Sample({row}, {p}, {5})[0];
  std::vector<std::vector<float>> rows;
  std::vector<SamplingParams> params;
  std::vector<int64_t> positions;
  for (int i = 0; i < 9; ++i) {
    std::vector<float> other(4096);
    for (float& x : other) x = normal(rng);
    rows.push_back(i == 6 ? row : other);
    params.push_back(i == 6 ? p : SamplingParams{0.7f, 0.5f, 0, static_cast<uint64_t>(i)});
    positions.push_back(i == 6 ? 5 : i);
  }
  EXPECT_EQ(Sample(rows, params, positions)[6], alone);
  int differ = 0;
  for (int64_t pos = 6; pos < 40; ++pos) differ += Sample({row}, {p}, {pos})[0] != alone;
  EXPECT_GT(differ, 10);
}

// ---- The executor.

ModelConfig ExecutorConfig(Family family, DType dtype) {
  ModelConfig c = testing::TinyConfig(family, dtype);
  c.hidden_size = 256;
  c.intermediate_size = 512;
  c.num_layers = 2;
  c.vocab_size = 1000;
  c.max_positions = 2048;
  if (family == Family::kQwen2) {  // biases, tied embeddings, head_dim 128, 2 heads a group
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 128;
  } else {  // head_dim 64, 4 heads a group, llama3 scaling
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = 64;
    c.rope_theta = 500000.0;
    c.rope_scaling = {true, 32.0, 1.0, 4.0, 256};
  }
  return c;
}

// A random model in host memory, its copy in device memory, both bound.
// The copy is one allocation with the tensors packed in order at 256 bytes,
// as the store's arena holds them (so that the executor pairs its GEMMs).
struct TwoCopies {
  ModelConfig config;
  testing::HostModel host;
  std::vector<TensorView> host_views, device_views;
  std::vector<DeviceMemory> memory;
  ModelWeights host_weights, device_weights;

  TwoCopies(const ModelConfig& c, uint64_t seed) : config(c), host(testing::MakeModel(c, seed)) {
    host_views = host.Views();
    std::vector<size_t> offsets;
    size_t total = 0;
    for (const TensorView& v : host_views) {
      offsets.push_back(total);
      total += (static_cast<size_t>(v.nbytes) + 255) / 256 * 256;
    }
    memory.emplace_back(total);
    for (size_t i = 0; i < host_views.size(); ++i) {
      const TensorView& v = host_views[i];
      TensorView d = v;
      d.data = static_cast<char*>(memory.front().get()) + offsets[i];
      d.device = Device::Cuda(0);
      EXPECT_EQ(cudaMemcpy(const_cast<void*>(d.data), v.data, v.nbytes, cudaMemcpyHostToDevice),
                cudaSuccess);
      device_views.push_back(d);
    }
    auto h = BindWeights(c, host_views);
    auto d = BindWeights(c, device_views);
    EXPECT_TRUE(h.ok() && d.ok()) << h.status().ToString() << d.status().ToString();
    if (h.ok()) host_weights = *h;
    if (d.ok()) device_weights = *d;
  }
};

ExecutorOptions Options() {
  ExecutorOptions o;
  o.max_seqs = 8;
  o.max_tokens_per_step = 512;
  o.block_size = 16;
  o.kv_pool_bytes = uint64_t{64} << 20;
  return o;
}

std::unique_ptr<CudaExecutor> Cuda(const TwoCopies& m, CudaExecutorOptions co = {},
                                   ExecutorOptions o = Options()) {
  auto e = CreateCudaExecutor(m.config, m.device_weights, 0, o, co);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// One sequence's part of a step.
struct Feed {
  std::vector<int32_t> tokens;
  int32_t start = 0;
  std::vector<int32_t> blocks;
  bool sample = true;
  SamplingParams params{};
  int64_t draw_position = 0;
};

// The arrays a StepBatch points into.
struct Batch {
  std::vector<int32_t> tokens, offsets{0}, starts, tables;
  std::vector<uint8_t> sample;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draws;
  int32_t max_blocks = 0;
  size_t sampled = 0;

  explicit Batch(const std::vector<Feed>& feeds) {
    for (const Feed& f : feeds) max_blocks = std::max(max_blocks, int32_t(f.blocks.size()));
    for (const Feed& f : feeds) {
      tokens.insert(tokens.end(), f.tokens.begin(), f.tokens.end());
      offsets.push_back(static_cast<int32_t>(tokens.size()));
      starts.push_back(f.start);
      std::vector<int32_t> row = f.blocks;
      row.resize(static_cast<size_t>(max_blocks), -1);
      tables.insert(tables.end(), row.begin(), row.end());
      sample.push_back(f.sample);
      params.push_back(f.params);
      draws.push_back(f.draw_position);
      sampled += f.sample;
    }
  }
  StepBatch View() const {
    StepBatch b;
    b.tokens = tokens;
    b.offsets = offsets;
    b.starts = starts;
    b.block_tables = tables;
    b.max_blocks = max_blocks;
    b.sample = sample;
    b.params = params;
    b.draw_positions = draws;
    return b;
  }
};

// The logits of the sampled sequences of one step, [sampled][vocab].
std::vector<std::vector<float>> StepLogits(Executor& e, const std::vector<Feed>& feeds,
                                           int64_t vocab) {
  const Batch b(feeds);
  std::vector<float> flat(b.sampled * static_cast<size_t>(vocab), NAN);
  const Status s = e.StepLogits(b.View(), flat);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<std::vector<float>> rows;
  for (size_t i = 0; i < b.sampled; ++i) {
    rows.emplace_back(flat.begin() + static_cast<ptrdiff_t>(i * vocab),
                      flat.begin() + static_cast<ptrdiff_t>((i + 1) * vocab));
  }
  return rows;
}

std::vector<int32_t> StepTokens(Executor& e, const std::vector<Feed>& feeds) {
  const Batch b(feeds);
  std::vector<int32_t> next(feeds.size(), -7);
  const Status s = e.Step(b.View(), next);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return next;
}

std::vector<int32_t> Tokens(int n, int salt, int vocab = 1000) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 17 + salt * 29 + 3) % vocab;
  return t;
}

std::vector<int32_t> Blocks(int first, int n) {
  std::vector<int32_t> b(static_cast<size_t>(n));
  std::iota(b.begin(), b.end(), first);
  return b;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, int begin, int end) {
  return {v.begin() + begin, v.begin() + end};
}

// ||a - b|| / ||b||.
double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct ExecutorCase {
  Family family;
  DType dtype;
  GemmEngine engine = GemmEngine::kAny;
};

void PrintTo(const ExecutorCase& c, std::ostream* os) {
  *os << (c.family == Family::kQwen2 ? "Qwen2 " : "Llama ") << DTypeName(c.dtype) << " "
      << EngineName(c.engine);
}

class LlmCudaExecutorTest : public LlmCudaTest, public ::testing::WithParamInterface<ExecutorCase> {
 protected:
  // An executor on the case's GEMM engine.
  std::unique_ptr<CudaExecutor> Gpu(const TwoCopies& m, CudaExecutorOptions co = {}) {
    co.gemm_engine = GetParam().engine;
    return Cuda(m, co);
  }
};

TEST_P(LlmCudaExecutorTest, MatchesTheCpuExecutor) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 21);
  auto gpu = Gpu(m);
  ASSERT_NE(gpu, nullptr);
  ExecutorOptions o = Options();
  o.kv_pool_bytes = uint64_t{16} << 20;
  auto cpu = CreateCpuExecutor(c, m.host_weights, o);
  ASSERT_TRUE(cpu.ok()) << cpu.status().ToString();
  // Two prompts (one past the first attention split), then decode steps
  // together. The GPU rounds every GEMM input to the 16-bit type, the CPU
  // keeps float32: a few 2^-8 (bf16) or 2^-11 (f16) relative per layer.
  const double tolerance = c.dtype == DType::kBF16 ? 4e-2 : 8e-3;
  const std::vector<int32_t> a = Tokens(300, 1), b = Tokens(5, 2);
  std::vector<Feed> step = {{a, 0, Blocks(0, 20)}, {b, 0, Blocks(20, 1)}};
  for (int s = 0; s < 4; ++s) {
    const auto want = StepLogits(**cpu, step, c.vocab_size);
    const auto got = StepLogits(*gpu, step, c.vocab_size);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LT(RelativeError(got[i], want[i]), tolerance) << "step " << s << " sequence " << i;
    }
    const int32_t pa = step[0].start + static_cast<int32_t>(step[0].tokens.size());
    const int32_t pb = step[1].start + static_cast<int32_t>(step[1].tokens.size());
    step = {{{Tokens(1, 10 + s)[0]}, pa, Blocks(0, 20)},
            {{Tokens(1, 20 + s)[0]}, pb, Blocks(20, 1)}};
  }
}

TEST_P(LlmCudaExecutorTest, ChunkedPrefillEqualsWhole) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 22);
  auto e = Gpu(m);
  ASSERT_NE(e, nullptr);
  SCOPED_TRACE(e->DescribeGemms());
  const std::vector<int32_t> prompt = Tokens(300, 3);
  const auto whole = StepLogits(*e, {{prompt, 0, Blocks(0, 20)}}, c.vocab_size);
  for (const std::vector<int>& cuts :
       std::vector<std::vector<int>>{{100, 177, 300}, {1, 2, 255, 256, 257, 300}}) {
    int begin = 0;
    std::vector<std::vector<float>> last;
    for (int end : cuts) {
      last = StepLogits(*e, {{Slice(prompt, begin, end), begin, Blocks(20, 20)}}, c.vocab_size);
      begin = end;
    }
    EXPECT_EQ(last, whole) << "cuts ending " << cuts.back();
    // Then the same decode steps on both copies.
    for (int s = 0; s < 3; ++s) {
      const std::vector<int32_t> t = {Tokens(1, 40 + s)[0]};
      EXPECT_EQ(StepLogits(*e, {{t, 300 + s, Blocks(0, 20)}}, c.vocab_size),
                StepLogits(*e, {{t, 300 + s, Blocks(20, 20)}}, c.vocab_size))
          << "decode " << s;
    }
  }
}

TEST_P(LlmCudaExecutorTest, PairedGemmsAgreeWithSeparateOnes) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 24);
  auto paired = Gpu(m);
  CudaExecutorOptions apart;
  apart.pair_gemms = false;
  auto separate = Gpu(m, apart);
  ASSERT_NE(paired, nullptr);
  ASSERT_NE(separate, nullptr);
  // The weights are packed as an arena packs them: the pairs are taken.
  EXPECT_NE(paired->DescribeGemms().find("k_proj+v_proj"), std::string::npos)
      << paired->DescribeGemms();
  EXPECT_NE(paired->DescribeGemms().find("gate_proj+up_proj"), std::string::npos);
  EXPECT_NE(separate->DescribeGemms().find("k_proj/v_proj"), std::string::npos)
      << separate->DescribeGemms();
  const double tolerance = c.dtype == DType::kBF16 ? 4e-2 : 8e-3;
  const std::vector<int32_t> prompt = Tokens(40, 5);
  auto a = StepLogits(*paired, {{prompt, 0, Blocks(0, 4)}}, c.vocab_size);
  auto b = StepLogits(*separate, {{prompt, 0, Blocks(0, 4)}}, c.vocab_size);
  for (int s = 0; s < 3; ++s) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_LT(RelativeError(a[i], b[i]), tolerance) << "step " << s;
    const std::vector<int32_t> t = {Tokens(1, 50 + s)[0]};
    a = StepLogits(*paired, {{t, 40 + s, Blocks(0, 4)}}, c.vocab_size);
    b = StepLogits(*separate, {{t, 40 + s, Blocks(0, 4)}}, c.vocab_size);
  }
}

// SwiGLU in the gate/up launch and q_proj with k/v in one launch (hearth's
// kernel, up to kTcSplitRows rows) give the logits of separate launches, bit
// for bit, in prefill chunks and decode steps, eager and graphed, with k/v
// as a pair and apart.
TEST_P(LlmCudaExecutorTest, FusedLaunchesEqualSeparateOnes) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 26);
  for (const bool pair : {true, false}) {
    SCOPED_TRACE(pair ? "k/v paired" : "k/v apart");
    // Untimed: the executors take the same engine and algorithm per shape
    // (timed, cuBLASLt and hearth's kernel could each win somewhere).
    CudaExecutorOptions profiled;
    profiled.time_gemms = false;
    profiled.pair_gemms = pair;
    profiled.profile = true;  // eager, with each kernel's name
    auto fused = Gpu(m, profiled);
    CudaExecutorOptions graphs;
    graphs.time_gemms = false;
    graphs.pair_gemms = pair;
    auto graphed = Gpu(m, graphs);
    // Every sequence on the attention's fold path (no combine), graphed.
    CudaExecutorOptions folding = graphs;
    folding.attention_fold_splits = 64;
    auto folded = Gpu(m, folding);
    // Each decode step's attention prefetching o_proj and the first rows of
    // gate_proj and up_proj into L2, graphed and eager.
    CudaExecutorOptions fetching = graphs;
    fetching.l2_prefetch_rows = 64;
    fetching.l2_prefetch_bytes = uint64_t{1} << 20;
    auto prefetched = Gpu(m, fetching);
    fetching.cuda_graphs = false;
    auto prefetched_eager = Gpu(m, fetching);
    // Nothing fused or prefetched, and every sequence of several splits on the
    // split path.
    CudaExecutorOptions off;
    off.time_gemms = false;
    off.pair_gemms = pair;
    off.fuse_swiglu = false;
    off.group_qkv = false;
    off.fuse_rope_attention = false;
    off.attention_fold_splits = 1;
    off.l2_prefetch_rows = 0;
    auto separate = Gpu(m, off);
    ASSERT_NE(fused, nullptr);
    ASSERT_NE(graphed, nullptr);
    ASSERT_NE(folded, nullptr);
    ASSERT_NE(separate, nullptr);
    ASSERT_NE(prefetched, nullptr);
    ASSERT_NE(prefetched_eager, nullptr);
    const auto step = [&](CudaExecutor& e, const std::vector<Feed>& feed) {
      return StepLogits(e, feed, c.vocab_size);
    };
    const auto same = [&](const std::vector<Feed>& feed, const std::string& what) {
      const auto want = step(*separate, feed);
      EXPECT_EQ(step(*fused, feed), want) << what;
      EXPECT_EQ(step(*graphed, feed), want) << what << ", graphed";
      EXPECT_EQ(step(*folded, feed), want) << what << ", folded";
      EXPECT_EQ(step(*prefetched, feed), want) << what << ", L2 prefetch";
      EXPECT_EQ(step(*prefetched_eager, feed), want) << what << ", L2 prefetch eager";
    };
    // The prompt in chunks of 16, 16 and 8 rows, then one row at a time (one
    // attention split), then 260 rows more and one row at a time again
    // (three splits: the split path where it is taken, the fold path on
    // `folded`).
    const std::vector<int32_t> prompt = Tokens(303, 7);
    for (int begin = 0; begin < 40; begin += 16) {
      const int end = std::min(begin + 16, 40);
      same({{Slice(prompt, begin, end), begin, Blocks(0, 20)}},
           "prefill from " + std::to_string(begin));
    }
    std::set<std::string> names;
    for (const KernelTime& t : fused->LastStepKernelTimes()) names.insert(t.name);
    // On hearth's kernel both GEMM fusions run (SwiGLU where gate/up are a
    // pair); the timed choice may keep cuBLASLt, which has neither. A
    // prefill chunk runs RoPE apart.
    if (GetParam().engine == GemmEngine::kOwn) {
      EXPECT_EQ(names.count("gemm q_proj + k/v"), 1u) << fused->DescribeGemms();
      EXPECT_EQ(names.count("gemm gate_proj+up_proj + swiglu"), pair ? 1u : 0u);
      EXPECT_EQ(names.count("swiglu"), pair ? 0u : 1u);
    }
    EXPECT_EQ(names.count("rope + kv write"), 1u);
    for (int s = 0; s < 3; ++s)
      same({{{Tokens(1, 70 + s)[0]}, 40 + s, Blocks(0, 20)}}, "decode " + std::to_string(s));
    names.clear();
    for (const KernelTime& t : fused->LastStepKernelTimes()) names.insert(t.name);
    EXPECT_EQ(names.count("rope + kv write"), 0u);
    EXPECT_EQ(names.count("attention + rope + kv write"), 1u);
    same({{Slice(prompt, 43, 303), 43, Blocks(0, 20)}}, "prefill from 43");
    for (int s = 0; s < 3; ++s)
      same({{{Tokens(1, 80 + s)[0]}, 303 + s, Blocks(0, 20)}}, "decode " + std::to_string(303 + s));
    // Graphs with the combine (three splits) and without (one split).
    EXPECT_EQ(graphed->captured_graphs(), 2);
    EXPECT_EQ(folded->captured_graphs(), 1);
    EXPECT_EQ(prefetched->captured_graphs(), 2);
  }
}

// Launch and Collect (the engine's overlap): a step launched before the one
// whose tokens it feeds (feed_previous), decodes beside a prefill chunk, two
// launched at once; the tokens are those of the same steps run one at a time
// with the tokens known.
TEST_P(LlmCudaExecutorTest, LaunchedStepsFeedTheTokensDrawnBeforeThem) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 27);
  CudaExecutorOptions untimed;  // the same algorithms on both
  untimed.time_gemms = false;
  auto piped = Gpu(m, untimed), alone = Gpu(m, untimed);
  ASSERT_NE(piped, nullptr);
  ASSERT_NE(alone, nullptr);
  const SamplingParams hot{1.1f, 0.9f, 0, 11};
  const std::vector<int32_t> p0 = Tokens(20, 1), p1 = Tokens(30, 2);
  const auto feed = [&](std::vector<int32_t> tokens, int32_t start, int blocks_from, int64_t draw) {
    return Feed{std::move(tokens), start, Blocks(blocks_from, 4), true, hot, draw};
  };
  // One at a time: sequence 0's prompt; its first decode beside sequence 1's
  // prompt; both decode.
  const auto t0 = StepTokens(*alone, {feed(p0, 0, 0, 0)});
  const auto t1 = StepTokens(*alone, {feed({t0[0]}, 20, 0, 1), feed(p1, 0, 10, 0)});
  const auto t2 = StepTokens(*alone, {feed({t1[0]}, 21, 0, 2), feed({t1[1]}, 30, 10, 1)});
  // Pipelined: each step launched before the one before it is collected,
  // the fed tokens' places holding 0.
  const Batch b0({feed(p0, 0, 0, 0)});
  const Batch b1({feed({0}, 20, 0, 1), feed(p1, 0, 10, 0)});
  const Batch b2({feed({0}, 21, 0, 2), feed({0}, 30, 10, 1)});
  const std::vector<int32_t> f1 = {0, -1}, f2 = {0, 1};
  StepBatch v1 = b1.View(), v2 = b2.View();
  v1.feed_previous = f1;
  v2.feed_previous = f2;
  std::vector<int32_t> n0(1), n1(2), n2(2);
  ASSERT_TRUE(piped->Launch(b0.View()).ok());
  ASSERT_TRUE(piped->Launch(v1).ok());
  EXPECT_EQ(piped->Launch(v2).code(), StatusCode::kFailedPrecondition) << "two are launched";
  ASSERT_TRUE(piped->Collect(n0).ok());
  ASSERT_TRUE(piped->Launch(v2).ok());
  ASSERT_TRUE(piped->Collect(n1).ok());
  ASSERT_TRUE(piped->Collect(n2).ok());
  EXPECT_EQ(piped->Collect(n2).code(), StatusCode::kFailedPrecondition) << "none is launched";
  EXPECT_EQ(n0, t0);
  EXPECT_EQ(n1, t1);
  EXPECT_EQ(n2, t2);
  // A feed from a sequence of the step before that drew nothing is refused.
  StepBatch v3 = b1.View();
  Feed quiet = feed(p0, 0, 0, 0);
  quiet.sample = false;
  const Batch b4({quiet, feed(p1, 0, 10, 0)});
  ASSERT_TRUE(piped->Launch(b4.View()).ok());
  ASSERT_TRUE(piped->Collect(n1).ok());
  const std::vector<int32_t> from_quiet = {0, -1};
  v3.feed_previous = from_quiet;
  EXPECT_EQ(piped->Launch(v3).code(), StatusCode::kInvalidArgument);
}

TEST_P(LlmCudaExecutorTest, BatchEqualsEachAlone) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 23);
  auto e = Gpu(m);
  ASSERT_NE(e, nullptr);
  SCOPED_TRACE(e->DescribeGemms());
  const int64_t v = c.vocab_size;
  const std::vector<int32_t> a = Tokens(37, 1), b = Tokens(260, 2), d = Tokens(5, 3);
  // Alone, on blocks 0..39.
  const auto a1 = StepLogits(*e, {{a, 0, Blocks(0, 4)}}, v);
  const auto b1 = StepLogits(*e, {{b, 0, Blocks(4, 20)}}, v);
  const auto d1 = StepLogits(*e, {{d, 0, Blocks(24, 2)}}, v);
  const auto a2 = StepLogits(*e, {{{5}, 37, Blocks(0, 4)}}, v);
  const auto b2 = StepLogits(*e, {{{6, 7, 8}, 260, Blocks(4, 20)}}, v);
  const auto d3 = StepLogits(*e, {{{9}, 5, Blocks(24, 2)}}, v);
  const auto a3 = StepLogits(*e, {{{10}, 38, Blocks(0, 4)}}, v);
  const auto b3 = StepLogits(*e, {{{11}, 263, Blocks(4, 20)}}, v);
  // Batched, on blocks 100..: step 1 three prefills; step 2 a decode beside
  // a chunk; step 3 three decodes (a graph bucket of 4 when graphs are on).
  const auto s1 =
      StepLogits(*e, {{a, 0, Blocks(100, 4)}, {b, 0, Blocks(104, 20)}, {d, 0, Blocks(124, 2)}}, v);
  const auto s2 = StepLogits(*e, {{{5}, 37, Blocks(100, 4)}, {{6, 7, 8}, 260, Blocks(104, 20)}}, v);
  const auto s3 = StepLogits(
      *e, {{{9}, 5, Blocks(124, 2)}, {{10}, 38, Blocks(100, 4)}, {{11}, 263, Blocks(104, 20)}}, v);
  EXPECT_EQ(s1[0], a1[0]);
  EXPECT_EQ(s1[1], b1[0]);
  EXPECT_EQ(s1[2], d1[0]);
  EXPECT_EQ(s2[0], a2[0]);
  EXPECT_EQ(s2[1], b2[0]);
  EXPECT_EQ(s3[0], d3[0]);
  EXPECT_EQ(s3[1], a3[0]);
  EXPECT_EQ(s3[2], b3[0]);
  // Drawn tokens too, with sampling on: each alone, then together.
  const SamplingParams hot{0.9f, 0.95f, 40, 99};
  std::vector<int32_t> alone;
  alone.push_back(StepTokens(*e, {{{12}, 39, Blocks(0, 4), true, hot, 3}})[0]);
  alone.push_back(StepTokens(*e, {{{13}, 264, Blocks(4, 20), true, hot, 4}})[0]);
  const auto together = StepTokens(
      *e, {{{12}, 39, Blocks(100, 4), true, hot, 3}, {{13}, 264, Blocks(104, 20), true, hot, 4}});
  EXPECT_EQ(together, alone);
}

TEST_P(LlmCudaExecutorTest, GraphDecodeEqualsEagerDecode) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 24);
  // Untimed GEMM choices: the two executors take the same algorithms.
  CudaExecutorOptions graphs, eager;
  graphs.time_gemms = eager.time_gemms = false;
  eager.cuda_graphs = false;
  auto g = Gpu(m, graphs), e = Gpu(m, eager);
  ASSERT_NE(g, nullptr);
  ASSERT_NE(e, nullptr);
  const int64_t v = c.vocab_size;
  // Prompts of 452 tokens in all; the first past the first attention split.
  std::vector<Feed> feeds;
  const int lengths[] = {300, 5, 40, 17, 90};
  for (int i = 0; i < 5; ++i) feeds.push_back({Tokens(lengths[i], i), 0, Blocks(30 * i, 30)});
  EXPECT_EQ(StepLogits(*g, feeds, v), StepLogits(*e, feeds, v));
  // Decode steps of 5, 3 (bucket 4, one padding row), 1 and 8 sequences,
  // logits then drawn tokens.
  std::vector<int32_t> pos;
  for (const Feed& f : feeds) pos.push_back(static_cast<int32_t>(f.tokens.size()));
  const SamplingParams hot{1.1f, 0.9f, 0, 5};
  for (const int n : {5, 3, 1, 5, 8}) {
    std::vector<Feed> step;
    for (int i = 0; i < n; ++i) {
      const int s = i % 5;
      if (n == 8 && i >= 5) {  // three more sequences, fresh
        step.push_back({{Tokens(1, 90 + i)[0]}, 0, Blocks(200 + 10 * i, 10)});
        continue;
      }
      step.push_back({{Tokens(1, 50 + pos[static_cast<size_t>(s)])[0]},
                      pos[static_cast<size_t>(s)],
                      Blocks(30 * s, 30),
                      i != 1,
                      {},
                      0});
      ++pos[static_cast<size_t>(s)];
    }
    // The same step twice on each: the logits, then drawn tokens (the second
    // write of the same keys and values changes nothing).
    EXPECT_EQ(StepLogits(*g, step, v), StepLogits(*e, step, v)) << n << " sequences";
    for (Feed& f : step) {
      f.params = hot;
      f.draw_position = f.start;
    }
    EXPECT_EQ(StepTokens(*g, step), StepTokens(*e, step)) << n << " sequences";
  }
  // Buckets 8, 4 and 1, each replayed at least once above.
  EXPECT_EQ(g->captured_graphs(), 3);
  EXPECT_EQ(e->captured_graphs(), 0);
}

// CudaExecutorOptions::launch_twice (llm_step_bench --twice) runs the named
// kernels again, eager and in the graphs; two that change nothing they read
// leave the logits and tokens as they were; a name no launch has runs
// nothing twice.
TEST_P(LlmCudaExecutorTest, LaunchTwiceRunsTheNamedKernelsAgain) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 26);
  CudaExecutorOptions plain, twice, unknown;
  plain.time_gemms = twice.time_gemms = unknown.time_gemms = false;
  twice.launch_twice = {"gemm lm_head", "sampling"};
  unknown.launch_twice = {"no such kernel"};
  auto p = Gpu(m, plain), t = Gpu(m, twice), u = Gpu(m, unknown);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(t, nullptr);
  ASSERT_NE(u, nullptr);
  const int64_t v = c.vocab_size;
  const std::vector<Feed> prompts{{Tokens(20, 1), 0, Blocks(0, 4)},
                                  {Tokens(7, 2), 0, Blocks(4, 4)}};
  EXPECT_EQ(StepLogits(*t, prompts, v), StepLogits(*p, prompts, v));
  const int64_t after_prefill = t->launches_twice();
  EXPECT_GE(after_prefill, 2);  // at least the lm_head and the sampling
  // Decode steps through a graph: logits, then drawn tokens.
  const SamplingParams hot{0.9f, 0.95f, 20, 7};
  for (int i = 0; i < 3; ++i) {
    const std::vector<Feed> step{{{Tokens(1, 30 + i)[0]}, 20 + i, Blocks(0, 4)},
                                 {{Tokens(1, 40 + i)[0]}, 7 + i, Blocks(4, 4)}};
    EXPECT_EQ(StepLogits(*t, step, v), StepLogits(*p, step, v)) << "step " << i;
  }
  EXPECT_EQ(StepTokens(*t, {{{5}, 23, Blocks(0, 4), true, hot, 1}}),
            StepTokens(*p, {{{5}, 23, Blocks(0, 4), true, hot, 1}}));
  EXPECT_GT(t->captured_graphs(), 0);
  EXPECT_GT(t->launches_twice(), after_prefill);
  EXPECT_EQ(p->launches_twice(), 0);
  EXPECT_EQ(StepLogits(*u, prompts, v).size(), prompts.size());
  EXPECT_EQ(u->launches_twice(), 0);
}

TEST_P(LlmCudaExecutorTest, RefusesBadStepsAndReportsItsMemory) {
  const ModelConfig c = ExecutorConfig(GetParam().family, GetParam().dtype);
  TwoCopies m(c, 25);
  auto e = Gpu(m);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->block_size(), 16);
  const uint64_t block_bytes = uint64_t{2} * 2 * static_cast<uint64_t>(c.num_kv_heads) * 16 *
                               static_cast<uint64_t>(c.head_dim) * 2;
  EXPECT_EQ(static_cast<uint64_t>(e->num_blocks()), (uint64_t{64} << 20) / block_bytes);
  EXPECT_GE(e->device_memory_bytes(), uint64_t{64} << 20);
  const std::vector<int32_t> prompt = Tokens(6, 1);
  auto refused = [&](const std::vector<Feed>& feeds, const std::string& part) {
    const Batch b(feeds);
    std::vector<float> logits(b.sampled * static_cast<size_t>(c.vocab_size));
    const Status s = e->StepLogits(b.View(), logits);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in " << s.message();
  };
  refused({{{3, 1000}, 0, Blocks(0, 1)}}, "token 1000");
  refused({{prompt, 0, {e->num_blocks()}}}, "is not in the pool");
  refused({{prompt, 0, {}}}, "needs 1 blocks");
  refused({{prompt, 2045, Blocks(0, 129)}}, "outside 0 .. 2047");
  refused({{prompt, 0, Blocks(0, 1)}, {prompt, 0, Blocks(0, 1)}}, "written by sequences 0 and 1");
  refused({{prompt, 0, Blocks(0, 1), true, SamplingParams{1.0f, 0.0f, 0, 0}}}, "top_p 0");
  refused({{std::vector<int32_t>(513, 1), 0, Blocks(0, 33)}}, "513 tokens");
  // The executor still works, and a refused step wrote nothing: position 6
  // on top of a prefill of 0..5 is what it is on fresh blocks.
  const auto x = StepLogits(*e, {{prompt, 0, Blocks(0, 1)}}, c.vocab_size);
  StepLogits(*e, {{prompt, 0, Blocks(1, 1)}}, c.vocab_size);
  EXPECT_EQ(StepLogits(*e, {{{9}, 6, Blocks(0, 1)}}, c.vocab_size),
            StepLogits(*e, {{{9}, 6, Blocks(1, 1)}}, c.vocab_size));
  ASSERT_EQ(x.size(), 1u);
  EXPECT_FALSE(std::any_of(x[0].begin(), x[0].end(), [](float f) { return std::isnan(f); }));
}

INSTANTIATE_TEST_SUITE_P(
    Models, LlmCudaExecutorTest,
    ::testing::Values(ExecutorCase{Family::kLlama, DType::kBF16},
                      ExecutorCase{Family::kQwen2, DType::kBF16},
                      ExecutorCase{Family::kLlama, DType::kF16},
                      ExecutorCase{Family::kLlama, DType::kBF16, GemmEngine::kOwn},
                      ExecutorCase{Family::kQwen2, DType::kBF16, GemmEngine::kOwn},
                      ExecutorCase{Family::kLlama, DType::kF16, GemmEngine::kOwn}),
    [](const ::testing::TestParamInfo<ExecutorCase>& p) {
      return std::string(p.param.family == Family::kQwen2 ? "Qwen2" : "Llama") +
             (p.param.dtype == DType::kBF16 ? "Bf16" : "F16") + EngineName(p.param.engine);
    });

TEST_F(LlmCudaTest, ExecutorRefusesWhatItCannotRun) {
  ModelConfig c = ExecutorConfig(Family::kLlama, DType::kBF16);
  TwoCopies m(c, 26);
  ModelConfig f32 = c;
  f32.dtype = DType::kF32;
  auto r = CreateCudaExecutor(f32, m.device_weights, 0, Options());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << r.status().ToString();
  ModelConfig odd = c;
  odd.head_dim = 32;
  r = CreateCudaExecutor(odd, m.device_weights, 0, Options());
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented) << r.status().ToString();
  // Host weights.
  r = CreateCudaExecutor(c, m.host_weights, 0, Options());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("is on cpu"), std::string::npos) << r.status().message();
  // A pool smaller than one block.
  ExecutorOptions o = Options();
  o.kv_pool_bytes = 1000;
  r = CreateCudaExecutor(c, m.device_weights, 0, o);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
  // A fraction of the free memory.
  o.kv_pool_bytes = 0;
  o.kv_pool_fraction = 0.05;
  auto e = CreateCudaExecutor(c, m.device_weights, 0, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_GT((*e)->num_blocks(), 0);
}

}  // namespace
}  // namespace hearth::llm
