// The sampling kernel of llm_kernels.h: greedy, temperature, top_k and top_p
// on the GPU. A row's first pass is spread over several blocks; the last of
// them to finish takes the row's draw.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>

#include "backends/cuda/argmax_order.cuh"
#include "backends/cuda/dependent_launch.h"
#include "backends/cuda/llm_device.cuh"
#include "backends/cuda/llm_kernels.h"
#include "backends/llm/llm_model.h"

namespace hearth::cuda {
namespace {

using namespace llm_device;  // NOLINT(google-build-using-namespace): this file's kernels are built
                             // of these

// ---- Sampling.
//
// Floor: one pass over the row's logits is 4 * vocab bytes (0.5 MB for a
// 128256 vocabulary; 64 rows: 33 MB, 8 us from DRAM). Greedy rows and rows
// drawn at a temperature alone take one pass, spread over the row's parts
// (one block reading 0.5 MB with 32 KB in flight took 23 us a step on an
// H100). Rows with top_k or top_p take, in the row's last block, three radix
// passes for each plus one for the top_p normaliser and one for the draw: up
// to 8 more, mostly from L2 (the logits were just written).

constexpr int kSampleThreads = 512;
constexpr int kRadixBins = 2048;  // 11-bit digits
constexpr int kMaxSampleParts = 32;
static_assert(kMaxSampleParts <= 32, "the row's last block folds the parts in one warp");
// One round of ForEachLogit's loads per thread of a part.
constexpr int64_t kLogitsPerPart = int64_t{16} * kSampleThreads;

// The most parts of a row: one round of loads per thread each.
int SampleParts(int64_t vocab) {
  return static_cast<int>(
      std::clamp<int64_t>((vocab + kLogitsPerPart - 1) / kLogitsPerPart, 1, kMaxSampleParts));
}

// A launch's parts: no more than one wave of blocks in all (`wave`: the
// SMs times the sampler's resident blocks an SM), where each block then
// streams its share.
int LaunchParts(int32_t rows, int64_t vocab, int wave) {
  return std::clamp(wave / std::max(rows, 1), 1, SampleParts(vocab));
}

// What a part found in its share of a row.
struct SamplePart {
  float best;  // the argmax (ArgmaxBefore's order) and its index, -1 for none
  int32_t best_i;
  float top;         // the largest number (NaN never counts), -inf for none
  uint32_t numbers;  // how many numbers
  float score;       // the Gumbel-max draw, for rows drawn in the first pass
  int32_t score_i;
};

// A row's place in the scratch: its arrival count (zero between launches:
// the row's last block resets it), then its parts. The places depend on the
// vocabulary alone, so launches of any row count share one scratch.
int64_t RowScratchBytes(int64_t vocab) {
  return (16 + SampleParts(vocab) * static_cast<int64_t>(sizeof(SamplePart)) + 15) / 16 * 16;
}

// Larger float, larger key (a NaN sorts by its bits).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// The warp's argmax, in every lane.
__device__ __forceinline__ void WarpArgmax(float& v, int& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, offset);
    const int oi = __shfl_xor_sync(kFullMask, index, offset);
    if (ArgmaxBefore<int>(ov, oi, v, index)) {
      v = ov;
      index = oi;
    }
  }
}

// The block's argmax, broadcast to every thread.
__device__ void BlockArgmax(float& v, int& index, float* scratch_v, int* scratch_i) {
  WarpArgmax(v, index);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    scratch_v[warp] = v;
    scratch_i[warp] = index;
  }
  __syncthreads();
  if (warp == 0) {
    const bool has = lane < static_cast<int>(blockDim.x >> 5);
    v = has ? scratch_v[lane] : 0.0f;
    index = has ? scratch_i[lane] : -1;
    WarpArgmax(v, index);
    if (lane == 0) {
      scratch_v[0] = v;
      scratch_i[0] = index;
    }
  }
  __syncthreads();
  v = scratch_v[0];
  index = scratch_i[0];
  __syncthreads();
}

// A token's top_p weight: exp(logit / temperature - top / temperature) in
// [0, 1] (top: the largest number among the logits), in units of 2^-40:
// exact integer sums, in any order.
__device__ __forceinline__ unsigned long long TokenWeight(float x, float scaled_top,
                                                          float temperature) {
  const float w = expf(__fdiv_rn(x, temperature) - scaled_top);
  return __float2ull_rz(w * 1099511627776.0f);
}

struct SampleShared {
  unsigned long long hist[kRadixBins];
  unsigned long long u64[32];
  float v[32];
  int i[32];
  uint32_t digit;
  unsigned long long above;
};

// Sum of v over the warp, in every lane (integers: exact in any order).
__device__ __forceinline__ unsigned long long WarpSumU64(unsigned long long v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Largest of v over the warp, in every lane.
__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Sum of v over the block, broadcast (integers: exact in any order).
__device__ unsigned long long BlockSumU64(unsigned long long v, SampleShared& sh) {
  v = WarpSumU64(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh.u64[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += sh.u64[w];
    sh.above = total;
  }
  __syncthreads();
  const unsigned long long total = sh.above;
  __syncthreads();
  return total;
}

// Largest of v over the block, broadcast.
__device__ float BlockMax(float v, SampleShared& sh) {
  v = WarpMax(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sh.v[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) m = fmaxf(m, sh.v[w]);
    sh.v[0] = m;
  }
  __syncthreads();
  const float m = sh.v[0];
  __syncthreads();
  return m;
}

// Calls f(v, j) for the block's share of a row's logits [begin, end), in no
// fixed order (every use is order-free: integer sums, fmaxf, ArgmaxBefore's
// total order). Several 16-byte loads in flight per thread: a loop of one
// dependent load at a time left a 128k-vocabulary row ~60 us on an H200.
template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* x, int64_t begin, int64_t end, F&& f) {
  constexpr int kInFlight = 4;
  const int64_t step = blockDim.x;
  const int64_t n = end - begin;
  if (n % 4 == 0 && begin % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const auto* x4 = reinterpret_cast<const float4*>(x + begin);
    const int64_t n4 = n / 4;
    int64_t i = threadIdx.x;
    for (; i + (kInFlight - 1) * step < n4; i += kInFlight * step) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) v[u] = x4[i + u * step];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int j = static_cast<int>(begin + 4 * (i + u * step));
        f(v[u].x, j);
        f(v[u].y, j + 1);
        f(v[u].z, j + 2);
        f(v[u].w, j + 3);
      }
    }
    for (; i < n4; i += step) {
      const float4 v = x4[i];
      const int j = static_cast<int>(begin + 4 * i);
      f(v.x, j);
      f(v.y, j + 1);
      f(v.z, j + 2);
      f(v.w, j + 3);
    }
    return;
  }
  int64_t i = begin + threadIdx.x;
  for (; i + (kInFlight - 1) * step < end; i += kInFlight * step) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = x[i + u * step];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) f(v[u], static_cast<int>(i + u * step));
  }
  for (; i < end; i += step) f(x[i], static_cast<int>(i));
}

template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* x, int64_t vocab, F&& f) {
  ForEachLogit(x, 0, vocab, f);
}

// The token of the Gumbel-max draw at logit v of token j.
__device__ __forceinline__ float GumbelScore(float v, int j, const SampleRow& p) {
  const float u = llm::GumbelUniform(p.seed, p.position, j);
  return __fadd_rn(__fdiv_rn(v, p.temperature), -logf(-logf(u)));
}

// The largest key t >= floor such that the measure (count, or weight when
// `weighted`) of the numbers (NaN never counts) with key >= t is >= target.
// Three passes of 11, 11 and 10 bits, most significant first; the
// histograms are integers, so the result does not depend on the order of
// the atomic adds.
__device__ uint32_t RadixSelect(const float* x, int64_t vocab, bool weighted, float scaled_top,
                                float temperature, unsigned long long target, uint32_t floor,
                                SampleShared& sh) {
  constexpr int kShift[3] = {21, 10, 0};
  constexpr int kBits[3] = {11, 11, 10};
  uint32_t prefix = 0;
  unsigned long long above = 0;  // measure of the tokens already known to be above
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = kShift[pass], bins = 1 << kBits[pass];
    const uint32_t high_mask = pass == 0 ? 0u : ~((1u << (shift + kBits[pass])) - 1u);
    for (int b = threadIdx.x; b < bins; b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    ForEachLogit(x, vocab, [&](float v, int) {
      const uint32_t key = OrderedKey(v);
      if (isnan(v) || key < floor || (key & high_mask) != prefix) return;
      atomicAdd(&sh.hist[(key >> shift) & static_cast<uint32_t>(bins - 1)],
                weighted ? TokenWeight(v, scaled_top, temperature) : 1ull);
    });
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l owns bins / 32 bins, lane 0 the highest; scanned high to low.
      const int per_lane = bins / 32;
      const int top = bins - 1 - lane * per_lane;
      unsigned long long own = 0;
      for (int b = 0; b < per_lane; ++b) own += sh.hist[top - b];
      unsigned long long inclusive = own;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long o = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane >= offset) inclusive += o;
      }
      const unsigned long long exclusive = inclusive - own;
      if (lane == 0) {
        // Kept when no bin reaches the target (a target above the measure,
        // which callers never ask): the lowest bin.
        sh.digit = 0;
        sh.above = above;
      }
      __syncwarp();
      if (above + exclusive < target && target <= above + inclusive) {
        unsigned long long cum = above + exclusive;
        for (int b = 0; b < per_lane; ++b) {
          const unsigned long long h = sh.hist[top - b];
          if (cum + h >= target) {
            sh.digit = static_cast<uint32_t>(top - b);
            sh.above = cum;
            break;
          }
          cum += h;
        }
      }
    }
    __syncthreads();
    prefix |= sh.digit << shift;
    above = sh.above;
    __syncthreads();
  }
  return prefix;
}

// Blocks (row, part), as SampleToken (llm_model.h) draws on the host: NaN
// logits are never kept nor drawn; where nothing can be kept, greedy. Each
// part reads its share of the row once (the argmax, the max, the count, and
// for a row drawn at a temperature alone, the draw); the row's last part to
// finish folds the parts and, for top_k and top_p, draws over the whole row.
__global__ void __launch_bounds__(kSampleThreads)
    SampleRows(const float* logits, int64_t vocab, const SampleRow* params, char* scratch,
               int64_t row_scratch, int32_t* tokens) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  __shared__ SampleShared sh;
  __shared__ bool last;
  const int row = blockIdx.x, part = blockIdx.y, parts = static_cast<int>(gridDim.y);
  const SampleRow p = params[row];
  if (p.active == 0) {
    if (part == 0 && threadIdx.x == 0) tokens[row] = -1;
    return;
  }
  const float* const x = logits + static_cast<int64_t>(row) * vocab;
  // No top_k or top_p: every number is kept, and the draw is order-free.
  const bool draw_here = p.temperature > 0.0f && p.top_k <= 0 && !(p.top_p < 1.0f);
  const int64_t chunk = ((vocab + parts - 1) / parts + 3) / 4 * 4;
  const int64_t begin = min(vocab, part * chunk), end = min(vocab, begin + chunk);
  float best = 0.0f, top = -INFINITY, score = 0.0f;
  int best_i = -1, score_i = -1;
  unsigned long long numbers = 0;
  ForEachLogit(x, begin, end, [&](float v, int j) {
    if (ArgmaxBefore<int>(v, j, best, best_i)) {
      best = v;
      best_i = j;
    }
    if (isnan(v)) return;
    top = fmaxf(top, v);
    ++numbers;
    if (draw_here) {
      const float s = GumbelScore(v, j, p);
      if (ArgmaxBefore<int>(s, j, score, score_i)) {
        score = s;
        score_i = j;
      }
    }
  });
  BlockArgmax(best, best_i, sh.v, sh.i);
  top = BlockMax(top, sh);
  numbers = BlockSumU64(numbers, sh);
  if (draw_here) BlockArgmax(score, score_i, sh.v, sh.i);
  char* const place = scratch + static_cast<int64_t>(row) * row_scratch;
  auto* const arrivals = reinterpret_cast<uint32_t*>(place);
  auto* const row_parts = reinterpret_cast<SamplePart*>(place + 16);
  if (threadIdx.x == 0) {
    row_parts[part] = {best, best_i, top, static_cast<uint32_t>(numbers), score, score_i};
    __threadfence();  // the part before the arrival
    last = atomicAdd(arrivals, 1u) == static_cast<uint32_t>(parts - 1);
    if (last) {
      __threadfence();  // the other parts' records after their arrivals, before the barrier
      *arrivals = 0;    // every part has arrived: ready for the next launch
    }
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    SamplePart f{0.0f, -1, -INFINITY, 0, 0.0f, -1};
    if (lane < parts) {
      const SamplePart* const at = row_parts + lane;
      f = {__ldcg(&at->best),    __ldcg(&at->best_i), __ldcg(&at->top),
           __ldcg(&at->numbers), __ldcg(&at->score),  __ldcg(&at->score_i)};
    }
    best = f.best;
    best_i = f.best_i;
    WarpArgmax(best, best_i);
    score = f.score;
    score_i = f.score_i;
    WarpArgmax(score, score_i);
    top = WarpMax(f.top);
    numbers = WarpSumU64(f.numbers);
    if (lane == 0) {
      if (!(p.temperature > 0.0f) || draw_here) {
        tokens[row] = draw_here && score_i >= 0 ? score_i : best_i;
      } else {
        sh.v[0] = top;
        sh.i[0] = best_i;
        sh.u64[0] = numbers;
      }
    }
  }
  // Greedy rows and rows drawn here are done once the parts are folded (the
  // whole block: the row's parameters decide; computed where used, as one
  // flag live across the fold took 64 registers and spilled).
  if (!(p.temperature > 0.0f) || draw_here) return;
  __syncthreads();
  top = sh.v[0];
  best_i = sh.i[0];
  numbers = sh.u64[0];
  __syncthreads();

  // top_k, top_p: this block alone, over the whole row.
  const float temperature = p.temperature;
  const float scaled_top = __fdiv_rn(top, temperature);
  uint32_t floor = 0;
  if (p.top_k > 0 && static_cast<unsigned long long>(p.top_k) < numbers) {
    floor = RadixSelect(x, vocab, false, scaled_top, temperature,
                        static_cast<unsigned long long>(p.top_k), 0, sh);
  }
  if (p.top_p < 1.0f) {
    unsigned long long z = 0;
    ForEachLogit(x, vocab, [&](float v, int) {
      if (!isnan(v) && OrderedKey(v) >= floor) z += TokenWeight(v, scaled_top, temperature);
    });
    const unsigned long long total = BlockSumU64(z, sh);
    const double wanted =
        ceil(static_cast<double>(fmaxf(p.top_p, 0.0f)) * static_cast<double>(total));
    unsigned long long target = static_cast<unsigned long long>(wanted);
    target = min(max(target, 1ull), total);
    if (target > 0) {
      floor = RadixSelect(x, vocab, true, scaled_top, temperature, target, floor, sh);
    }
  }
  score = 0.0f;
  score_i = -1;
  ForEachLogit(x, vocab, [&](float v, int j) {
    if (isnan(v) || OrderedKey(v) < floor) return;
    const float s = GumbelScore(v, j, p);
    if (ArgmaxBefore<int>(s, j, score, score_i)) {
      score = s;
      score_i = j;
    }
  });
  BlockArgmax(score, score_i, sh.v, sh.i);
  if (threadIdx.x == 0) tokens[row] = score_i >= 0 ? score_i : best_i;
}

}  // namespace

int64_t SampleScratchBytes(int32_t rows, int64_t vocab) {
  return int64_t{std::max(rows, 0)} * RowScratchBytes(vocab);
}

cudaError_t LaunchSample(const float* logits, int32_t rows, int64_t vocab, const SampleRow* params,
                         void* scratch, int32_t* tokens, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab < 1 || vocab > 0x7fffffff || scratch == nullptr ||
      reinterpret_cast<uintptr_t>(scratch) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  // One wave of the sampler's blocks, as PrepareAttention finds the
  // attention's: the device's SMs times the blocks resident on each.
  static const std::pair<cudaError_t, int> wave = [] {
    int device = 0, sms = 0, per_sm = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, SampleRows, kSampleThreads, 0);
    }
    return std::pair{e, std::max(1, sms * std::max(1, per_sm))};
  }();
  if (wave.first != cudaSuccess) return wave.first;
  return LaunchDependent(SampleRows,
                         dim3(static_cast<unsigned>(rows), LaunchParts(rows, vocab, wave.second)),
                         kSampleThreads, 0, stream, logits, vocab, params,
                         static_cast<char*>(scratch), RowScratchBytes(vocab), tokens);
}

}  // namespace hearth::cuda
