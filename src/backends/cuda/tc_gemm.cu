#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "backends/cuda/dependent_launch.h"
#include "backends/cuda/llm_device.cuh"
#include "backends/cuda/tc_gemm.h"

namespace hearth::cuda {
namespace {

// Warps of a split-mode CTA, and the most parts a shape's k is cut into:
// the parts of a column group are added within one CTA.
constexpr int kSplitWarps = 8;
// SMs of an H100/H200, which the launch sizes below are made for. A
// constant, so that the order of sums never depends on the GPU.
constexpr int64_t kSms = 132;
// The most warps a one-row launch's parts may give it: one wave of two
// 8-warp CTAs an SM, 16 warps an SM, their 16-byte loads enough to cover the
// memory's latency; past a wave, the last one runs on few SMs. Counted per
// weight of a batch: the SwiGLU pair's warp computes both.
constexpr int64_t kTargetWarps = 2 * kSms * kSplitWarps;
static_assert(kTargetWarps == 2112);
std::atomic<int64_t> g_target_warps{kTargetWarps};
// 64-wide k blocks whose weights a lane loads before it multiplies them.
constexpr int kUnroll = 4;
// CTAs a many-rows launch aims for: two per SM.
constexpr int64_t kTileTargetCtas = 2 * kSms;
// Tiles from which a many-rows launch runs a shape's tiles as they are, one
// CTA each with all its parts: three quarters of one wave.
// Below, groups of parts fill it (and a second kernel adds them); above, they
// would add that kernel and the part sums' traffic to a launch already about
// one wave wide.
constexpr int64_t kSpreadBelowTiles = kSms * 3 / 4;
static_assert(kTileTargetCtas == 264 && kSpreadBelowTiles == 99);
std::atomic<int64_t> g_spread_below{kSpreadBelowTiles};

struct Params {
  const uint16_t* x;
  const uint16_t* w;
  const void* bias;
  void* y;
  float* ws;
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

// A weight's 16 bytes, read once: streamed past the caches.
__device__ __forceinline__ uint4 LoadWeight(const uint16_t* p) {
  return __ldcs(reinterpret_cast<const uint4*>(p));
}

// One part's sums for the 16 rows from 0 and the 8 columns from w[i] (which
// points at the first column's row) of each of kN weights, their loads
// interleaved: acc[i] is the mma fragment {row r, col 2q}, {r, 2q + 1},
// {r + 8, 2q}, {r + 8, 2q + 1} of weight i.
template <bool kBf16, int kN>
__device__ __forceinline__ void PartSums(const Params& p, const uint16_t* const (&w)[kN],
                                         int64_t k0, float (&acc)[kN][4]) {
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < kN; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
  const uint16_t* wl[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) wl[i] = w[i] + r * p.k + k0 + q * 16;
  const uint16_t* xl[2];
  bool ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = int64_t{h} * 8 + r;
    ok[h] = row < p.m;
    xl[h] = p.x + (ok[h] ? row : 0) * p.k + k0 + q * 16;
  }
  for (int64_t kb = 0; kb < p.part; kb += 64 * kUnroll) {
    uint4 wv[kUnroll][kN][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u * 64 < p.part) {
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const uint16_t* at = wl[i] + kb + u * 64;
          wv[u][i][0] = LoadWeight(at);
          wv[u][i][1] = LoadWeight(at + 8);
        }
      }
    }
    // x (an earlier kernel's output) only after it is done; the first
    // weights are in flight meanwhile.
    if (kb == 0) {
      DependentWait();
      DependentRelease();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u * 64 >= p.part) continue;
      uint4 xv[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (ok[h]) {
          const auto* at = reinterpret_cast<const uint4*>(xl[h] + kb + u * 64);
          // Through L2 (coherent): an earlier kernel wrote x while this
          // one was already resident (dependent_launch.h).
          xv[h][0] = __ldcg(at);
          xv[h][1] = __ldcg(at + 1);
        } else {
          xv[h][0] = xv[h][1] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint32_t a[4] = {Word(xv[0], 2 * s), Word(xv[1], 2 * s), Word(xv[0], 2 * s + 1),
                               Word(xv[1], 2 * s + 1)};
#pragma unroll
        for (int i = 0; i < kN; ++i)
          Mma<kBf16>(acc[i], a, Word(wv[u][i], 2 * s), Word(wv[u][i], 2 * s + 1));
      }
    }
  }
}

// Calls f(h, row) for each of the lane's two rows (half h) that exists.
template <typename F>
__device__ __forceinline__ void ForLaneRows(int r, int64_t m, F&& f) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = int64_t{h} * 8 + r;
    if (row < m) f(h, row);
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

// A value rounded to the input type and back, as a later kernel reads it.
template <bool kBf16>
__device__ __forceinline__ float Rounded(float v) {
  if constexpr (kBf16) {
    return __bfloat162float(__float2bfloat16_rn(v));
  } else {
    return __half2float(__float2half_rn(v));
  }
}

// The SwiGLU epilogue: two adjacent columns of gate (g) and up (u) as the
// products rounded to the input type, silu(g) * u stored at batch entry 0.
template <bool kBf16>
__device__ __forceinline__ void StoreSwiGlu(const Params& p, int64_t row, int64_t col, float2 g,
                                            float2 u) {
  const float2 v{llm_device::SiluTimes(Rounded<kBf16>(g.x), Rounded<kBf16>(u.x)),
                 llm_device::SiluTimes(Rounded<kBf16>(g.y), Rounded<kBf16>(u.y))};
  Store<kBf16, false>(p, 0, row, col, v);
}

// Few rows: CTA `block` of a split-mode launch, kSplitWarps warps holding
// kSplitWarps / splits column groups of 8 columns, a warp per (group, part).
// The warps of a group add their parts in shared memory, in order, and the
// first stores the sum. With kSwiGlu a warp computes the same 8 columns of
// both weights of the batch of two (gate, up) and stores silu(gate) * up.
template <bool kBf16, bool kF32Out, bool kSwiGlu>
__device__ __forceinline__ void SplitBlock(const Params& p, int64_t block) {
  constexpr int kN = kSwiGlu ? 2 : 1;
  // A warp's part sums: row r's column pair q at [r * 4 + q].
  __shared__ float2 sums[kN][kSplitWarps][kTcSplitRows * 4];
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const int part = warp % p.splits;
  const int64_t g = block * (kSplitWarps / p.splits) + warp / p.splits;
  const bool active = g < p.groups * (kSwiGlu ? 1 : p.batch);
  const int b = kSwiGlu ? 0 : static_cast<int>(g / p.groups);
  const int64_t col0 = (g % p.groups) * 8;
  float acc[kN][4];
  if (active) {
    const uint16_t* w[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) w[i] = p.w + (b + i) * p.w_stride + col0 * p.k;
    PartSums<kBf16, kN>(p, w, part * p.part, acc);
  } else {
    DependentWait();
  }
  const int lane = static_cast<int>(threadIdx.x & 31), r = lane >> 2, q = lane & 3;
  const int64_t col = col0 + 2 * q;
  const auto store = [&](int64_t row, const float2(&v)[kN]) {
    if constexpr (kSwiGlu) {
      StoreSwiGlu<kBf16>(p, row, col, v[0], v[kN - 1]);
    } else {
      Store<kBf16, kF32Out>(p, b, row, col, v[0]);
    }
  };
  if (p.splits == 1) {
    if (!active) return;
    ForLaneRows(r, p.m, [&](int h, int64_t row) {
      float2 v[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = {acc[i][2 * h], acc[i][2 * h + 1]};
      store(row, v);
    });
    return;
  }
  if (active) {
    ForLaneRows(r, p.m, [&](int h, int64_t row) {
#pragma unroll
      for (int i = 0; i < kN; ++i) sums[i][warp][row * 4 + q] = {acc[i][2 * h], acc[i][2 * h + 1]};
    });
  }
  __syncthreads();
  if (!active || part != 0) return;
  ForLaneRows(r, p.m, [&](int, int64_t row) {
    float2 t[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      t[i] = sums[i][warp][row * 4 + q];
      for (int s = 1; s < p.splits; ++s) {
        const float2 v = sums[i][warp + s][row * 4 + q];
        t[i].x += v.x;
        t[i].y += v.y;
      }
    }
    store(row, t);
  });
}

template <bool kBf16, bool kF32Out, bool kSwiGlu>
__global__ void __launch_bounds__(kSplitWarps * 32) SplitKernel(Params p) {
  SplitBlock<kBf16, kF32Out, kSwiGlu>(p, blockIdx.x);
}

// Several split-mode products in one launch: entry e owns the CTAs from
// first[e].
struct GroupParams {
  Params p[kTcMaxGroup];
  int64_t first[kTcMaxGroup + 1];
  int count;
};

template <bool kBf16>
__global__ void __launch_bounds__(kSplitWarps * 32) GroupKernel(GroupParams gp) {
  const int64_t block = blockIdx.x;
  int e = 0;
  while (e + 1 < gp.count && block >= gp.first[e + 1]) ++e;
  SplitBlock<kBf16, false, false>(gp.p[e], block - gp.first[e]);
}

// Many rows: a CTA per (kRows x kTileCols tile, group of parts), the
// tiles of x and w staged in shared memory by cp.async, kStages deep. Each
// warp holds a kRows / 2 x 32 piece of the tile. Within the CTA the parts of its
// group run in order, each summed from 0 and added to the running total as it
// ends; so the group of parts 0 .. P-1 has their ordered sum, and every other
// group writes each of its parts alone; ReduceKernel then adds the group-0
// total and the later parts in order: ((p0 + p1) + p2) + ..., the same bits
// as the split mode.
constexpr int kTileCols = 128;
constexpr int kTileWarps = 8;  // 2 (rows) x 4 (columns) warps of kRows / 2 x 32
constexpr int kTileThreads = kTileWarps * 32;
// 16-byte chunks of one stage: a 64-wide k block of the tile's rows of x and
// of its columns (rows of w).
__host__ __device__ constexpr int StageChunks(int rows) { return (rows + kTileCols) * 8; }
// Tiles and stages: up to kDeepRows rows, where a launch has about one CTA
// an SM and is bound by the weights' stream, 64 rows through 6 stages (144
// KiB); above, 128 rows through 4 (128 KiB), one CTA an SM either way.
constexpr int kDeepRows = 128;
constexpr int TileSmemBytes(int stages, int rows) { return stages * StageChunks(rows) * 16; }

struct TileParams {
  int64_t col_tiles;  // per batch entry
  int32_t groups;     // groups of parts, one CTA each
  int32_t parts;      // parts per group
};

__device__ __forceinline__ void CpAsync16(void* smem, const void* global, bool valid) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int bytes = valid ? 16 : 0;  // 0: the chunk is zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global),
               "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Chunk c (of 8) of a staged row lies at c ^ (row & 7): the 8 lanes of one
// 16-byte shared load (rows r and r + 1, chunks 2q or 2q + 1) hit 8 distinct
// bank groups.
__device__ __forceinline__ int Swz(int row, int chunk) { return row * 8 + (chunk ^ (row & 7)); }

// Where the part sums of slot `slot` (0: the group-0 total; s > 0: part
// parts - 1 + s) of batch entry b lie.
__device__ __forceinline__ float* TileSlot(const Params& p, int slot, int b, int64_t row,
                                           int64_t col) {
  return p.ws + ((int64_t{slot} * p.batch + b) * p.m + row) * p.n + col;
}

template <bool kBf16, bool kF32Out, int kStages, int kRows>
__global__ void __launch_bounds__(kTileThreads, kStages <= 4 && kRows <= 64 ? 2 : 1)
    TileKernel(Params p, TileParams t) {
  constexpr int kMT = kRows / 32;  // m16 tiles of a warp
  constexpr int kStageChunks = StageChunks(kRows);
  extern __shared__ uint4 smem[];
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int r = lane >> 2, q = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;  // the warp's piece
  const int b = static_cast<int>(blockIdx.y / t.col_tiles);
  const int64_t row0 = int64_t{blockIdx.x} * kRows;
  const int64_t col0 = (blockIdx.y % t.col_tiles) * kTileCols;
  const int group = static_cast<int>(blockIdx.z);
  const uint16_t* w = p.w + b * p.w_stride;
  const int64_t k_begin = int64_t{group} * t.parts * p.part;
  const int blocks_per_part = static_cast<int>(p.part / 64);
  const int blocks = blocks_per_part * t.parts;

  // Stage s's chunks: x rows at [0, kRows * 8), w rows after them.
  const auto load_x = [&](int stage, int block) {
    uint4* st = smem + stage * kStageChunks;
    const int64_t k0 = k_begin + int64_t{block} * 64;
#pragma unroll
    for (int i = 0; i < kRows * 8 / kTileThreads; ++i) {
      const int c = tid + i * kTileThreads, row = c >> 3, ch = c & 7;
      const int64_t g = row0 + row;
      const bool ok = g < p.m;
      CpAsync16(st + Swz(row, ch), p.x + (ok ? g : 0) * p.k + k0 + ch * 8, ok);
    }
  };
  const auto load_w = [&](int stage, int block) {
    uint4* st = smem + stage * kStageChunks + kRows * 8;
    const int64_t k0 = k_begin + int64_t{block} * 64;
#pragma unroll
    for (int i = 0; i < kTileCols * 8 / kTileThreads; ++i) {
      const int c = tid + i * kTileThreads, col = c >> 3, ch = c & 7;
      const int64_t g = col0 + col;
      const bool ok = g < p.n;
      CpAsync16(st + Swz(col, ch), w + (ok ? g : 0) * p.k + k0 + ch * 8, ok);
    }
  };

  float acc[kMT][4][4], total[kMT][4][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = total[i][j][e] = 0.0f;

        // The first stages' weights before the wait (no kernel writes them), x
        // after it; the first commit group holds them all with x's first block.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < blocks) load_w(s, s);
  }
  DependentWait();
  DependentRelease();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < blocks) load_x(s, s);
    CpAsyncCommit();
  }
  int part_in_group = 0;
  for (int blk = 0; blk < blocks; ++blk) {
    CpAsyncWait<kStages - 2>();
    __syncthreads();
    // The stage read last iteration is free now: every warp passed the barrier.
    if (blk + kStages - 1 < blocks) {
      load_x((blk + kStages - 1) % kStages, blk + kStages - 1);
      load_w((blk + kStages - 1) % kStages, blk + kStages - 1);
    }
    CpAsyncCommit();
    const uint4* st = smem + (blk % kStages) * kStageChunks;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Chunk 2q + half of the lane's rows and columns: k elements
      // q * 16 + half * 8 + 0 .. 7 of the block, steps 2 * half and 2 * half + 1.
      uint4 a[kMT][2], bw[4];
#pragma unroll
      for (int i = 0; i < kMT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          a[i][h] = st[Swz(wm * (kRows / 2) + i * 16 + h * 8 + r, 2 * q + half)];
#pragma unroll
      for (int j = 0; j < 4; ++j) bw[j] = st[kRows * 8 + Swz(wn * 32 + j * 8 + r, 2 * q + half)];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
          const uint32_t af[4] = {e == 0 ? a[i][0].x : a[i][0].z, e == 0 ? a[i][1].x : a[i][1].z,
                                  e == 0 ? a[i][0].y : a[i][0].w, e == 0 ? a[i][1].y : a[i][1].w};
#pragma unroll
          for (int j = 0; j < 4; ++j)
            Mma<kBf16>(acc[i][j], af, e == 0 ? bw[j].x : bw[j].z, e == 0 ? bw[j].y : bw[j].w);
        }
      }
    }
    if ((blk + 1) % blocks_per_part != 0) continue;
    // A part ends: group 0 adds it to its running total; another group
    // writes it alone (slot part_in_group, 1-based after group 0's total).
    const bool write = group > 0;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (write) {
          const int64_t col = col0 + wn * 32 + j * 8 + 2 * q;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = row0 + wm * (kRows / 2) + i * 16 + h * 8 + r;
            if (row < p.m && col < p.n) {
              const int slot = (group - 1) * t.parts + part_in_group + 1;
              __stcg(reinterpret_cast<float2*>(TileSlot(p, slot, b, row, col)),
                     {acc[i][j][2 * h], acc[i][j][2 * h + 1]});
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            total[i][j][e] = part_in_group == 0 ? acc[i][j][e] : total[i][j][e] + acc[i][j][e];
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
      }
    ++part_in_group;
  }
  CpAsyncWait<0>();

  if (t.groups == 1) {
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t col = col0 + wn * 32 + j * 8 + 2 * q;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = row0 + wm * (kRows / 2) + i * 16 + h * 8 + r;
          if (row < p.m && col < p.n)
            Store<kBf16, kF32Out>(p, b, row, col, {total[i][j][2 * h], total[i][j][2 * h + 1]});
        }
      }
    return;
  }
  // Group 0's total goes to slot 0; ReduceKernel adds the slots in order.
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t col = col0 + wn * 32 + j * 8 + 2 * q;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = row0 + wm * (kRows / 2) + i * 16 + h * 8 + r;
        if (group == 0 && row < p.m && col < p.n)
          __stcg(reinterpret_cast<float2*>(TileSlot(p, 0, b, row, col)),
                 {total[i][j][2 * h], total[i][j][2 * h + 1]});
      }
    }
}

// The many-rows mode's groups of parts, added in order: slot 0 (group 0's
// total), then every later part alone. A thread per two columns of a row;
// all the GPU's SMs share the work.
template <bool kBf16, bool kF32Out>
__global__ void __launch_bounds__(256) ReduceKernel(Params p, int32_t slots) {
  DependentWait();
  DependentRelease();
  const int64_t pairs = p.n / 2, all = p.batch * p.m * pairs;
  for (int64_t e = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; e < all;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t col = (e % pairs) * 2, rest = e / pairs, row = rest % p.m;
    const int b = static_cast<int>(rest / p.m);
    float2 v = __ldcg(reinterpret_cast<const float2*>(TileSlot(p, 0, b, row, col)));
#pragma unroll 8
    for (int s = 1; s < slots; ++s) {
      const float2 u = __ldcg(reinterpret_cast<const float2*>(TileSlot(p, s, b, row, col)));
      v.x += u.x;
      v.y += u.y;
    }
    Store<kBf16, kF32Out>(p, b, row, col, v);
  }
}

// Launches a TileKernel, first letting it have its shared memory on the
// current device (an attribute of the function in each device's context;
// `devices` has a bit per device where it is set).
template <typename Kernel>
cudaError_t LaunchTile(Kernel kernel, int smem, std::atomic<uint64_t>& devices, dim3 grid,
                       const Params& p, const TileParams& t, cudaStream_t stream) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (devices.load(std::memory_order_relaxed) & bit) == 0) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    devices.fetch_or(bit, std::memory_order_relaxed);
  }
  return LaunchDependent(kernel, grid, kTileThreads, smem, stream, p, t);
}

// CTAs of a split-mode launch: every column group (of each batch entry, or
// of the SwiGLU pair) times its parts, kSplitWarps warps a CTA.
int64_t SplitCtas(const Params& p, bool swiglu) {
  const int64_t groups = p.groups * (swiglu ? 1 : p.batch), per_cta = kSplitWarps / p.splits;
  return (groups + per_cta - 1) / per_cta;
}

template <bool kBf16, bool kF32Out>
cudaError_t Launch(const Params& base, const TcGemmArgs& args, cudaStream_t stream) {
  Params p = base;
  if (p.m <= kTcSplitRows) {
    p.groups = p.n / 8;
    const dim3 grid(static_cast<unsigned>(SplitCtas(p, args.swiglu)));
    static_assert(kTcSplitRows == 16, "the split mode holds one 16-row tile");
    if constexpr (!kF32Out) {
      if (args.swiglu)
        return LaunchDependent(SplitKernel<kBf16, false, true>, grid, kSplitWarps * 32, 0, stream,
                               p);
    }
    return LaunchDependent(SplitKernel<kBf16, kF32Out, false>, grid, kSplitWarps * 32, 0, stream,
                           p);
  }
  // Up to kDeepRows rows, 64-row tiles through 6 stages; above, 128-row
  // tiles (a warp's 64 x 32 piece reads each staged fragment for twice the
  // products) through 4.
  const bool deep = p.m <= kDeepRows;
  const int rows = deep ? 64 : 128;
  TileParams t{};
  t.col_tiles = (p.n + kTileCols - 1) / kTileCols;
  const int64_t tiles = t.col_tiles * p.batch * ((p.m + rows - 1) / rows);
  // Groups of parts in flight at once: for a shape of fewer tiles than
  // g_spread_below, enough CTAs for two waves (kTileTargetCtas) where the part
  // sums fit the workspace. The bits do not depend on it.
  t.groups = 1;
  const bool spread = tiles < g_spread_below.load(std::memory_order_relaxed);
  while (spread && t.groups < p.splits && tiles * t.groups < kTileTargetCtas) {
    const int32_t next = t.groups * 2;
    const uint64_t slot_bytes = static_cast<uint64_t>(p.batch) * p.m * p.n * sizeof(float);
    const uint64_t slots = static_cast<uint64_t>(p.splits - p.splits / next + 1);
    if (slots * slot_bytes > args.workspace_bytes) break;
    t.groups = next;
  }
  t.parts = p.splits / t.groups;
  const dim3 grid(static_cast<unsigned>((p.m + rows - 1) / rows),
                  static_cast<unsigned>(t.col_tiles * p.batch), static_cast<unsigned>(t.groups));
  constexpr int kDeepSmem = TileSmemBytes(6, 64), kWideSmem = TileSmemBytes(4, 128);
  static std::atomic<uint64_t> deep_devices{0}, wide_devices{0};
  const cudaError_t e = deep ? LaunchTile(TileKernel<kBf16, kF32Out, 6, 64>, kDeepSmem,
                                          deep_devices, grid, p, t, stream)
                             : LaunchTile(TileKernel<kBf16, kF32Out, 4, 128>, kWideSmem,
                                          wide_devices, grid, p, t, stream);
  if (e != cudaSuccess || t.groups == 1) return e;
  const int64_t pairs = p.batch * p.m * p.n / 2;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((pairs + 255) / 256, kSms * 8));
  return LaunchDependent(ReduceKernel<kBf16, kF32Out>, blocks, 256, 0, stream, p,
                         (t.groups - 1) * t.parts + 1);
}

bool Aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

}  // namespace

void SetTcGemmTargetWarps(int64_t warps) {
  g_target_warps.store(warps > 0 ? warps : kTargetWarps, std::memory_order_relaxed);
}

void SetTcGemmSpreadBelowTiles(int64_t tiles) {
  g_spread_below.store(tiles > 0 ? tiles : kSpreadBelowTiles, std::memory_order_relaxed);
}

int32_t TcGemmSplits(const TcGemmShape& shape) {
  if (shape.n < 8 || shape.k < 64 || shape.n % 8 != 0 || shape.k % 64 != 0 || shape.batch < 1)
    return 0;
  const int64_t groups = shape.n / 8;
  int32_t splits = 1;
  const int64_t target = g_target_warps.load(std::memory_order_relaxed);
  while (groups * splits * 2 <= target && splits < kSplitWarps &&
         shape.k % (int64_t{64} * splits * 2) == 0) {
    splits *= 2;
  }
  return splits;
}

namespace {

bool Valid(const TcGemmArgs& a) {
  const int32_t splits = TcGemmSplits(a.shape);
  const int64_t elem = a.f32_out ? 4 : 2;
  return !(
      splits == 0 || a.m < 0 || a.x == nullptr || a.w == nullptr || a.y == nullptr ||
      !Aligned(a.x, 16) || !Aligned(a.w, 16) || !Aligned(a.y, static_cast<uintptr_t>(2 * elem)) ||
      (a.bias != nullptr && !Aligned(a.bias, static_cast<uintptr_t>(2 * elem))) ||
      (a.shape.batch > 1 &&
       (a.w_stride % 8 != 0 || a.y_stride % 2 != 0 || a.bias_stride % 2 != 0)) ||
      (a.workspace_bytes > 0 && a.workspace == nullptr) ||
      (a.swiglu && (a.shape.batch != 2 || a.m > kTcSplitRows || a.f32_out || a.bias != nullptr)));
}

Params MakeParams(const TcGemmArgs& a) {
  const int32_t splits = TcGemmSplits(a.shape);
  Params p{};
  p.x = static_cast<const uint16_t*>(a.x);
  p.w = static_cast<const uint16_t*>(a.w);
  p.bias = a.bias;
  p.y = a.y;
  p.ws = a.workspace;
  p.m = a.m;
  p.n = a.shape.n;
  p.k = a.shape.k;
  p.splits = splits;
  p.part = a.shape.k / splits;
  p.batch = a.shape.batch;
  p.w_stride = a.w_stride;
  p.bias_stride = a.bias_stride;
  p.y_stride = a.y_stride;
  return p;
}

}  // namespace

cudaError_t LaunchTcGemm(const TcGemmArgs& a, cudaStream_t stream) {
  if (!Valid(a)) return cudaErrorInvalidValue;
  if (a.m == 0) return cudaSuccess;
  const Params p = MakeParams(a);
  cudaError_t set = cudaSuccess;
  if (a.bf16) {
    set = a.f32_out ? Launch<true, true>(p, a, stream) : Launch<true, false>(p, a, stream);
  } else {
    set = a.f32_out ? Launch<false, true>(p, a, stream) : Launch<false, false>(p, a, stream);
  }
  if (set != cudaSuccess) {
    (void)cudaGetLastError();  // not left for the next call to find
    return set;
  }
  return cudaGetLastError();
}

cudaError_t LaunchTcGemmGroup(std::span<const TcGemmArgs> group, cudaStream_t stream) {
  if (group.empty() || group.size() > static_cast<size_t>(kTcMaxGroup))
    return cudaErrorInvalidValue;
  GroupParams gp{};
  gp.count = static_cast<int>(group.size());
  int64_t blocks = 0;
  for (size_t e = 0; e < group.size(); ++e) {
    const TcGemmArgs& a = group[e];
    if (!Valid(a) || a.m != group[0].m || a.m > kTcSplitRows || a.bf16 != group[0].bf16 ||
        a.f32_out || a.swiglu) {
      return cudaErrorInvalidValue;
    }
    Params& p = gp.p[e];
    p = MakeParams(a);
    p.groups = p.n / 8;
    gp.first[e] = blocks;
    blocks += SplitCtas(p, false);
  }
  gp.first[group.size()] = blocks;
  if (group[0].m == 0) return cudaSuccess;
  const cudaError_t set = group[0].bf16
                              ? LaunchDependent(GroupKernel<true>, static_cast<unsigned>(blocks),
                                                kSplitWarps * 32, 0, stream, gp)
                              : LaunchDependent(GroupKernel<false>, static_cast<unsigned>(blocks),
                                                kSplitWarps * 32, 0, stream, gp);
  if (set != cudaSuccess) {
    (void)cudaGetLastError();
    return set;
  }
  return cudaGetLastError();
}

}  // namespace hearth::cuda
