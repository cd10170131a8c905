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

// The warp rows kernel. One warp owns R consecutive output features. Lanes
// stride over k with 16-byte loads: per step a lane loads R float4 of
// weights (streamed, evict-first) and, per row m, one float4 of x through
// the read-only cache, and accumulates rows x R partial sums. A butterfly
// shuffle reduces them across the warp at the end.
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

// The sliced kernel, for 3 to 16 rows. A warp owns NR consecutive features
// and walks k in slices of 128 floats. Its lanes form 4 groups of 8: group
// g holds rows [g*RPG, (g+1)*RPG) of the slice of x in registers (lane l of
// the group the float4 columns l, l+8, l+16, l+24 of the slice), and every
// group reads the same weights: per feature, 4 float4 loads per lane that
// are one 128-byte line per instruction, broadcast to the 4 groups. Each
// weight value loaded meets RPG rows in registers; a reduce-scatter over the
// group's 8 lanes (3 shuffles) leaves each lane the slice's sum for one row,
// which it adds to its running sum for that feature. Compared with the warp
// rows kernel, x costs registers once per slice instead of L1 loads per
// feature, and the FMAs, not the load units, set the pace.
template <int RPG>
__device__ __forceinline__ float GroupReduce(const float (&acc)[RPG], int l) {
  if constexpr (RPG == 4) {
    const bool hi = (l & 4) != 0;
    float keep0 = hi ? acc[2] : acc[0], keep1 = hi ? acc[3] : acc[1];
    keep0 += __shfl_xor_sync(kFullMask, hi ? acc[0] : acc[2], 4);
    keep1 += __shfl_xor_sync(kFullMask, hi ? acc[1] : acc[3], 4);
    const bool mid = (l & 2) != 0;
    float keep = mid ? keep1 : keep0;
    keep += __shfl_xor_sync(kFullMask, mid ? keep0 : keep1, 2);
    return keep + __shfl_xor_sync(kFullMask, keep, 1);  // row (l >> 1) & 3
  } else if constexpr (RPG == 2) {
    const bool hi = (l & 4) != 0;
    float keep = hi ? acc[1] : acc[0];
    keep += __shfl_xor_sync(kFullMask, hi ? acc[0] : acc[1], 4);
    keep += __shfl_xor_sync(kFullMask, keep, 2);
    return keep + __shfl_xor_sync(kFullMask, keep, 1);  // row (l >> 2) & 1
  } else {
    float keep = acc[0];
    keep += __shfl_xor_sync(kFullMask, keep, 4);
    keep += __shfl_xor_sync(kFullMask, keep, 2);
    return keep + __shfl_xor_sync(kFullMask, keep, 1);  // row 0
  }
}

template <int RPG, int NR>
__global__ void __launch_bounds__(kThreads) SlicedGemmF32(SkinnyGemmArgs a) {
  constexpr int kLanesPerRow = 8 / RPG;  // lanes of a group that end with the same row
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int g = lane >> 3, l = lane & 7;
  const int64_t warp = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int64_t n0 = warp * NR;
  if (n0 >= a.n) return;
  const int64_t k4 = a.k / 4;
  const int rows = static_cast<int>(a.rows);
  const auto* x4 = reinterpret_cast<const float4*>(a.x);
  const auto* w4 = reinterpret_cast<const float4*>(a.w);
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float out[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) out[i] = 0.0f;

  for (int64_t s = 0; s < k4; s += 32) {
    float4 xr[RPG][4];
#pragma unroll
    for (int r = 0; r < RPG; ++r) {
      const int m = g * RPG + r;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = s + l + 8 * j;
        xr[r][j] = m < rows && c < k4 ? __ldg(x4 + m * k4 + c) : zero;
      }
    }
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      // Past the last feature a warp re-reads the last row; its sums are dropped.
      const int64_t n = n0 + i < a.n ? n0 + i : a.n - 1;
      float4 wv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t c = s + l + 8 * j;
        wv[j] = c < k4 ? __ldcs(w4 + n * k4 + c) : zero;
      }
      float acc[RPG];
#pragma unroll
      for (int r = 0; r < RPG; ++r) {
        acc[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) Fma4(acc[r], xr[r][j], wv[j]);
      }
      out[i] += GroupReduce<RPG>(acc, l);
    }
  }

  const int m = g * RPG + (l / kLanesPerRow) % RPG;
  if (l % kLanesPerRow != 0 || m >= rows) return;
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    if (n0 + i >= a.n) break;
    float v = out[i];
    if (a.bias != nullptr) v += a.bias[n0 + i];
    if (a.relu) v = v < 0.0f ? 0.0f : v;
    a.y[m * a.n + n0 + i] = v;
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
cudaError_t LaunchWarpRows(const SkinnyGemmArgs& a, int features_per_warp, cudaStream_t stream) {
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

template <int RPG>
cudaError_t LaunchSliced(const SkinnyGemmArgs& a, int features_per_warp, cudaStream_t stream) {
  switch (features_per_warp) {
    case 8:
      return LaunchGrid(SlicedGemmF32<RPG, 8>, 8, a, stream);
    case 16:
      return LaunchGrid(SlicedGemmF32<RPG, 16>, 16, a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// One pass over the weights for a.rows <= the kernel's rows per pass.
cudaError_t LaunchPass(const SkinnyGemmArgs& a, SkinnyKernel kernel, int features_per_warp,
                       cudaStream_t stream) {
  if (kernel == SkinnyKernel::kSliced) {
    const int f = features_per_warp != 0 ? features_per_warp : 16;
    if (a.rows <= 4) return LaunchSliced<1>(a, f, stream);
    if (a.rows <= 8) return LaunchSliced<2>(a, f, stream);
    return LaunchSliced<4>(a, f, stream);
  }
  const int f = features_per_warp != 0 ? features_per_warp : 2;
  if (a.rows <= 1) return LaunchWarpRows<1>(a, f, stream);
  if (a.rows <= 2) return LaunchWarpRows<2>(a, f, stream);
  if (a.rows <= 4) return LaunchWarpRows<4>(a, f, stream);
  if (a.rows <= 8) return LaunchWarpRows<8>(a, f, stream);
  if (a.rows <= 16) return LaunchWarpRows<16>(a, f, stream);
  return LaunchWarpRows<32>(a, f, stream);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool SkinnyGemmSupported(const SkinnyGemmArgs& a) {
  return a.k > 0 && a.k % 4 == 0 && a.n > 0 && a.rows > 0 && Aligned16(a.x) && Aligned16(a.w) &&
         a.y != nullptr;
}

cudaError_t LaunchSkinnyGemmF32(const SkinnyGemmArgs& a, SkinnyTuning tuning,
                                cudaStream_t stream) {
  if (!SkinnyGemmSupported(a)) return cudaErrorInvalidValue;
  // Measured on the H200 (bench/gemm): the warp rows kernel streams the
  // weights at full speed for 1 or 2 rows, the sliced one wins above.
  const SkinnyKernel kernel = tuning.kernel != SkinnyKernel::kAuto ? tuning.kernel
                              : a.rows <= 2                        ? SkinnyKernel::kWarpRows
                                                                   : SkinnyKernel::kSliced;
  const int64_t per_pass = kernel == SkinnyKernel::kSliced ? 16 : 32;
  for (int64_t first = 0; first < a.rows; first += per_pass) {
    SkinnyGemmArgs pass = a;
    pass.rows = a.rows - first < per_pass ? a.rows - first : per_pass;
    pass.x = a.x + first * a.k;
    pass.y = a.y + first * a.n;
    const cudaError_t e = LaunchPass(pass, kernel, tuning.features_per_warp, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace hearth::cuda
