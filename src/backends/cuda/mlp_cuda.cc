// mlp on cuBLASLt.
//
// Layout. The weights are row-major PyTorch Linear weights: W1 [H,IN], W2
// [OUT,H]; the activations are row-major too: X [B,IN], Hd [B,H], Y [B,OUT].
// cuBLASLt is column-major, and a row-major [R,C] matrix is the column-major
// [C,R] matrix of its transpose. So we compute the transposed products
//   Hd^T [H,B]   = op_T(W1 as col-major [IN,H], ld IN) * (X^T  as col-major [IN,B], ld IN)
//   Y^T  [OUT,B] = op_T(W2 as col-major [H,OUT], ld H) * (Hd^T as col-major [H,B],  ld H)
// i.e. TN GEMMs with m = H (or OUT), n = B, k = IN (or H), whose column-major
// outputs are exactly the row-major Hd and Y: no copy or transpose anywhere.
// The epilogue's bias has one entry per row m of D, which is one per output
// feature, as Linear's bias; RELU_BIAS applies the bias then the ReLU.
//
// Types. F32 weights: everything F32, compute 32F (32F_FAST_TF32 only with
// allow_tf32). F16/BF16 weights: the F32 input batch is narrowed to the
// weight dtype by a kernel; both GEMMs take 16-bit A and B with F32 compute
// and scale; the hidden activation D is in the weight dtype (bias type = D
// type = weight dtype) and the logits D in F32, whose bias must be F32: the
// 16-bit head.bias is widened once into a private buffer of OUT floats.
// (A/B 16F|16BF with C/D the same type or 32F, compute 32F, scale 32F, are
// listed combinations of cublasLtMatmul.)
//
// GEMM choice (parameter "gemm": auto | cublaslt | skinny). F32 weights
// without TF32 run batches of up to kSkinnyAutoMaxBatch rows on the skinny
// kernel (skinny_gemm.h), which reads each weight once for the whole batch,
// and larger ones on cuBLASLt, whose algorithm for each batch size is the
// fastest of the heuristic's candidates, timed once. 16-bit weights always
// use cuBLASLt, which streams them at full bandwidth.
#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/cuda/cuda_backends.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/skinny_gemm.h"
#include "backends/model_weights.h"
#include "memory/cuda_driver.h"

namespace hearth {
namespace {

using cuda::CudaCheck;
using cuda::LtCheck;

// 8 MiB: room for split-K on the skinny batch GEMMs; every MiB here is paid
// once per worker process.
constexpr uint64_t kWorkspaceBytes = uint64_t{8} << 20;

// cuBLASLt heuristic results timed when a batch size is first planned.
constexpr int kAlgoCandidates = 8;

// Under "gemm: auto", F32 batches up to this size take the skinny kernel:
// on the H200 it beats the best timed cuBLASLt algorithm up to 8 rows (0.44
// against 0.70 ms at 2 rows, 0.81 against 0.90 ms at 8) and loses from 16
// on (1.78 against 1.28 ms), bench/gemm.
constexpr int64_t kSkinnyAutoMaxBatch = 8;

enum class GemmMode { kAuto, kCublasLt, kSkinny };

Result<GemmMode> ParseGemmMode(const BackendOptions& options) {
  const auto it = options.parameters.find("gemm");
  if (it == options.parameters.end() || it->second == "auto") return GemmMode::kAuto;
  if (it->second == "cublaslt") return GemmMode::kCublasLt;
  if (it->second == "skinny") return GemmMode::kSkinny;
  return InvalidArgument("parameter gemm: '" + it->second + "' is not auto, cublaslt or skinny");
}

template <typename T>
Status SetAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return LtCheck(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                 "cublasLtMatmulDescSetAttribute");
}

// The largest power of two (up to 256) dividing the address: cuBLASLt's
// heuristic assumes 256-byte aligned pointers unless told otherwise.
uint32_t Alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// One GEMM D = epilogue(op_T(A) * B + bias) of the forward pass.
struct Gemm {
  cuda::LtMatmulDesc desc;
  cuda::LtLayout a;  // the weight, fixed
  const void* weight = nullptr;
  uint64_t m = 0, k = 0;
  cudaDataType b_type{}, d_type{};
};

// Layouts and algorithms for one batch size, made on first use.
struct BatchPlan {
  cuda::LtLayout b1, d1, b2, d2;
  cublasLtMatmulAlgo_t algo1{}, algo2{};
};

class MlpCuda final : public Backend {
 public:
  MlpCuda(const MlpWeights& w, int device, const BackendOptions& options)
      : device_(device),
        max_batch_(options.max_batch_size),
        in_(w.in),
        hidden_(w.hidden),
        out_(w.out),
        narrow_(w.dtype != DType::kF32),
        bf16_(w.dtype == DType::kBF16),
        inputs_(MlpInputs(w)),
        outputs_(MlpOutputs(w)),
        plans_(static_cast<size_t>(options.max_batch_size) + 1) {}

  Status Init(const MlpWeights& w, const BackendOptions& options) {
    ASSIGN_OR_RETURN(const GemmMode mode, ParseGemmMode(options));
    const cudaDataType ab = w.dtype == DType::kF32   ? CUDA_R_32F
                            : w.dtype == DType::kF16 ? CUDA_R_16F
                                                     : CUDA_R_16BF;
    const cublasComputeType_t compute = w.dtype == DType::kF32 && options.allow_tf32
                                            ? CUBLAS_COMPUTE_32F_FAST_TF32
                                            : CUBLAS_COMPUTE_32F;
    const uint64_t b = static_cast<uint64_t>(max_batch_);
    const uint64_t ab_size = DTypeSize(w.dtype);
    ASSIGN_OR_RETURN(stream_, cuda::CreateStream());
    ASSIGN_OR_RETURN(input_f32_, cuda::AllocateDevice(b * in_ * 4, "mlp input", &device_bytes_));
    if (narrow_) {
      ASSIGN_OR_RETURN(input_narrow_,
                       cuda::AllocateDevice(b * in_ * ab_size, "mlp 16-bit input", &device_bytes_));
      ASSIGN_OR_RETURN(head_bias_f32_,
                       cuda::AllocateDevice(out_ * 4, "mlp head bias", &device_bytes_));
      RETURN_IF_ERROR(CudaCheck(
          cuda::LaunchWidenToF32(w.head_bias->data, static_cast<float*>(head_bias_f32_.get()), out_,
                                 bf16_, stream_.get()),
          "widen head.bias"));
    }
    ASSIGN_OR_RETURN(hidden_buffer_,
                     cuda::AllocateDevice(b * hidden_ * ab_size, "mlp hidden", &device_bytes_));
    ASSIGN_OR_RETURN(logits_, cuda::AllocateDevice(b * out_ * 4, "mlp logits", &device_bytes_));
    ASSIGN_OR_RETURN(argmax_, cuda::AllocateDevice(b * 8, "mlp argmax", &device_bytes_));
    ASSIGN_OR_RETURN(workspace_,
                     cuda::AllocateDevice(kWorkspaceBytes, "cuBLASLt workspace", &device_bytes_));

    cublasLtHandle_t lt = nullptr;
    RETURN_IF_ERROR(LtCheck(cublasLtCreate(&lt), "cublasLtCreate"));
    lt_.reset(lt);

    const void* head_bias = narrow_ ? head_bias_f32_.get() : w.head_bias->data;
    RETURN_IF_ERROR(InitGemm(gemm1_, compute, ab, ab, w.encoder_weight->data, w.encoder_bias->data,
                             CUBLASLT_EPILOGUE_RELU_BIAS, hidden_, in_));
    RETURN_IF_ERROR(InitGemm(gemm2_, compute, ab, CUDA_R_32F, w.head_weight->data, head_bias,
                             CUBLASLT_EPILOGUE_BIAS, out_, hidden_));

    // rows is set per batch; 1 here for the support check.
    skinny1_ = {static_cast<const float*>(input_f32_.get()),
                static_cast<const float*>(w.encoder_weight->data),
                static_cast<const float*>(w.encoder_bias->data),
                static_cast<float*>(hidden_buffer_.get()),
                1,
                static_cast<int64_t>(hidden_),
                static_cast<int64_t>(in_),
                true};
    skinny2_ = {static_cast<const float*>(hidden_buffer_.get()),
                static_cast<const float*>(w.head_weight->data),
                static_cast<const float*>(head_bias),
                static_cast<float*>(logits_.get()),
                1,
                static_cast<int64_t>(out_),
                static_cast<int64_t>(hidden_),
                false};
    const bool skinny_fits = w.dtype == DType::kF32 && !options.allow_tf32 &&
                             cuda::SkinnyGemmSupported(skinny1_) &&
                             cuda::SkinnyGemmSupported(skinny2_);
    if (mode == GemmMode::kSkinny && !skinny_fits) {
      return InvalidArgument(
          "parameter gemm: skinny needs F32 weights, allow_tf32 off, input and hidden sizes that "
          "are multiples of 4 and 16-byte aligned weights");
    }
    skinny_max_batch_ = !skinny_fits || mode == GemmMode::kCublasLt ? 0
                        : mode == GemmMode::kSkinny                 ? max_batch_
                                                                    : kSkinnyAutoMaxBatch;
    return CudaCheck(cudaStreamSynchronize(stream_.get()), "mlp setup");
  }

  Status InjectDeviceFault() override {
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    return CudaCheck(cuda::LaunchIllegalAddressWrite(stream_.get()), "fault injection kernel");
  }

  const std::vector<IoSpec>& inputs() const override { return inputs_; }
  const std::vector<IoSpec>& outputs() const override { return outputs_; }
  uint64_t device_memory_bytes() const override { return device_bytes_; }
  // Every copy is cudaMemcpyDefault: host or device addresses alike.
  bool takes_device_addresses() const override { return true; }

  Status Run(int64_t batch, std::span<const void* const> inputs,
             std::span<void* const> outputs) override {
    if (inputs.size() != 1 || outputs.size() != 2) {
      return InvalidArgument("mlp takes 1 input and 2 outputs");
    }
    if (batch < 1 || batch > max_batch_) {
      return InvalidArgument("batch " + std::to_string(batch) + " outside [1, " +
                             std::to_string(max_batch_) + "]");
    }
    RETURN_IF_ERROR(MakeContextCurrent(device_));
    const auto n = static_cast<uint64_t>(batch);
    cudaStream_t s = stream_.get();
    RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(input_f32_.get(), inputs[0], n * in_ * 4, cudaMemcpyDefault, s),
                  "copy mlp input to the device"));
    const void* x = input_f32_.get();
    if (narrow_) {
      RETURN_IF_ERROR(
          CudaCheck(cuda::LaunchNarrowFromF32(static_cast<const float*>(x), input_narrow_.get(),
                                              batch * in_, bf16_, s),
                    "narrow mlp input"));
      x = input_narrow_.get();
    }
    if (batch <= skinny_max_batch_) {
      RETURN_IF_ERROR(RunSkinny(batch));
    } else {
      RETURN_IF_ERROR(RunCublasLt(batch, x));
    }
    RETURN_IF_ERROR(
        CudaCheck(cuda::LaunchArgmaxRows(static_cast<const float*>(logits_.get()), batch, out_,
                                         static_cast<int64_t*>(argmax_.get()), s),
                  "argmax kernel"));
    RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(outputs[0], logits_.get(), n * out_ * 4, cudaMemcpyDefault, s),
                  "copy logits to the host"));
    RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(outputs[1], argmax_.get(), n * 8, cudaMemcpyDefault, s),
                  "copy argmax to the host"));
    return CudaCheck(cudaStreamSynchronize(s), "mlp forward");
  }

 private:
  Status RunSkinny(int64_t batch) {
    cuda::SkinnyGemmArgs a1 = skinny1_, a2 = skinny2_;
    a1.rows = a2.rows = batch;
    RETURN_IF_ERROR(
        CudaCheck(cuda::LaunchSkinnyGemmF32(a1, 0, stream_.get()), "skinny GEMM encoder"));
    return CudaCheck(cuda::LaunchSkinnyGemmF32(a2, 0, stream_.get()), "skinny GEMM head");
  }

  Status RunCublasLt(int64_t batch, const void* x) {
    ASSIGN_OR_RETURN(const BatchPlan* plan, Plan(batch));
    RETURN_IF_ERROR(
        Matmul(gemm1_, &plan->algo1, x, plan->b1.get(), hidden_buffer_.get(), plan->d1.get())
            .WithContext("mlp encoder"));
    return Matmul(gemm2_, &plan->algo2, hidden_buffer_.get(), plan->b2.get(), logits_.get(),
                  plan->d2.get())
        .WithContext("mlp head");
  }

  Status InitGemm(Gemm& g, cublasComputeType_t compute, cudaDataType ab, cudaDataType d,
                  const void* weight, const void* bias, cublasLtEpilogue_t epilogue, int64_t m,
                  int64_t k) {
    cublasLtMatmulDesc_t desc = nullptr;
    RETURN_IF_ERROR(
        LtCheck(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F), "cublasLtMatmulDescCreate"));
    g.desc.reset(desc);
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue));
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias));
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, d));
    ASSIGN_OR_RETURN(g.a,
                     cuda::CreateLayout(ab, static_cast<uint64_t>(k), static_cast<uint64_t>(m), k));
    g.weight = weight;
    g.m = static_cast<uint64_t>(m);
    g.k = static_cast<uint64_t>(k);
    g.b_type = ab;
    g.d_type = d;
    return Status::Ok();
  }

  // B [k, batch] and D [m, batch] layouts and an algorithm: `reuse` if
  // given and valid for this batch size, else the heuristic's candidates,
  // timed on large weights.
  Status PlanGemm(const Gemm& g, uint64_t batch, const void* b_ptr, const void* d_ptr,
                  cuda::LtLayout* b, cuda::LtLayout* d, cublasLtMatmulAlgo_t* algo,
                  const cublasLtMatmulAlgo_t* reuse) {
    ASSIGN_OR_RETURN(*b, cuda::CreateLayout(g.b_type, g.k, batch, static_cast<int64_t>(g.k)));
    ASSIGN_OR_RETURN(*d, cuda::CreateLayout(g.d_type, g.m, batch, static_cast<int64_t>(g.m)));
    if (reuse != nullptr) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt_.get(), g.desc.get(), g.a.get(), b->get(), d->get(), d->get(),
                                  reuse, &check) == CUBLAS_STATUS_SUCCESS &&
          check.workspaceSize <= kWorkspaceBytes) {
        *algo = *reuse;
        return Status::Ok();
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    RETURN_IF_ERROR(
        LtCheck(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"));
    cuda::LtPreference owned_pref(pref);
    const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>, 4> alignments{{
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, Alignment(g.weight)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, Alignment(b_ptr)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, Alignment(d_ptr)},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, Alignment(d_ptr)},
    }};
    for (const auto& [attr, value] : alignments) {
      RETURN_IF_ERROR(
          LtCheck(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
                  "cublasLtMatmulPreferenceSetAttribute"));
    }
    const uint64_t workspace = kWorkspaceBytes;
    RETURN_IF_ERROR(
        LtCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                     &workspace, sizeof(workspace)),
                "cublasLtMatmulPreferenceSetAttribute"));
    std::array<cublasLtMatmulHeuristicResult_t, kAlgoCandidates> results{};
    int found = 0;
    RETURN_IF_ERROR(LtCheck(
        cublasLtMatmulAlgoGetHeuristic(lt_.get(), g.desc.get(), g.a.get(), b->get(), d->get(),
                                       d->get(), pref, kAlgoCandidates, results.data(), &found),
        "cublasLtMatmulAlgoGetHeuristic"));
    if (found == 0) {
      return Unimplemented("cuBLASLt has no algorithm for a " + std::to_string(g.m) + "x" +
                           std::to_string(batch) + "x" + std::to_string(g.k) + " GEMM");
    }
    *algo = results[0].algo;
    // The heuristic's first choice can be far from the best for these skinny
    // shapes (1.9 against 1.3 ms for the seed's MLP at batch 16 on an H200):
    // on large weights, time the candidates once and keep the fastest.
    if (reuse != nullptr || found == 1 || g.m * g.k < (uint64_t{1} << 22)) return Status::Ok();
    cudaEvent_t start = nullptr, stop = nullptr;
    RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&start), "cudaEventCreate"));
    cuda::CudaEvent owned_start(start);
    RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&stop), "cudaEventCreate"));
    cuda::CudaEvent owned_stop(stop);
    float best_ms = 0;
    for (int i = 0; i < found; ++i) {
      const cublasLtMatmulAlgo_t* candidate = &results[static_cast<size_t>(i)].algo;
      // A candidate that fails to run is skipped, never chosen.
      if (!Matmul(g, candidate, b_ptr, b->get(), const_cast<void*>(d_ptr), d->get()).ok()) continue;
      RETURN_IF_ERROR(CudaCheck(cudaEventRecord(start, stream_.get()), "cudaEventRecord"));
      for (int r = 0; r < 2; ++r) {
        RETURN_IF_ERROR(Matmul(g, candidate, b_ptr, b->get(), const_cast<void*>(d_ptr), d->get()));
      }
      RETURN_IF_ERROR(CudaCheck(cudaEventRecord(stop, stream_.get()), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(stop), "timing cuBLASLt candidates"));
      float ms = 0;
      RETURN_IF_ERROR(CudaCheck(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime"));
      if (best_ms == 0 || ms < best_ms) {
        best_ms = ms;
        *algo = *candidate;
      }
    }
    return Status::Ok();
  }

  // D = epilogue(op_T(weight) * B + bias) with `algo`, queued on the stream.
  Status Matmul(const Gemm& g, const cublasLtMatmulAlgo_t* algo, const void* b_ptr,
                cublasLtMatrixLayout_t b, void* d_ptr, cublasLtMatrixLayout_t d) {
    const float one = 1.0f, zero = 0.0f;
    return LtCheck(
        cublasLtMatmul(lt_.get(), g.desc.get(), &one, g.weight, g.a.get(), b_ptr, b, &zero, d_ptr,
                       d, d_ptr, d, algo, workspace_.get(), kWorkspaceBytes, stream_.get()),
        "cublasLtMatmul");
  }

  // Algorithms are timed for powers of two (and max_batch_) only; the batch
  // sizes between take their bucket's choice where it is valid for them.
  // So a dynamic batcher that forms every size from 1 to 64 pays for 7
  // timings, not 64 (each is ~50 ms on the seed's MLP).
  Result<const BatchPlan*> Plan(int64_t batch) {
    auto& slot = plans_[static_cast<size_t>(batch)];
    if (slot) return slot.get();
    int64_t bucket = 1;
    while (bucket < batch) bucket *= 2;
    bucket = std::min(bucket, max_batch_);
    const BatchPlan* tuned = nullptr;
    if (bucket != batch) {
      ASSIGN_OR_RETURN(tuned, Plan(bucket));
    }
    auto plan = std::make_unique<BatchPlan>();
    const auto n = static_cast<uint64_t>(batch);
    const void* x = narrow_ ? input_narrow_.get() : input_f32_.get();
    RETURN_IF_ERROR(PlanGemm(gemm1_, n, x, hidden_buffer_.get(), &plan->b1, &plan->d1, &plan->algo1,
                             tuned != nullptr ? &tuned->algo1 : nullptr)
                        .WithContext("mlp encoder, batch " + std::to_string(batch)));
    RETURN_IF_ERROR(PlanGemm(gemm2_, n, hidden_buffer_.get(), logits_.get(), &plan->b2, &plan->d2,
                             &plan->algo2, tuned != nullptr ? &tuned->algo2 : nullptr)
                        .WithContext("mlp head, batch " + std::to_string(batch)));
    slot = std::move(plan);
    return slot.get();
  }

  const int device_;
  const int64_t max_batch_;
  const uint64_t in_, hidden_, out_;
  const bool narrow_, bf16_;
  std::vector<IoSpec> inputs_, outputs_;
  uint64_t device_bytes_ = 0;
  // Declared before the buffers: destroyed after them, so that no buffer is
  // freed while work queued on the stream could still use it.
  cuda::CudaStream stream_;
  cuda::LtHandle lt_;
  cuda::DeviceBuffer input_f32_, input_narrow_, head_bias_f32_, hidden_buffer_, logits_, argmax_,
      workspace_;
  Gemm gemm1_, gemm2_;
  // The F32 skinny path: arguments without the row count; batches up to
  // skinny_max_batch_ take it (0: never).
  cuda::SkinnyGemmArgs skinny1_, skinny2_;
  int64_t skinny_max_batch_ = 0;
  std::vector<std::unique_ptr<BatchPlan>> plans_;  // by batch size
};

}  // namespace

Result<std::unique_ptr<Backend>> CreateMlpCuda(const MlpWeights& weights, int device,
                                               const BackendOptions& options) {
  RETURN_IF_ERROR(MakeContextCurrent(device));
  auto backend = std::make_unique<MlpCuda>(weights, device, options);
  RETURN_IF_ERROR(
      backend->Init(weights, options).WithContext("mlp on cuda:" + std::to_string(device)));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace hearth
