#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backends/cuda/tc_gemm.h"

namespace hearth::cuda {
namespace {

constexpr int kWarps = 4;  // per CTA
// Warps a one-row launch should have: ~16 per SM of an H100/H200, enough
// 16-byte loads in flight to cover the memory's latency. A constant, so that
// the order of sums never depends on the GPU.
constexpr int64_t kTargetWarps = 2048;
// 64-wide k blocks whose weights a lane loads before it multiplies them.
constexpr int kUnroll = 4;
// Row tiles of 16 per warp in the many-rows mode.
constexpr int kSeqTiles = 4;

struct Params {
  const uint16_t* x;
  const uint16_t* w;
  const void* bias;
  void* y;
  float* ws;
  uint32_t* counters;
  int64_t m, n, k, part;  // part = k / splits
  int32_t splits, batch;
  int64_t w_stride, bias_stride, y_stride;
  int64_t groups;  // column groups per batch entry
};

template <bool kBf16>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Word i (two elements) of a lane's 32 bytes.
__device__ __forceinline__ uint32_t Word(const uint4 (&v)[2], int i) {
  const uint4& h = v[i >> 2];
  switch (i & 3) {
    case 0:
      return h.x;
    case 1:
      return h.y;
    case 2:
      return h.z;
    default:
      return h.w;
  }
}

template <bool kStream>
__device__ __forceinline__ uint4 LoadWeight(const uint16_t* p) {
  if constexpr (kStream) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}

// One part's sums for MT row tiles of 16 (from row0) and R column tiles of 8
// (w points at the first column's row): acc[i][j] is the mma fragment of
// tile (i, j): {row r, col 2q}, {r, 2q + 1}, {r + 8, 2q}, {r + 8, 2q + 1}.
template <bool kBf16, int MT, int R, bool kStream>
__device__ __forceinline__ void PartSums(const Params& p, const uint16_t* w, int64_t row0,
                                         int64_t k0, float (&acc)[MT][R][4]) {
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  const uint16_t* wl = w + r * p.k + k0 + q * 16;
  const uint16_t* xl[MT][2];
  bool ok[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + i * 16 + h * 8 + r;
      ok[i][h] = row < p.m;
      xl[i][h] = p.x + (ok[i][h] ? row : 0) * p.k + k0 + q * 16;
    }
  }
  for (int64_t kb = 0; kb < p.part; kb += 64 * kUnroll) {
    uint4 wv[kUnroll][R][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u * 64 < p.part) {
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const uint16_t* at = wl + j * 8 * p.k + kb + u * 64;
          wv[u][j][0] = LoadWeight<kStream>(at);
          wv[u][j][1] = LoadWeight<kStream>(at + 8);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u * 64 >= p.part) continue;
      uint4 xv[MT][2][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (ok[i][h]) {
            const auto* at = reinterpret_cast<const uint4*>(xl[i][h] + kb + u * 64);
            xv[i][h][0] = __ldg(at);
            xv[i][h][1] = __ldg(at + 1);
          } else {
            xv[i][h][0] = xv[i][h][1] = make_uint4(0, 0, 0, 0);
          }
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const uint32_t a[4] = {Word(xv[i][0], 2 * s), Word(xv[i][1], 2 * s),
                                 Word(xv[i][0], 2 * s + 1), Word(xv[i][1], 2 * s + 1)};
#pragma unroll
          for (int j = 0; j < R; ++j)
            Mma<kBf16>(acc[i][j], a, Word(wv[u][j], 2 * s), Word(wv[u][j], 2 * s + 1));
        }
      }
    }
  }
}

// Calls f(i, h, row) for each row the lane holds (row tile i, half h) that
// exists.
template <int MT, typename F>
__device__ __forceinline__ void ForLaneRows(int64_t row0, int r, int64_t m, F&& f) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + i * 16 + h * 8 + r;
      if (row < m) f(i, h, row);
    }
}

// Adds the bias and stores two adjacent columns of one row.
template <bool kBf16, bool kF32Out>
__device__ __forceinline__ void Store(const Params& p, int b, int64_t row, int64_t col, float2 v) {
  if constexpr (kF32Out) {
    if (p.bias != nullptr) {
      const float* bias = static_cast<const float*>(p.bias) + b * p.bias_stride + col;
      v.x += bias[0];
      v.y += bias[1];
    }
    float* y = static_cast<float*>(p.y) + b * p.y_stride + row * p.n + col;
    *reinterpret_cast<float2*>(y) = v;
  } else if constexpr (kBf16) {
    if (p.bias != nullptr) {
      const auto* bias = static_cast<const __nv_bfloat16*>(p.bias) + b * p.bias_stride + col;
      v.x += __bfloat162float(bias[0]);
      v.y += __bfloat162float(bias[1]);
    }
    auto* y = static_cast<__nv_bfloat16*>(p.y) + b * p.y_stride + row * p.n + col;
    *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v.x, v.y);
  } else {
    if (p.bias != nullptr) {
      const auto* bias = static_cast<const __half*>(p.bias) + b * p.bias_stride + col;
      v.x += __half2float(bias[0]);
      v.y += __half2float(bias[1]);
    }
    auto* y = static_cast<__half*>(p.y) + b * p.y_stride + row * p.n + col;
    *reinterpret_cast<__half2*>(y) = __floats2half2_rn(v.x, v.y);
  }
}

// Few rows: a warp per (8 columns, part); blockIdx.z is the part.
template <bool kBf16, int MT, bool kF32Out>
__global__ void __launch_bounds__(kWarps * 32) SplitKernel(Params p) {
  const int64_t g = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  if (g >= p.groups * p.batch) return;
  const int b = static_cast<int>(g / p.groups);
  const int64_t col0 = (g % p.groups) * 8;
  const int part = static_cast<int>(blockIdx.z);
  float acc[MT][1][4];
  PartSums<kBf16, MT, 1, true>(p, p.w + b * p.w_stride + col0 * p.k, 0, part * p.part, acc);
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, q = lane & 3;
  const int64_t col = col0 + 2 * q;
  if (p.splits == 1) {
    ForLaneRows<MT>(0, r, p.m, [&](int i, int h, int64_t row) {
      Store<kBf16, kF32Out>(p, b, row, col, {acc[i][0][2 * h], acc[i][0][2 * h + 1]});
    });
    return;
  }
  // Part sums of (part, b) at ws[((part * batch + b) * kTcSplitRows + row) * n + col].
  const auto at = [&](int s, int64_t row) {
    return p.ws + ((int64_t{s} * p.batch + b) * kTcSplitRows + row) * p.n + col;
  };
  ForLaneRows<MT>(0, r, p.m, [&](int i, int h, int64_t row) {
    __stcg(reinterpret_cast<float2*>(at(part, row)), {acc[i][0][2 * h], acc[i][0][2 * h + 1]});
  });
  __threadfence();
  __syncwarp();
  uint32_t before = 0;
  if (lane == 0) before = atomicAdd(&p.counters[g], 1u);
  before = __shfl_sync(0xffffffffu, before, 0);
  if (before != static_cast<uint32_t>(p.splits - 1)) return;
  // The last of the column group's warps: every part is written.
  __threadfence();
  ForLaneRows<MT>(0, r, p.m, [&](int, int, int64_t row) {
    float2 t = __ldcg(reinterpret_cast<const float2*>(at(0, row)));
    for (int s = 1; s < p.splits; ++s) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(at(s, row)));
      t.x += v.x;
      t.y += v.y;
    }
    Store<kBf16, kF32Out>(p, b, row, col, t);
  });
  if (lane == 0) p.counters[g] = 0;
}

// Many rows: a warp per (8 * R columns, 64 rows), the parts in order.
template <bool kBf16, int R, bool kF32Out>
__global__ void __launch_bounds__(kWarps * 32) SeqKernel(Params p) {
  const int64_t g = int64_t{blockIdx.x} * kWarps + (threadIdx.x >> 5);
  if (g >= p.groups * p.batch) return;
  const int b = static_cast<int>(g / p.groups);
  const int64_t col0 = (g % p.groups) * 8 * R;
  const int64_t row0 = int64_t{blockIdx.y} * 16 * kSeqTiles;
  const uint16_t* w = p.w + b * p.w_stride + col0 * p.k;
  float total[kSeqTiles][R][4];
  for (int part = 0; part < p.splits; ++part) {
    float acc[kSeqTiles][R][4];
    PartSums<kBf16, kSeqTiles, R, false>(p, w, row0, part * p.part, acc);
#pragma unroll
    for (int i = 0; i < kSeqTiles; ++i)
#pragma unroll
      for (int j = 0; j < R; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          total[i][j][e] = part == 0 ? acc[i][j][e] : total[i][j][e] + acc[i][j][e];
  }
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, q = lane & 3;
  ForLaneRows<kSeqTiles>(row0, r, p.m, [&](int i, int h, int64_t row) {
#pragma unroll
    for (int j = 0; j < R; ++j)
      Store<kBf16, kF32Out>(p, b, row, col0 + j * 8 + 2 * q,
                            {total[i][j][2 * h], total[i][j][2 * h + 1]});
  });
}

template <bool kBf16, bool kF32Out>
void Launch(const Params& base, cudaStream_t stream) {
  Params p = base;
  if (p.m <= kTcSplitRows) {
    p.groups = p.n / 8;
    const dim3 grid(static_cast<unsigned>((p.groups * p.batch + kWarps - 1) / kWarps), 1,
                    static_cast<unsigned>(p.splits));
    if (p.m <= 16) {
      SplitKernel<kBf16, 1, kF32Out><<<grid, kWarps * 32, 0, stream>>>(p);
    } else if (p.m <= 32) {
      SplitKernel<kBf16, 2, kF32Out><<<grid, kWarps * 32, 0, stream>>>(p);
    } else {
      SplitKernel<kBf16, 4, kF32Out><<<grid, kWarps * 32, 0, stream>>>(p);
    }
    return;
  }
  const bool wide = p.n % 16 == 0;
  p.groups = p.n / (wide ? 16 : 8);
  const dim3 grid(static_cast<unsigned>((p.groups * p.batch + kWarps - 1) / kWarps),
                  static_cast<unsigned>((p.m + 16 * kSeqTiles - 1) / (16 * kSeqTiles)), 1);
  if (wide) {
    SeqKernel<kBf16, 2, kF32Out><<<grid, kWarps * 32, 0, stream>>>(p);
  } else {
    SeqKernel<kBf16, 1, kF32Out><<<grid, kWarps * 32, 0, stream>>>(p);
  }
}

bool Aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

}  // namespace

int32_t TcGemmSplits(const TcGemmShape& shape) {
  if (shape.n < 8 || shape.k < 64 || shape.n % 8 != 0 || shape.k % 64 != 0 || shape.batch < 1)
    return 0;
  const int64_t groups = shape.batch * shape.n / 8;
  int32_t splits = 1;
  while (groups * splits < kTargetWarps && shape.k % (int64_t{64} * splits * 2) == 0) splits *= 2;
  return splits;
}

uint64_t TcGemmWorkspaceBytes(const TcGemmShape& shape) {
  const int32_t splits = TcGemmSplits(shape);
  if (splits <= 1) return 0;
  return static_cast<uint64_t>(splits) * static_cast<uint64_t>(shape.batch) *
         static_cast<uint64_t>(kTcSplitRows) * static_cast<uint64_t>(shape.n) * sizeof(float);
}

uint64_t TcGemmCounters(const TcGemmShape& shape) {
  return TcGemmSplits(shape) <= 1
             ? 0
             : static_cast<uint64_t>(shape.batch) * static_cast<uint64_t>(shape.n / 8);
}

cudaError_t LaunchTcGemm(const TcGemmArgs& a, cudaStream_t stream) {
  const int32_t splits = TcGemmSplits(a.shape);
  const int64_t elem = a.f32_out ? 4 : 2;
  if (splits == 0 || a.m < 0 || a.x == nullptr || a.w == nullptr || a.y == nullptr ||
      !Aligned(a.x, 16) || !Aligned(a.w, 16) || !Aligned(a.y, static_cast<uintptr_t>(2 * elem)) ||
      (a.bias != nullptr && !Aligned(a.bias, static_cast<uintptr_t>(2 * elem))) ||
      (a.shape.batch > 1 &&
       (a.w_stride % 8 != 0 || a.y_stride % 2 != 0 || a.bias_stride % 2 != 0)) ||
      (splits > 1 && (a.workspace == nullptr || a.counters == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (a.m == 0) return cudaSuccess;
  Params p{};
  p.x = static_cast<const uint16_t*>(a.x);
  p.w = static_cast<const uint16_t*>(a.w);
  p.bias = a.bias;
  p.y = a.y;
  p.ws = a.workspace;
  p.counters = a.counters;
  p.m = a.m;
  p.n = a.shape.n;
  p.k = a.shape.k;
  p.splits = splits;
  p.part = a.shape.k / splits;
  p.batch = a.shape.batch;
  p.w_stride = a.w_stride;
  p.bias_stride = a.bias_stride;
  p.y_stride = a.y_stride;
  if (a.bf16) {
    if (a.f32_out) {
      Launch<true, true>(p, stream);
    } else {
      Launch<true, false>(p, stream);
    }
  } else if (a.f32_out) {
    Launch<false, true>(p, stream);
  } else {
    Launch<false, false>(p, stream);
  }
  return cudaGetLastError();
}

}  // namespace hearth::cuda
