// The engines of libhearth_backends_cuda.so (cuda/cuda_engines.cc), through
// the loader as hearth-worker reaches them: its hearth_create_engine, and
// the registry's kind "count" on a CUDA device, which gets its engine from
// the library. The count engine touches no device, so the library's path
// runs wherever the library loads; the test with its weights in device
// memory skips when no CUDA device can be used.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <string>

#include "backends/cuda/cuda_backend_abi.h"
#include "backends/plugin.h"
#include "engine_test_support.h"
#include "hearth/arena.h"

namespace hearth {
namespace {

using testing::CountRequest;
using testing::RecordingSink;

Result<Plugin> CudaLibrary() {
  return OpenPlugin(
      HEARTH_CUDA_BACKEND_LIBRARY, HEARTH_BACKENDS_CUDA_BUILD_PATH,
      {HEARTH_CREATE_CUDA_BACKEND, HEARTH_CUDA_HOST_REGISTER, HEARTH_CUDA_HOST_UNREGISTER});
}

void ExpectCounts(Engine& e) {
  EXPECT_EQ(e.inputs(), (std::vector<IoSpec>{{"n", DType::kI64, {1}}}));
  EXPECT_EQ(e.outputs(), (std::vector<IoSpec>{{"token_ids", DType::kI64, {-1}}}));
  EXPECT_EQ(e.capacity(), 4u);
  CountRequest a(3, R"({"start": 7})"), b(5, "", {0, 1, 2}), zero(0);
  ASSERT_TRUE(e.Add(1, a.view()).ok());
  ASSERT_TRUE(e.Add(2, b.view()).ok());
  EXPECT_EQ(e.Add(3, zero.view()).code(), StatusCode::kInvalidArgument);
  RecordingSink sink;
  while (e.busy()) ASSERT_TRUE(e.Step(sink).ok());
  EXPECT_EQ(sink.streams[1].numbers, (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(sink.streams[2].numbers, (std::vector<int64_t>{3, 4}));
  EXPECT_TRUE(sink.streams[1].final && sink.streams[2].final);
}

EngineOptions Options() {
  EngineOptions options;
  options.max_streams = 4;
  options.batching = false;
  return options;
}

TEST(CudaEngines, TheLibraryExportsTheCountEngine) {
  auto lib = CudaLibrary();
  ASSERT_TRUE(lib.ok()) << lib.status().ToString();
  ASSERT_NE(lib->create_engine, nullptr) << lib->path << " exports no hearth_create_engine";
  auto e = CreatePluginEngine(*lib, "count", {}, Device::Cuda(0), Options());
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ExpectCounts(**e);

  // Only for a GPU, and only the kinds it has.
  Status st = CreatePluginEngine(*lib, "count", {}, Device::Host(), Options()).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("libhearth_backends_cuda.so builds no engine on device kind 0"),
            std::string::npos)
      << st.message();
  st = CreatePluginEngine(*lib, "nope", {}, Device::Cuda(0), Options()).status();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("libhearth_backends_cuda.so has no engine 'nope' (its engines: "),
            std::string::npos)
      << st.message();

  // A caller of another build.
  HearthEngineOptions c{};
  const HearthEngineTable* table = nullptr;
  void* engine = nullptr;
  std::array<char, 512> error{};
  EXPECT_EQ(lib->create_engine(HEARTH_ENGINE_ABI_VERSION + 1, "count", nullptr, 0,
                               static_cast<int32_t>(DeviceKind::kCuda), 0, &c, &table, &engine,
                               error.data(), error.size()),
            static_cast<int>(StatusCode::kFailedPrecondition));
  EXPECT_NE(std::string(error.data()).find("it comes from another build"), std::string::npos)
      << error.data();
}

// The registry's "count" on a CUDA device is the library's: a weight the
// library's checks refuse (host memory for a GPU engine) shows whose it is,
// as the CPU engine ignores its weights.
TEST(CudaEngines, TheRegistrysCountOnAGpuIsTheLibrarys) {
  const int64_t shape = 1;
  const float one = 1;
  const TensorView host_weight{"w", DType::kF32, {shape}, &one, 0, 4, Device::Host()};
  Status st = CreateEngine("count", {host_weight}, Device::Cuda(0), Options()).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "weight 'w' is on cpu, but the engine runs on cuda:0");
  EXPECT_TRUE(CreateEngine("count", {host_weight}, Device::Host(), Options()).ok());

  auto e = CreateEngine("count", {}, Device::Cuda(0), Options());
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ExpectCounts(**e);
}

// A decoupled model on a GPU as hearth-worker builds it: its weights in
// device memory.
TEST(CudaEngines, CountsForAModelOnAGpu) {
  std::string why;
  if (!CudaAvailable(&why)) GTEST_SKIP() << "no CUDA device: " << why;
  void* weight = nullptr;
  ASSERT_EQ(cudaMalloc(&weight, 4 * 500), cudaSuccess);
  const std::unique_ptr<void, decltype(&cudaFree)> freed(weight, cudaFree);
  const TensorView on_gpu{"weight", DType::kF32, {500}, weight, 0, 4 * 500, Device::Cuda(0)};
  auto e = CreateEngine("count", {on_gpu}, Device::Cuda(0), Options());
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ExpectCounts(**e);
}

}  // namespace
}  // namespace hearth
