#include "backends/cuda/llm_executor.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_util.h"
#include "backends/cuda/llm_gemm.h"
#include "backends/cuda/llm_kernel_timer.h"
#include "backends/cuda/llm_kernels.h"
#include "memory/cuda_driver.h"

namespace hearth::llm {
namespace {

using cuda::CudaCheck;

// The pool when ExecutorOptions sets neither its bytes nor its fraction (as
// the CPU executor's default).
constexpr uint64_t kDefaultPoolBytes = uint64_t{64} << 20;
// Alignment of each array in the step's input buffer.
constexpr int64_t kMetaAlignment = 64;

int64_t AlignUp(int64_t v, int64_t a) { return (v + a - 1) / a * a; }
int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct PinnedFree {
  void operator()(void* p) const noexcept { cuda::LogIfError(cudaFreeHost(p), "cudaFreeHost"); }
};
using PinnedBuffer = std::unique_ptr<void, PinnedFree>;
using GraphExec = cuda::UniqueHandle<cudaGraphExec_t, cudaGraphExecDestroy>;
using CudaGraph = cuda::UniqueHandle<cudaGraph_t, cudaGraphDestroy>;

Result<PinnedBuffer> AllocatePinned(uint64_t bytes, std::string_view what) {
  void* p = nullptr;
  RETURN_IF_ERROR(
      CudaCheck(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocDefault),
                "cudaHostAlloc " + std::to_string(bytes) + " bytes for " + std::string(what)));
  return PinnedBuffer(p);
}

std::string TensorName(const char* role, int64_t layer) {
  return layer < 0 ? std::string(role)
                   : "model.layers." + std::to_string(layer) + "." + std::string(role);
}

// The tensor is there, in `dtype`, of `shape`, on cuda:device, 16-byte aligned.
Status CheckTensor(const TensorView* t, const char* role, int64_t layer, DType dtype,
                   const std::vector<int64_t>& shape, int device) {
  const std::string name = TensorName(role, layer);
  if (t == nullptr) return NotFound("the CUDA llm executor needs " + name);
  if (t->dtype != dtype) {
    return InvalidArgument(name + ": dtype " + std::string(DTypeName(t->dtype)) + ", expected " +
                           std::string(DTypeName(dtype)));
  }
  if (t->shape != shape) {
    return InvalidArgument(name + ": shape " + ShapeString(t->shape) + ", expected " +
                           ShapeString(shape));
  }
  if (t->device != Device::Cuda(device)) {
    return InvalidArgument(name + " is on " + t->device.ToString() +
                           ", the executor on cuda:" + std::to_string(device));
  }
  if (t->data == nullptr || reinterpret_cast<uintptr_t>(t->data) % 16 != 0) {
    return InvalidArgument(name + ": its device address is not 16-byte aligned");
  }
  return Status::Ok();
}

// Where each array of the step's input buffer starts (bytes). The fixed part
// has room for the largest step; block tables, work items and combine rows
// follow, at offsets each step records in its AttnStep.
struct MetaLayout {
  int64_t step = 0;        // cuda::AttnStep
  int64_t tokens = 0;      // int32 [token rows]
  int64_t positions = 0;   // int32 [token rows]
  int64_t slots = 0;       // int32 [token rows]
  int64_t seqs = 0;        // AttnSeq [max_seqs]
  int64_t logit_rows = 0;  // int32 [max_seqs]: the token row of each sampled sequence
  int64_t sample = 0;      // SampleRow [max_seqs]
  int64_t feed = 0;  // int32 [token rows]: -1, or the drawn token (of the step before) it feeds
  int64_t dynamic = 0;
  int64_t capacity = 0;
};

struct LayerPointers {
  const void* input_norm;
  const void* q;
  const void* k;
  const void* v;
  const void* q_bias;
  const void* k_bias;
  const void* v_bias;
  const void* o;
  const void* post_norm;
  const void* gate;
  const void* up;
  const void* down;
};

// The L2 prefetch of a layer's attention launch: the weights of the GEMMs
// after it in the order they run, o_proj's, then as many leading rows of
// gate_proj as of up_proj (of `rows` each), within `budget` bytes. A weight
// that is not 16-byte aligned is left out (the launch would refuse it).
cuda::L2Prefetch PrefetchAfterAttention(const LayerPointers& w, uint64_t budget, int64_t o_bytes,
                                        int64_t row_bytes, int64_t gate_rows) {
  cuda::L2Prefetch p;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  budget -= budget % 16;
  if (!aligned(w.o)) return p;
  p.ptr[0] = w.o;
  p.bytes[0] = std::min(budget, static_cast<uint64_t>(o_bytes) / 16 * 16);
  budget -= p.bytes[0];
  const uint64_t rows =
      std::min(budget / 2 / static_cast<uint64_t>(row_bytes), static_cast<uint64_t>(gate_rows));
  if (rows == 0 || !aligned(w.gate) || !aligned(w.up)) return p;
  // row_bytes (hidden x 2) is a multiple of 16: hidden % 8 == 0.
  p.ptr[1] = w.gate;
  p.bytes[1] = rows * static_cast<uint64_t>(row_bytes);
  p.ptr[2] = w.up;
  p.bytes[2] = p.bytes[1];
  return p;
}

// What one step runs: its rows, and the graph bucket when it replays one.
struct StepPlan {
  int32_t tokens = 0;
  int32_t seqs = 0;
  int32_t logit_rows = 0;
  int32_t items = 0;
  int32_t combine = 0;
  int32_t bucket = 0;   // > 0: the decode graph of this many sequences
  bool decode = false;  // every sequence feeds one token
  int64_t upload_bytes = 0;
};

// A decode graph: its bucket, and whether it runs the attention's combine
// (a step whose every sequence took the fold path replays one without).
using GraphKey = std::pair<int32_t, bool>;

class CudaLlmExecutor final : public CudaExecutor {
 public:
  CudaLlmExecutor(const ModelConfig& config, int device, const ExecutorOptions& options,
                  const CudaExecutorOptions& cuda_options)
      : device_(device),
        cuda_options_(cuda_options),
        hidden_(config.hidden_size),
        intermediate_(config.intermediate_size),
        layers_count_(config.num_layers),
        heads_(static_cast<int32_t>(config.num_heads)),
        kv_heads_(static_cast<int32_t>(config.num_kv_heads)),
        head_dim_(static_cast<int32_t>(config.head_dim)),
        vocab_(config.vocab_size),
        eps_(static_cast<float>(config.rms_norm_eps)),
        bf16_(config.dtype == DType::kBF16),
        max_seqs_(options.max_seqs),
        max_tokens_(options.max_tokens_per_step),
        token_rows_(std::max(options.max_tokens_per_step, options.max_seqs)),
        block_size_(options.block_size),
        max_positions_(options.max_positions > 0
                           ? options.max_positions
                           : static_cast<int32_t>(std::min<int64_t>(
                                 config.max_positions, std::numeric_limits<int32_t>::max()))),
        max_blocks_per_seq_(
            static_cast<int32_t>(CeilDiv(max_positions_, std::max(1, options.block_size)))) {
    attn_shape_ = {heads_, kv_heads_, head_dim_, block_size_, bf16_};
  }

  // A step launched and not collected still runs: it ends before the
  // buffers it uses are freed.
  ~CudaLlmExecutor() override {
    if (stream_ != nullptr) cuda::LogIfError(cudaStreamSynchronize(stream_.get()), "llm executor");
  }

  Status Init(const ModelConfig& config, const ModelWeights& weights,
              const ExecutorOptions& options);

  int32_t block_size() const override { return block_size_; }
  int32_t num_blocks() const override { return num_blocks_; }
  uint64_t device_memory_bytes() const override { return device_bytes_; }
  cudaStream_t stream() const override { return stream_.get(); }
  std::vector<KernelTime> LastStepKernelTimes() const override { return kernel_times_; }
  std::string DescribeGemms() const override { return gemms_->Describe(); }
  int64_t launches_twice() const override { return launches_twice_; }
  int captured_graphs() const override {
    return static_cast<int>(std::count_if(graphs_.begin(), graphs_.end(),
                                          [](const auto& g) { return g.second != nullptr; }));
  }

  Status Step(const StepBatch& batch, std::span<int32_t> next) override {
    if (in_flight_ > 0) return FailedPrecondition("Step: a launched step is not collected");
    if (next.size() != batch.num_seqs()) {
      return InvalidArgument("Step: next holds " + std::to_string(next.size()) + " tokens for " +
                             std::to_string(batch.num_seqs()) + " sequences");
    }
    RETURN_IF_ERROR(Launch(batch));
    return Collect(next);
  }

  Status StepLogits(const StepBatch& batch, std::span<float> logits) override;
  Status Launch(const StepBatch& batch) override;
  Status Collect(std::span<int32_t> next) override;

 private:
  Status Validate(const StepBatch& batch) const;
  // Writes the step's inputs into the host buffer of slot_.
  Result<StepPlan> Build(const StepBatch& batch);
  // After an error: waits for what was queued (it may still read the
  // step's inputs and write the cache) and forgets every launched step. A
  // lost context is DeviceLost whichever call saw it first.
  Status Abandon(const Status& why);
  // Queues the forward for `rows` token rows (a graph bucket pads them),
  // logits and sampling for `logit_rows`, the combine kernel for up to
  // `combine_rows`, the attention on `attention_grid` blocks; `decode`: every
  // sequence feeds one token (RoPE may then run in the attention).
  Status Enqueue(int32_t rows, int32_t logit_rows, int32_t combine_rows, int attention_grid,
                 bool decode);
  // The forward of a decode step of `bucket` sequences, with or without the
  // combine, as Queue runs it.
  Status EnqueueDecode(const GraphKey& key);
  Result<cudaGraphExec_t> DecodeGraph(const GraphKey& key);
  // Queues the upload of the step's inputs (slot_'s host buffer), the step
  // (graph or eager), the copy of its tokens (to slot_'s) or logits back,
  // and slot_'s event after them.
  Status Queue(const StepPlan& p, std::span<float> logits, bool want_logits);
  int32_t Bucket(int32_t seqs) const;

  template <typename T>
  T* HostArray(int64_t offset) {
    return reinterpret_cast<T*>(static_cast<char*>(meta_host_[slot_].get()) + offset);
  }
  template <typename T>
  T* DeviceArray(int64_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(meta_dev_.get()) + offset);
  }

  // Runs `launch` (returning cudaError_t or Status) on the stream, timed
  // while profiling.
  template <typename Launch>
  Status Timed(const char* name, Launch&& launch) {
    RETURN_IF_ERROR(timer_.Time(name, stream_.get(), launch));
    if (cuda_options_.launch_twice.empty() ||
        std::find(cuda_options_.launch_twice.begin(), cuda_options_.launch_twice.end(), name) ==
            cuda_options_.launch_twice.end()) {
      return Status::Ok();
    }
    ++launches_twice_;
    return timer_.Time(name, stream_.get(), launch);
  }
  // The last launched step's sample flags (empty: none to feed from).
  std::span<const uint8_t> LastSample() const {
    if (last_slot_ < 0) return {};
    return launched_sample_[last_slot_];
  }
  Status Gemm(int shape, const char* name, const void* w, const void* bias, const void* x, void* y,
              int32_t m);

  void* KCache(int64_t layer) const {
    return static_cast<char*>(pool_.get()) + (2 * layer) * layer_cache_bytes_;
  }
  void* VCache(int64_t layer) const {
    return static_cast<char*>(pool_.get()) + (2 * layer + 1) * layer_cache_bytes_;
  }

  const int device_;
  const CudaExecutorOptions cuda_options_;
  const int64_t hidden_, intermediate_, layers_count_;
  const int32_t heads_, kv_heads_, head_dim_;
  const int64_t vocab_;
  const float eps_;
  const bool bf16_;
  const int32_t max_seqs_, max_tokens_, token_rows_, block_size_, max_positions_,
      max_blocks_per_seq_;
  cuda::AttnShape attn_shape_;
  int attention_grid_ = 1;
  int32_t num_blocks_ = 0;
  uint64_t layer_cache_bytes_ = 0;
  int64_t max_items_ = 0, max_partials_ = 0, max_combine_ = 0;
  uint64_t device_bytes_ = 0;

  const void* embed_ = nullptr;
  const void* final_norm_ = nullptr;
  const void* lm_head_ = nullptr;
  std::vector<LayerPointers> layers_;
  // What each layer's attention asks the L2 cache to fetch
  // (CudaExecutorOptions::l2_prefetch_rows).
  std::vector<cuda::L2Prefetch> prefetch_;
  int q_gemm_ = -1, kv_gemm_ = -1, o_gemm_ = -1, gate_up_gemm_ = -1, down_gemm_ = -1,
      lm_head_gemm_ = -1;

  // Declared before everything that work on it may use: destroyed last, so
  // that no buffer is freed while queued work could still touch it.
  cuda::CudaStream stream_;
  std::unique_ptr<GemmSet> gemms_;
  cuda::DeviceBuffer resid_, xn_, q_, kv_, attn_, delta_, gu_, xf_, logits_, sampled_,
      sample_scratch_, inv_freq_, partial_acc_, partial_ml_, meta_dev_, pool_;
  // Keys and values, gate and up activations: each pair in one buffer, the
  // second at a fixed offset, so that a pair of GEMMs can run as one strided
  // batch (pair_kv_, pair_gate_up_: the weights are packed for it).
  void* k_ = nullptr;
  void* v_ = nullptr;
  void* gate_ = nullptr;
  void* up_ = nullptr;
  bool pair_kv_ = false, pair_gate_up_ = false;
  // Two steps may be launched and not collected (Launch, Collect): each has
  // a slot, its own pinned inputs and tokens (the host writes a step's
  // inputs while the one before may still be uploading them) and the event
  // after its tokens' copy.
  PinnedBuffer meta_host_[2], sampled_host_[2];
  cuda::CudaEvent done_[2];
  std::vector<uint8_t> launched_sample_[2];  // each slot's sample flags
  int slot_ = 0;                             // the slot Build and Queue use
  int oldest_ = 0, in_flight_ = 0;           // the slot Collect takes; steps launched
  // The slot of the last step launched, whose draws the next one's
  // feed_previous refers to (its slot is not reused before the next launch);
  // -1: none, or its draws are overwritten (Abandon, StepLogits).
  int last_slot_ = -1;
  MetaLayout meta_;
  cuda::AttnPlan plan_;
  std::map<GraphKey, GraphExec> graphs_;

  // Profiling: eager steps are timed kernel by kernel.
  KernelTimer timer_;
  int64_t launches_twice_ = 0;  // CudaExecutorOptions::launch_twice
  std::vector<KernelTime> kernel_times_;
};

Status CudaLlmExecutor::Init(const ModelConfig& config, const ModelWeights& weights,
                             const ExecutorOptions& options) {
  // ---- The model and the options.
  if (config.dtype != DType::kBF16 && config.dtype != DType::kF16) {
    return Unimplemented("the CUDA llm executor runs F16 and BF16 checkpoints, not " +
                         std::string(DTypeName(config.dtype)));
  }
  if (hidden_ < 8 || hidden_ % 8 != 0 || intermediate_ < 8 || intermediate_ % 8 != 0 ||
      layers_count_ < 1 || vocab_ < 1 || vocab_ > std::numeric_limits<int32_t>::max() ||
      heads_ < 1 || kv_heads_ < 1 || !cuda::AttentionSupported(attn_shape_)) {
    return Unimplemented(
        "the CUDA llm executor needs hidden_size and intermediate_size multiples of 8, head_dim "
        "64 or 128 and num_heads a multiple of num_kv_heads at most 64 times it; the model has "
        "hidden_size " +
        std::to_string(hidden_) + ", intermediate_size " + std::to_string(intermediate_) +
        ", head_dim " + std::to_string(head_dim_) + ", " + std::to_string(heads_) + " heads, " +
        std::to_string(kv_heads_) + " KV heads");
  }
  if (max_seqs_ < 1 || max_tokens_ < 1 || block_size_ < 1 || block_size_ > 4096 ||
      max_positions_ < 1) {
    return InvalidArgument("executor options: max_seqs " + std::to_string(max_seqs_) +
                           ", max_tokens_per_step " + std::to_string(max_tokens_) +
                           ", block_size " + std::to_string(block_size_) + ", max_positions " +
                           std::to_string(max_positions_) +
                           " (each at least 1, block_size at most 4096)");
  }
  if (options.max_positions > config.max_positions) {
    return InvalidArgument("executor options: max_positions " +
                           std::to_string(options.max_positions) + " is past the model's " +
                           std::to_string(config.max_positions));
  }
  if (options.kv_pool_fraction < 0 || options.kv_pool_fraction > 1 ||
      std::isnan(options.kv_pool_fraction)) {
    return InvalidArgument("executor options: kv_pool_fraction " +
                           std::to_string(options.kv_pool_fraction) + " is not in [0, 1]");
  }

  // ---- The weights.
  const DType dt = config.dtype;
  const int64_t q_out = int64_t{heads_} * head_dim_, kv_out = int64_t{kv_heads_} * head_dim_;
  RETURN_IF_ERROR(
      CheckTensor(weights.embed, "model.embed_tokens.weight", -1, dt, {vocab_, hidden_}, device_));
  RETURN_IF_ERROR(CheckTensor(weights.final_norm, "model.norm.weight", -1, dt, {hidden_}, device_));
  RETURN_IF_ERROR(
      CheckTensor(weights.lm_head, "lm_head.weight", -1, dt, {vocab_, hidden_}, device_));
  if (static_cast<int64_t>(weights.layers.size()) != layers_count_) {
    return InvalidArgument("the weights hold " + std::to_string(weights.layers.size()) +
                           " layers, the config " + std::to_string(layers_count_));
  }
  embed_ = weights.embed->data;
  final_norm_ = weights.final_norm->data;
  lm_head_ = weights.lm_head->data;
  for (int64_t l = 0; l < layers_count_; ++l) {
    const LayerWeights& w = weights.layers[static_cast<size_t>(l)];
    RETURN_IF_ERROR(CheckTensor(w.input_norm, "input_layernorm.weight", l, dt, {hidden_}, device_));
    RETURN_IF_ERROR(CheckTensor(w.q, "self_attn.q_proj.weight", l, dt, {q_out, hidden_}, device_));
    RETURN_IF_ERROR(CheckTensor(w.k, "self_attn.k_proj.weight", l, dt, {kv_out, hidden_}, device_));
    RETURN_IF_ERROR(CheckTensor(w.v, "self_attn.v_proj.weight", l, dt, {kv_out, hidden_}, device_));
    RETURN_IF_ERROR(CheckTensor(w.o, "self_attn.o_proj.weight", l, dt, {hidden_, q_out}, device_));
    RETURN_IF_ERROR(
        CheckTensor(w.post_norm, "post_attention_layernorm.weight", l, dt, {hidden_}, device_));
    RETURN_IF_ERROR(
        CheckTensor(w.gate, "mlp.gate_proj.weight", l, dt, {intermediate_, hidden_}, device_));
    RETURN_IF_ERROR(
        CheckTensor(w.up, "mlp.up_proj.weight", l, dt, {intermediate_, hidden_}, device_));
    RETURN_IF_ERROR(
        CheckTensor(w.down, "mlp.down_proj.weight", l, dt, {hidden_, intermediate_}, device_));
    if (config.qkv_bias) {
      RETURN_IF_ERROR(CheckTensor(w.q_bias, "self_attn.q_proj.bias", l, dt, {q_out}, device_));
      RETURN_IF_ERROR(CheckTensor(w.k_bias, "self_attn.k_proj.bias", l, dt, {kv_out}, device_));
      RETURN_IF_ERROR(CheckTensor(w.v_bias, "self_attn.v_proj.bias", l, dt, {kv_out}, device_));
    }
    layers_.push_back({w.input_norm->data, w.q->data, w.k->data, w.v->data,
                       config.qkv_bias ? w.q_bias->data : nullptr,
                       config.qkv_bias ? w.k_bias->data : nullptr,
                       config.qkv_bias ? w.v_bias->data : nullptr, w.o->data, w.post_norm->data,
                       w.gate->data, w.up->data, w.down->data});
    prefetch_.push_back(PrefetchAfterAttention(layers_.back(), cuda_options_.l2_prefetch_bytes,
                                               hidden_ * q_out * 2, hidden_ * 2, intermediate_));
  }
  const std::vector<double> inv_freq = config.InverseFrequencies();
  if (static_cast<int64_t>(inv_freq.size()) != head_dim_ / 2) {
    return Internal("ModelConfig::InverseFrequencies gave " + std::to_string(inv_freq.size()) +
                    " frequencies for head_dim " + std::to_string(head_dim_));
  }

  // ---- Workspaces.
  ASSIGN_OR_RETURN(stream_, cuda::CreateStream());
  cudaStream_t s = stream_.get();
  ASSIGN_OR_RETURN(gemms_, GemmSet::Create(bf16_, s, &device_bytes_));
  const auto rows = static_cast<uint64_t>(token_rows_);
  const auto seqs = static_cast<uint64_t>(max_seqs_);
  const uint64_t e = 2;  // bytes per F16/BF16 element
  const auto h = static_cast<uint64_t>(hidden_), im = static_cast<uint64_t>(intermediate_);
  const auto qo = static_cast<uint64_t>(q_out), kvo = static_cast<uint64_t>(kv_out);
  const auto sample_scratch_bytes =
      static_cast<uint64_t>(cuda::SampleScratchBytes(max_seqs_, vocab_));
  struct Workspace {
    cuda::DeviceBuffer* buffer;
    uint64_t bytes;
    const char* what;
  };
  const Workspace workspaces[] = {
      {&resid_, rows * h * 4, "residual stream"},
      {&xn_, rows * h * e, "normalised activations"},
      {&q_, rows * qo * e, "queries"},
      {&kv_, 2 * rows * kvo * e, "keys and values"},
      {&attn_, rows * qo * e, "attention output"},
      {&delta_, rows * h * e, "layer outputs"},
      {&gu_, 2 * rows * im * e, "gate and up activations"},
      {&xf_, seqs * h * e, "final normalised rows"},
      {&logits_, seqs * static_cast<uint64_t>(vocab_) * 4, "logits"},
      {&sampled_, seqs * 4, "sampled tokens"},
      {&sample_scratch_, sample_scratch_bytes, "sampling scratch"},
      {&inv_freq_, static_cast<uint64_t>(head_dim_ / 2) * 4, "RoPE frequencies"},
  };
  for (const Workspace& w : workspaces) {
    ASSIGN_OR_RETURN(*w.buffer, cuda::AllocateDevice(w.bytes, w.what, &device_bytes_));
  }
  RETURN_IF_ERROR(CudaCheck(cudaMemsetAsync(sample_scratch_.get(), 0, sample_scratch_bytes, s),
                            "clear the sampling scratch"));
  k_ = kv_.get();
  v_ = static_cast<char*>(kv_.get()) + rows * kvo * e;
  gate_ = gu_.get();
  up_ = static_cast<char*>(gu_.get()) + rows * im * e;
  std::vector<float> inv_freq_f32(inv_freq.begin(), inv_freq.end());
  RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(inv_freq_.get(), inv_freq_f32.data(),
                                            inv_freq_f32.size() * 4, cudaMemcpyHostToDevice, s),
                            "copy the RoPE frequencies"));
  RETURN_IF_ERROR(CudaCheck(cuda::PrepareAttention(attn_shape_, &attention_grid_),
                            "preparing the attention kernel"));

  // ---- GEMM algorithms, timed on random activations (never on zeros).
  const cuda::ElemType et = bf16_ ? cuda::ElemType::kBF16 : cuda::ElemType::kF16;
  const std::pair<void*, uint64_t> inputs[] = {
      {xn_.get(), rows * h}, {attn_.get(), rows * qo}, {gate_, rows * im}, {xf_.get(), seqs * h}};
  uint64_t seed = 1;
  for (const auto& [p, n] : inputs) {
    RETURN_IF_ERROR(
        CudaCheck(cuda::LaunchFillRandom(p, static_cast<int64_t>(n), et, 1.0f, seed++, s), "fill"));
  }
  // Held (locked) until every shape has its algorithm.
  std::optional<PlanCache> cache;
  if (!cuda_options_.plan_cache_path.empty() && cuda_options_.time_gemms) {
    Result<PlanCache> opened = PlanCache::Open(cuda_options_.plan_cache_path);
    if (opened.ok()) {
      cache.emplace(std::move(opened).value());
      for (const std::string& note : cache->notes())
        std::fprintf(stderr, "backend llm: %s\n", note.c_str());
    } else {
      std::fprintf(stderr,
                   "backend llm: no GEMM plan cache (%s): this worker times its own GEMM "
                   "algorithms, and a stream resumed on it may draw other tokens\n",
                   opened.status().message().c_str());
    }
  }
  GemmTuning tuning;
  tuning.cache = cache.has_value() ? &*cache : nullptr;
  tuning.time_candidates = cuda_options_.time_gemms;
  tuning.allow_split_k = cuda_options_.allow_split_k;
  tuning.engine = cuda_options_.gemm_engine;
  for (int32_t m : {max_seqs_, 16, 64}) tuning.timed_rows.push_back(m);
  auto add = [&](const char* name, int64_t n, int64_t k, int64_t max_m, bool f32_out,
                 std::vector<const void*> ws, std::vector<const void*> biases, const void* x,
                 void* y) -> Result<int> {
    GemmShapeSpec spec;
    spec.name = name;
    spec.n = n;
    spec.k = k;
    spec.max_m = max_m;
    spec.bias = !biases.empty();
    spec.f32_out = f32_out;
    spec.weights = std::move(ws);
    spec.biases = std::move(biases);
    spec.x_scratch = x;
    spec.y_scratch = y;
    return gemms_->AddShape(spec, tuning);
  };
  std::vector<const void*> wq, wkv, wo, wgu, wd, bq, bkv;
  for (const LayerPointers& l : layers_) {
    wq.push_back(l.q);
    wkv.push_back(l.k);
    wkv.push_back(l.v);
    wo.push_back(l.o);
    wgu.push_back(l.gate);
    wgu.push_back(l.up);
    wd.push_back(l.down);
    if (config.qkv_bias) {
      bq.push_back(l.q_bias);
      bkv.push_back(l.k_bias);
      bkv.push_back(l.v_bias);
    }
  }
  ASSIGN_OR_RETURN(q_gemm_,
                   add("q_proj", q_out, hidden_, token_rows_, false, wq, bq, xn_.get(), q_.get()));
  // A layer's second weight of a pair (v_proj after k_proj, up_proj after
  // gate_proj) at the same distance from its first in every layer, as the
  // arena packs them in name order: the pair runs as one strided batch.
  const auto uniform_stride = [&](auto first, auto second, int64_t min_elements) -> int64_t {
    if (!cuda_options_.pair_gemms || layers_.empty()) return 0;
    const auto distance = [&](const LayerPointers& l) {
      return static_cast<const char*>(l.*second) - static_cast<const char*>(l.*first);
    };
    const std::ptrdiff_t bytes = distance(layers_.front());
    for (const LayerPointers& l : layers_)
      if (distance(l) != bytes) return 0;
    if (bytes % 2 != 0 || bytes / 2 < min_elements) return 0;
    return bytes / 2;
  };
  const int64_t kv_stride = uniform_stride(&LayerPointers::k, &LayerPointers::v, kv_out * hidden_);
  const int64_t kv_bias_stride =
      config.qkv_bias ? uniform_stride(&LayerPointers::k_bias, &LayerPointers::v_bias, kv_out) : 1;
  pair_kv_ = kv_stride > 0 && kv_bias_stride > 0;
  const int64_t gu_stride =
      uniform_stride(&LayerPointers::gate, &LayerPointers::up, intermediate_ * hidden_);
  pair_gate_up_ = gu_stride > 0;
  auto add_pair = [&](const char* name, int64_t n, std::vector<const void*> ws,
                      std::vector<const void*> biases, int64_t w_stride, int64_t b_stride,
                      void* y) -> Result<int> {
    GemmShapeSpec spec;
    spec.name = name;
    spec.n = n;
    spec.k = hidden_;
    spec.max_m = token_rows_;
    spec.bias = !biases.empty();
    spec.weights = std::move(ws);
    spec.biases = std::move(biases);
    spec.x_scratch = xn_.get();
    spec.y_scratch = y;
    spec.batch = 2;
    spec.weight_stride = w_stride;
    spec.bias_stride = spec.bias ? b_stride : 0;
    spec.y_stride = token_rows_ * n;
    return gemms_->AddShape(spec, tuning);
  };
  if (pair_kv_) {
    ASSIGN_OR_RETURN(kv_gemm_,
                     add_pair("k_proj+v_proj", kv_out, wkv, bkv, kv_stride, kv_bias_stride, k_));
  } else {
    ASSIGN_OR_RETURN(kv_gemm_, add("k_proj/v_proj", kv_out, hidden_, token_rows_, false, wkv, bkv,
                                   xn_.get(), k_));
  }
  ASSIGN_OR_RETURN(o_gemm_, add("o_proj", hidden_, q_out, token_rows_, false, wo, {}, attn_.get(),
                                delta_.get()));
  if (pair_gate_up_) {
    ASSIGN_OR_RETURN(gate_up_gemm_,
                     add_pair("gate_proj+up_proj", intermediate_, wgu, {}, gu_stride, 0, gate_));
  } else {
    ASSIGN_OR_RETURN(gate_up_gemm_, add("gate_proj/up_proj", intermediate_, hidden_, token_rows_,
                                        false, wgu, {}, xn_.get(), gate_));
  }
  ASSIGN_OR_RETURN(down_gemm_, add("down_proj", hidden_, intermediate_, token_rows_, false, wd, {},
                                   gate_, delta_.get()));
  ASSIGN_OR_RETURN(lm_head_gemm_, add("lm_head", vocab_, hidden_, max_seqs_, true, {lm_head_}, {},
                                      xf_.get(), logits_.get()));
  if (cache.has_value()) {
    if (Status saved = cache->Save(); !saved.ok())
      std::fprintf(stderr, "backend llm: %s\n", saved.message().c_str());
    std::fprintf(stderr, "backend llm: GEMM algorithms of %d of 6 weight shapes from %s\n",
                 gemms_->cached_shapes(), cache->path().c_str());
    cache.reset();  // the next worker's turn
  }
  // Initialised activations: a graph bucket's padding rows read rows no step
  // wrote (their results are dropped).
  for (const Workspace& w : workspaces) {
    if (w.buffer == &inv_freq_) continue;
    RETURN_IF_ERROR(
        CudaCheck(cudaMemsetAsync(w.buffer->get(), 0, w.bytes, s), "clear the workspaces"));
  }
  RETURN_IF_ERROR(CudaCheck(cudaStreamSynchronize(s), "executor set-up"));

  // ---- The KV pool, and what grows with it: the attention's partials (a
  // decode row at position p has p / kAttnSplitKeys + 1 splits) and work items.
  const uint64_t block_bytes =
      static_cast<uint64_t>(layers_count_) * 2 * kvo * static_cast<uint64_t>(block_size_) * e;
  const double per_block_extra =
      static_cast<double>(block_size_) / cuda::kAttnSplitKeys *
      (static_cast<double>(heads_) * (head_dim_ + 2) * 4 + kv_heads_ * sizeof(cuda::AttnWorkItem));
  uint64_t pool_blocks = 0;
  if (options.kv_pool_bytes > 0) {
    pool_blocks = options.kv_pool_bytes / block_bytes;
  } else if (options.kv_pool_fraction > 0) {
    size_t free = 0, total = 0;
    RETURN_IF_ERROR(CudaCheck(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"));
    const double budget = options.kv_pool_fraction * static_cast<double>(free);
    pool_blocks =
        static_cast<uint64_t>(budget / (static_cast<double>(block_bytes) + per_block_extra));
  } else {
    pool_blocks = kDefaultPoolBytes / block_bytes;
  }
  // Token slots are int32.
  pool_blocks = std::min<uint64_t>(
      pool_blocks, static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) / block_size_);
  if (pool_blocks == 0) {
    return ResourceExhausted("the KV pool holds no block of " + std::to_string(block_bytes) +
                             " bytes (" + std::to_string(block_size_) + " tokens x " +
                             std::to_string(layers_count_) + " layers)");
  }
  num_blocks_ = static_cast<int32_t>(pool_blocks);
  layer_cache_bytes_ = pool_blocks * kvo * static_cast<uint64_t>(block_size_) * e;
  ASSIGN_OR_RETURN(pool_,
                   cuda::AllocateDevice(pool_blocks * block_bytes, "KV pool", &device_bytes_));
  const int64_t pool_splits = CeilDiv(int64_t{num_blocks_} * block_size_, cuda::kAttnSplitKeys);
  max_partials_ = int64_t{heads_} * (max_seqs_ + pool_splits);
  max_items_ = cuda::MaxFoldItems(attn_shape_, token_rows_, max_seqs_) +
               int64_t{kv_heads_} * (max_seqs_ + pool_splits);
  max_combine_ = int64_t{token_rows_} * heads_;
  if (max_items_ > std::numeric_limits<int32_t>::max() ||
      max_partials_ > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument("the KV pool of " + std::to_string(num_blocks_) +
                           " blocks needs more attention work items than int32 counts");
  }
  ASSIGN_OR_RETURN(partial_acc_,
                   cuda::AllocateDevice(static_cast<uint64_t>(max_partials_) * head_dim_ * 4,
                                        "attention partials", &device_bytes_));
  ASSIGN_OR_RETURN(partial_ml_, cuda::AllocateDevice(static_cast<uint64_t>(max_partials_) * 2 * 4,
                                                     "attention partial maxima", &device_bytes_));

  // ---- The step's input buffer, pinned on the host and on the device.
  int64_t at = 0;
  auto place = [&](int64_t bytes) {
    const int64_t offset = at;
    at = AlignUp(at + bytes, kMetaAlignment);
    return offset;
  };
  meta_.step = place(sizeof(cuda::AttnStep));
  meta_.tokens = place(int64_t{token_rows_} * 4);
  meta_.positions = place(int64_t{token_rows_} * 4);
  meta_.slots = place(int64_t{token_rows_} * 4);
  meta_.seqs = place(int64_t{max_seqs_} * static_cast<int64_t>(sizeof(cuda::AttnSeq)));
  meta_.logit_rows = place(int64_t{max_seqs_} * 4);
  meta_.sample = place(int64_t{max_seqs_} * static_cast<int64_t>(sizeof(cuda::SampleRow)));
  meta_.feed = place(int64_t{token_rows_} * 4);
  meta_.dynamic = at;
  meta_.capacity =
      meta_.dynamic + AlignUp(int64_t{max_seqs_} * max_blocks_per_seq_ * 4, kMetaAlignment) +
      AlignUp(max_items_ * static_cast<int64_t>(sizeof(cuda::AttnWorkItem)), kMetaAlignment) +
      AlignUp(max_combine_ * static_cast<int64_t>(sizeof(cuda::AttnCombineRow)), kMetaAlignment);
  ASSIGN_OR_RETURN(meta_dev_, cuda::AllocateDevice(static_cast<uint64_t>(meta_.capacity),
                                                   "step inputs", &device_bytes_));
  for (int i = 0; i < 2; ++i) {
    ASSIGN_OR_RETURN(meta_host_[i],
                     AllocatePinned(static_cast<uint64_t>(meta_.capacity), "step inputs"));
    ASSIGN_OR_RETURN(sampled_host_[i], AllocatePinned(seqs * 4, "sampled tokens"));
    std::memset(meta_host_[i].get(), 0, static_cast<size_t>(meta_.capacity));
    cudaEvent_t event = nullptr;
    RETURN_IF_ERROR(CudaCheck(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                              "cudaEventCreateWithFlags"));
    done_[i].reset(event);
  }
  RETURN_IF_ERROR(
      CudaCheck(cudaMemcpyAsync(meta_dev_.get(), meta_host_[0].get(),
                                static_cast<size_t>(meta_.capacity), cudaMemcpyHostToDevice, s),
                "clear the step inputs"));
  return CudaCheck(cudaStreamSynchronize(s), "executor set-up");
}

Status CudaLlmExecutor::Validate(const StepBatch& batch) const {
  const size_t n = batch.num_seqs();
  if (n < 1 || n > static_cast<size_t>(max_seqs_)) {
    return InvalidArgument("the step holds " + std::to_string(n) +
                           " sequences, the executor 1 to " + std::to_string(max_seqs_));
  }
  if (batch.tokens.size() > static_cast<size_t>(max_tokens_)) {
    return InvalidArgument("the step feeds " + std::to_string(batch.tokens.size()) +
                           " tokens, the executor takes " + std::to_string(max_tokens_) +
                           " at most");
  }
  if (batch.offsets.size() != n + 1 || batch.sample.size() != n || batch.params.size() != n ||
      batch.draw_positions.size() != n || batch.max_blocks < 0 ||
      batch.block_tables.size() != n * static_cast<size_t>(batch.max_blocks)) {
    return InvalidArgument(
        "the step's offsets, sample, params, draw_positions and block_tables do not match its " +
        std::to_string(n) + " sequences");
  }
  if (n > 0 &&
      (batch.offsets[0] != 0 || static_cast<size_t>(batch.offsets[n]) != batch.tokens.size())) {
    return InvalidArgument("the step's offsets do not span its " +
                           std::to_string(batch.tokens.size()) + " tokens");
  }
  for (size_t t = 0; t < batch.tokens.size(); ++t) {
    if (batch.tokens[t] < 0 || batch.tokens[t] >= vocab_) {
      return InvalidArgument("token " + std::to_string(batch.tokens[t]) + " (at " +
                             std::to_string(t) + ") is not in the vocabulary of " +
                             std::to_string(vocab_));
    }
  }
  // The blocks each sequence writes, to refuse two sequences writing one.
  std::vector<std::pair<int32_t, int32_t>> written;  // (block, sequence)
  for (size_t i = 0; i < n; ++i) {
    const std::string seq = "sequence " + std::to_string(i);
    const int64_t q_len = int64_t{batch.offsets[i + 1]} - batch.offsets[i];
    if (q_len < 1) return InvalidArgument(seq + " feeds no token");
    const int64_t start = batch.starts[i];
    if (start < 0 || start + q_len > max_positions_) {
      return InvalidArgument(seq + ": positions " + std::to_string(start) + " .. " +
                             std::to_string(start + q_len - 1) + " are outside 0 .. " +
                             std::to_string(max_positions_ - 1));
    }
    const int64_t blocks = CeilDiv(start + q_len, block_size_);
    if (blocks > batch.max_blocks) {
      return InvalidArgument(seq + " needs " + std::to_string(blocks) +
                             " blocks, its block table has " + std::to_string(batch.max_blocks));
    }
    for (int64_t b = 0; b < blocks; ++b) {
      const int32_t id =
          batch.block_tables[i * static_cast<size_t>(batch.max_blocks) + static_cast<size_t>(b)];
      if (id < 0 || id >= num_blocks_) {
        return InvalidArgument(seq + ": block " + std::to_string(id) + " (entry " +
                               std::to_string(b) + ") is not in the pool of " +
                               std::to_string(num_blocks_));
      }
      if (b >= start / block_size_) written.emplace_back(id, static_cast<int32_t>(i));
    }
    if (batch.sample[i] != 0) {
      const SamplingParams& p = batch.params[i];
      if (!(p.temperature >= 0) || std::isinf(p.temperature) || !(p.top_p > 0 && p.top_p <= 1) ||
          p.top_k < 0) {
        return InvalidArgument(seq + ": sampling temperature " + std::to_string(p.temperature) +
                               ", top_p " + std::to_string(p.top_p) + ", top_k " +
                               std::to_string(p.top_k) +
                               " (temperature >= 0, 0 < top_p <= 1, top_k >= 0)");
      }
    }
  }
  std::sort(written.begin(), written.end());
  for (size_t j = 1; j < written.size(); ++j) {
    if (written[j].first == written[j - 1].first && written[j].second != written[j - 1].second) {
      return InvalidArgument("block " + std::to_string(written[j].first) +
                             " is written by sequences " + std::to_string(written[j - 1].second) +
                             " and " + std::to_string(written[j].second) + " in one step");
    }
  }
  return Status::Ok();
}

int32_t CudaLlmExecutor::Bucket(int32_t seqs) const {
  int32_t bucket = 1;
  while (bucket < seqs) bucket *= 2;
  return std::min(bucket, max_seqs_);
}

Result<StepPlan> CudaLlmExecutor::Build(const StepBatch& batch) {
  StepPlan p;
  p.seqs = static_cast<int32_t>(batch.num_seqs());
  p.tokens = static_cast<int32_t>(batch.tokens.size());
  p.decode = p.tokens == p.seqs;  // every sequence feeds one token (each feeds >= 1)
  p.bucket = cuda_options_.cuda_graphs && !cuda_options_.profile && p.decode ? Bucket(p.seqs) : 0;
  const int32_t rows = p.bucket > 0 ? p.bucket : p.tokens;

  auto* tokens = HostArray<int32_t>(meta_.tokens);
  auto* positions = HostArray<int32_t>(meta_.positions);
  auto* slots = HostArray<int32_t>(meta_.slots);
  auto* seqs = HostArray<cuda::AttnSeq>(meta_.seqs);
  auto* logit_rows = HostArray<int32_t>(meta_.logit_rows);
  auto* sample = HostArray<cuda::SampleRow>(meta_.sample);
  auto* feed = HostArray<int32_t>(meta_.feed);

  int32_t stride = 1;
  for (int32_t i = 0; i < p.seqs; ++i) {
    const int64_t context = int64_t{batch.starts[i]} + batch.offsets[i + 1] - batch.offsets[i];
    stride = std::max(stride, static_cast<int32_t>(CeilDiv(context, block_size_)));
  }
  auto* tables = HostArray<int32_t>(meta_.dynamic);
  const int64_t tables_end = meta_.dynamic + int64_t{p.seqs} * stride * 4;
  // Where a sequence feeds the step before's token: that step's draws hold
  // one token per sampled sequence, in order; drawn_before[j] is sequence
  // j's place among them.
  std::vector<int32_t> drawn_before;
  if (!batch.feed_previous.empty()) {
    const std::span<const uint8_t> before = LastSample();
    drawn_before.resize(before.size());
    int32_t drawn = 0;
    for (size_t j = 0; j < before.size(); ++j) {
      drawn_before[j] = drawn;
      drawn += before[j] != 0 ? 1 : 0;
    }
  }
  for (int32_t i = 0; i < p.seqs; ++i) {
    const int32_t first = batch.offsets[i], q_len = batch.offsets[i + 1] - first;
    const int32_t start = batch.starts[i];
    const int32_t* table = batch.block_tables.data() + static_cast<size_t>(i) * batch.max_blocks;
    const auto blocks = static_cast<int32_t>(CeilDiv(int64_t{start} + q_len, block_size_));
    for (int32_t b = 0; b < stride; ++b)
      tables[int64_t{i} * stride + b] = b < blocks ? table[b] : -1;
    seqs[i] = {first, q_len, start, i * stride};
    for (int32_t j = 0; j < q_len; ++j) {
      const int32_t pos = start + j;
      tokens[first + j] = batch.tokens[static_cast<size_t>(first + j)];
      feed[first + j] = -1;
      positions[first + j] = pos;
      slots[first + j] = table[pos / block_size_] * block_size_ + pos % block_size_;
    }
    if (!batch.feed_previous.empty() && batch.feed_previous[i] >= 0) {
      // Checked (CheckFeedPrevious): one token, drawn by the step before.
      feed[first] = drawn_before[static_cast<size_t>(batch.feed_previous[i])];
    }
    if (batch.sample[i] != 0) {
      const SamplingParams& sp = batch.params[i];
      logit_rows[p.logit_rows] = first + q_len - 1;
      sample[p.logit_rows] = {sp.temperature,         sp.top_p, sp.top_k, 1, sp.seed,
                              batch.draw_positions[i]};
      ++p.logit_rows;
    }
  }
  // A graph bucket's padding: token 0 at position 0, never written to the
  // cache, never sampled.
  for (int32_t t = p.tokens; t < rows; ++t) {
    tokens[t] = 0;
    feed[t] = -1;
    positions[t] = 0;
    slots[t] = -1;
  }
  for (int32_t r = p.logit_rows; r < p.bucket; ++r) {
    logit_rows[r] = 0;
    sample[r] = {0.0f, 1.0f, 0, 0, 0, 0};
  }

  if (!cuda::PlanPagedAttention(attn_shape_, {seqs, static_cast<size_t>(p.seqs)}, max_items_,
                                max_partials_, cuda_options_.attention_fold_splits, &plan_)) {
    return Internal("the step's attention needs more than " + std::to_string(max_items_) +
                    " work items");
  }
  p.items = static_cast<int32_t>(plan_.items.size());
  p.combine = static_cast<int32_t>(plan_.combine.size());
  const int64_t items_at = AlignUp(tables_end, kMetaAlignment);
  const int64_t combine_at =
      AlignUp(items_at + int64_t{p.items} * static_cast<int64_t>(sizeof(cuda::AttnWorkItem)),
              kMetaAlignment);
  p.upload_bytes =
      combine_at + int64_t{p.combine} * static_cast<int64_t>(sizeof(cuda::AttnCombineRow));
  if (p.upload_bytes > meta_.capacity || p.combine > max_combine_) {
    return Internal("the step's inputs need " + std::to_string(p.upload_bytes) +
                    " bytes, the buffer holds " + std::to_string(meta_.capacity));
  }
  std::memcpy(HostArray<char>(items_at), plan_.items.data(),
              plan_.items.size() * sizeof(cuda::AttnWorkItem));
  std::memcpy(HostArray<char>(combine_at), plan_.combine.data(),
              plan_.combine.size() * sizeof(cuda::AttnCombineRow));
  *HostArray<cuda::AttnStep>(meta_.step) = {DeviceArray<const cuda::AttnSeq>(meta_.seqs),
                                            DeviceArray<const int32_t>(meta_.dynamic),
                                            DeviceArray<const cuda::AttnWorkItem>(items_at),
                                            DeviceArray<const cuda::AttnCombineRow>(combine_at),
                                            p.items,
                                            p.combine};
  return p;
}

Status CudaLlmExecutor::Gemm(int shape, const char* name, const void* w, const void* bias,
                             const void* x, void* y, int32_t m) {
  return Timed(name, [&] { return gemms_->Run(shape, w, bias, x, y, m); });
}

Status CudaLlmExecutor::Enqueue(int32_t rows, int32_t logit_rows, int32_t combine_rows,
                                int attention_grid, bool decode) {
  const cudaStream_t s = stream_.get();
  const bool bf = bf16_;
  auto* tokens = DeviceArray<const int32_t>(meta_.tokens);
  auto* step = DeviceArray<const cuda::AttnStep>(meta_.step);
  auto* resid = static_cast<float*>(resid_.get());
  RETURN_IF_ERROR(Timed("embed", [&] {
    return cuda::LaunchEmbed(tokens, rows, embed_, hidden_, bf, resid, s,
                             DeviceArray<const int32_t>(meta_.feed),
                             static_cast<const int32_t*>(sampled_.get()));
  }));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerPointers& w = layers_[l];
    const auto layer = static_cast<int64_t>(l);
    RETURN_IF_ERROR(Timed("rmsnorm", [&] {
      return cuda::LaunchAddRmsNorm(resid, l == 0 ? nullptr : delta_.get(), w.input_norm, nullptr,
                                    rows, hidden_, eps_, bf, xn_.get(), s);
    }));
    const int qkv_shapes[] = {q_gemm_, kv_gemm_, kv_gemm_};
    const size_t qkv_count = pair_kv_ ? 2 : 3;
    if (cuda_options_.group_qkv && gemms_->Groups({qkv_shapes, qkv_count}, rows)) {
      const GemmSet::Call calls[] = {{q_gemm_, w.q, w.q_bias, xn_.get(), q_.get()},
                                     {kv_gemm_, w.k, w.k_bias, xn_.get(), k_},
                                     {kv_gemm_, w.v, w.v_bias, xn_.get(), v_}};
      RETURN_IF_ERROR(Timed("gemm q_proj + k/v", [&] {
        return gemms_->RunGroup({calls, qkv_count}, rows);
      }));
    } else if (pair_kv_) {
      RETURN_IF_ERROR(Gemm(q_gemm_, "gemm q_proj", w.q, w.q_bias, xn_.get(), q_.get(), rows));
      RETURN_IF_ERROR(Gemm(kv_gemm_, "gemm k_proj+v_proj", w.k, w.k_bias, xn_.get(), k_, rows));
    } else {
      RETURN_IF_ERROR(Gemm(q_gemm_, "gemm q_proj", w.q, w.q_bias, xn_.get(), q_.get(), rows));
      RETURN_IF_ERROR(Gemm(kv_gemm_, "gemm k_proj", w.k, w.k_bias, xn_.get(), k_, rows));
      RETURN_IF_ERROR(Gemm(kv_gemm_, "gemm v_proj", w.v, w.v_bias, xn_.get(), v_, rows));
    }
    const bool rope_in_attention =
        decode && cuda_options_.fuse_rope_attention && rows <= kRopeInAttentionSeqs;
    cuda::AttnRope rope;
    if (rope_in_attention) {
      rope.k = k_;
      rope.v = v_;
      rope.positions = DeviceArray<const int32_t>(meta_.positions);
      rope.slots = DeviceArray<const int32_t>(meta_.slots);
      rope.inv_freq = static_cast<const float*>(inv_freq_.get());
    } else {
      RETURN_IF_ERROR(Timed("rope + kv write", [&] {
        cuda::RopeKvArgs a;
        a.q = q_.get();
        a.k = k_;
        a.v = v_;
        a.positions = DeviceArray<const int32_t>(meta_.positions);
        a.slots = DeviceArray<const int32_t>(meta_.slots);
        a.inv_freq = static_cast<const float*>(inv_freq_.get());
        a.k_cache = KCache(layer);
        a.v_cache = VCache(layer);
        a.tokens = rows;
        a.num_heads = heads_;
        a.num_kv_heads = kv_heads_;
        a.head_dim = head_dim_;
        a.block_size = block_size_;
        a.bf16 = bf;
        return cuda::LaunchRopeKvWrite(a, s);
      }));
    }
    const bool prefetch = decode && rows <= cuda_options_.l2_prefetch_rows;
    RETURN_IF_ERROR(Timed(rope_in_attention ? "attention + rope + kv write" : "attention", [&] {
      return cuda::LaunchPagedAttention(attn_shape_, q_.get(), KCache(layer), VCache(layer),
                                        attn_.get(), static_cast<float*>(partial_acc_.get()),
                                        static_cast<float*>(partial_ml_.get()), step,
                                        attention_grid, s, rope_in_attention ? &rope : nullptr,
                                        prefetch ? &prefetch_[l] : nullptr);
    }));
    if (combine_rows > 0) {
      RETURN_IF_ERROR(Timed("attention combine", [&] {
        return cuda::LaunchAttnCombine(attn_shape_, static_cast<const float*>(partial_acc_.get()),
                                       static_cast<const float*>(partial_ml_.get()), step,
                                       combine_rows, attn_.get(), s);
      }));
    }
    RETURN_IF_ERROR(Gemm(o_gemm_, "gemm o_proj", w.o, nullptr, attn_.get(), delta_.get(), rows));
    RETURN_IF_ERROR(Timed("rmsnorm", [&] {
      return cuda::LaunchAddRmsNorm(resid, delta_.get(), w.post_norm, nullptr, rows, hidden_, eps_,
                                    bf, xn_.get(), s);
    }));
    if (pair_gate_up_ && cuda_options_.fuse_swiglu && gemms_->FusesSwiGlu(gate_up_gemm_, rows)) {
      // SwiGLU in the pair's launch, into gate_ as the SwiGLU launch writes it.
      RETURN_IF_ERROR(Timed("gemm gate_proj+up_proj + swiglu", [&] {
        return gemms_->RunSwiGlu(gate_up_gemm_, w.gate, xn_.get(), gate_, rows);
      }));
    } else if (pair_gate_up_) {
      RETURN_IF_ERROR(
          Gemm(gate_up_gemm_, "gemm gate_proj+up_proj", w.gate, nullptr, xn_.get(), gate_, rows));
      RETURN_IF_ERROR(Timed("swiglu", [&] {
        return cuda::LaunchSwiGlu(gate_, up_, gate_, int64_t{rows} * intermediate_, bf, s);
      }));
    } else {
      RETURN_IF_ERROR(
          Gemm(gate_up_gemm_, "gemm gate_proj", w.gate, nullptr, xn_.get(), gate_, rows));
      RETURN_IF_ERROR(Gemm(gate_up_gemm_, "gemm up_proj", w.up, nullptr, xn_.get(), up_, rows));
      RETURN_IF_ERROR(Timed("swiglu", [&] {
        return cuda::LaunchSwiGlu(gate_, up_, gate_, int64_t{rows} * intermediate_, bf, s);
      }));
    }
    RETURN_IF_ERROR(Gemm(down_gemm_, "gemm down_proj", w.down, nullptr, gate_, delta_.get(), rows));
  }
  if (logit_rows == 0) return Status::Ok();
  RETURN_IF_ERROR(Timed("final rmsnorm", [&] {
    return cuda::LaunchAddRmsNorm(resid, delta_.get(), final_norm_,
                                  DeviceArray<const int32_t>(meta_.logit_rows), logit_rows, hidden_,
                                  eps_, bf, xf_.get(), s);
  }));
  RETURN_IF_ERROR(
      Gemm(lm_head_gemm_, "gemm lm_head", lm_head_, nullptr, xf_.get(), logits_.get(), logit_rows));
  return Timed("sampling", [&] {
    return cuda::LaunchSample(static_cast<const float*>(logits_.get()), logit_rows, vocab_,
                              DeviceArray<const cuda::SampleRow>(meta_.sample),
                              sample_scratch_.get(), static_cast<int32_t*>(sampled_.get()), s);
  });
}

Status CudaLlmExecutor::EnqueueDecode(const GraphKey& key) {
  const auto [bucket, combine] = key;
  return Enqueue(bucket, bucket, combine ? bucket * heads_ : 0, attention_grid_, true);
}

Result<cudaGraphExec_t> CudaLlmExecutor::DecodeGraph(const GraphKey& key) {
  const cudaStream_t s = stream_.get();
  // Thread-local capture: other threads' CUDA calls (other executors, the
  // worker) stay legal meanwhile.
  RETURN_IF_ERROR(CudaCheck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
                            "cudaStreamBeginCapture"));
  const Status enqueued = EnqueueDecode(key);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s, &graph);
  CudaGraph owned(graph);
  const std::string what = "capturing the decode graph of " + std::to_string(key.first) +
                           " sequences" + (key.second ? "" : " without the combine");
  RETURN_IF_ERROR(enqueued.WithContext(what));
  RETURN_IF_ERROR(CudaCheck(ended, what));
  cudaGraphExec_t exec = nullptr;
  RETURN_IF_ERROR(CudaCheck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate"));
  graphs_[key].reset(exec);
  return exec;
}

Status CudaLlmExecutor::Queue(const StepPlan& p, std::span<float> logits, bool want_logits) {
  const cudaStream_t s = stream_.get();
  RETURN_IF_ERROR(
      CudaCheck(cudaMemcpyAsync(meta_dev_.get(), meta_host_[slot_].get(),
                                static_cast<size_t>(p.upload_bytes), cudaMemcpyHostToDevice, s),
                "copy the step's inputs to the device"));
  if (p.bucket > 0) {
    const GraphKey key{p.bucket, p.combine > 0};
    const auto captured = graphs_.find(key);
    if (captured != graphs_.end() && captured->second) {
      RETURN_IF_ERROR(CudaCheck(cudaGraphLaunch(captured->second.get(), s), "cudaGraphLaunch"));
    } else {
      // A graph's first step runs eagerly with the graph's shapes (the same
      // kernels, so the same results), which loads every kernel and lets the
      // libraries set themselves up outside a capture; then the capture,
      // which runs nothing, serves the later steps of its kind.
      RETURN_IF_ERROR(EnqueueDecode(key));
      if (captured == graphs_.end()) {
        const Result<cudaGraphExec_t> graph = DecodeGraph(key);
        if (!graph.ok()) {
          if (graph.status().code() == StatusCode::kDeviceLost) return graph.status();
          // This step is done; the later ones of its kind run eagerly too.
          spdlog::warn("llm executor on cuda:{}: {}; steps of {} sequences{} run without a graph",
                       device_, graph.status().ToString(), p.bucket,
                       key.second ? "" : " without the combine");
          graphs_[key];
        }
      }
    }
  } else {
    timer_.Begin(cuda_options_.profile);
    const Status enqueued = Enqueue(p.tokens, p.logit_rows, p.combine,
                                    std::min(attention_grid_, std::max(p.items, 1)), p.decode);
    timer_.End();
    RETURN_IF_ERROR(enqueued);
  }
  if (p.logit_rows > 0) {
    if (want_logits) {
      RETURN_IF_ERROR(CudaCheck(cudaMemcpyAsync(logits.data(), logits_.get(), logits.size() * 4,
                                                cudaMemcpyDeviceToHost, s),
                                "copy the logits to the host"));
    } else {
      RETURN_IF_ERROR(CudaCheck(
          cudaMemcpyAsync(sampled_host_[slot_].get(), sampled_.get(),
                          static_cast<size_t>(p.logit_rows) * 4, cudaMemcpyDeviceToHost, s),
          "copy the sampled tokens to the host"));
    }
  }
  return CudaCheck(cudaEventRecord(done_[slot_].get(), s), "cudaEventRecord");
}

Status CudaLlmExecutor::Abandon(const Status& why) {
  in_flight_ = 0;
  last_slot_ = -1;
  const cudaError_t drained = cudaStreamSynchronize(stream_.get());
  if (cuda::IsSticky(drained)) return CudaCheck(drained, why.message());
  cuda::LogIfError(drained, "finishing a failed llm step");
  return why;
}

Status CudaLlmExecutor::Launch(const StepBatch& batch) {
  if (in_flight_ >= kMaxLaunched)
    return FailedPrecondition(std::to_string(kMaxLaunched) +
                              " steps are launched already, none collected");
  if (Status valid = Validate(batch); !valid.ok()) return Abandon(valid);
  if (Status fed = CheckFeedPrevious(batch, LastSample()); !fed.ok()) return Abandon(fed);
  RETURN_IF_ERROR(MakeContextCurrent(device_));
  // The slot's last step was collected: its upload and copy back are done.
  slot_ = (oldest_ + in_flight_) % 2;
  Result<StepPlan> p = Build(batch);
  if (!p.ok()) return Abandon(p.status());
  if (Status queued = Queue(*p, {}, false); !queued.ok()) return Abandon(queued);
  if (cuda_options_.profile) {
    // Eager, one event pair per kernel: read before another step's launch.
    if (Status done = CudaCheck(cudaStreamSynchronize(stream_.get()), "llm step"); !done.ok())
      return Abandon(done);
    Result<std::vector<KernelTime>> times = timer_.Collect();
    if (!times.ok()) return Abandon(times.status());
    kernel_times_ = std::move(*times);
  }
  launched_sample_[slot_].assign(batch.sample.begin(), batch.sample.end());
  last_slot_ = slot_;
  ++in_flight_;
  return Status::Ok();
}

Status CudaLlmExecutor::Collect(std::span<int32_t> next) {
  if (in_flight_ == 0) return FailedPrecondition("no step is launched");
  const std::vector<uint8_t>& sample = launched_sample_[oldest_];
  if (next.size() != sample.size()) {
    return Abandon(InvalidArgument("Collect: next holds " + std::to_string(next.size()) +
                                   " tokens for the step's " + std::to_string(sample.size()) +
                                   " sequences"));
  }
  RETURN_IF_ERROR(MakeContextCurrent(device_));
  if (Status done = CudaCheck(cudaEventSynchronize(done_[oldest_].get()), "llm step"); !done.ok())
    return Abandon(done);
  const auto* drawn = static_cast<const int32_t*>(sampled_host_[oldest_].get());
  size_t j = 0;
  for (size_t i = 0; i < sample.size(); ++i) next[i] = sample[i] != 0 ? drawn[j++] : -1;
  oldest_ = (oldest_ + 1) % 2;
  --in_flight_;
  return Status::Ok();
}

Status CudaLlmExecutor::StepLogits(const StepBatch& batch, std::span<float> logits) {
  if (in_flight_ > 0) return FailedPrecondition("StepLogits: a launched step is not collected");
  RETURN_IF_ERROR(Validate(batch));
  if (!batch.feed_previous.empty())
    return InvalidArgument("StepLogits feeds no token of another step");
  size_t sampled = 0;
  for (uint8_t s : batch.sample) sampled += s != 0 ? 1 : 0;
  if (logits.size() != sampled * static_cast<size_t>(vocab_)) {
    return InvalidArgument("StepLogits: logits hold " + std::to_string(logits.size()) +
                           " floats for " + std::to_string(sampled) + " sampled sequences of " +
                           std::to_string(vocab_));
  }
  RETURN_IF_ERROR(MakeContextCurrent(device_));
  slot_ = oldest_;
  // Its sampling overwrites the tokens a next step could have fed.
  last_slot_ = -1;
  ASSIGN_OR_RETURN(const StepPlan p, Build(batch));
  if (Status queued = Queue(p, logits, true); !queued.ok()) return Abandon(queued);
  if (Status done = CudaCheck(cudaStreamSynchronize(stream_.get()), "llm step"); !done.ok())
    return Abandon(done);
  if (cuda_options_.profile) {
    ASSIGN_OR_RETURN(kernel_times_, timer_.Collect());
  }
  return Status::Ok();
}

}  // namespace

Status ParseL2Prefetch(std::string_view text, CudaExecutorOptions* options) {
  const auto bad = [&] {
    return InvalidArgument("HEARTH_LLM_L2_PREFETCH=" + std::string(text.substr(0, 64)) +
                           ": want ROWS or ROWS,MIB (sequences up to which the attention "
                           "prefetches, 0 to 4096; MiB fetched, 0 to 1024)");
  };
  const size_t comma = text.find(',');
  const std::string_view rows = text.substr(0, comma);
  int32_t r = 0;
  const auto [rows_end, rows_error] = std::from_chars(rows.data(), rows.data() + rows.size(), r);
  if (rows.empty() || rows_error != std::errc() || rows_end != rows.data() + rows.size() || r < 0 ||
      r > 4096)
    return bad();
  uint64_t bytes = options->l2_prefetch_bytes;
  if (comma != std::string_view::npos) {
    const std::string_view mib = text.substr(comma + 1);
    uint32_t m = 0;
    const auto [mib_end, mib_error] = std::from_chars(mib.data(), mib.data() + mib.size(), m);
    if (mib.empty() || mib_error != std::errc() || mib_end != mib.data() + mib.size() || m > 1024)
      return bad();
    bytes = uint64_t{m} << 20;
  }
  options->l2_prefetch_rows = r;
  options->l2_prefetch_bytes = bytes;
  return Status::Ok();
}

Result<std::unique_ptr<CudaExecutor>> CreateCudaExecutor(const ModelConfig& config,
                                                         const ModelWeights& weights,
                                                         int device_index,
                                                         const ExecutorOptions& options,
                                                         const CudaExecutorOptions& cuda_options) {
  RETURN_IF_ERROR(MakeContextCurrent(device_index));
  auto executor = std::make_unique<CudaLlmExecutor>(config, device_index, options, cuda_options);
  RETURN_IF_ERROR(executor->Init(config, weights, options)
                      .WithContext("llm executor on cuda:" + std::to_string(device_index)));
  return std::unique_ptr<CudaExecutor>(std::move(executor));
}

Result<std::unique_ptr<Executor>> CreateCudaExecutor(const ModelConfig& config,
                                                     const ModelWeights& weights, int device_index,
                                                     const ExecutorOptions& options) {
  CudaExecutorOptions cuda_options;
  cuda_options.plan_cache_path = DefaultPlanCachePath("gemm-plans").value_or("");
  if (const char* v = std::getenv("HEARTH_LLM_L2_PREFETCH"); v != nullptr) {
    RETURN_IF_ERROR(ParseL2Prefetch(v, &cuda_options));
  }
  cuda_options.gemm_engine =
      options.gemms == ExecutorOptions::Gemms::kCublasLt ? GemmEngine::kCublasLt
      : options.gemms == ExecutorOptions::Gemms::kHearth ? GemmEngine::kOwnFirst
                                                         : GemmEngine::kAny;
  ASSIGN_OR_RETURN(std::unique_ptr<CudaExecutor> executor,
                   CreateCudaExecutor(config, weights, device_index, options, cuda_options));
  return std::unique_ptr<Executor>(std::move(executor));
}

}  // namespace hearth::llm
