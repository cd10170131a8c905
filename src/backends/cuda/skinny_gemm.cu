#include "backends/cuda/skinny_gemm.h"

namespace hearth::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps per block
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ void Fma4(float& acc, const float4& a, const float4& b) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  acc = fmaf(a.w, b.w, acc);
}

// The kernel described in skinny_gemm.h.
// MT: rows of x the kernel is compiled for (a.rows <= MT, the rest masked).
// R: output features per warp.
template <int MT, int R>
__global__ void __launch_bounds__(kThreads) SkinnyGemmF32(SkinnyGemmArgs a) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int64_t warp = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int64_t n0 = warp * R;
  if (n0 >= a.n) return;  // the whole warp leaves together
  const int64_t k4 = a.k / 4;
  const int rows = static_cast<int>(a.rows);
  const auto* x4 = reinterpret_cast<const float4*>(a.x);
  const float4* w4[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // Past the last feature a warp re-reads the last row; its sums are dropped.
    const int64_t n = n0 + r < a.n ? n0 + r : a.n - 1;
    w4[r] = reinterpret_cast<const float4*>(a.w) + n * k4;
  }
  float acc[MT][R];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  }

  int64_t i = lane;
  // Two steps per iteration: 2R independent weight loads in flight per lane.
  for (; i + 32 < k4; i += 64) {
    float4 wa[R], wb[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      wa[r] = __ldcs(w4[r] + i);
      wb[r] = __ldcs(w4[r] + i + 32);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < rows) {
        const float4 xa = __ldg(x4 + m * k4 + i);
        const float4 xb = __ldg(x4 + m * k4 + i + 32);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          Fma4(acc[m][r], xa, wa[r]);
          Fma4(acc[m][r], xb, wb[r]);
        }
      }
    }
  }
  if (i < k4) {
    float4 wa[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wa[r] = __ldcs(w4[r] + i);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < rows) {
        const float4 xa = __ldg(x4 + m * k4 + i);
#pragma unroll
        for (int r = 0; r < R; ++r) Fma4(acc[m][r], xa, wa[r]);
      }
    }
  }

  // Butterfly: afterwards every lane holds every sum.
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
      acc[m][r] = v;
    }
  }
  // Sum number j = m * R + r is written by lane j % 32.
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int j = m * R + r;
      if ((j & 31) == lane && m < rows && n0 + r < a.n) {
        float v = acc[m][r];
        if (a.bias != nullptr) v += a.bias[n0 + r];
        if (a.relu) v = v < 0.0f ? 0.0f : v;  // NaN stays NaN, as std::max(v, 0) on the CPU
        a.y[m * a.n + n0 + r] = v;
      }
    }
  }
}

template <typename Kernel>
cudaError_t LaunchGrid(Kernel kernel, int64_t features_per_warp, const SkinnyGemmArgs& a,
                       cudaStream_t stream) {
  const int64_t warps = (a.n + features_per_warp - 1) / features_per_warp;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <int MT>
cudaError_t LaunchPass(const SkinnyGemmArgs& a, int features_per_warp, cudaStream_t stream) {
  switch (features_per_warp) {
    case 2:
      return LaunchGrid(SkinnyGemmF32<MT, 2>, 2, a, stream);
    case 4:
      return LaunchGrid(SkinnyGemmF32<MT, 4>, 4, a, stream);
    case 8:
      // 8 x 32 accumulators would not fit the register file: 4 instead.
      if constexpr (MT < 32) return LaunchGrid(SkinnyGemmF32<MT, 8>, 8, a, stream);
      return LaunchGrid(SkinnyGemmF32<MT, 4>, 4, a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool SkinnyGemmSupported(const SkinnyGemmArgs& a) {
  return a.k > 0 && a.k % 4 == 0 && a.n > 0 && a.rows > 0 && Aligned16(a.x) && Aligned16(a.w) &&
         a.y != nullptr;
}

cudaError_t LaunchSkinnyGemmF32(const SkinnyGemmArgs& a, int features_per_warp,
                                cudaStream_t stream) {
  if (!SkinnyGemmSupported(a)) return cudaErrorInvalidValue;
  // 2 features per warp: within 2% of the best choice for 1 to 8 rows on the
  // H200 (bench/gemm), where the kernel is used.
  const int f = features_per_warp != 0 ? features_per_warp : 2;
  for (int64_t first = 0; first < a.rows; first += kSkinnyMaxRows) {
    SkinnyGemmArgs pass = a;
    pass.rows = a.rows - first < kSkinnyMaxRows ? a.rows - first : kSkinnyMaxRows;
    pass.x = a.x + first * a.k;
    pass.y = a.y + first * a.n;
    cudaError_t e = cudaErrorInvalidValue;
    if (pass.rows <= 1) {
      e = LaunchPass<1>(pass, f, stream);
    } else if (pass.rows <= 2) {
      e = LaunchPass<2>(pass, f, stream);
    } else if (pass.rows <= 4) {
      e = LaunchPass<4>(pass, f, stream);
    } else if (pass.rows <= 8) {
      e = LaunchPass<8>(pass, f, stream);
    } else if (pass.rows <= 16) {
      e = LaunchPass<16>(pass, f, stream);
    } else {
      e = LaunchPass<32>(pass, f, stream);
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace hearth::cuda
