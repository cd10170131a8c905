// The CPU executor: one forward step of a Llama-family decoder over a batch
// of sequences, float32 throughout; its products split by outputs over threads.
//
// Why float32 and not a bf16 GEMM on BF16 weights (OpenBLAS's sbgemm): it
// takes both operands in bf16, so every activation entering a projection
// would be rounded to 8 bits of mantissa; this executor is the reference the
// CUDA one and torch are compared with, so it keeps activations in float32
// and pays with a widened copy of 16-bit weights instead.
//
// Batch invariance. A row's (token's) logits are bitwise the same whatever
// else is in its step: other sequences, the rest of its own prompt's chunk,
// a prefill or a decode. A stream resumed on
// another worker is prefilled again and then draws, bit for bit, what it
// would have drawn. Every row goes through the same per-row code: RMSNorm,
// RoPE, SwiGLU and the softmax row by row, in one order; a row's attention
// reads its keys and values from the KV cache (written for the whole step
// first) and reduces over them in position order, 0 to its own. The
// projections are InvariantGemm (invariant_gemm.h): a row's bits do not
// depend on the other rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backends/llm/invariant_gemm.h"
#include "backends/llm/llm_model.h"
#include "common/float16.h"

namespace hearth::llm {
namespace {

constexpr uint64_t kDefaultKvPoolBytes = 64ull << 20;

// A tensor as float32: the caller's bytes in place (F32, aligned), or a
// private widened copy.
class F32Tensor {
 public:
  F32Tensor() = default;
  explicit F32Tensor(const TensorView* t) {
    if (t == nullptr) return;
    const size_t n = t->nbytes / DTypeSize(t->dtype);
    if (t->dtype == DType::kF32 && reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0) {
      data_ = static_cast<const float*>(t->data);
      return;
    }
    owned_.resize(n);
    if (t->dtype == DType::kF32) {
      std::memcpy(owned_.data(), t->data, n * sizeof(float));
    } else {
      const auto* src = static_cast<const uint8_t*>(t->data);
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        owned_[i] = t->dtype == DType::kF16 ? HalfToFloat(h) : BFloat16ToFloat(h);
      }
    }
    data_ = owned_.data();
  }
  const float* data() const { return data_; }
  uint64_t owned_bytes() const { return owned_.size() * sizeof(float); }

 private:
  std::vector<float> owned_;
  const float* data_ = nullptr;
};

struct Layer {
  F32Tensor input_norm, q, k, v, q_bias, k_bias, v_bias, o, post_norm, gate, up, down;
};

// transformers' LlamaRMSNorm in float32: x * rsqrt(mean(x^2) + eps), then
// times the weight. The mean is summed in double (one order, any batch).
void RmsNorm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float variance = static_cast<float>(sum / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (x[i] * scale);
}

// Rotate-half RoPE of `heads` heads of one row in place: the pair (i, i +
// half) turns by the angle of frequency i.
void Rope(float* x, int64_t heads, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cos[i] - x2 * sin[i];
      v[i + half] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

// A dot product in one fixed order (eight lanes, then their sum).
float Dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) lane[i % 8] += a[i] * b[i];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

class CpuExecutor final : public Executor {
 public:
  CpuExecutor(const ModelConfig& config, const ModelWeights& weights,
              const ExecutorOptions& options, int32_t max_positions, int32_t num_blocks)
      : c_(config),
        options_(options),
        max_positions_(max_positions),
        num_blocks_(num_blocks),
        embed_(weights.embed),
        final_norm_(weights.final_norm),
        // Tied: one copy serves both.
        lm_head_(weights.lm_head == weights.embed ? F32Tensor() : F32Tensor(weights.lm_head)),
        tied_(weights.lm_head == weights.embed),
        gemm_(options.cpu_threads) {
    for (const LayerWeights& l : weights.layers) {
      layers_.push_back(Layer{F32Tensor(l.input_norm), F32Tensor(l.q), F32Tensor(l.k),
                              F32Tensor(l.v), F32Tensor(l.q_bias), F32Tensor(l.k_bias),
                              F32Tensor(l.v_bias), F32Tensor(l.o), F32Tensor(l.post_norm),
                              F32Tensor(l.gate), F32Tensor(l.up), F32Tensor(l.down)});
    }
    for (double f : config.InverseFrequencies()) inv_freq_.push_back(f);

    const int64_t t = options.max_tokens_per_step, hidden = c_.hidden_size;
    x_.resize(static_cast<size_t>(t * hidden));
    h_.resize(static_cast<size_t>(t * hidden));
    q_.resize(static_cast<size_t>(t * c_.num_heads * c_.head_dim));
    attn_.resize(q_.size());
    k_.resize(static_cast<size_t>(t * c_.num_kv_heads * c_.head_dim));
    v_.resize(k_.size());
    gate_.resize(static_cast<size_t>(t * c_.intermediate_size));
    up_.resize(gate_.size());
    cos_.resize(static_cast<size_t>(t * c_.head_dim / 2));
    sin_.resize(cos_.size());
    positions_.resize(static_cast<size_t>(t));
    scores_.resize(static_cast<size_t>(max_positions));
    last_norm_.resize(static_cast<size_t>(options.max_seqs * hidden));
    logits_.resize(static_cast<size_t>(options.max_seqs * c_.vocab_size));
    kv_ = std::make_unique_for_overwrite<float[]>(static_cast<size_t>(num_blocks) * BlockFloats());
  }

  int32_t block_size() const override { return options_.block_size; }
  int32_t num_blocks() const override { return num_blocks_; }
  uint64_t device_memory_bytes() const override { return 0; }

  Status Step(const StepBatch& batch, std::span<int32_t> next) override {
    if (next.size() != batch.num_seqs()) {
      return InvalidArgument("next holds " + std::to_string(next.size()) + " tokens for " +
                             std::to_string(batch.num_seqs()) + " sequences");
    }
    ASSIGN_OR_RETURN(size_t sampled, Check(batch));
    Forward(batch, std::span<float>(logits_.data(), sampled * static_cast<size_t>(c_.vocab_size)));
    size_t row = 0;
    for (size_t i = 0; i < batch.num_seqs(); ++i) {
      next[i] = -1;
      if (!batch.sample[i]) continue;
      const std::span<const float> logits(logits_.data() + row * c_.vocab_size,
                                          static_cast<size_t>(c_.vocab_size));
      next[i] = SampleToken(logits, batch.params[i], batch.draw_positions[i]);
      ++row;
    }
    return Status::Ok();
  }

  Status StepLogits(const StepBatch& batch, std::span<float> logits) override {
    ASSIGN_OR_RETURN(size_t sampled, Check(batch));
    if (logits.size() != sampled * static_cast<size_t>(c_.vocab_size)) {
      return InvalidArgument("logits holds " + std::to_string(logits.size()) + " floats, " +
                             std::to_string(sampled) + " sampled sequences x vocab " +
                             std::to_string(c_.vocab_size) + " expected");
    }
    Forward(batch, logits);
    return Status::Ok();
  }

 private:
  // y[rows, out] = x[rows, in] * w[out, in]^T (+ y when accumulate).
  void Project(int64_t rows, int64_t out, int64_t in, const float* x, const F32Tensor& w, float* y,
               bool accumulate) {
    gemm_.Run(rows, out, in, x, w.data(), y, accumulate);
  }

  // The same from a bias broadcast over the rows (as torch's addmm).
  void ProjectWithBias(int64_t rows, int64_t out, int64_t in, const float* x, const F32Tensor& w,
                       const F32Tensor& bias, float* y) {
    if (bias.data() == nullptr) return Project(rows, out, in, x, w, y, false);
    for (int64_t r = 0; r < rows; ++r) std::copy_n(bias.data(), out, y + r * out);
    Project(rows, out, in, x, w, y, true);
  }

  // Floats of one block: every layer's keys and values of block_size tokens,
  // laid out [layer][key, value][kv head][slot][head_dim].
  size_t BlockFloats() const {
    return static_cast<size_t>(c_.num_layers * 2 * c_.num_kv_heads * options_.block_size *
                               c_.head_dim);
  }
  float* KvHead(int32_t block, int64_t layer, int kv, int64_t head) {
    const int64_t slots = options_.block_size * c_.head_dim;
    return kv_.get() + static_cast<size_t>(block) * BlockFloats() +
           static_cast<size_t>(((layer * 2 + kv) * c_.num_kv_heads + head) * slots);
  }

  // Everything Step may trust, checked before anything is written: the
  // number of sampled sequences, or InvalidArgument naming what is wrong.
  Result<size_t> Check(const StepBatch& b) const {
    const size_t n = b.num_seqs();
    if (n == 0 || n > static_cast<size_t>(options_.max_seqs)) {
      return InvalidArgument("a step of " + std::to_string(n) + " sequences (1 to " +
                             std::to_string(options_.max_seqs) + ")");
    }
    if (b.offsets.size() != n + 1 || b.sample.size() != n || b.params.size() != n ||
        b.draw_positions.size() != n) {
      return InvalidArgument(
          "a step of " + std::to_string(n) + " sequences needs " + std::to_string(n + 1) +
          " offsets and " + std::to_string(n) + " of sample, params and draw_positions; got " +
          std::to_string(b.offsets.size()) + ", " + std::to_string(b.sample.size()) + ", " +
          std::to_string(b.params.size()) + ", " + std::to_string(b.draw_positions.size()));
    }
    if (b.tokens.empty() || b.tokens.size() > static_cast<size_t>(options_.max_tokens_per_step)) {
      return InvalidArgument("a step of " + std::to_string(b.tokens.size()) + " tokens (1 to " +
                             std::to_string(options_.max_tokens_per_step) + ")");
    }
    if (b.offsets[0] != 0 || static_cast<size_t>(b.offsets[n]) != b.tokens.size()) {
      return InvalidArgument("offsets must run from 0 to the " + std::to_string(b.tokens.size()) +
                             " tokens");
    }
    if (b.max_blocks <= 0 || b.block_tables.size() != n * static_cast<size_t>(b.max_blocks)) {
      return InvalidArgument("block_tables holds " + std::to_string(b.block_tables.size()) +
                             " ids, not " + std::to_string(n) + " sequences x max_blocks " +
                             std::to_string(b.max_blocks));
    }
    for (size_t t = 0; t < b.tokens.size(); ++t) {
      if (b.tokens[t] < 0 || b.tokens[t] >= c_.vocab_size) {
        return InvalidArgument("token " + std::to_string(b.tokens[t]) + " (at " +
                               std::to_string(t) + ") is outside the vocabulary of " +
                               std::to_string(c_.vocab_size));
      }
    }
    const int32_t bs = options_.block_size;
    std::vector<std::pair<int32_t, size_t>> written;  // (block, sequence)
    size_t sampled = 0;
    for (size_t i = 0; i < n; ++i) {
      const std::string seq = "sequence " + std::to_string(i);
      const int32_t len = b.offsets[i + 1] - b.offsets[i];
      if (len <= 0) return InvalidArgument(seq + " feeds no tokens (offsets must increase)");
      if (b.starts[i] < 0 || b.starts[i] > max_positions_ - len) {
        return InvalidArgument(seq + " feeds positions " + std::to_string(b.starts[i]) + " to " +
                               std::to_string(int64_t{b.starts[i]} + len - 1) +
                               ", past the executor's max_positions " +
                               std::to_string(max_positions_));
      }
      const int32_t end = b.starts[i] + len;
      const int32_t needed = (end + bs - 1) / bs;
      if (needed > b.max_blocks) {
        return InvalidArgument(seq + " reaches position " + std::to_string(end - 1) + ", " +
                               std::to_string(needed) + " blocks of " + std::to_string(bs) +
                               ", past max_blocks " + std::to_string(b.max_blocks));
      }
      const int32_t* table = b.block_tables.data() + i * static_cast<size_t>(b.max_blocks);
      for (int32_t j = 0; j < needed; ++j) {
        if (table[j] < 0 || table[j] >= num_blocks_) {
          return InvalidArgument(seq + "'s block " + std::to_string(j) + " is " +
                                 std::to_string(table[j]) + ", not a block of the pool (0 to " +
                                 std::to_string(num_blocks_ - 1) + ")");
        }
      }
      for (int32_t j = b.starts[i] / bs; j < needed; ++j) written.emplace_back(table[j], i);
      if (!b.sample[i]) continue;
      ++sampled;
      const SamplingParams& p = b.params[i];
      if (!(p.temperature >= 0 && std::isfinite(p.temperature)) || !(p.top_p > 0 && p.top_p <= 1) ||
          p.top_k < 0 || b.draw_positions[i] < 0) {
        return InvalidArgument(seq + ": sampling with temperature " +
                               std::to_string(p.temperature) + ", top_p " +
                               std::to_string(p.top_p) + ", top_k " + std::to_string(p.top_k) +
                               ", draw position " + std::to_string(b.draw_positions[i]) +
                               " (temperature >= 0, top_p in (0, 1], top_k >= 0)");
      }
    }
    std::sort(written.begin(), written.end());
    for (size_t j = 1; j < written.size(); ++j) {
      if (written[j].first == written[j - 1].first) {
        return InvalidArgument("block " + std::to_string(written[j].first) +
                               " is written by sequences " + std::to_string(written[j - 1].second) +
                               " and " + std::to_string(written[j].second) + " in one step");
      }
    }
    return sampled;
  }

  void Forward(const StepBatch& b, std::span<float> logits) {
    const int64_t rows = static_cast<int64_t>(b.tokens.size());
    const int64_t hidden = c_.hidden_size, hd = c_.head_dim, half = hd / 2;
    const int64_t nh = c_.num_heads, nkv = c_.num_kv_heads, inter = c_.intermediate_size;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    const float* embed = embed_.data();

    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(embed + static_cast<int64_t>(b.tokens[r]) * hidden, hidden, &x_[r * hidden]);
    }
    // Each row's position and rotation, in double then rounded.
    for (size_t i = 0; i < b.num_seqs(); ++i) {
      for (int32_t r = b.offsets[i]; r < b.offsets[i + 1]; ++r) {
        const int32_t pos = b.starts[i] + (r - b.offsets[i]);
        positions_[r] = pos;
        for (int64_t j = 0; j < half; ++j) {
          const double angle = pos * inv_freq_[j];
          cos_[r * half + j] = static_cast<float>(std::cos(angle));
          sin_[r * half + j] = static_cast<float>(std::sin(angle));
        }
      }
    }

    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& l = layers_[li];
      const auto layer = static_cast<int64_t>(li);
      for (int64_t r = 0; r < rows; ++r) {
        RmsNorm(&x_[r * hidden], l.input_norm.data(), hidden, eps, &h_[r * hidden]);
      }
      ProjectWithBias(rows, nh * hd, hidden, h_.data(), l.q, l.q_bias, q_.data());
      ProjectWithBias(rows, nkv * hd, hidden, h_.data(), l.k, l.k_bias, k_.data());
      ProjectWithBias(rows, nkv * hd, hidden, h_.data(), l.v, l.v_bias, v_.data());
      for (int64_t r = 0; r < rows; ++r) {
        Rope(&q_[r * nh * hd], nh, hd, &cos_[r * half], &sin_[r * half]);
        Rope(&k_[r * nkv * hd], nkv, hd, &cos_[r * half], &sin_[r * half]);
      }
      StoreKv(b, layer);
      Attend(b, layer);
      Project(rows, hidden, nh * hd, attn_.data(), l.o, x_.data(), true);

      for (int64_t r = 0; r < rows; ++r) {
        RmsNorm(&x_[r * hidden], l.post_norm.data(), hidden, eps, &h_[r * hidden]);
      }
      Project(rows, inter, hidden, h_.data(), l.gate, gate_.data(), false);
      Project(rows, inter, hidden, h_.data(), l.up, up_.data(), false);
      for (int64_t j = 0; j < rows * inter; ++j) {
        const float g = gate_[j];
        gate_[j] = g / (1.0f + std::exp(-g)) * up_[j];
      }
      Project(rows, hidden, inter, gate_.data(), l.down, x_.data(), true);
    }

    // The last row of each sampled sequence: final norm, lm_head.
    int64_t n = 0;
    for (size_t i = 0; i < b.num_seqs(); ++i) {
      if (!b.sample[i]) continue;
      RmsNorm(&x_[(b.offsets[i + 1] - 1) * hidden], final_norm_.data(), hidden, eps,
              &last_norm_[n * hidden]);
      ++n;
    }
    if (n == 0) return;
    Project(n, c_.vocab_size, hidden, last_norm_.data(), tied_ ? embed_ : lm_head_, logits.data(),
            false);
  }

  void StoreKv(const StepBatch& b, int64_t layer) {
    const int32_t bs = options_.block_size;
    const int64_t hd = c_.head_dim, nkv = c_.num_kv_heads;
    for (size_t i = 0; i < b.num_seqs(); ++i) {
      const int32_t* table = b.block_tables.data() + i * static_cast<size_t>(b.max_blocks);
      for (int32_t r = b.offsets[i]; r < b.offsets[i + 1]; ++r) {
        const int32_t pos = positions_[r];
        const int32_t block = table[pos / bs];
        const int64_t slot = pos % bs;
        for (int64_t g = 0; g < nkv; ++g) {
          std::copy_n(&k_[(r * nkv + g) * hd], hd, KvHead(block, layer, 0, g) + slot * hd);
          std::copy_n(&v_[(r * nkv + g) * hd], hd, KvHead(block, layer, 1, g) + slot * hd);
        }
      }
    }
  }

  // Causal attention of every row over its sequence's positions 0 to its
  // own, read from the cache in position order; float32 softmax with the
  // max subtracted, its sum in double.
  void Attend(const StepBatch& b, int64_t layer) {
    const int32_t bs = options_.block_size;
    const int64_t hd = c_.head_dim, nh = c_.num_heads, group = c_.num_heads / c_.num_kv_heads;
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
    float* scores = scores_.data();
    for (size_t i = 0; i < b.num_seqs(); ++i) {
      const int32_t* table = b.block_tables.data() + i * static_cast<size_t>(b.max_blocks);
      for (int32_t r = b.offsets[i]; r < b.offsets[i + 1]; ++r) {
        const int32_t keys = positions_[r] + 1;
        for (int64_t h = 0; h < nh; ++h) {
          const int64_t g = h / group;
          const float* q = &q_[(r * nh + h) * hd];
          float max = -INFINITY;
          for (int32_t j = 0; j < keys; ++j) {
            const float* key = KvHead(table[j / bs], layer, 0, g) + (j % bs) * hd;
            scores[j] = Dot(q, key, hd) * scale;
            max = std::max(max, scores[j]);
          }
          double sum = 0;
          for (int32_t j = 0; j < keys; ++j) {
            scores[j] = std::exp(scores[j] - max);
            sum += scores[j];
          }
          const float total = static_cast<float>(sum);
          float* out = &attn_[(r * nh + h) * hd];
          std::fill_n(out, hd, 0.0f);
          for (int32_t j = 0; j < keys; ++j) {
            const float p = scores[j] / total;
            const float* value = KvHead(table[j / bs], layer, 1, g) + (j % bs) * hd;
            for (int64_t d = 0; d < hd; ++d) out[d] += p * value[d];
          }
        }
      }
    }
  }

  const ModelConfig c_;
  const ExecutorOptions options_;
  const int32_t max_positions_;
  const int32_t num_blocks_;
  F32Tensor embed_, final_norm_, lm_head_;
  bool tied_;
  std::vector<Layer> layers_;
  std::vector<double> inv_freq_;
  // Workspaces, [max_tokens_per_step] rows (last_*, logits_: [max_seqs]).
  std::vector<float> x_, h_, q_, k_, v_, attn_, gate_, up_, cos_, sin_, scores_;
  std::vector<int32_t> positions_;
  std::vector<float> last_norm_, logits_;
  std::unique_ptr<float[]> kv_;  // [num_blocks][BlockFloats()]
  InvariantGemm gemm_;
};

Status CheckHost(const TensorView* t) {
  if (t == nullptr || t->device.kind == DeviceKind::kHost) return Status::Ok();
  return InvalidArgument("tensor '" + t->name + "' is on " + t->device.ToString() +
                         ", but the CPU executor runs on host memory");
}

}  // namespace

Result<std::unique_ptr<Executor>> CreateCpuExecutor(const ModelConfig& config,
                                                    const ModelWeights& weights,
                                                    const ExecutorOptions& options) {
  if (weights.embed == nullptr || weights.final_norm == nullptr || weights.lm_head == nullptr ||
      weights.layers.size() != static_cast<size_t>(config.num_layers)) {
    return InvalidArgument("the weights are not bound for this config (BindWeights)");
  }
  for (const TensorView* t : {weights.embed, weights.final_norm, weights.lm_head})
    RETURN_IF_ERROR(CheckHost(t));
  for (const LayerWeights& l : weights.layers) {
    for (const TensorView* t : {l.input_norm, l.q, l.k, l.v, l.q_bias, l.k_bias, l.v_bias, l.o,
                                l.post_norm, l.gate, l.up, l.down}) {
      RETURN_IF_ERROR(CheckHost(t));
    }
  }
  if (options.max_seqs <= 0 || options.max_tokens_per_step <= 0 || options.block_size <= 0 ||
      options.max_positions < 0) {
    return InvalidArgument("executor options: max_seqs " + std::to_string(options.max_seqs) +
                           ", max_tokens_per_step " + std::to_string(options.max_tokens_per_step) +
                           ", block_size " + std::to_string(options.block_size) +
                           ", max_positions " + std::to_string(options.max_positions) +
                           " (each must be > 0; max_positions 0: the config's)");
  }
  const int64_t max_positions =
      options.max_positions == 0 ? config.max_positions : options.max_positions;
  if (max_positions > config.max_positions) {
    return InvalidArgument("executor options: max_positions " + std::to_string(max_positions) +
                           " exceeds the model's " + std::to_string(config.max_positions));
  }
  const uint64_t pool = options.kv_pool_bytes == 0 ? kDefaultKvPoolBytes : options.kv_pool_bytes;
  const uint64_t block_bytes = static_cast<uint64_t>(config.num_layers) * 2 *
                               static_cast<uint64_t>(config.num_kv_heads) *
                               static_cast<uint64_t>(options.block_size) *
                               static_cast<uint64_t>(config.head_dim) * sizeof(float);
  const uint64_t blocks = pool / block_bytes;
  if (blocks == 0) {
    return ResourceExhausted("a KV pool of " + std::to_string(pool) + " bytes holds no block of " +
                             std::to_string(block_bytes) + " bytes (" +
                             std::to_string(options.block_size) + " tokens)");
  }
  return std::unique_ptr<Executor>(new CpuExecutor(
      config, weights, options, static_cast<int32_t>(max_positions),
      static_cast<int32_t>(std::min<uint64_t>(blocks, std::numeric_limits<int32_t>::max()))));
}

}  // namespace hearth::llm
