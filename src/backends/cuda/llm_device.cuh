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

template <typename T>
__device__ __forceinline__ void Store8(T* p, const float (&f)[8]) {
  typename Elem<T>::Pair pairs[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = Elem<T>::FromFloat2(f[2 * i], f[2 * i + 1]);
  uint4 u;
  memcpy(&u, pairs, 16);
  *reinterpret_cast<uint4*>(p) = u;
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

// Sum over the block in a fixed tree (warps, then warp 0): the same bits for
// the same inputs whatever else runs. blockDim.x is a multiple of 32.
__device__ inline float BlockSum(float v, float* scratch /* [32] */) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  const float total = scratch[0];
  __syncthreads();  // scratch may be reused by the caller
  return total;
}

}  // namespace hearth::cuda::llm_device
