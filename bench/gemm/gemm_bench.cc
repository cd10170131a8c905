// The mlp forward on the GPU, by batch size: the backend with cuBLASLt
// against the backend with the skinny F32 kernel, the kernel alone with each
// features-per-warp choice, and the 16-bit weights on cuBLASLt.
//
//   gemm_bench [--dims 16384,16384,12800] [--rows 1,2,4,8,16,32,64,128] [--iterations 50]
//
// The skinny kernel runs only up to 32 rows: beyond, it is several passes.
//
// Prints one line per measurement:
//   forward dtype=F32 gemm=skinny rows=16 ms=0.512 weight_gbps=3650 tflops=29.8
//   kernel rows=2 per_warp=2 ms=0.453 weight_gbps=4223 tflops=4.2
// ms is the median of --iterations timed runs (after warm-up); weight_gbps
// the weight bytes over that time (one read of every weight per forward).
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/cuda/skinny_gemm.h"
#include "common/float16.h"
#include "hearth/arena.h"

namespace hearth {
namespace {

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "gemm_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(e));
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

// A device tensor of pseudo-random values in [-scale, scale), as `dtype`.
TensorView DeviceTensor(const std::string& name, DType dtype, std::vector<int64_t> shape,
                        float scale, uint64_t seed) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  std::vector<std::byte> bytes(n * DTypeSize(dtype));
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const float v = (static_cast<float>(state >> 40) / 16777216.0f * 2 - 1) * scale;
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dtype == DType::kF16 ? FloatToHalf(v) : FloatToBFloat16(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  void* p = nullptr;
  Check(cudaMalloc(&p, bytes.size()), "cudaMalloc");
  Check(cudaMemcpy(p, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), "cudaMemcpy");
  return TensorView{name, dtype, std::move(shape), p, 0, bytes.size(), Device::Cuda(0)};
}


template <typename Body>
double MedianMs(int iterations, Body&& body) {
  for (int i = 0; i < 3; ++i) body();
  std::vector<double> ms;
  for (int i = 0; i < iterations; ++i) {
    const auto t = std::chrono::steady_clock::now();
    body();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t)
                     .count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void Print(const std::string& head, double ms, double weight_bytes, double flops) {
  std::printf("%s ms=%.4f weight_gbps=%.0f tflops=%.1f\n", head.c_str(), ms,
              weight_bytes / (ms * 1e-3) / 1e9, flops / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

int Main(int argc, char** argv) {
  std::string dims_text = "16384,16384,12800", rows_text = "1,2,4,8,16,32,64,128";
  int iterations = 50;
  CLI::App app{"gemm_bench: the mlp forward on the GPU by batch size"};
  app.add_option("--dims", dims_text, "IN,H,OUT");
  app.add_option("--rows", rows_text, "batch sizes");
  app.add_option("--iterations", iterations)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const std::vector<int64_t> dims = ParseList(dims_text), rows_list = ParseList(rows_text);
  if (dims.size() != 3) Fail("--dims needs IN,H,OUT");
  std::string why;
  if (!CudaAvailable(&why)) Fail("no CUDA device: " + why);
  const int64_t in = dims[0], hidden = dims[1], out = dims[2];
  const int64_t max_rows = *std::max_element(rows_list.begin(), rows_list.end());

  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const std::vector<TensorView> weights{
        DeviceTensor("encoder.weight", dtype, {hidden, in}, 0.01f, 1),
        DeviceTensor("encoder.bias", dtype, {hidden}, 0.01f, 2),
        DeviceTensor("head.weight", dtype, {out, hidden}, 0.01f, 3),
        DeviceTensor("head.bias", dtype, {out}, 0.01f, 4)};
    const double weight_bytes = static_cast<double>(DTypeSize(dtype)) *
                                static_cast<double>(in * hidden + hidden * out);
    const std::vector<std::string> gemms =
        dtype == DType::kF32 ? std::vector<std::string>{"cublaslt", "skinny", "auto"}
                             : std::vector<std::string>{"auto"};
    for (const std::string& gemm : gemms) {
      BackendOptions options;
      options.max_batch_size = static_cast<int>(max_rows);
      options.parameters["gemm"] = gemm;
      auto backend = CreateBackend("mlp", weights, Device::Cuda(0), options);
      if (!backend.ok()) Fail(backend.status().ToString());
      void* host_in = nullptr;
      void* host_logits = nullptr;
      void* host_argmax = nullptr;
      Check(cudaMallocHost(&host_in, static_cast<size_t>(max_rows * in) * 4), "cudaMallocHost");
      Check(cudaMallocHost(&host_logits, static_cast<size_t>(max_rows * out) * 4), "cudaMallocHost");
      Check(cudaMallocHost(&host_argmax, static_cast<size_t>(max_rows) * 8), "cudaMallocHost");
      std::fill_n(static_cast<float*>(host_in), max_rows * in, 0.5f);
      const void* inputs[] = {host_in};
      void* outputs[] = {host_logits, host_argmax};
      for (int64_t rows : rows_list) {
        if (gemm == "skinny" && rows > cuda::kSkinnyMaxRows) continue;
        const double ms = MedianMs(iterations, [&] {
          Status s = (*backend)->Run(rows, inputs, outputs);
          if (!s.ok()) Fail(s.ToString());
        });
        Print("forward dtype=" + std::string(DTypeName(dtype)) + " gemm=" + gemm +
                  " rows=" + std::to_string(rows),
              ms, weight_bytes, 2.0 * static_cast<double>(rows * (in * hidden + hidden * out)));
      }
      cudaFreeHost(host_in);
      cudaFreeHost(host_logits);
      cudaFreeHost(host_argmax);
    }

    if (dtype == DType::kF32) {
      // The two skinny GEMMs alone, by features per warp.
      float *x = nullptr, *h = nullptr, *y = nullptr;
      Check(cudaMalloc(reinterpret_cast<void**>(&x), static_cast<size_t>(max_rows * in) * 4), "cudaMalloc");
      Check(cudaMalloc(reinterpret_cast<void**>(&h), static_cast<size_t>(max_rows * hidden) * 4), "cudaMalloc");
      Check(cudaMalloc(reinterpret_cast<void**>(&y), static_cast<size_t>(max_rows * out) * 4), "cudaMalloc");
      Check(cudaMemset(x, 0, static_cast<size_t>(max_rows * in) * 4), "cudaMemset");
      for (int64_t rows : rows_list) {
        if (rows > cuda::kSkinnyMaxRows) continue;
        for (int per_warp : {2, 4, 8}) {
          cuda::SkinnyGemmArgs a1{x, static_cast<const float*>(weights[0].data),
                                  static_cast<const float*>(weights[1].data), h, rows, hidden, in,
                                  true};
          cuda::SkinnyGemmArgs a2{h, static_cast<const float*>(weights[2].data),
                                  static_cast<const float*>(weights[3].data), y, rows, out, hidden,
                                  false};
          const double ms = MedianMs(iterations, [&] {
            Check(cuda::LaunchSkinnyGemmF32(a1, per_warp, nullptr), "skinny encoder");
            Check(cuda::LaunchSkinnyGemmF32(a2, per_warp, nullptr), "skinny head");
            Check(cudaDeviceSynchronize(), "skinny forward");
          });
          Print("kernel rows=" + std::to_string(rows) + " per_warp=" + std::to_string(per_warp), ms,
                weight_bytes, 2.0 * static_cast<double>(rows * (in * hidden + hidden * out)));
        }
      }
      cudaFree(x);
      cudaFree(h);
      cudaFree(y);
    }
    for (const TensorView& t : weights) cudaFree(const_cast<void*>(t.data));
  }
  return 0;
}

}  // namespace
}  // namespace hearth

int main(int argc, char** argv) { return hearth::Main(argc, argv); }
