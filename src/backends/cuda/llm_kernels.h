// Kernels of backend: llm on CUDA (llm_executor.cc), behind host launchers.
// Each launcher queues its kernel on `stream` and returns cudaGetLastError()
// (launch errors only; faults show up at the next synchronisation).
//
// Activations are row-major [rows, features] in the weights' dtype (F16 or
// BF16, `bf16` says which); the residual stream is float32. The KV cache of a
// layer is [blocks, kv_heads, block_size, head_dim] in the weights' dtype:
// token slot s (= block * block_size + offset) of KV head h lives at
// ((block * kv_heads + h) * block_size + offset) * head_dim.
//
// Batch invariance: every kernel computes a row from that row's inputs alone,
// in an order that does not depend on the other rows, the row count or the
// grid: a row's result is the same bits whichever batch it is in.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda/l2_prefetch.h"

namespace hearth::cuda {

// Element type of a buffer that the fill kernel writes.
enum class ElemType { kF32, kF16, kBF16 };

// p[i] = uniform pseudo-random values in [-scale, scale) (a hash of seed and
// i), as `type`: weights for benchmarks and tests, and the inputs on which
// GEMM algorithms are timed.
cudaError_t LaunchFillRandom(void* p, int64_t n, ElemType type, float scale, uint64_t seed,
                             cudaStream_t stream);

// resid[r, :] = float(table[tokens[r], :]) for r < rows. hidden % 8 == 0,
// table 16-byte aligned; tokens must be in range (checked by the caller).
// With feed: a row r with feed[r] >= 0 takes its token from drawn[feed[r]]
// instead (a token drawn on the device by the step before, in range).
cudaError_t LaunchEmbed(const int32_t* tokens, int32_t rows, const void* table, int64_t hidden,
                        bool bf16, float* resid, cudaStream_t stream, const int32_t* feed = nullptr,
                        const int32_t* drawn = nullptr);

// RMSNorm fused with the residual add, one row per block. For i < rows, with
// r = gather ? gather[i] : i:
//   x = resid[r] + (delta ? float(delta[r]) : 0)
//   out[i] = weight * (x / sqrt(mean(x^2) + eps))   (float32, rounded once)
// and resid[r] = x when gather is null (with a gather, resid is only read:
// the final norm of the rows whose logits are needed). hidden % 8 == 0, every
// pointer 16-byte aligned.
cudaError_t LaunchAddRmsNorm(float* resid, const void* delta, const void* weight,
                             const int32_t* gather, int32_t rows, int64_t hidden, float eps,
                             bool bf16, void* out, cudaStream_t stream);

// RoPE (rotate-half, as transformers' Llama) of q in place and of k, written
// with v into the KV cache of one layer.
struct RopeKvArgs {
  void* q = nullptr;                   // [tokens, num_heads, head_dim], rotated in place
  const void* k = nullptr;             // [tokens, num_kv_heads, head_dim]
  const void* v = nullptr;             // [tokens, num_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [tokens]
  const int32_t* slots = nullptr;      // [tokens]: cache slot, or -1: not written
  const float* inv_freq = nullptr;     // [head_dim / 2]
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int32_t tokens = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  bool bf16 = true;
};
cudaError_t LaunchRopeKvWrite(const RopeKvArgs& args, cudaStream_t stream);

// out[i] = silu(gate[i]) * up[i] in float32, rounded once; n % 8 == 0. out may
// be gate.
cudaError_t LaunchSwiGlu(const void* gate, const void* up, void* out, int64_t n, bool bf16,
                         cudaStream_t stream);

// ---- Attention over the paged KV cache (prefill chunks and decode alike).
//
// A query row is one (token, head). The rows of one KV head's group of
// query heads (G = num_heads / num_kv_heads) at up to kAttnTileRows / G
// consecutive positions of one sequence form a tile, so that each KV head is
// read once for its group. Row at position p attends keys 0..p (causal).
//
// Fixed reduction order: the keys of a row are cut into splits of
// kAttnSplitKeys keys at absolute positions (0, 128, 256, ...), each split
// into steps of kAttnTileKeys keys (an online softmax over the steps); the
// splits' (max, sum, accumulator) are then folded in split order, by one
// function, either inside the work item that ran them all (fold path) or by
// the combine kernel from per-split partials (split path: one work item per
// split, for parallelism at small batches). Both give the same bits, so a
// row's result depends on its position alone, never on the batch, the
// chunking of its prompt or the path its step took.
inline constexpr int kAttnTileRows = 64;
inline constexpr int kAttnTileKeys = 64;
inline constexpr int kAttnSplitKeys = 128;
static_assert(kAttnSplitKeys % kAttnTileKeys == 0);

struct AttnShape {
  int32_t num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  bool bf16 = true;
};

// Device-side description of one step (plain structs: the host writes them).
struct AttnSeq {
  int32_t q_offset;      // its first token among the step's tokens
  int32_t q_len;         // tokens fed (>= 1)
  int32_t start;         // position of the first token fed; keys 0 .. start + q_len - 1
  int32_t table_offset;  // its block table: block_tables + table_offset
};
struct AttnWorkItem {
  int32_t seq;
  int32_t q_first;  // first query position (index among the sequence's tokens fed)
  int32_t kv_head;
  int32_t split_lo;  // splits [split_lo, split_hi)
  int32_t split_hi;
  int32_t partial_base;  // -1: writes the output; else the sequence's first partial entry
};
// Split path: partial entry of (split j, token qi of the sequence, head h) is
// partial_base + (j * q_len + qi) * num_heads + h; the combine row of (qi, h)
// folds entries entry0 + j * split_stride for j < num_splits.
struct AttnCombineRow {
  int32_t entry0;
  int32_t split_stride;
  int32_t num_splits;
  int32_t out_row;  // token * num_heads + head
};
struct AttnStep {
  const AttnSeq* seqs;
  const int32_t* block_tables;
  const AttnWorkItem* items;
  const AttnCombineRow* combine;
  int32_t num_items;
  int32_t num_combine;
};

// The host side of a step: its work items and combine rows.
struct AttnPlan {
  std::vector<AttnWorkItem> items;
  std::vector<AttnCombineRow> combine;
  int64_t partial_entries = 0;
};
// Plans a step over `seqs` (their q_offset/q_len/start). A sequence whose
// tokens fit one tile and whose keys span more than `fold_splits` splits
// takes the split path while max_items and max_partial_entries allow, every
// other the fold path (one item runs its splits in turn, and no combine row
// is needed: a step of short sequences then skips the combine launch). Both
// paths give the same bits, so fold_splits (>= 1) is a matter of speed only.
// False when even the fold path would need more than max_items items.
bool PlanPagedAttention(const AttnShape& shape, std::span<const AttnSeq> seqs, int64_t max_items,
                        int64_t max_partial_entries, int32_t fold_splits, AttnPlan* plan);
// Work items of the fold path for `total_tokens` tokens in `num_seqs`
// sequences at most: the least max_items that always plans.
int64_t MaxFoldItems(const AttnShape& shape, int64_t total_tokens, int64_t num_seqs);

// Whether the attention kernels take this shape (head_dim 64 or 128, a group
// of at most kAttnTileRows heads).
bool AttentionSupported(const AttnShape& shape);
// Raises the kernels' shared-memory limit on the current device and returns
// the grid of the persistent attention kernel (blocks resident at once).
cudaError_t PrepareAttention(const AttnShape& shape, int* grid);
// RoPE and the KV cache write done by the attention itself, for a step in
// which every sequence feeds at most kAttnTileRows / group tokens (one tile of
// query rows: a decode step). q is then read unrotated and rotated on its way
// into the tile; each work item first writes, rotated, the keys (and the
// values) of the tokens fed whose positions fall in its key range into the
// cache, then reads them back with the older keys. Every key an item reads is
// then either in the cache before the launch or its own to write. The same
// bits as LaunchRopeKvWrite followed by the attention (one RopePair,
// llm_device.cuh), one launch fewer.
struct AttnRope {
  const void* k = nullptr;             // [tokens, num_kv_heads, head_dim], not rotated
  const void* v = nullptr;             // [tokens, num_kv_heads, head_dim]
  const int32_t* positions = nullptr;  // [tokens]
  const int32_t* slots = nullptr;      // [tokens]: cache slot of each token fed
  const float* inv_freq = nullptr;     // [head_dim / 2]
};
// out [tokens, num_heads, head_dim] for every row of step->items; rows of the
// split path get their partials (partial_acc [entries, head_dim], partial_ml
// [entries, 2]) and are finished by LaunchAttnCombine. `grid` blocks loop over
// the step's items (step->num_items is read on the device, so one launch
// serves any step: CUDA graphs). rope: see AttnRope (nullptr: q is rotated
// and the cache written already; the caches are then only read). prefetch:
// weights the grid asks L2 to fetch (l2_prefetch.h; nullptr: none), in a
// decode step those of o_proj and the MLP: the attention reads a few KB of
// keys per layer at a few sequences, and most of its persistent grid has no
// work item then.
cudaError_t LaunchPagedAttention(const AttnShape& shape, const void* q, void* k_cache,
                                 void* v_cache, void* out, float* partial_acc, float* partial_ml,
                                 const AttnStep* step, int grid, cudaStream_t stream,
                                 const AttnRope* rope = nullptr,
                                 const L2Prefetch* prefetch = nullptr);
// Folds the split path's partials into out, for the first step->num_combine
// of max_rows combine rows.
cudaError_t LaunchAttnCombine(const AttnShape& shape, const float* partial_acc,
                              const float* partial_ml, const AttnStep* step, int32_t max_rows,
                              void* out, cudaStream_t stream);

// ---- Sampling, over rows of float32 logits [rows, vocab]:
// temperature <= 0: the first index of the max (a NaN counts as the max);
// else the Gumbel-max draw of llm_model.h over the tokens kept by top_k, then
// top_p, with GumbelUniform(seed, position, token). The top_k and top_p
// thresholds are found by radix selection over the logits' order-preserving
// bits (3 digit passes), the top_p mass in fixed point (2^-40 of the largest
// token's weight), so that the sums are exact and the draw deterministic.
struct SampleRow {
  float temperature;
  float top_p;
  int32_t top_k;
  int32_t active;  // 0: a padding row, token -1
  uint64_t seed;
  int64_t position;
};
// A row's first pass (the argmax, and the draw where neither top_k nor top_p
// is set) is spread over up to 32 blocks, which meet in `scratch`: 16-byte
// aligned, SampleScratchBytes(rows, vocab) bytes, zero before its first
// launch; each launch leaves it ready for the next of up to `rows` rows of the
// same vocabulary (one stream at a time).
int64_t SampleScratchBytes(int32_t rows, int64_t vocab);
cudaError_t LaunchSample(const float* logits, int32_t rows, int64_t vocab, const SampleRow* params,
                         void* scratch, int32_t* tokens, cudaStream_t stream);

}  // namespace hearth::cuda
