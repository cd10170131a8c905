// What the kernels of backend: llm on CUDA share (llm_kernels.cu,
// llm_attention.cu, llm_sampling.cu): 16-bit element types, 16-byte loads and
// stores of 8 elements, grid sizes and a block sum in a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace hearth::cuda::llm_device {

inline constexpr unsigned kFullMask = 0xffffffffu;

// ---- 16-bit element types.

template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 FromFloat(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ float2 ToFloat2(Pair p) { return __bfloat1622float2(p); }
  static __device__ __forceinline__ Pair FromFloat2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct Elem<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half FromFloat(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float2 ToFloat2(Pair p) { return __half22float2(p); }
  static __device__ __forceinline__ Pair FromFloat2(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};

template <typename T>
__device__ __forceinline__ uint32_t PairBits(typename Elem<T>::Pair p) {
  uint32_t u;
  memcpy(&u, &p, 4);
  return u;
}

// 8 consecutive elements (one 16-byte access) as floats.
template <typename T>
__device__ __forceinline__ void Load8(const T* p, float (&f)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  typename Elem<T>::Pair pairs[4];
  memcpy(pairs, &u, 16);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = Elem<T>::ToFloat2(pairs[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

// 8 floats rounded to T, as the 16 bytes Store8 writes.
template <typename T>
__device__ __forceinline__ uint4 Pack8(const float (&f)[8]) {
  typename Elem<T>::Pair pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = Elem<T>::FromFloat2(f[2 * i], f[2 * i + 1]);
  uint4 u;
  memcpy(&u, pairs, 16);
  return u;
}

template <typename T>
__device__ __forceinline__ void Store8(T* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = Pack8<T>(f);
}

// SwiGLU of one element: silu(g) * u, from g and u as their 16-bit values.
// Every kernel that computes it (the SwiGLU launch, the GEMM's epilogue) calls
// this, so that they give the same bits.
__device__ __forceinline__ float SiluTimes(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// RoPE of one rotated pair: x1 at element j of a head, x2 at j + head_dim / 2,
// at position `pos` with inv_freq[j]. As transformers, the angle is a float32
// product and its cos and sin are float32; the products are rounded apart (no
// FMA), so that every kernel that rotates (the RoPE launch, the attention
// that rotates its own queries and keys) gives the same bits.
__device__ __forceinline__ float2 RopePair(float x1, float x2, int pos, float inv_freq) {
  float s, c;
  sincosf(static_cast<float>(pos) * inv_freq, &s, &c);
  return make_float2(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)),
                     __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// RopePair over 8 pairs: elements j .. j + 7 of a head (x_lo) with j + half ..
// (x_hi), inv_freq pointing at inv_freq[j]; each half is one 16-byte access.
template <typename T>
__device__ __forceinline__ void RopeChunk(const T* x_lo, const T* x_hi, int pos,
                                          const float* inv_freq, T* y_lo, T* y_hi) {
  float a[8], b[8];
  Load8(x_lo, a);
  Load8(x_hi, b);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float2 r = RopePair(a[e], b[e], pos, inv_freq[e]);
    a[e] = r.x;
    b[e] = r.y;
  }
  Store8(y_lo, a);
  Store8(y_hi, b);
}

inline unsigned GridFor(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535 * 16)));
}

// Sum over a warp in a fixed butterfly; every lane gets the same bits (each
// addition has the same two operands on both lanes).
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sum over the block in a fixed tree (warps, then warp 0): the same bits for
// the same inputs whatever else runs. blockDim.x is a multiple of 32.
__device__ inline float BlockSum(float v, float* scratch /* [32] */) {
  v = WarpSum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = WarpSum(lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();  // scratch may be reused by the caller
  return total;
}

// ---- RMSNorm's arithmetic, shared by the AddRmsNorm launch and the GEMMs
// that fold it in (tc_gemm.h), so that both give the same bits. For a row of
// `hidden` float elements v (hidden / 8 <= kNormMaxChunks chunks of 8):
//   - chunk c's sum of squares: ChunkSquares over v[8c .. 8c + 7];
//   - the row's sum: the chunks' sums as BlockSum adds them over a block of
//     NormThreads(hidden) threads, thread c holding chunk c (0 past the last);
//   - x = weight * (v * inv), inv = InvRms(sum), rounded to the input type.

inline constexpr int64_t kNormMaxChunks = 1024;

// The AddRmsNorm launch's block size: a multiple of 32 (BlockSum), one chunk
// per thread up to 1024 threads.
__host__ __device__ constexpr int NormThreads(int64_t hidden) {
  const int64_t threads = (hidden / 8 + 31) / 32 * 32;
  return static_cast<int>(threads < 32 ? 32 : threads > 1024 ? 1024 : threads);
}

__device__ __forceinline__ float ChunkSquares(const float (&v)[8]) {
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
  return ss;
}

__device__ __forceinline__ float InvRms(float sum, int64_t hidden, float eps) {
  return rsqrtf(__fdiv_rn(sum, static_cast<float>(hidden)) + eps);
}

__device__ __forceinline__ float NormScale(float weight, float v, float inv) {
  return weight * (v * inv);
}

// The row's sum from its chunk sums (chunks[c], c < hidden / 8 <=
// kNormMaxChunks), by one whole warp, with BlockSum's bits: each group of 32
// chunks summed as a warp of that block sums them, then their sums as its
// warp 0 does. Every lane returns it. The chunks are read through L2 (an
// earlier kernel wrote them, dependent_launch.h).
__device__ inline float SumOfChunks(const float* chunks, int64_t hidden) {
  const int64_t n8 = hidden / 8;
  const int groups = NormThreads(hidden) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31);
  float mine = 0.0f;
  // Eight groups at a time, their loads and butterflies interleaved.
  for (int g0 = 0; g0 < groups; g0 += 8) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t c = int64_t{g0 + j} * 32 + lane;
      v[j] = g0 + j < groups && c < n8 ? __ldcg(chunks + c) : 0.0f;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] += __shfl_xor_sync(kFullMask, v[j], offset);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (lane == g0 + j) mine = v[j];
    }
  }
  return WarpSum(mine);
}

}  // namespace hearth::cuda::llm_device
