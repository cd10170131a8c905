#include "backends/cuda/llm_gemm.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string_view>

#include "backends/cuda/tc_gemm.h"

namespace hearth::llm {
namespace {

using cuda::CudaCheck;
using cuda::LtCheck;

// 32 MiB: cuBLASLt's recommendation for Hopper; room for the split-K
// algorithms of the skinny decode GEMMs.
constexpr uint64_t kWorkspaceBytes = uint64_t{32} << 20;
constexpr int kCandidatesPerRowCount = 8;
// Rows per cuBLASLt call: a larger m runs as chunks of this many rows, each
// row's bits the same in any chunk (batch invariance). Bounding m bounds the
// split-K workspace (splits x rows x n x 4 bytes), so that split-K
// candidates stay valid for every row count.
constexpr int64_t kChunkRows = 512;
// Timed runs per candidate and row count, after one warm-up run.
constexpr int kTimedRuns = 3;
// The plan cache's word for hearth's own kernel, and its revision, part of
// every key: a kernel whose speed or bits changed has its shapes timed again
// instead of reading a choice made against the one before (2: a column
// group's parts added in the CTA, k in at most 8 parts).
constexpr std::string_view kOwnPlan = "hearth-tc";
constexpr int kOwnRevision = 2;

template <typename T>
Status SetAttr(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  return LtCheck(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                 "cublasLtMatmulDescSetAttribute");
}

// The largest power of two (up to 256) dividing the address.
uint32_t Alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

template <typename T>
T AlgoConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

template <typename T>
T AlgoCap(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return T{};
  }
  return value;
}

// A split-K algorithm is deterministic (and its rows independent of the row
// count) only when its partial sums are reduced in a separate pass; the
// in-place scheme adds them with atomics, in whatever order they land.
bool Deterministic(const cublasLtMatmulAlgo_t& algo) {
  return AlgoConfig<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1 ||
         AlgoConfig<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) !=
             CUBLASLT_REDUCTION_SCHEME_INPLACE;
}

// Variants of a candidate that split K into `splits` parts reduced in the
// compute type: the heuristics rarely propose them for the weight shapes of
// a decode step, whose few output tiles leave most SMs idle at a few rows.
std::vector<cublasLtMatmulAlgo_t> SplitKVariants(const cublasLtMatmulAlgo_t& algo) {
  std::vector<cublasLtMatmulAlgo_t> out;
  if (AlgoCap<int32_t>(algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) == 0) return out;
  const auto schemes = AlgoCap<uint32_t>(algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
  if ((schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) == 0) return out;
  for (int32_t splits : {2, 4, 8}) {
    cublasLtMatmulAlgo_t v = algo;
    const uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                             sizeof(splits)) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&v, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                             sizeof(scheme)) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    out.push_back(v);
  }
  return out;
}

// An algorithm as the plan cache keeps it: its 64 bytes in hex.
std::string AlgoHex(const cublasLtMatmulAlgo_t& algo) {
  static constexpr char kDigits[] = "0123456789abcdef";
  const auto* bytes = reinterpret_cast<const unsigned char*>(&algo);
  std::string out;
  for (size_t i = 0; i < sizeof(algo); ++i) {
    out += kDigits[bytes[i] >> 4];
    out += kDigits[bytes[i] & 15];
  }
  return out;
}

std::optional<cublasLtMatmulAlgo_t> AlgoFromHex(std::string_view hex) {
  cublasLtMatmulAlgo_t algo{};
  if (hex.size() != 2 * sizeof(algo)) return std::nullopt;
  auto* bytes = reinterpret_cast<unsigned char*>(&algo);
  const auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof(algo); ++i) {
    const int hi = digit(hex[2 * i]), lo = digit(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    bytes[i] = static_cast<unsigned char>(hi * 16 + lo);
  }
  return algo;
}

bool SameAlgo(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

std::string ShapeName(const GemmShapeSpec& s) {
  return s.name + " (" + std::to_string(s.n) + "x" + std::to_string(s.k) + ", up to " +
         std::to_string(s.max_m) + " rows)";
}

}  // namespace

Result<std::unique_ptr<GemmSet>> GemmSet::Create(bool bf16, cudaStream_t stream,
                                                 uint64_t* device_bytes) {
  std::unique_ptr<GemmSet> set(new GemmSet(bf16, stream));
  cublasLtHandle_t lt = nullptr;
  RETURN_IF_ERROR(LtCheck(cublasLtCreate(&lt), "cublasLtCreate"));
  set->lt_.reset(lt);
  int device = 0;
  RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  cudaDeviceProp prop{};
  RETURN_IF_ERROR(CudaCheck(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  int runtime = 0;
  RETURN_IF_ERROR(CudaCheck(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion"));
  std::string name = prop.name;
  for (char& c : name)
    if (c < 0x20 || c > 0x7e || c == '\t') c = '_';
  set->device_key_ = name + " sm" + std::to_string(prop.major) + std::to_string(prop.minor) +
                     " cublasLt " + std::to_string(cublasLtGetVersion()) + " cudart " +
                     std::to_string(runtime) + " hearth-tc " + std::to_string(kOwnRevision);
  ASSIGN_OR_RETURN(set->workspace_,
                   cuda::AllocateDevice(kWorkspaceBytes, "cuBLASLt workspace", device_bytes));
  ASSIGN_OR_RETURN(set->own_workspace_, cuda::AllocateDevice(cuda::kTcMaxWorkspaceBytes,
                                                             "GEMM part sums", device_bytes));
  return set;
}

GemmSet::~GemmSet() = default;

static Status SetBatch(cublasLtMatrixLayout_t layout, int32_t batch, int64_t stride) {
  RETURN_IF_ERROR(LtCheck(cublasLtMatrixLayoutSetAttribute(
                              layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)),
                          "cublasLtMatrixLayoutSetAttribute"));
  return LtCheck(cublasLtMatrixLayoutSetAttribute(
                     layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
                 "cublasLtMatrixLayoutSetAttribute");
}

Result<cublasLtMatrixLayout_t> GemmSet::Layout(bool f32, uint64_t rows, uint64_t cols,
                                               int32_t batch, int64_t stride) {
  const auto key = std::make_tuple(f32, rows, cols, batch, batch > 1 ? stride : 0);
  const auto it = layouts_.find(key);
  if (it != layouts_.end()) return it->second.get();
  const cudaDataType type = f32 ? CUDA_R_32F : bf16_ ? CUDA_R_16BF : CUDA_R_16F;
  ASSIGN_OR_RETURN(cuda::LtLayout layout,
                   cuda::CreateLayout(type, rows, cols, static_cast<int64_t>(rows)));
  if (batch > 1) RETURN_IF_ERROR(SetBatch(layout.get(), batch, stride));
  cublasLtMatrixLayout_t raw = layout.get();
  layouts_.emplace(key, std::move(layout));
  return raw;
}

Result<cublasLtMatrixLayout_t> GemmSet::XLayout(const Shape& s, int64_t m) {
  return Layout(false, static_cast<uint64_t>(s.spec.k), static_cast<uint64_t>(m), s.spec.batch, 0);
}

Result<cublasLtMatrixLayout_t> GemmSet::YLayout(const Shape& s, int64_t m) {
  return Layout(s.spec.f32_out, static_cast<uint64_t>(s.spec.n), static_cast<uint64_t>(m),
                s.spec.batch, s.spec.y_stride);
}

Result<int> GemmSet::AddShape(const GemmShapeSpec& spec, const GemmTuning& tuning) {
  if (spec.n < 1 || spec.k < 1 || spec.max_m < 1 || spec.weights.empty() ||
      spec.bias != !spec.biases.empty() || spec.x_scratch == nullptr || spec.y_scratch == nullptr ||
      spec.batch < 1 ||
      (spec.batch > 1 &&
       (spec.weight_stride < spec.n * spec.k || spec.y_stride < spec.max_m * spec.n ||
        (spec.bias && spec.bias_stride < spec.n)))) {
    return Internal("GEMM shape " + ShapeName(spec) + " is malformed");
  }
  auto s = std::make_unique<Shape>();
  s->spec = spec;
  const cudaDataType ab = bf16_ ? CUDA_R_16BF : CUDA_R_16F;
  cublasLtMatmulDesc_t desc = nullptr;
  RETURN_IF_ERROR(LtCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                          "cublasLtMatmulDescCreate"));
  s->desc.reset(desc);
  RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T));
  RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N));
  if (spec.bias) {
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS));
    // A 16-bit output takes a bias of its own type.
    RETURN_IF_ERROR(
        SetAttr(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, spec.f32_out ? CUDA_R_32F : ab));
    RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, spec.biases.front()));
    if (spec.batch > 1)
      RETURN_IF_ERROR(SetAttr(desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, spec.bias_stride));
  }
  ASSIGN_OR_RETURN(s->a, cuda::CreateLayout(ab, static_cast<uint64_t>(spec.k),
                                            static_cast<uint64_t>(spec.n), spec.k));
  if (spec.batch > 1) RETURN_IF_ERROR(SetBatch(s->a.get(), spec.batch, spec.weight_stride));
  RETURN_IF_ERROR(Choose(*s, tuning).WithContext("GEMM " + ShapeName(spec)));
  shapes_.push_back(std::move(s));
  return static_cast<int>(shapes_.size() - 1);
}

Status GemmSet::Choose(Shape& s, const GemmTuning& tuning) {
  const GemmShapeSpec& spec = s.spec;
  const int64_t max_m = std::min(spec.max_m, kChunkRows);
  // Row counts whose heuristics propose candidates (and that are timed): the
  // decode batch sizes first, so that without timing the first valid
  // candidate is the one the heuristic made for them.
  std::vector<int64_t> timed;
  for (int64_t m : tuning.timed_rows) {
    if (m >= 1 && m <= max_m) timed.push_back(m);
  }
  timed.push_back(1);
  timed.push_back(max_m);
  {
    std::vector<int64_t> unique;
    for (int64_t m : timed) {
      if (std::find(unique.begin(), unique.end(), m) == unique.end()) unique.push_back(m);
    }
    timed = std::move(unique);
  }
  // Row counts an algorithm must be valid for: a sample of 1 .. max_m (the
  // layouts differ only in their column count, which tile-based kernels
  // take at any size; a failure at a row count not sampled would show as an
  // error of that step, never as a silently different algorithm).
  std::set<int64_t> checked(timed.begin(), timed.end());
  for (int64_t m : {1, 2, 3, 5, 8, 16, 17, 33, 64, 127, 128, 255, 256, 511, 512, 1024, 2048}) {
    if (m <= max_m) checked.insert(m);
  }

  cublasLtMatmulPreference_t pref = nullptr;
  RETURN_IF_ERROR(LtCheck(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"));
  cuda::LtPreference owned_pref(pref);
  uint32_t weight_alignment = 256;
  for (const void* w : spec.weights) weight_alignment = std::min(weight_alignment, Alignment(w));
  // x and y are always the executor's buffers (cudaMalloc: 256-byte aligned).
  const uint32_t buffer_alignment = std::min(Alignment(spec.x_scratch), Alignment(spec.y_scratch));
  const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>, 4> alignments{{
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, weight_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, buffer_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, buffer_alignment},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, buffer_alignment},
  }};
  for (const auto& [attr, value] : alignments) {
    RETURN_IF_ERROR(LtCheck(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
                            "cublasLtMatmulPreferenceSetAttribute"));
  }
  const uint64_t workspace = kWorkspaceBytes;
  RETURN_IF_ERROR(
      LtCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &workspace, sizeof(workspace)),
              "cublasLtMatmulPreferenceSetAttribute"));

  // An algorithm every row count takes.
  const auto valid_for_all = [&](const cublasLtMatmulAlgo_t& algo) -> Result<bool> {
    for (int64_t m : checked) {
      ASSIGN_OR_RETURN(cublasLtMatrixLayout_t b, XLayout(s, m));
      ASSIGN_OR_RETURN(cublasLtMatrixLayout_t d, YLayout(s, m));
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt_.get(), s.desc.get(), s.a.get(), b, d, d, &algo, &check) !=
              CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > kWorkspaceBytes) {
        return false;
      }
    }
    return true;
  };
  // hearth's kernel: 16-byte loads of w and x, pairs of y (and bias) elements.
  const cuda::TcGemmShape own_shape{spec.n, spec.k, spec.batch};
  uint32_t bias_alignment = 256;
  for (const void* b : spec.biases) bias_alignment = std::min(bias_alignment, Alignment(b));
  const bool own_runs = bias_alignment >= 8 && cuda::TcGemmSplits(own_shape) > 0 &&
                        weight_alignment >= 16 && buffer_alignment >= 16 &&
                        (spec.batch == 1 || (spec.weight_stride % 8 == 0 &&
                                             spec.y_stride % 2 == 0 && spec.bias_stride % 2 == 0));
  if (tuning.engine == GemmEngine::kOwn || (tuning.engine == GemmEngine::kOwnFirst && own_runs)) {
    if (!own_runs) {
      return Unimplemented(
          "hearth's GEMM kernel takes k a multiple of 64, n of 8 and 16-byte "
          "aligned weights");
    }
    s.own = true;
    return Status::Ok();
  }
  // From here the choice is among cuBLASLt's algorithms, with hearth's kernel
  // too where either engine may run.
  const bool own_ok = own_runs && tuning.engine == GemmEngine::kAny;
  // The plan cache keeps a choice among both engines under the shape's key,
  // and a choice among cuBLASLt's alone under its own: every worker of a
  // model then runs the same algorithm (a stream resumed on another draws
  // the same tokens) whichever engines its config allows.
  const std::string cache_key =
      CacheKey(s, weight_alignment) + (tuning.engine == GemmEngine::kAny ? "" : " cublaslt-only");
  PlanCache* const cache = tuning.cache;
  if (cache != nullptr && tuning.time_candidates) {
    if (const std::optional<std::string> kept = cache->Get(cache_key)) {
      if (*kept == kOwnPlan && own_ok) {
        s.own = true;
        ++cached_shapes_;
        return Status::Ok();
      }
      const std::optional<cublasLtMatmulAlgo_t> algo = AlgoFromHex(*kept);
      if (algo.has_value() && Deterministic(*algo)) {
        ASSIGN_OR_RETURN(const bool valid, valid_for_all(*algo));
        if (valid) {
          s.algo = *algo;
          ++cached_shapes_;
          return Status::Ok();
        }
      }
      // Not one this library takes (any more): timed again, and replaced.
    }
  }

  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (int64_t m : timed) {
    ASSIGN_OR_RETURN(cublasLtMatrixLayout_t b, XLayout(s, m));
    ASSIGN_OR_RETURN(cublasLtMatrixLayout_t d, YLayout(s, m));
    std::array<cublasLtMatmulHeuristicResult_t, kCandidatesPerRowCount> results{};
    int found = 0;
    RETURN_IF_ERROR(
        LtCheck(cublasLtMatmulAlgoGetHeuristic(lt_.get(), s.desc.get(), s.a.get(), b, d, d, pref,
                                               kCandidatesPerRowCount, results.data(), &found),
                "cublasLtMatmulAlgoGetHeuristic"));
    for (int i = 0; i < found; ++i) {
      const auto& r = results[static_cast<size_t>(i)];
      if (r.state != CUBLAS_STATUS_SUCCESS || !Deterministic(r.algo)) continue;
      std::vector<cublasLtMatmulAlgo_t> proposed = {r.algo};
      if (tuning.allow_split_k) {
        for (const auto& v : SplitKVariants(r.algo)) proposed.push_back(v);
      } else if (AlgoConfig<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1) {
        continue;
      }
      for (const auto& algo : proposed) {
        const bool seen = std::any_of(candidates.begin(), candidates.end(),
                                      [&](const auto& c) { return SameAlgo(c, algo); });
        if (!seen) candidates.push_back(algo);
      }
    }
  }
  std::vector<cublasLtMatmulAlgo_t> valid;
  for (const auto& algo : candidates) {
    ASSIGN_OR_RETURN(const bool ok, valid_for_all(algo));
    if (ok) valid.push_back(algo);
  }
  if (valid.empty() && !own_ok) {
    return Unimplemented("cuBLASLt offers no algorithm valid for every row count from 1 to " +
                         std::to_string(max_m) + " (" + std::to_string(candidates.size()) +
                         " candidates)");
  }
  // Candidate c < valid.size() is cuBLASLt's valid[c]; c == valid.size() is
  // hearth's kernel (where it can run the shape).
  const size_t count = valid.size() + (own_ok ? 1 : 0);
  const auto choose = [&](size_t c) {
    s.own = c == valid.size();
    if (!s.own) s.algo = valid[c];
  };
  choose(0);
  if (!tuning.time_candidates) return Status::Ok();
  const auto keep = [&] {
    return cache != nullptr ? cache->Put(cache_key, s.own ? std::string(kOwnPlan) : AlgoHex(s.algo))
                            : Status::Ok();
  };
  if (count == 1) return keep();

  cudaEvent_t start = nullptr, stop = nullptr;
  RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&start), "cudaEventCreate"));
  cuda::CudaEvent owned_start(start);
  RETURN_IF_ERROR(CudaCheck(cudaEventCreate(&stop), "cudaEventCreate"));
  cuda::CudaEvent owned_stop(stop);
  const void* weight = spec.weights.front();
  const void* bias = spec.bias ? spec.biases.front() : nullptr;
  const auto run = [&](size_t c, int64_t m) {
    if (c == valid.size()) return RunOwn(s, weight, bias, spec.x_scratch, spec.y_scratch, m);
    return Matmul(s, valid[c], weight, bias, spec.x_scratch, spec.y_scratch, m);
  };
  constexpr double kFailed = std::numeric_limits<double>::infinity();
  // ms[c][r]: candidate c at row count timed[r].
  std::vector<std::vector<double>> ms(count, std::vector<double>(timed.size(), kFailed));
  for (size_t r = 0; r < timed.size(); ++r) {
    for (size_t c = 0; c < count; ++c) {
      // A candidate that fails to run is never chosen.
      if (!run(c, timed[r]).ok()) continue;
      RETURN_IF_ERROR(CudaCheck(cudaEventRecord(start, stream_), "cudaEventRecord"));
      for (int i = 0; i < kTimedRuns; ++i) RETURN_IF_ERROR(run(c, timed[r]));
      RETURN_IF_ERROR(CudaCheck(cudaEventRecord(stop, stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(CudaCheck(cudaEventSynchronize(stop), "timing GEMM candidates"));
      float elapsed = 0;
      RETURN_IF_ERROR(
          CudaCheck(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime"));
      ms[c][r] = elapsed;
    }
  }
  // The summed slowdown against each row count's best.
  double best_score = kFailed;
  for (size_t c = 0; c < count; ++c) {
    double score = 0;
    for (size_t r = 0; r < timed.size(); ++r) {
      double best = kFailed;
      for (size_t o = 0; o < count; ++o) best = std::min(best, ms[o][r]);
      score += ms[c][r] / std::max(best, 1e-6);
    }
    if (score < best_score) {
      best_score = score;
      choose(c);
    }
  }
  return keep();
}

std::string GemmSet::CacheKey(const Shape& s, uint32_t weight_alignment) const {
  const GemmShapeSpec& spec = s.spec;
  return device_key_ + (bf16_ ? " bf16 " : " f16 ") + std::to_string(spec.n) + "x" +
         std::to_string(spec.k) + " rows " + std::to_string(std::min(spec.max_m, kChunkRows)) +
         (spec.bias ? " bias" : "") + (spec.f32_out ? " f32-out" : "") + " align " +
         std::to_string(weight_alignment) +
         (spec.batch > 1
              ? " batch " + std::to_string(spec.batch) + " strides " +
                    std::to_string(spec.weight_stride) + "/" + std::to_string(spec.bias_stride) +
                    "/" + std::to_string(spec.y_stride)
              : std::string());
}

Status GemmSet::Matmul(Shape& s, const cublasLtMatmulAlgo_t& algo, const void* weight,
                       const void* bias, const void* x, void* y, int64_t m) {
  if (bias != nullptr) {
    RETURN_IF_ERROR(SetAttr(s.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias));
  }
  ASSIGN_OR_RETURN(cublasLtMatrixLayout_t b, XLayout(s, m));
  ASSIGN_OR_RETURN(cublasLtMatrixLayout_t d, YLayout(s, m));
  const float one = 1.0f, zero = 0.0f;
  return LtCheck(cublasLtMatmul(lt_.get(), s.desc.get(), &one, weight, s.a.get(), x, b, &zero, y, d,
                                y, d, &algo, workspace_.get(), kWorkspaceBytes, stream_),
                 "cublasLtMatmul");
}

Status GemmSet::Run(int shape, const void* weight, const void* bias, const void* x, void* y,
                    int64_t m) {
  if (shape < 0 || static_cast<size_t>(shape) >= shapes_.size()) {
    return Internal("no GEMM shape #" + std::to_string(shape));
  }
  Shape& s = *shapes_[static_cast<size_t>(shape)];
  if (m < 1 || m > s.spec.max_m || (bias != nullptr) != s.spec.bias) {
    return Internal("GEMM " + ShapeName(s.spec) + " run with " + std::to_string(m) + " rows" +
                    (bias != nullptr ? " and a bias" : ""));
  }
  if (s.own) return RunOwn(s, weight, bias, x, y, m).WithContext("GEMM " + s.spec.name);
  const int64_t x_row = s.spec.k * 2, y_row = s.spec.n * (s.spec.f32_out ? 4 : 2);
  for (int64_t at = 0; at < m; at += kChunkRows) {
    RETURN_IF_ERROR(Matmul(s, s.algo, weight, bias, static_cast<const std::byte*>(x) + at * x_row,
                           static_cast<std::byte*>(y) + at * y_row, std::min(kChunkRows, m - at))
                        .WithContext("GEMM " + s.spec.name));
  }
  return Status::Ok();
}

bool GemmSet::FusesSwiGlu(int shape, int64_t m) const {
  if (shape < 0 || static_cast<size_t>(shape) >= shapes_.size()) return false;
  const Shape& s = *shapes_[static_cast<size_t>(shape)];
  return s.own && s.spec.batch == 2 && !s.spec.bias && !s.spec.f32_out && m >= 1 &&
         m <= std::min<int64_t>(s.spec.max_m, cuda::kTcSplitRows);
}

Status GemmSet::RunSwiGlu(int shape, const void* weight, const void* x, void* y, int64_t m) {
  if (!FusesSwiGlu(shape, m)) {
    return Internal("GEMM #" + std::to_string(shape) + " cannot run SwiGLU at " +
                    std::to_string(m) + " rows");
  }
  const Shape& s = *shapes_[static_cast<size_t>(shape)];
  return RunOwn(s, weight, nullptr, x, y, m, true).WithContext("GEMM " + s.spec.name + " + SwiGLU");
}

cuda::TcGemmArgs GemmSet::OwnArgs(const Shape& s, const void* weight, const void* bias,
                                  const void* x, void* y, int64_t m) const {
  cuda::TcGemmArgs a;
  a.shape = {s.spec.n, s.spec.k, s.spec.batch};
  a.bf16 = bf16_;
  a.f32_out = s.spec.f32_out;
  a.x = x;
  a.w = weight;
  a.bias = bias;
  a.y = y;
  a.m = m;
  a.w_stride = s.spec.weight_stride;
  a.bias_stride = s.spec.bias_stride;
  a.y_stride = s.spec.y_stride;
  a.workspace = static_cast<float*>(own_workspace_.get());
  a.workspace_bytes = cuda::kTcMaxWorkspaceBytes;
  return a;
}

Status GemmSet::RunOwn(const Shape& s, const void* weight, const void* bias, const void* x, void* y,
                       int64_t m, bool swiglu) {
  cuda::TcGemmArgs a = OwnArgs(s, weight, bias, x, y, m);
  a.swiglu = swiglu;
  return CudaCheck(cuda::LaunchTcGemm(a, stream_), "hearth's GEMM kernel");
}

bool GemmSet::Groups(std::span<const int> shapes, int64_t m) const {
  if (shapes.empty() || shapes.size() > static_cast<size_t>(cuda::kTcMaxGroup) || m < 1 ||
      m > cuda::kTcSplitRows) {
    return false;
  }
  for (const int i : shapes) {
    if (i < 0 || static_cast<size_t>(i) >= shapes_.size()) return false;
    const Shape& s = *shapes_[static_cast<size_t>(i)];
    if (!s.own || s.spec.f32_out || m > s.spec.max_m) return false;
  }
  return true;
}

Status GemmSet::RunGroup(std::span<const Call> calls, int64_t m) {
  std::array<int, cuda::kTcMaxGroup> ids{};
  if (calls.size() > ids.size()) return Internal("more GEMMs in one group than it takes");
  for (size_t i = 0; i < calls.size(); ++i) ids[i] = calls[i].shape;
  if (!Groups({ids.data(), calls.size()}, m)) {
    return Internal("these GEMMs cannot run as one launch at " + std::to_string(m) + " rows");
  }
  std::array<cuda::TcGemmArgs, cuda::kTcMaxGroup> args{};
  std::string names;
  for (size_t i = 0; i < calls.size(); ++i) {
    const Call& c = calls[i];
    const Shape& s = *shapes_[static_cast<size_t>(c.shape)];
    if ((c.bias != nullptr) != s.spec.bias) {
      return Internal("GEMM " + ShapeName(s.spec) + " run with" + (c.bias ? "" : "out") +
                      " a bias");
    }
    names += (names.empty() ? "" : ", ") + s.spec.name;
    args[i] = OwnArgs(s, c.weight, c.bias, c.x, c.y, m);
  }
  return CudaCheck(cuda::LaunchTcGemmGroup({args.data(), calls.size()}, stream_),
                   "hearth's GEMM kernel")
      .WithContext("GEMMs " + names);
}

int GemmSet::own_shapes() const {
  return static_cast<int>(
      std::count_if(shapes_.begin(), shapes_.end(), [](const auto& s) { return s->own; }));
}

std::string GemmSet::Describe() const {
  std::string out;
  for (const auto& s : shapes_) {
    if (s->own) {
      out += ShapeName(s->spec) + ": hearth's tensor-core kernel, k in " +
             std::to_string(cuda::TcGemmSplits({s->spec.n, s->spec.k, s->spec.batch})) + " parts\n";
      continue;
    }
    out += ShapeName(s->spec) + ": algo " +
           std::to_string(AlgoConfig<int32_t>(s->algo, CUBLASLT_ALGO_CONFIG_ID)) + " tile " +
           std::to_string(AlgoConfig<uint32_t>(s->algo, CUBLASLT_ALGO_CONFIG_TILE_ID)) +
           " stages " +
           std::to_string(AlgoConfig<uint32_t>(s->algo, CUBLASLT_ALGO_CONFIG_STAGES_ID)) +
           " split-k " +
           std::to_string(AlgoConfig<int32_t>(s->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) +
           " reduction " +
           std::to_string(AlgoConfig<uint32_t>(s->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME)) +
           " swizzle " +
           std::to_string(AlgoConfig<uint32_t>(s->algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING)) +
           " custom " +
           std::to_string(AlgoConfig<uint32_t>(s->algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION)) + "\n";
  }
  return out;
}

}  // namespace hearth::llm
