// The kernels of llm_kernels.h. Each states the floor it is bound by: the
// bytes it must move over the H200's ~4.0e12 B/s (or, for the attention on
// long prompts, its tensor-core work), so that bench/llm's per-kernel times
// can be read against it.
//
// Rounding that two code paths must reproduce bit for bit (the attention's
// fold of splits, in the attention kernel and in the combine kernel) is
// written with explicit __fmul_rn/__fadd_rn/__fdiv_rn, which the compiler may
// not contract into FMAs differently in the two places.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backends/cuda/dependent_launch.h"
#include "backends/cuda/llm_kernels.h"
#include "backends/llm/llm_model.h"

namespace hearth::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

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

unsigned GridFor(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(blocks, 65535 * 16)));
}

// Sum over the block in a fixed tree (warps, then warp 0): the same bits for
// the same inputs whatever else runs. blockDim.x is a multiple of 32.
__device__ float BlockSum(float v, float* scratch /* [32] */) {
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
__global__ void Embed(const int32_t* tokens, const T* table, int64_t hidden, float* resid) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  const int64_t row = blockIdx.x;
  const T* src = table + static_cast<int64_t>(tokens[row]) * hidden;
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

template <typename T>
__global__ void AddRmsNorm(float* resid, const T* delta, const T* weight, const int32_t* gather,
                           int64_t hidden, float eps, T* out) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  __shared__ float scratch[32];
  const int64_t i = blockIdx.x;
  const int64_t r = gather != nullptr ? gather[i] : i;
  float* x = resid + r * hidden;
  const T* d = delta != nullptr ? delta + r * hidden : nullptr;
  const int64_t n8 = hidden / 8;
  float ss = 0.0f;
  for (int64_t c = threadIdx.x; c < n8; c += blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(x)[2 * c];
    const float4 b = reinterpret_cast<const float4*>(x)[2 * c + 1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (d != nullptr) {
      float dv[8];
      Load8(d + 8 * c, dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __fadd_rn(v[j], dv[j]);
      if (gather == nullptr) {
        reinterpret_cast<float4*>(x)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
        reinterpret_cast<float4*>(x)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
  }
  ss = BlockSum(ss, scratch);
  const float inv = rsqrtf(__fdiv_rn(ss, static_cast<float>(hidden)) + eps);
  T* o = out + i * hidden;
  // Second pass: the same thread re-reads the elements it wrote (or, with a
  // gather, adds delta again: the same float additions).
  for (int64_t c = threadIdx.x; c < n8; c += blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(x)[2 * c];
    const float4 b = reinterpret_cast<const float4*>(x)[2 * c + 1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    if (d != nullptr && gather != nullptr) {
      float dv[8];
      Load8(d + 8 * c, dv);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __fadd_rn(v[j], dv[j]);
    }
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
  // As transformers: the angle is a float32 product, cos and sin of it in float32.
  float s, c;
  sincosf(static_cast<float>(pos) * a.inv_freq[j], &s, &c);
  if (h < nq) {
    T* x = static_cast<T*>(a.q) + (static_cast<int64_t>(t) * nq + h) * d;
    const float x1 = Elem<T>::ToFloat(x[j]), x2 = Elem<T>::ToFloat(x[j + half]);
    x[j] = Elem<T>::FromFloat(x1 * c - x2 * s);
    x[j + half] = Elem<T>::FromFloat(x2 * c + x1 * s);
    return;
  }
  const int hk = h - nq;
  const int64_t block = slot / a.block_size, offset = slot % a.block_size;
  const int64_t src = (static_cast<int64_t>(t) * nk + hk) * d;
  const int64_t dst = ((block * nk + hk) * a.block_size + offset) * d;
  const T* k = static_cast<const T*>(a.k) + src;
  const float x1 = Elem<T>::ToFloat(k[j]), x2 = Elem<T>::ToFloat(k[j + half]);
  T* kc = static_cast<T*>(a.k_cache) + dst;
  kc[j] = Elem<T>::FromFloat(x1 * c - x2 * s);
  kc[j + half] = Elem<T>::FromFloat(x2 * c + x1 * s);
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
    for (int j = 0; j < 8; ++j) g[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    Store8(out + 8 * c, g);
  }
}

// ---- Paged attention.
//
// One block of 4 warps runs one work item at a time (a persistent grid loops
// over the step's items). The tile's 64 query rows (warp w: rows 16w..16w+15)
// stay in shared memory; keys and values stream through two shared-memory
// buffers of 64 keys (cp.async, the next step's loads in flight during this
// step's math). S = Q K^T and O += P V run on mma.m16n8k16 (bf16 or f16 in,
// f32 accumulate); the softmax is online per row, in the log2 domain.
// Shared memory rows are swizzled in 16-byte chunks (chunk c of row r at
// c ^ (r & 7)) so that ldmatrix reads are free of bank conflicts.
//
// Floor: the KV bytes of every key of every sequence, read once per KV head:
// decode of 64 sequences x 1024 keys on the 1B Llama (8 KV heads of 64, bf16)
// reads 64 x 1024 x 8 x 64 x 2 x 2 = 134 MB over 16 layers, 2.1 us per layer.
// Long prefill chunks are bound by the tensor cores instead (4 * rows * keys *
// head_dim flops, ~660 TFLOP/s dense bf16 with mma.sync).

constexpr int kAttnThreads = 128;

struct AttnArgs {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* partial_acc;
  float* partial_ml;
  const AttnStep* step;
  int32_t num_heads, num_kv_heads, block_size;
  float scale_log2;  // log2(e) / sqrt(head_dim)
};

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a * b for one m16n8k16 tile (row-major A, column-major B).
template <typename T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Element offset of 16-byte chunk c of row r in a swizzled [rows][D] tile.
template <int D>
__device__ __forceinline__ int Swizzle(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// The fold of a split's (max m, sum l, accumulator a) into a running state
// (M, L, A), in split order: the one definition both paths use.
struct FoldScales {
  float run, add;
};
// The scale of the larger side is 1 exactly (not exp2f(0)): folding a split
// into the empty state (-inf, 0, 0) must give back its bits, so that a
// partial written by one work item and folded again by the combine kernel
// equals the split folded in place.
__device__ __forceinline__ float Exp2Diff(float a, float b) { return a == b ? 1.0f : exp2f(a - b); }
__device__ __forceinline__ FoldScales FoldScale(float big_m, float m) {
  const float mx = fmaxf(big_m, m);
  if (mx == -INFINITY) return {1.0f, 0.0f};  // both empty: the running state stays
  return {Exp2Diff(big_m, mx), Exp2Diff(m, mx)};
}
__device__ __forceinline__ float FoldValue(float running, float value, FoldScales s) {
  return __fadd_rn(__fmul_rn(running, s.run), __fmul_rn(value, s.add));
}
__device__ __forceinline__ float Normalize(float acc, float sum) {
  return sum > 0.0f ? __fdiv_rn(acc, sum) : 0.0f;
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) PagedAttention(AttnArgs a) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kDTiles = D / 8;  // n-tiles of the output
  constexpr int kTile = kAttnTileRows * D;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* const q_s = reinterpret_cast<T*>(smem_raw);
  T* const k_s = q_s + kTile;      // [2][64][D]
  T* const v_s = k_s + 2 * kTile;  // [2][64][D]

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31, warp = tid >> 5;
  const AttnStep* const st = a.step;
  const int num_items = st->num_items;
  const int group = a.num_heads / a.num_kv_heads;
  const int positions_per_tile = kAttnTileRows / group;
  const T* const q = static_cast<const T*>(a.q);
  const T* const k_cache = static_cast<const T*>(a.k_cache);
  const T* const v_cache = static_cast<const T*>(a.v_cache);

  for (int w = static_cast<int>(blockIdx.x); w < num_items; w += static_cast<int>(gridDim.x)) {
    const AttnWorkItem it = st->items[w];
    const AttnSeq sq = st->seqs[it.seq];
    const int32_t* const table = st->block_tables + sq.table_offset;
    const int tile_positions = min(positions_per_tile, sq.q_len - it.q_first);
    const int rows_valid = tile_positions * group;
    const int key_end = sq.start + it.q_first + tile_positions;  // last position + 1
    const int key_lo = it.split_lo * kAttnSplitKeys;
    const int key_hi = min(it.split_hi * kAttnSplitKeys, key_end);
    const int n_tiles = key_hi > key_lo ? (key_hi - key_lo + kAttnTileKeys - 1) / kAttnTileKeys : 0;

    // Q rows: row r is position it.q_first + r / group, head kv_head * group + r % group.
    for (int i = tid; i < kAttnTileRows * kChunks; i += kAttnThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const bool valid = r < rows_valid;
      const T* src = q;
      if (valid) {
        const int token = sq.q_offset + it.q_first + r / group;
        const int head = it.kv_head * group + r % group;
        src = q + (static_cast<int64_t>(token) * a.num_heads + head) * D + c * 8;
      }
      CpAsync16(SmemAddress(q_s + Swizzle<D>(r, c)), src, valid);
    }
    // Keys and values of step j (keys key_lo + 64 j ...) into buffer j & 1;
    // keys past key_hi are zero-filled, so that their P * V terms are 0 * 0.
    auto load_kv = [&](int j) {
      const int t0 = key_lo + j * kAttnTileKeys;
      T* const kd = k_s + (j & 1) * kTile;
      T* const vd = v_s + (j & 1) * kTile;
      for (int i = tid; i < kAttnTileKeys * kChunks; i += kAttnThreads) {
        const int r = i / kChunks, c = i % kChunks;
        const int key = t0 + r;
        const bool valid = key < key_hi;
        int64_t offset = 0;
        if (valid) {
          const int64_t block = __ldg(table + key / a.block_size);
          offset = ((block * a.num_kv_heads + it.kv_head) * a.block_size + key % a.block_size) * D +
                   c * 8;
        }
        CpAsync16(SmemAddress(kd + Swizzle<D>(r, c)), k_cache + offset, valid);
        CpAsync16(SmemAddress(vd + Swizzle<D>(r, c)), v_cache + offset, valid);
      }
    };
    if (n_tiles > 0) load_kv(0);
    CpAsyncCommit();

    // This thread's two rows: g = lane / 4 and g + 8 of its warp's 16.
    const int r0 = warp * 16 + (lane >> 2), r1 = r0 + 8;
    const int pos0 = r0 < rows_valid ? sq.start + it.q_first + r0 / group : -1;
    const int pos1 = r1 < rows_valid ? sq.start + it.q_first + r1 / group : -1;
    const bool warp_active = warp * 16 < rows_valid;  // uniform over the warp

    float run_m[2] = {-INFINITY, -INFINITY}, run_l[2] = {0.0f, 0.0f};
    float run_acc[kDTiles][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[kDTiles][4];
#pragma unroll
    for (int dn = 0; dn < kDTiles; ++dn) {
#pragma unroll
      for (int e = 0; e < 4; ++e) run_acc[dn][e] = acc[dn][e] = 0.0f;
    }
    // Folds the finished split (m, l, acc) into the running state and resets it.
    auto fold_split = [&]() {
      FoldScales sc[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float total = l[i];  // this thread's columns; the quad holds the row
        total += __shfl_xor_sync(kFullMask, total, 1);
        total += __shfl_xor_sync(kFullMask, total, 2);
        sc[i] = FoldScale(run_m[i], m[i]);
        run_l[i] = FoldValue(run_l[i], total, sc[i]);
        run_m[i] = fmaxf(run_m[i], m[i]);
        m[i] = -INFINITY;
        l[i] = 0.0f;
      }
#pragma unroll
      for (int dn = 0; dn < kDTiles; ++dn) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          run_acc[dn][e] = FoldValue(run_acc[dn][e], acc[dn][e], sc[e >> 1]);
          acc[dn][e] = 0.0f;
        }
      }
    };

    int split = it.split_lo;
    for (int j = 0; j < n_tiles; ++j) {
      if (j + 1 < n_tiles) {
        load_kv(j + 1);
        CpAsyncCommit();
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      __syncthreads();
      const int t0 = key_lo + j * kAttnTileKeys;
      if (warp_active) {
        if (t0 / kAttnSplitKeys != split) {
          fold_split();
          split = t0 / kAttnSplitKeys;
        }
        const T* const ks = k_s + (j & 1) * kTile;
        const T* const vs = v_s + (j & 1) * kTile;
        // S = Q K^T for 16 rows x 64 keys.
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          uint32_t qa[4];
          Ldmatrix4(qa,
                    SmemAddress(q_s + Swizzle<D>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4))));
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) {
            uint32_t kb[4];
            Ldmatrix4(kb, SmemAddress(ks + Swizzle<D>(16 * nn + ((lane >> 4) << 3) + (lane & 7),
                                                      2 * kk + ((lane >> 3) & 1))));
            Mma<T>(s[2 * nn], qa, kb[0], kb[1]);
            Mma<T>(s[2 * nn + 1], qa, kb[2], kb[3]);
          }
        }
        // Causal mask (keys past a row's position, which covers keys past
        // key_hi), scale to the log2 domain, row maxima over the quad.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = t0 + 8 * n + 2 * (lane & 3) + (e & 1);
            const int pos = e < 2 ? pos0 : pos1;
            s[n][e] = key <= pos ? s[n][e] * a.scale_log2 : -INFINITY;
            tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
          }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 1));
          tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 2));
          const float m_new = fmaxf(m[i], tile_max[i]);
          m_use[i] = m_new == -INFINITY ? 0.0f : m_new;
          // 1 exactly when the max stays: a step whose keys are all masked
          // for this row (a prefill tile's later rows) changes nothing.
          alpha[i] = Exp2Diff(m[i], m_use[i]);
          m[i] = m_new;
        }
        // P = exp2(S - m), rounded to T for the P V product; the row sums add
        // the rounded values, so that numerator and denominator agree.
        uint32_t pa[4][4];
        float row_sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const auto h0 = Elem<T>::FromFloat2(exp2f(s[n][0] - m_use[0]), exp2f(s[n][1] - m_use[0]));
          const auto h1 = Elem<T>::FromFloat2(exp2f(s[n][2] - m_use[1]), exp2f(s[n][3] - m_use[1]));
          const float2 f0 = Elem<T>::ToFloat2(h0), f1 = Elem<T>::ToFloat2(h1);
          row_sum[0] += f0.x;
          row_sum[0] += f0.y;
          row_sum[1] += f1.x;
          row_sum[1] += f1.y;
          pa[n >> 1][(n & 1) * 2] = PairBits<T>(h0);
          pa[n >> 1][(n & 1) * 2 + 1] = PairBits<T>(h1);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + row_sum[i];
#pragma unroll
        for (int dn = 0; dn < kDTiles; ++dn) {
          acc[dn][0] *= alpha[0];
          acc[dn][1] *= alpha[0];
          acc[dn][2] *= alpha[1];
          acc[dn][3] *= alpha[1];
        }
        // O += P V.
#pragma unroll
        for (int kk = 0; kk < kAttnTileKeys / 16; ++kk) {
#pragma unroll
          for (int dp = 0; dp < D / 16; ++dp) {
            uint32_t vb[4];
            Ldmatrix4Trans(
                vb, SmemAddress(vs + Swizzle<D>(16 * kk + (lane & 15), 2 * dp + (lane >> 4))));
            Mma<T>(acc[2 * dp], pa[kk], vb[0], vb[1]);
            Mma<T>(acc[2 * dp + 1], pa[kk], vb[2], vb[3]);
          }
        }
      }
      __syncthreads();  // buffer j & 1 is free for step j + 2's loads
    }
    CpAsyncWait<0>();  // the Q loads, when there was no step

    if (warp_active) {
      fold_split();
      const int rows[2] = {r0, r1};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (rows[i] >= rows_valid) continue;
        const int qi = it.q_first + rows[i] / group;
        const int head = it.kv_head * group + rows[i] % group;
        const int d0 = 2 * (lane & 3);
        if (it.partial_base < 0) {
          T* const o = static_cast<T*>(a.out) +
                       (static_cast<int64_t>(sq.q_offset + qi) * a.num_heads + head) * D;
#pragma unroll
          for (int dn = 0; dn < kDTiles; ++dn) {
            *reinterpret_cast<typename Elem<T>::Pair*>(o + 8 * dn + d0) =
                Elem<T>::FromFloat2(Normalize(run_acc[dn][2 * i], run_l[i]),
                                    Normalize(run_acc[dn][2 * i + 1], run_l[i]));
          }
        } else {
          const int64_t entry = it.partial_base +
                                (static_cast<int64_t>(it.split_lo) * sq.q_len + qi) * a.num_heads +
                                head;
          float* const pacc = a.partial_acc + entry * D;
#pragma unroll
          for (int dn = 0; dn < kDTiles; ++dn) {
            *reinterpret_cast<float2*>(pacc + 8 * dn + d0) =
                make_float2(run_acc[dn][2 * i], run_acc[dn][2 * i + 1]);
          }
          if ((lane & 3) == 0) {
            a.partial_ml[2 * entry] = run_m[i];
            a.partial_ml[2 * entry + 1] = run_l[i];
          }
        }
      }
    }
    __syncthreads();  // shared memory is the next item's
  }
}

// One warp per combine row. Floor: reads the partials (head_dim + 2 floats
// per split) and writes the row: ~1 KB per row and split at head_dim 128.
template <typename T, int D>
__global__ void AttnCombine(const float* partial_acc, const float* partial_ml, const AttnStep* st,
                            T* out) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  constexpr int kPerLane = D / 32;
  const int row = static_cast<int>(blockIdx.x) * 4 + static_cast<int>(threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= st->num_combine) return;
  const AttnCombineRow c = st->combine[row];
  float big_m = -INFINITY, big_l = 0.0f, acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  for (int j = 0; j < c.num_splits; ++j) {
    const int64_t entry = c.entry0 + static_cast<int64_t>(j) * c.split_stride;
    const float m = partial_ml[2 * entry], l = partial_ml[2 * entry + 1];
    const FoldScales sc = FoldScale(big_m, m);
    big_l = FoldValue(big_l, l, sc);
    big_m = fmaxf(big_m, m);
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      acc[e] = FoldValue(acc[e], partial_acc[entry * D + lane * kPerLane + e], sc);
    }
  }
  T* const o = out + static_cast<int64_t>(c.out_row) * D + lane * kPerLane;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) o[e] = Elem<T>::FromFloat(Normalize(acc[e], big_l));
}

template <typename T, int D>
size_t AttentionSmem() {
  return size_t{5} * kAttnTileRows * D * sizeof(T);  // Q, and K and V twice
}

template <typename T, int D>
cudaError_t PrepareAttentionT(int* grid) {
  const size_t smem = AttentionSmem<T, D>();
  cudaError_t e = cudaFuncSetAttribute(
      PagedAttention<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  int device = 0, sms = 0, per_sm = 0;
  if ((e = cudaGetDevice(&device)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
    return e;
  }
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PagedAttention<T, D>,
                                                         kAttnThreads, smem)) != cudaSuccess) {
    return e;
  }
  *grid = std::max(1, sms * std::max(1, per_sm));
  return cudaSuccess;
}

template <typename T, int D>
cudaError_t LaunchAttentionT(const AttnArgs& args, int grid, cudaStream_t stream) {
  return LaunchDependent(PagedAttention<T, D>, static_cast<unsigned>(grid), kAttnThreads,
                         AttentionSmem<T, D>(), stream, args);
}

template <typename T, int D>
cudaError_t LaunchCombineT(const float* pacc, const float* pml, const AttnStep* step, int32_t rows,
                           void* out, cudaStream_t stream) {
  return LaunchDependent(AttnCombine<T, D>, static_cast<unsigned>((rows + 3) / 4), 128, 0, stream,
                         pacc, pml, step, static_cast<T*>(out));
}

// ---- Sampling.
//
// Floor: one pass over the row's logits is 4 * vocab bytes (0.5 MB for a
// 128256 vocabulary; 64 rows: 33 MB, 8 us from DRAM). Greedy rows take one
// pass; sampled rows take the max, the draw, and for top_k and top_p three
// radix passes each plus one for the top_p normaliser: up to 9, mostly from
// L2 (the logits were just written).

constexpr int kSampleThreads = 512;
constexpr int kRadixBins = 2048;  // 11-bit digits

// Larger float, larger key (a NaN sorts by its bits).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}

// Whether (a, ia) comes before (b, ib) in argmax order; index -1 is "none".
__device__ __forceinline__ bool Better(float a, int ia, float b, int ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return na;
  if (na || a == b) return ia < ib;
  return a > b;
}

// The block's argmax, broadcast to every thread.
__device__ void BlockArgmax(float& v, int& index, float* scratch_v, int* scratch_i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, offset);
    const int oi = __shfl_xor_sync(kFullMask, index, offset);
    if (Better(ov, oi, v, index)) {
      v = ov;
      index = oi;
    }
  }
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
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float ov = __shfl_xor_sync(kFullMask, v, offset);
      const int oi = __shfl_xor_sync(kFullMask, index, offset);
      if (Better(ov, oi, v, index)) {
        v = ov;
        index = oi;
      }
    }
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

// Sum of v over the block, broadcast (integers: exact in any order).
__device__ unsigned long long BlockSumU64(unsigned long long v, SampleShared& sh) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
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
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
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

// Calls f(v, j) for the block's share of a row's logits, in no fixed order
// (every use is order-free: integer sums, fmaxf, Better's total order).
// Several 16-byte loads in flight per thread: a loop of one dependent load
// at a time left a 128k-vocabulary row ~60 us on an H200.
template <typename F>
__device__ __forceinline__ void ForEachLogit(const float* x, int64_t vocab, F&& f) {
  constexpr int kInFlight = 4;
  const int64_t step = blockDim.x;
  if (vocab % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const auto* x4 = reinterpret_cast<const float4*>(x);
    const int64_t n4 = vocab / 4;
    int64_t i = threadIdx.x;
    for (; i + (kInFlight - 1) * step < n4; i += kInFlight * step) {
      float4 v[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) v[u] = x4[i + u * step];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int j = static_cast<int>(4 * (i + u * step));
        f(v[u].x, j);
        f(v[u].y, j + 1);
        f(v[u].z, j + 2);
        f(v[u].w, j + 3);
      }
    }
    for (; i < n4; i += step) {
      const float4 v = x4[i];
      const int j = static_cast<int>(4 * i);
      f(v.x, j);
      f(v.y, j + 1);
      f(v.z, j + 2);
      f(v.w, j + 3);
    }
    return;
  }
  int64_t i = threadIdx.x;
  for (; i + (kInFlight - 1) * step < vocab; i += kInFlight * step) {
    float v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = x[i + u * step];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) f(v[u], static_cast<int>(i + u * step));
  }
  for (; i < vocab; i += step) f(x[i], static_cast<int>(i));
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

// One block per row, as SampleToken (llm_model.h) draws on the host: NaN
// logits are never kept nor drawn; where nothing can be kept, greedy.
__global__ void __launch_bounds__(kSampleThreads)
    SampleRows(const float* logits, int64_t vocab, const SampleRow* params, int32_t* tokens) {
  DependentWait();  // dependent_launch.h
  DependentRelease();
  __shared__ SampleShared sh;
  const int row = blockIdx.x;
  const SampleRow p = params[row];
  if (p.active == 0) {
    if (threadIdx.x == 0) tokens[row] = -1;
    return;
  }
  const float* const x = logits + static_cast<int64_t>(row) * vocab;
  float best = 0.0f, top = -INFINITY;
  int best_i = -1;
  unsigned long long numbers = 0;
  ForEachLogit(x, vocab, [&](float v, int j) {
    if (Better(v, j, best, best_i)) {
      best = v;
      best_i = j;
    }
    if (!isnan(v)) {
      top = fmaxf(top, v);
      ++numbers;
    }
  });
  BlockArgmax(best, best_i, sh.v, sh.i);
  if (!(p.temperature > 0.0f)) {
    if (threadIdx.x == 0) tokens[row] = best_i;
    return;
  }
  top = BlockMax(top, sh);
  numbers = BlockSumU64(numbers, sh);
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
  float score = 0.0f;
  int index = -1;
  ForEachLogit(x, vocab, [&](float v, int j) {
    if (isnan(v) || OrderedKey(v) < floor) return;
    const float u = llm::GumbelUniform(p.seed, p.position, j);
    const float s = __fadd_rn(__fdiv_rn(v, temperature), -logf(-logf(u)));
    if (Better(s, j, score, index)) {
      score = s;
      index = j;
    }
  });
  BlockArgmax(score, index, sh.v, sh.i);
  if (threadIdx.x == 0) tokens[row] = index >= 0 ? index : best_i;
}

}  // namespace

cudaError_t LaunchFillRandom(void* p, int64_t n, ElemType type, float scale, uint64_t seed,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  FillRandom<<<GridFor(n, 256), 256, 0, stream>>>(p, n, type, scale, seed);
  return cudaGetLastError();
}

cudaError_t LaunchEmbed(const int32_t* tokens, int32_t rows, const void* table, int64_t hidden,
                        bool bf16, float* resid, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (hidden % 8 != 0) return cudaErrorInvalidValue;
  const unsigned threads = static_cast<unsigned>(std::clamp<int64_t>(hidden / 8, 32, 256));
  if (bf16) {
    return LaunchDependent(Embed<__nv_bfloat16>, rows, threads, 0, stream, tokens,
                           static_cast<const __nv_bfloat16*>(table), hidden, resid);
  }
  return LaunchDependent(Embed<__half>, rows, threads, 0, stream, tokens,
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

bool AttentionSupported(const AttnShape& shape) {
  return (shape.head_dim == 64 || shape.head_dim == 128) && shape.num_kv_heads > 0 &&
         shape.num_heads % shape.num_kv_heads == 0 &&
         shape.num_heads / shape.num_kv_heads <= kAttnTileRows && shape.block_size >= 1;
}

int64_t MaxFoldItems(const AttnShape& shape, int64_t total_tokens, int64_t num_seqs) {
  const int64_t per_tile = kAttnTileRows / (shape.num_heads / shape.num_kv_heads);
  return shape.num_kv_heads * (total_tokens / per_tile + num_seqs);
}

bool PlanPagedAttention(const AttnShape& shape, std::span<const AttnSeq> seqs, int64_t max_items,
                        int64_t max_partial_entries, AttnPlan* plan) {
  plan->items.clear();
  plan->combine.clear();
  plan->partial_entries = 0;
  const int32_t heads = shape.num_heads, kv_heads = shape.num_kv_heads;
  const int32_t per_tile = kAttnTileRows / (heads / kv_heads);
  int64_t fold_items = 0;
  for (const AttnSeq& s : seqs)
    fold_items += int64_t{kv_heads} * ((s.q_len + per_tile - 1) / per_tile);
  if (fold_items > max_items) return false;
  int64_t spare_items = max_items - fold_items;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const AttnSeq& s = seqs[i];
    const int32_t seq = static_cast<int32_t>(i);
    const int64_t context = int64_t{s.start} + s.q_len;
    const auto splits = static_cast<int32_t>((context + kAttnSplitKeys - 1) / kAttnSplitKeys);
    const int64_t extra_items = int64_t{kv_heads} * (splits - 1);
    const int64_t entries = int64_t{s.q_len} * heads * splits;
    if (s.q_len <= per_tile && splits > 1 && extra_items <= spare_items &&
        plan->partial_entries + entries <= max_partial_entries) {
      const auto base = static_cast<int32_t>(plan->partial_entries);
      plan->partial_entries += entries;
      spare_items -= extra_items;
      for (int32_t h = 0; h < kv_heads; ++h) {
        for (int32_t j = 0; j < splits; ++j) plan->items.push_back({seq, 0, h, j, j + 1, base});
      }
      for (int32_t qi = 0; qi < s.q_len; ++qi) {
        for (int32_t h = 0; h < heads; ++h) {
          plan->combine.push_back({base + qi * heads + h, s.q_len * heads,
                                   (s.start + qi) / kAttnSplitKeys + 1,
                                   (s.q_offset + qi) * heads + h});
        }
      }
      continue;
    }
    for (int32_t first = 0; first < s.q_len; first += per_tile) {
      const int64_t last_key = int64_t{s.start} + std::min(first + per_tile, s.q_len);  // + 1
      const auto tile_splits =
          static_cast<int32_t>((last_key + kAttnSplitKeys - 1) / kAttnSplitKeys);
      for (int32_t h = 0; h < kv_heads; ++h) {
        plan->items.push_back({seq, first, h, 0, tile_splits, -1});
      }
    }
  }
  return true;
}

cudaError_t PrepareAttention(const AttnShape& shape, int* grid) {
  if (!AttentionSupported(shape)) return cudaErrorInvalidValue;
  if (shape.bf16) {
    return shape.head_dim == 64 ? PrepareAttentionT<__nv_bfloat16, 64>(grid)
                                : PrepareAttentionT<__nv_bfloat16, 128>(grid);
  }
  return shape.head_dim == 64 ? PrepareAttentionT<__half, 64>(grid)
                              : PrepareAttentionT<__half, 128>(grid);
}

cudaError_t LaunchPagedAttention(const AttnShape& shape, const void* q, const void* k_cache,
                                 const void* v_cache, void* out, float* partial_acc,
                                 float* partial_ml, const AttnStep* step, int grid,
                                 cudaStream_t stream) {
  if (!AttentionSupported(shape) || grid < 1) return cudaErrorInvalidValue;
  AttnArgs args{
      q,
      k_cache,
      v_cache,
      out,
      partial_acc,
      partial_ml,
      step,
      shape.num_heads,
      shape.num_kv_heads,
      shape.block_size,
      static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(shape.head_dim)))};
  if (shape.bf16) {
    return shape.head_dim == 64 ? LaunchAttentionT<__nv_bfloat16, 64>(args, grid, stream)
                                : LaunchAttentionT<__nv_bfloat16, 128>(args, grid, stream);
  }
  return shape.head_dim == 64 ? LaunchAttentionT<__half, 64>(args, grid, stream)
                              : LaunchAttentionT<__half, 128>(args, grid, stream);
}

cudaError_t LaunchAttnCombine(const AttnShape& shape, const float* partial_acc,
                              const float* partial_ml, const AttnStep* step, int32_t max_rows,
                              void* out, cudaStream_t stream) {
  if (!AttentionSupported(shape)) return cudaErrorInvalidValue;
  if (max_rows <= 0) return cudaSuccess;
  if (shape.bf16) {
    return shape.head_dim == 64 ? LaunchCombineT<__nv_bfloat16, 64>(partial_acc, partial_ml, step,
                                                                    max_rows, out, stream)
                                : LaunchCombineT<__nv_bfloat16, 128>(partial_acc, partial_ml, step,
                                                                     max_rows, out, stream);
  }
  return shape.head_dim == 64
             ? LaunchCombineT<__half, 64>(partial_acc, partial_ml, step, max_rows, out, stream)
             : LaunchCombineT<__half, 128>(partial_acc, partial_ml, step, max_rows, out, stream);
}

cudaError_t LaunchSample(const float* logits, int32_t rows, int64_t vocab, const SampleRow* params,
                         int32_t* tokens, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab < 1 || vocab > 0x7fffffff) return cudaErrorInvalidValue;
  return LaunchDependent(SampleRows, rows, kSampleThreads, 0, stream, logits, vocab, params,
                         tokens);
}

}  // namespace hearth::cuda
