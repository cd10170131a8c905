// The GEMMs of the CUDA llm executor on cuBLASLt, one algorithm per weight
// shape for every row count:
//   y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]),  1 <= m <= max_m,
// with w a row-major checkpoint weight (out_features x in_features), x and y
// row-major, F16 or BF16 inputs, F32 accumulation, y in the input type or F32.
//
// Layout: cuBLASLt is column-major, and a row-major [R, C] matrix is the
// column-major [C, R] matrix of its transpose, so the product is run as
// y^T [n, m] = op_T(w as col-major [k, n]) * (x^T as col-major [k, m]): a TN
// GEMM whose column-major output is exactly row-major y (as mlp_cuda.cc).
//
// Batch invariance: a row of y must have the same bits whatever m is, so
// that a sequence's tokens do not depend on the batch it runs in. cuBLASLt's
// own choice varies with m (tile, split-K), so each shape gets one algorithm
// (tile, stages, split-K count and reduction scheme fixed in it) checked valid
// for row counts 1 .. 512 and used for all of them; more rows run as chunks
// of 512. Within one algorithm each output element is one dot product
// reduced in an order that the algorithm fixes, whatever the other columns
// of the tile hold; split-K candidates (the heuristics' own, and each
// candidate split 2, 4 or 8 ways) reduce their parts in a separate pass,
// never with atomics. The cost: the algorithm is a compromise over m (chosen
// by the summed slowdown against each row count's best candidate, timed at a
// few row counts).
//
// Two engines: cuBLASLt, and hearth's own tensor-core kernel (tc_gemm.h),
// which streams the weights at a few rows where cuBLASLt's tiles do not and
// fixes its order of sums by construction. Each shape runs on one of them
// for every row count, chosen like cuBLASLt's algorithms (the summed
// slowdown over the timed row counts), so a row's bits never depend on m.
//
// Floor: a decode step's GEMMs read their weights once, n * k * 2 bytes over
// ~4.0e12 B/s (the 1B Llama's 2.47 GB of weights with the tied lm_head:
// 0.62 ms); from a few hundred rows on, the tensor cores bind instead
// (2 * m * n * k flops at ~800 TFLOP/s dense bf16).
//
// Thread-safety: one thread.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "backends/cuda/cuda_util.h"
#include "backends/cuda/tc_gemm.h"
#include "backends/llm/plan_cache.h"
#include "hearth/status.h"

namespace hearth::llm {

struct GemmShapeSpec {
  std::string name;  // for messages and profiles: "q_proj", ...
  int64_t n = 0, k = 0;
  int64_t max_m = 0;
  bool bias = false;
  bool f32_out = false;  // y in F32 (the logits) instead of the input type
  // Every weight (and bias) this shape will run with: their alignment bounds
  // the algorithms, the first is timed.
  std::vector<const void*> weights;
  std::vector<const void*> biases;
  // Scratch of at least max_m x k inputs and max_m x n outputs, for timing.
  const void* x_scratch = nullptr;
  void* y_scratch = nullptr;
  // A pair of weights run as one strided batch (k_proj and v_proj, gate_proj
  // and up_proj: one launch instead of two): batch 2, the second weight (and
  // bias) at weight_stride (bias_stride) elements past the first, as the
  // arena packs a layer's tensors; both read the same x; the second output
  // at y_stride elements past the first (y_scratch must hold both).
  int32_t batch = 1;
  int64_t weight_stride = 0, bias_stride = 0, y_stride = 0;
};

enum class GemmEngine {
  kAny,       // the faster of the two, timed (else cuBLASLt's first valid)
  kCublasLt,  // cuBLASLt only
  kOwn,       // hearth's kernel only (an error for a shape it cannot run)
  kOwnFirst,  // hearth's kernel where it runs the shape, else cuBLASLt only
};

struct GemmTuning {
  GemmEngine engine = GemmEngine::kAny;
  // Time the candidates (else the heuristic's first valid one: the same on
  // every run, which tests comparing two executors need).
  bool time_candidates = true;
  // Allow split-K algorithms (a fixed split count is still batch invariant).
  bool allow_split_k = true;
  // The row counts timed besides 1 and max_m (decode batch sizes).
  std::vector<int64_t> timed_rows;
  // Where a timed choice is kept and looked up first (plan_cache.h), so that
  // every worker of this GPU model and cuBLASLt version runs the same
  // algorithm; null: none.
  PlanCache* cache = nullptr;
};

class GemmSet {
 public:
  // `bf16`: the input type (else F16). The workspace is allocated here and
  // added to *device_bytes.
  static Result<std::unique_ptr<GemmSet>> Create(bool bf16, cudaStream_t stream,
                                                 uint64_t* device_bytes);
  ~GemmSet();
  GemmSet(const GemmSet&) = delete;
  GemmSet& operator=(const GemmSet&) = delete;

  // Adds a shape and chooses its algorithm; returns its index.
  Result<int> AddShape(const GemmShapeSpec& spec, const GemmTuning& tuning);

  // Queues y = x w^T (+ bias) for m rows on the set's stream. bias must be
  // given exactly when the shape has one.
  Status Run(int shape, const void* weight, const void* bias, const void* x, void* y, int64_t m);

  // Whether RunSwiGlu can run `shape` at m rows: a pair without a bias on
  // hearth's kernel, in its split mode (m <= cuda::kTcSplitRows).
  bool FusesSwiGlu(int shape, int64_t m) const;
  // Queues y[m, n] = silu(x w^T) * (x w2^T), w2 the pair's second weight, in
  // one launch (FusesSwiGlu must hold): the same bits as Run followed by a
  // SwiGLU launch over the pair's two outputs.
  Status RunSwiGlu(int shape, const void* weight, const void* x, void* y, int64_t m);

  // One product of RunGroup.
  struct Call {
    int shape = -1;
    const void* weight = nullptr;
    const void* bias = nullptr;
    const void* x = nullptr;
    void* y = nullptr;
  };
  // Whether RunGroup can run these shapes at m rows in one launch: each on
  // hearth's kernel, without f32 outputs, m <= cuda::kTcSplitRows, at most
  // cuda::kTcMaxGroup of them, their workspaces fitting side by side.
  bool Groups(std::span<const int> shapes, int64_t m) const;
  // Queues the calls in one launch (Groups must hold), each with the bits
  // Run gives it.
  Status RunGroup(std::span<const Call> calls, int64_t m);

  // "q_proj: algo 21 tile 15 stages 8 splitK 1 ..." per shape, for logs.
  std::string Describe() const;
  // Shapes that run on hearth's own kernel.
  int own_shapes() const;
  // Shapes whose algorithm came from the plan cache.
  int cached_shapes() const { return cached_shapes_; }

 private:
  struct Shape {
    GemmShapeSpec spec;
    cuda::LtMatmulDesc desc;
    cuda::LtLayout a;
    cublasLtMatmulAlgo_t algo{};
    bool own = false;  // hearth's kernel (tc_gemm.h) instead of algo
  };

  GemmSet(bool bf16, cudaStream_t stream) : bf16_(bf16), stream_(stream) {}
  // The plan cache's key of a shape: the GPU, the library versions, the
  // shape, its types and alignments.
  std::string CacheKey(const Shape& s, uint32_t weight_alignment) const;
  // batch > 1: a strided batch of `stride` elements (0: one matrix for all).
  Result<cublasLtMatrixLayout_t> Layout(bool f32, uint64_t rows, uint64_t cols, int32_t batch = 1,
                                        int64_t stride = 0);
  // x's and y's layouts of a shape at m rows.
  Result<cublasLtMatrixLayout_t> XLayout(const Shape& s, int64_t m);
  Result<cublasLtMatrixLayout_t> YLayout(const Shape& s, int64_t m);
  Status Matmul(Shape& s, const cublasLtMatmulAlgo_t& algo, const void* weight, const void* bias,
                const void* x, void* y, int64_t m);
  Status Choose(Shape& s, const GemmTuning& tuning);
  cuda::TcGemmArgs OwnArgs(const Shape& s, const void* weight, const void* bias, const void* x,
                           void* y, int64_t m) const;
  Status RunOwn(const Shape& s, const void* weight, const void* bias, const void* x, void* y,
                int64_t m, bool swiglu = false);

  const bool bf16_;
  const cudaStream_t stream_;
  cuda::LtHandle lt_;
  cuda::DeviceBuffer workspace_;
  // The own kernel's part sums at many rows, shared by its launches, which
  // the stream orders.
  cuda::DeviceBuffer own_workspace_;
  std::vector<std::unique_ptr<Shape>> shapes_;
  std::string device_key_;  // "NVIDIA H200 sm90 cublasLt 130000 cudart 13000 hearth-tc 2"
  int cached_shapes_ = 0;
  // Column-major layouts by (F32?, rows, cols, batch, stride); ld = rows.
  std::map<std::tuple<bool, uint64_t, uint64_t, int32_t, int64_t>, cuda::LtLayout> layouts_;
};

}  // namespace hearth::llm
