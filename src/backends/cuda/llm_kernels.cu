// The kernels of llm_kernels.h, but for the attention (llm_attention.cu) and
// the sampling (llm_sampling.cu). Each states the floor it is bound by: the
// bytes it must move over the H200's ~4.0e12 B/s (or, for the attention on
// long prompts, its tensor-core work), so that bench/llm's per-kernel times
// can be read against it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backends/cuda/dependent_launch.h"
#include "backends/cuda/llm_device.cuh"
#include "backends/cuda/llm_kernels.h"
#include "backends/llm/llm_model.h"

namespace hearth::cuda {
namespace {

using namespace llm_device;  // NOLINT(google-build-using-namespace): this file's kernels are built
                             // of these

// ---- Fill.

__global__ void FillRandom(void* p, int64_t n, ElemType type, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint64_t h = llm::SplitMix64(seed ^ llm::SplitMix64(static_cast<uint64_t>(i)));
    const float v = (static_cast<float>(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
    switch (type) {
      case ElemType::kF32:
        static_cast<float*>(p)[i] = v;
        break;
      case ElemType::kF16:
        static_cast<__half*>(p)[i] = __float2half_rn(v);
        break;
      case ElemType::kBF16:
        static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
        break;
    }
  }
}

// ---- Embedding gather. Floor: reads hidden * 2 and writes hidden * 4 bytes
// per row (1B Llama, 64 rows: 0.8 MB, 0.2 us).

template <typename T>
__global__ void Embed(const int32_t* tokens, const int32_t* feed, const int32_t* drawn,
                      const T* table, int64_t hidden, float* resid) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  const int64_t row = blockIdx.x;
  const int32_t from = feed != nullptr ? feed[row] : -1;
  const int32_t token = from >= 0 ? drawn[from] : tokens[row];
  const T* src = table + static_cast<int64_t>(token) * hidden;
  float* dst = resid + row * hidden;
  for (int64_t c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
    float f[8];
    Load8(src + 8 * c, f);
    auto* d = reinterpret_cast<float4*>(dst + 8 * c);
    d[0] = make_float4(f[0], f[1], f[2], f[3]);
    d[1] = make_float4(f[4], f[5], f[6], f[7]);
  }
}

// ---- Residual add + RMSNorm, one block per row. Floor: per row, reads the
// residual (4 * hidden), delta and weight (2 * hidden each), writes the
// residual and the output (4 + 2 per element): 14 * hidden bytes; 1B Llama,
// 64 rows: 1.8 MB, 0.46 us (the weight is read by every row but from L2).

// Chunk c (8 elements) of the residual row x, plus the delta row d's where
// d is given, and then written back to x where `write`.
template <typename T>
__device__ __forceinline__ void ResidualChunk(float* x, const T* d, int64_t c, bool write,
                                              float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(x)[2 * c];
  const float4 b = reinterpret_cast<const float4*>(x)[2 * c + 1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  if (d == nullptr) return;
  float dv[8];
  Load8(d + 8 * c, dv);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __fadd_rn(v[j], dv[j]);
  if (write) {
    reinterpret_cast<float4*>(x)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(x)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

template <typename T>
__global__ void AddRmsNorm(float* resid, const T* delta, const T* weight, const int32_t* gather,
                           int64_t hidden, float eps, T* out) {
  __shared__ float scratch[32];
  const int64_t n8 = hidden / 8;
  if (n8 <= static_cast<int64_t>(blockDim.x)) {
    // One 8-element chunk per thread (hidden up to 8 * 1024): the weight's
    // chunk loaded before the wait (no kernel writes a weight), the row's
    // kept in registers through the sum. The same arithmetic as below.
    const int64_t c = threadIdx.x;
    float w[8];
    if (c < n8) Load8(weight + 8 * c, w);
    DependentWait();  // dependent_launch.h
    DependentRelease();
    const int64_t i = blockIdx.x;
    const int64_t r = gather != nullptr ? gather[i] : i;
    float v[8] = {};
    float ss = 0.0f;
    if (c < n8) {
      ResidualChunk(resid + r * hidden, delta != nullptr ? delta + r * hidden : nullptr, c,
                    gather == nullptr, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
    }
    ss = BlockSum(ss, scratch);
    const float inv = rsqrtf(__fdiv_rn(ss, static_cast<float>(hidden)) + eps);
    if (c < n8) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = w[j] * (v[j] * inv);
      Store8(out + i * hidden + 8 * c, v);
    }
    return;
  }
  DependentWait();  // dependent_launch.h
  DependentRelease();
  const int64_t i = blockIdx.x;
  const int64_t r = gather != nullptr ? gather[i] : i;
  float* x = resid + r * hidden;
  const T* d = delta != nullptr ? delta + r * hidden : nullptr;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < n8; c += blockDim.x) {
    float v[8];
    ResidualChunk(x, d, c, gather == nullptr, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
  }
  ss = BlockSum(ss, scratch);
  const float inv = rsqrtf(__fdiv_rn(ss, static_cast<float>(hidden)) + eps);
  T* o = out + i * hidden;
  // Second pass: the same thread re-reads the elements it wrote (or, with a
  // gather, adds delta again: the same float additions).
  for (int64_t c = threadIdx.x; c < n8; c += blockDim.x) {
    float v[8];
    ResidualChunk(x, gather != nullptr ? d : nullptr, c, false, v);
    float w[8];
    Load8(weight + 8 * c, w);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = w[j] * (v[j] * inv);
    Store8(o + 8 * c, v);
  }
}

// ---- RoPE + KV cache write, one block per token. Floor: reads q, k, v and
// writes q and the cache rows: (2 * heads + 3 * kv_heads) * head_dim * 2
// bytes per token; 1B Llama, 64 tokens: 0.7 MB, 0.2 us.

// One thread per (head, pair of rotated elements): a decode step's few
// tokens still spread over (num_heads + num_kv_heads) * head_dim / 2
// threads, each with one round trip to memory (one block per token looped
// over the heads in turn, one dependent load after another: ~10 us a layer
// on an H200 at one token).
template <typename T>
__global__ void RopeKvWrite(RopeKvArgs a) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  const int t = blockIdx.x;
  const int d = a.head_dim, half = d / 2;
  const int h = blockIdx.y * (blockDim.x / half) + threadIdx.x / half, j = threadIdx.x % half;
  const int nq = a.num_heads, nk = a.num_kv_heads;
  if (h >= nq + nk) return;
  const int pos = a.positions[t];
  const int slot = a.slots[t];
  if (h >= nq && slot < 0) return;
  if (h < nq) {
    T* x = static_cast<T*>(a.q) + (static_cast<int64_t>(t) * nq + h) * d;
    const float2 r =
        RopePair(Elem<T>::ToFloat(x[j]), Elem<T>::ToFloat(x[j + half]), pos, a.inv_freq[j]);
    x[j] = Elem<T>::FromFloat(r.x);
    x[j + half] = Elem<T>::FromFloat(r.y);
    return;
  }
  const int hk = h - nq;
  const int64_t block = slot / a.block_size, offset = slot % a.block_size;
  const int64_t src = (static_cast<int64_t>(t) * nk + hk) * d;
  const int64_t dst = ((block * nk + hk) * a.block_size + offset) * d;
  const T* k = static_cast<const T*>(a.k) + src;
  const float2 r =
      RopePair(Elem<T>::ToFloat(k[j]), Elem<T>::ToFloat(k[j + half]), pos, a.inv_freq[j]);
  T* kc = static_cast<T*>(a.k_cache) + dst;
  kc[j] = Elem<T>::FromFloat(r.x);
  kc[j + half] = Elem<T>::FromFloat(r.y);
  const T* v = static_cast<const T*>(a.v) + src;
  T* vc = static_cast<T*>(a.v_cache) + dst;
  vc[j] = v[j];
  vc[j + half] = v[j + half];
}

// ---- SwiGLU. Floor: 6 bytes per element (two reads, one write); 1B Llama,
// 64 rows x 8192: 3.1 MB, 0.8 us. A cuBLASLt epilogue cannot do it: gate and
// up are two GEMMs over two weights (the store's read-only mapping holds
// them apart, and a concatenated copy would double their memory).

template <typename T>
__global__ void SwiGlu(const T* gate, const T* up, T* out, int64_t n8) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < n8;
       c += int64_t{gridDim.x} * blockDim.x) {
    float g[8], u[8];
    Load8(gate + 8 * c, g);
    Load8(up + 8 * c, u);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = SiluTimes(g[j], u[j]);
    Store8(out + 8 * c, g);
  }
}

}  // namespace

cudaError_t LaunchFillRandom(void* p, int64_t n, ElemType type, float scale, uint64_t seed,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillRandom<<<GridFor(n, 256), 256, 0, stream>>>(p, n, type, scale, seed);
  return cudaGetLastError();
}

cudaError_t LaunchEmbed(const int32_t* tokens, int32_t rows, const void* table, int64_t hidden,
                        bool bf16, float* resid, cudaStream_t stream, const int32_t* feed,
                        const int32_t* drawn) {
  if (rows <= 0) return cudaSuccess;
  if (hidden % 8 != 0 || (feed != nullptr && drawn == nullptr)) return cudaErrorInvalidValue;
  const unsigned threads = static_cast<unsigned>(std::clamp<int64_t>(hidden / 8, 32, 256));
  if (bf16) {
    return LaunchDependent(Embed<__nv_bfloat16>, rows, threads, 0, stream, tokens, feed, drawn,
                           static_cast<const __nv_bfloat16*>(table), hidden, resid);
  }
  return LaunchDependent(Embed<__half>, rows, threads, 0, stream, tokens, feed, drawn,
                         static_cast<const __half*>(table), hidden, resid);
}

cudaError_t LaunchAddRmsNorm(float* resid, const void* delta, const void* weight,
                             const int32_t* gather, int32_t rows, int64_t hidden, float eps,
                             bool bf16, void* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  // A multiple of 32 (BlockSum), one 8-element chunk per thread up to 1024 threads.
  const unsigned threads =
      static_cast<unsigned>(std::clamp<int64_t>((hidden / 8 + 31) / 32 * 32, 32, 1024));
  if (bf16) {
    return LaunchDependent(AddRmsNorm<__nv_bfloat16>, rows, threads, 0, stream, resid,
                           static_cast<const __nv_bfloat16*>(delta),
                           static_cast<const __nv_bfloat16*>(weight), gather, hidden, eps,
                           static_cast<__nv_bfloat16*>(out));
  }
  return LaunchDependent(AddRmsNorm<__half>, rows, threads, 0, stream, resid,
                         static_cast<const __half*>(delta), static_cast<const __half*>(weight),
                         gather, hidden, eps, static_cast<__half*>(out));
}

cudaError_t LaunchRopeKvWrite(const RopeKvArgs& args, cudaStream_t stream) {
  if (args.tokens <= 0) return cudaSuccess;
  if (args.head_dim % 8 != 0 || args.head_dim > 2048 || args.block_size < 1)
    return cudaErrorInvalidValue;
  // Whole heads per block, at least 128 threads where a head is smaller.
  const int half = args.head_dim / 2;
  const int heads_per_block = std::max(1, 128 / half);
  const dim3 grid(static_cast<unsigned>(args.tokens),
                  static_cast<unsigned>((args.num_heads + args.num_kv_heads + heads_per_block - 1) /
                                        heads_per_block));
  const unsigned threads = static_cast<unsigned>(heads_per_block * half);
  if (args.bf16) {
    return LaunchDependent(RopeKvWrite<__nv_bfloat16>, grid, threads, 0, stream, args);
  }
  return LaunchDependent(RopeKvWrite<__half>, grid, threads, 0, stream, args);
}

cudaError_t LaunchSwiGlu(const void* gate, const void* up, void* out, int64_t n, bool bf16,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n % 8 != 0) return cudaErrorInvalidValue;
  const int64_t n8 = n / 8;
  if (bf16) {
    return LaunchDependent(SwiGlu<__nv_bfloat16>, GridFor(n8, 256), 256, 0, stream,
                           static_cast<const __nv_bfloat16*>(gate),
                           static_cast<const __nv_bfloat16*>(up), static_cast<__nv_bfloat16*>(out),
                           n8);
  }
  return LaunchDependent(SwiGlu<__half>, GridFor(n8, 256), 256, 0, stream,
                         static_cast<const __half*>(gate), static_cast<const __half*>(up),
                         static_cast<__half*>(out), n8);
}

}  // namespace hearth::cuda
