// The paged attention of llm_kernels.h and the kernel that folds its splits.
// The fold's rounding, which both kernels must reproduce bit for bit, is
// written with explicit __fmul_rn/__fadd_rn/__fdiv_rn, which the compiler may
// not contract into FMAs differently in the two places.
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
  void* k_cache;  // written only with rope
  void* v_cache;
  void* out;
  float* partial_acc;
  float* partial_ml;
  const AttnStep* step;
  int32_t num_heads, num_kv_heads, block_size;
  float scale_log2;  // log2(e) / sqrt(head_dim)
  AttnRope rope;     // rope.inv_freq == nullptr: q rotated and the cache written already
  L2Prefetch prefetch;
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

// kRope: RoPE and the KV write inside (AttnRope); a template parameter, so
// that the kernel without them keeps its registers.
template <typename T, int D, bool kRope>
__global__ void __launch_bounds__(kAttnThreads) PagedAttention(AttnArgs a) {
  // Chunks dealt over the blocks first: every SM's copy engine takes a share.
  PrefetchL2(a.prefetch, uint64_t{threadIdx.x} * gridDim.x + blockIdx.x,
             uint64_t{gridDim.x} * blockDim.x);
  DependentWait();  // dependent_launch.h
  DependentRelease();
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kHalfChunks = kChunks / 2;
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
    if constexpr (kRope) {
      // Rotated on the way in: a thread takes chunk c and its partner c + half.
      for (int i = tid; i < kAttnTileRows * kHalfChunks; i += kAttnThreads) {
        const int r = i / kHalfChunks, c = i % kHalfChunks;
        T* const lo = q_s + Swizzle<D>(r, c);
        T* const hi = q_s + Swizzle<D>(r, c + kHalfChunks);
        if (r < rows_valid) {
          const int token = sq.q_offset + it.q_first + r / group;
          const int head = it.kv_head * group + r % group;
          const T* src = q + (static_cast<int64_t>(token) * a.num_heads + head) * D + c * 8;
          RopeChunk<T>(src, src + D / 2, __ldg(a.rope.positions + token), a.rope.inv_freq + c * 8,
                       lo, hi);
        } else {
          *reinterpret_cast<uint4*>(lo) = make_uint4(0, 0, 0, 0);
          *reinterpret_cast<uint4*>(hi) = make_uint4(0, 0, 0, 0);
        }
      }
      // This KV head's keys and values of the tokens fed at positions in
      // [key_lo, key_hi), into the cache before any thread loads them.
      const int new_lo = max(key_lo, sq.start);
      for (int i = tid; i < max(key_hi - new_lo, 0) * kHalfChunks; i += kAttnThreads) {
        const int pos = new_lo + i / kHalfChunks, c = i % kHalfChunks;
        const int token = sq.q_offset + (pos - sq.start);
        const int64_t slot = __ldg(a.rope.slots + token);
        const int64_t src = (static_cast<int64_t>(token) * a.num_kv_heads + it.kv_head) * D + c * 8;
        const int64_t dst = ((slot / a.block_size * a.num_kv_heads + it.kv_head) * a.block_size +
                             slot % a.block_size) *
                                D +
                            c * 8;
        const T* const k_new = static_cast<const T*>(a.rope.k) + src;
        const T* const v_new = static_cast<const T*>(a.rope.v) + src;
        T* const k_dst = static_cast<T*>(a.k_cache) + dst;
        T* const v_dst = static_cast<T*>(a.v_cache) + dst;
        RopeChunk<T>(k_new, k_new + D / 2, pos, a.rope.inv_freq + c * 8, k_dst, k_dst + D / 2);
        *reinterpret_cast<uint4*>(v_dst) = *reinterpret_cast<const uint4*>(v_new);
        *reinterpret_cast<uint4*>(v_dst + D / 2) = *reinterpret_cast<const uint4*>(v_new + D / 2);
      }
      __syncthreads();
    } else {
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
  cudaError_t e =
      cudaFuncSetAttribute(PagedAttention<T, D, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(PagedAttention<T, D, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  int device = 0, sms = 0, per_sm = 0;
  if ((e = cudaGetDevice(&device)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess) {
    return e;
  }
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PagedAttention<T, D, false>,
                                                         kAttnThreads, smem)) != cudaSuccess) {
    return e;
  }
  *grid = std::max(1, sms * std::max(1, per_sm));
  return cudaSuccess;
}

template <typename T, int D>
cudaError_t LaunchAttentionT(const AttnArgs& args, int grid, cudaStream_t stream) {
  if (args.rope.inv_freq != nullptr) {
    return LaunchDependent(PagedAttention<T, D, true>, static_cast<unsigned>(grid), kAttnThreads,
                           AttentionSmem<T, D>(), stream, args);
  }
  return LaunchDependent(PagedAttention<T, D, false>, static_cast<unsigned>(grid), kAttnThreads,
                         AttentionSmem<T, D>(), stream, args);
}

template <typename T, int D>
cudaError_t LaunchCombineT(const float* pacc, const float* pml, const AttnStep* step, int32_t rows,
                           void* out, cudaStream_t stream) {
  return LaunchDependent(AttnCombine<T, D>, static_cast<unsigned>((rows + 3) / 4), 128, 0, stream,
                         pacc, pml, step, static_cast<T*>(out));
}

}  // namespace

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
                        int64_t max_partial_entries, int32_t fold_splits, AttnPlan* plan) {
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
    if (s.q_len <= per_tile && splits > std::max(fold_splits, 1) && extra_items <= spare_items &&
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

cudaError_t LaunchPagedAttention(const AttnShape& shape, const void* q, void* k_cache,
                                 void* v_cache, void* out, float* partial_acc, float* partial_ml,
                                 const AttnStep* step, int grid, cudaStream_t stream,
                                 const AttnRope* rope, const L2Prefetch* prefetch) {
  if (!AttentionSupported(shape) || grid < 1) return cudaErrorInvalidValue;
  if (prefetch != nullptr && !L2PrefetchValid(*prefetch)) return cudaErrorInvalidValue;
  if (rope != nullptr && (rope->k == nullptr || rope->v == nullptr || rope->positions == nullptr ||
                          rope->slots == nullptr || rope->inv_freq == nullptr))
    return cudaErrorInvalidValue;
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
      static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(shape.head_dim))),
      rope != nullptr ? *rope : AttnRope{},
      prefetch != nullptr ? *prefetch : L2Prefetch{}};
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

}  // namespace hearth::cuda
