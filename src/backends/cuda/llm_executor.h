// The CUDA executor of backend: llm (llm_model.h): Llama-family decoders
// (Llama 2/3.x, Mistral, Qwen2; GQA) with F16 or BF16 weights on one GPU.
// Built into libhearth_backends_cuda.so.
//
// A step: embedding gather; per layer RMSNorm (fused with the residual add;
// the residual stream is float32), the q, k and v GEMMs (three cuBLASLt
// calls: the weights are the store's read-only mapping, so no fused QKV
// copy), RoPE fused with the KV cache write, paged attention, the o GEMM,
// RMSNorm, the gate and up GEMMs, SwiGLU, the down GEMM; then the final
// RMSNorm and the lm_head GEMM of the sampled rows only, and sampling. At a
// few rows on hearth's GEMM kernel, launches are fused (CudaExecutorOptions:
// SwiGLU into the gate/up GEMM, q/k/v in one launch, RoPE into the
// attention), each with the bits of the launches it replaces.
// llm_kernels.h and llm_gemm.h say how each stays batch invariant: a
// sequence's tokens and logits do not depend on the other sequences of its
// step or on how its prompt was chunked.
//
// Decode steps (one token per sequence) replay a CUDA graph captured once per
// batch-size bucket (1, 2, 4, ... up to max_seqs; a step pads to its bucket),
// after one copy of the step's inputs into the graph's device buffers; a
// bucket's first step runs eagerly with the graph's shapes, then the graph
// is captured. Other steps run eagerly. The KV pool (ExecutorOptions) holds blocks of
// block_size tokens in the weights' dtype for every layer.
//
// Errors: out of device memory is ResourceExhausted; a sticky CUDA error
// DeviceLost (the context is gone: every later call fails the same way).
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/llm_gemm.h"
#include "backends/llm/llm_model.h"

namespace hearth::llm {

struct CudaExecutorOptions {
  // Decode steps through captured graphs (else every step runs eagerly).
  bool cuda_graphs = true;
  // Time cuBLASLt's candidate algorithms at creation and keep the fastest
  // over the row counts; else the heuristic's first valid candidate, the
  // same on every run (tests that compare two executors bit for bit).
  bool time_gemms = true;
  // Allow split-K GEMM algorithms (their split count is fixed per weight
  // shape, so they stay batch invariant).
  bool allow_split_k = true;
  // Run k_proj and v_proj, and gate_proj and up_proj, each as one strided
  // batch of two where every layer has the second weight at the same
  // distance from the first (as the store's arena packs them); else as two
  // GEMMs each.
  bool pair_gemms = true;
  // Where gate_proj and up_proj run as a pair on hearth's kernel at up to
  // cuda::kTcSplitRows rows, apply SwiGLU in that launch (the same bits as a
  // SwiGLU launch after it).
  bool fuse_swiglu = true;
  // Where q_proj and k/v all run on hearth's kernel, run them in one launch
  // at up to cuda::kTcSplitRows rows (the same bits as apart).
  bool group_qkv = true;
  // In decode steps of up to kRopeInAttentionSeqs sequences, RoPE and the
  // KV cache write done by the attention kernel (cuda::AttnRope) instead of
  // their own launch (the same bits).
  bool fuse_rope_attention = true;
  // A sequence whose keys span at most this many attention splits
  // (cuda::kAttnSplitKeys keys each) has them run in turn by one work item,
  // and a step in which every sequence does needs no combine launch; longer
  // ones take a work item per split and the combine (the same bits either
  // way: cuda::PlanPagedAttention). At least 1; a step whose every sequence
  // has one split skips the combine whatever it is.
  int32_t attention_fold_splits = 1;
  // In decode steps of up to this many sequences, the attention launch asks
  // the L2 cache to fetch the layer's o_proj weight and then the first rows
  // of gate_proj and up_proj, l2_prefetch_bytes in all (cuda/l2_prefetch.h):
  // at a few sequences the attention reads little, and the memory would idle
  // until o_proj starts. The same bits either way. 0: never. Timed on the
  // H100 (1B Llama shape, 3 runs each): 1.7% less a step at one sequence,
  // 0.9% at 2, 1.2% at 4, nothing at 16; nothing on the 8B shape, whose
  // o_proj alone is past the 24 MiB. HEARTH_LLM_L2_PREFETCH=ROWS[,MIB] in the
  // environment sets both for the executors the engine makes
  // (CreateCudaExecutor without these options).
  int32_t l2_prefetch_rows = 4;
  uint64_t l2_prefetch_bytes = uint64_t{24} << 20;
  // Which GEMM engine each weight shape may run on (llm_gemm.h): the faster
  // of cuBLASLt and hearth's own kernel, or one of them.
  GemmEngine gemm_engine = GemmEngine::kAny;
  // Every step eager, with an event pair around each kernel
  // (LastStepKernelTimes).
  bool profile = false;
  // For timing only (llm_step_bench --twice): the launches of these kernel
  // names (those of LastStepKernelTimes) run twice, eager and in the
  // graphs, so that a step's time less the plain step's is what the kernel
  // costs where it stands among the others. The step's values are then
  // wrong wherever a kernel updates what it reads (the rmsnorm adds the
  // residual again); a serving executor leaves this empty.
  std::vector<std::string> launch_twice;
  // The plan cache (backends/llm/plan_cache.h) that keeps the timed GEMM
  // algorithms, so that every executor of this GPU model runs the same ones
  // (a stream resumed on another worker then draws the same tokens) and
  // later ones skip the timing; empty: none. A cache that cannot be opened
  // is said on stderr and the executor times on its own.
  std::string plan_cache_path;
};

// Reads HEARTH_LLM_L2_PREFETCH's value, ROWS or ROWS,MIB (rows 0 to 4096,
// MiB 0 to 1024), into l2_prefetch_rows and l2_prefetch_bytes; anything
// else is an InvalidArgument naming the variable, and options is unchanged.
Status ParseL2Prefetch(std::string_view text, CudaExecutorOptions* options);

// The most sequences of a decode step whose RoPE runs in the attention
// (CudaExecutorOptions::fuse_rope_attention): where a step is bound by its
// launches. With it in every decode step, 256 sequences took 5.11 ms a step
// on the H200 against 4.63 ms without it.
inline constexpr int32_t kRopeInAttentionSeqs = 16;

struct KernelTime {
  std::string name;  // "attention", "gemm gate_proj", ...
  int launches = 0;
  double ms = 0;  // summed over the launches of the last step
};

class CudaExecutor : public Executor {
 public:
  // The stream every step runs on (for events around Step).
  virtual cudaStream_t stream() const = 0;
  // With CudaExecutorOptions::profile: the last step's time per kernel, in
  // the order of their first launch.
  virtual std::vector<KernelTime> LastStepKernelTimes() const = 0;
  // The cuBLASLt algorithm of each weight shape, one line each.
  virtual std::string DescribeGemms() const = 0;
  // Decode graphs captured so far (one per batch-size bucket used).
  virtual int captured_graphs() const = 0;
  // Launches run a second time so far (CudaExecutorOptions::launch_twice).
  virtual int64_t launches_twice() const = 0;
};

// The weights are device addresses on device_index in config.dtype (F16 or
// BF16; F32 checkpoints are refused as Unimplemented), read only; they must
// outlive the executor. head_dim must be 64 or 128.
Result<std::unique_ptr<Executor>> CreateCudaExecutor(const ModelConfig& config,
                                                     const ModelWeights& weights, int device_index,
                                                     const ExecutorOptions& options);
Result<std::unique_ptr<CudaExecutor>> CreateCudaExecutor(const ModelConfig& config,
                                                         const ModelWeights& weights,
                                                         int device_index,
                                                         const ExecutorOptions& options,
                                                         const CudaExecutorOptions& cuda_options);

}  // namespace hearth::llm
