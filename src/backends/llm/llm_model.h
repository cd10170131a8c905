// backend: llm — the model a generation engine runs: what config.json says
// (ModelConfig), the checkpoint's tensors bound to their roles (ModelWeights),
// and the Executor that runs one forward step over a batch of sequences on a
// paged KV cache and draws each sequence's next token. The engine
// (llm_engine.h) schedules; an Executor computes. There are two: the CPU one
// (cpu_executor.cc, what CI runs) and the CUDA one
// (cuda/llm_executor.cc in libhearth_backends_cuda.so). Both take the same
// StepBatch and must give the same tokens within their dtype's tolerance.
//
// Families: LlamaForCausalLM (Llama 2, 3, 3.1, 3.2 with rope_scaling
// "llama3"), MistralForCausalLM, Qwen2ForCausalLM (biases on q, k, v).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hearth/attach.h"
#include "hearth/device.h"
#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth::llm {

enum class Family { kLlama, kMistral, kQwen2 };

// Llama 3.1's rope_scaling {"rope_type": "llama3", ...}: the inverse
// frequencies are rescaled once (ModelConfig::InverseFrequencies).
struct RopeScaling {
  bool llama3 = false;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 1.0;
  int64_t original_max_position_embeddings = 0;
};

// config.json (and generation_config.json beside it), checked: every field
// that changes the math is either implemented or refused by name.
struct ModelConfig {
  Family family = Family::kLlama;
  std::string architecture;  // as written: "LlamaForCausalLM", ...
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;  // num_heads % num_kv_heads == 0 (GQA)
  int64_t head_dim = 0;      // head_dim, or hidden_size / num_heads
  int64_t vocab_size = 0;
  // max_position_embeddings; MistralForCausalLM with a sliding_window below
  // it: sliding_window (every position then sees all earlier ones, so the
  // window never masks anything), said in `notes`.
  int64_t max_positions = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;       // Qwen2
  DType dtype = DType::kBF16;  // torch_dtype (or dtype): F32, F16 or BF16
  // Token ids from config.json and generation_config.json (union; either
  // may give an int or a list). bos: -1 when none.
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;
  // generation_config.json's sampling defaults (when it sets do_sample;
  // else greedy): a request's parameters override them. Where do_sample is
  // true and a field is unset, transformers' GenerationConfig defaults:
  // temperature 1, top_p 1, top_k 50.
  float default_temperature = 0.0f;
  float default_top_p = 1.0f;
  int32_t default_top_k = 0;
  // Sentences for the engine to log when it loads the model, each naming the
  // file, field and value: what was adjusted (a Mistral sliding_window that
  // caps max_positions) or is not applied (generation_config.json's
  // repetition_penalty, num_beams, ...: defaults of transformers' generate
  // that this engine does not implement; a request cannot ask for them).
  std::vector<std::string> notes;

  // head_dim / 2 inverse frequencies of RoPE (rotate-half form, as
  // transformers' Llama), rope_scaling applied. In double; executors round.
  std::vector<double> InverseFrequencies() const;
};

// Reads DIR/config.json and, when present, DIR/generation_config.json.
// InvalidArgument naming the file and the field (and its value) for anything
// malformed, inconsistent or that would change the math and is not
// implemented (hidden_act other than silu, attention_bias on Llama,
// rope_scaling of another type, Qwen2's use_sliding_window, ...). A Mistral
// sliding_window narrower than max_position_embeddings is not refused: it
// caps max_positions (see there). NotFound for a missing config.json.
Result<ModelConfig> ReadModelConfig(const std::string& version_dir);
// The same from the texts (tests); generation_config may be empty.
Result<ModelConfig> ParseModelConfig(std::string_view config_json,
                                     std::string_view generation_config_json);

// One decoder layer's tensors (transformers' names under
// model.layers.N.): views into the caller's tensors, valid while they are.
// Shapes as in the checkpoint (out_features x in_features).
struct LayerWeights {
  const TensorView* input_norm = nullptr;  // input_layernorm.weight [hidden]
  const TensorView* q = nullptr;           // self_attn.q_proj.weight [heads*head_dim, hidden]
  const TensorView* k = nullptr;           // self_attn.k_proj.weight [kv_heads*head_dim, hidden]
  const TensorView* v = nullptr;           // self_attn.v_proj.weight [kv_heads*head_dim, hidden]
  const TensorView* q_bias = nullptr;      // Qwen2 only
  const TensorView* k_bias = nullptr;
  const TensorView* v_bias = nullptr;
  const TensorView* o = nullptr;          // self_attn.o_proj.weight [hidden, heads*head_dim]
  const TensorView* post_norm = nullptr;  // post_attention_layernorm.weight [hidden]
  const TensorView* gate = nullptr;       // mlp.gate_proj.weight [intermediate, hidden]
  const TensorView* up = nullptr;         // mlp.up_proj.weight [intermediate, hidden]
  const TensorView* down = nullptr;       // mlp.down_proj.weight [hidden, intermediate]
};

struct ModelWeights {
  const TensorView* embed = nullptr;       // model.embed_tokens.weight [vocab, hidden]
  const TensorView* final_norm = nullptr;  // model.norm.weight [hidden]
  const TensorView* lm_head = nullptr;     // lm_head.weight [vocab, hidden]; = embed when tied
  std::vector<LayerWeights> layers;
};

// Every tensor the config needs, with its dtype (config.dtype) and shape;
// NotFound naming a missing tensor, InvalidArgument naming a tensor whose
// dtype or shape differs (expected and found). Tensors the model does not
// use (rotary_emb.inv_freq of old checkpoints) are ignored; an lm_head.weight
// beside tie_word_embeddings: true is refused (which one would be meant?).
Result<ModelWeights> BindWeights(const ModelConfig& config, const std::vector<TensorView>& weights);

// How a sequence's next token is drawn. temperature 0: greedy (the first
// index of the largest logit). Else the Gumbel-max draw below over the kept
// tokens: top_k > 0 keeps the tokens whose logit is at least the k-th
// largest; top_p < 1 then keeps the most probable tokens (softmax of
// logits / temperature over those kept) whose probabilities sum to at least
// top_p: every token whose probability is at least the largest threshold t
// for which the sum of probabilities >= t is >= top_p.
// Arithmetic, which executors share so that they draw the same tokens: the
// scaled logit is the float32 quotient logit / temperature, Gumbel(u) is
// computed in float32 and added to it in float32; ties go to the first index.
struct SamplingParams {
  float temperature = 0.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;
  uint64_t seed = 0;
};

// The draw is keyed by (seed, position, token), not by a generator's state,
// so that a stream resumed elsewhere draws what it would have drawn:
// token = argmax over kept tokens of logit / temperature + Gumbel(u), with
// u = GumbelUniform(seed, position, token) in (0, 1) and Gumbel(u) =
// -log(-log(u)). `position` is the index of the token being drawn among the
// stream's generated tokens (0 for the first).
#if defined(__CUDACC__)
#define HEARTH_LLM_HD __host__ __device__
#else
#define HEARTH_LLM_HD
#endif
HEARTH_LLM_HD inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
HEARTH_LLM_HD inline float GumbelUniform(uint64_t seed, int64_t position, int32_t token) {
  const uint64_t h = SplitMix64(
      seed ^ SplitMix64((static_cast<uint64_t>(position) << 32) ^ static_cast<uint32_t>(token)));
  // 24 random bits, centred in their interval: never 0, never 1.
  return (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}
#undef HEARTH_LLM_HD

// The draw above on the host, over one row of `logits` (vocab floats), for
// the token number `position` of its stream: what the CPU executor's Step
// does, and the reference other executors' draws are tested against.
// Parameters are taken as valid (temperature >= 0, top_p in (0, 1], top_k
// >= 0; Step refuses others). NaN logits are never kept by top_k or top_p,
// and never drawn; greedy takes a NaN as larger than any number, as
// torch.argmax does. Where nothing can be kept, greedy.
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, int64_t position);

// One forward step over a batch of sequences. Sequence i feeds
// tokens[offsets[i] .. offsets[i+1]) at positions starts[i] ... (its
// earlier positions are already in its KV blocks); the executor writes the
// keys and values of every token fed into the sequence's blocks
// (block_tables row i: the block ids of positions 0, block_size, 2 *
// block_size, ... up to the last position fed) and, where sample[i], draws
// the next token after the last one fed, with params[i], as token number
// draw_positions[i] of that stream.
//
// feed_previous (empty, or one per sequence): where feed_previous[i] = j >=
// 0, sequence i feeds one token, the one drawn for sequence j of the step
// launched just before this one (Executor::Launch), which need not have been
// collected yet; its entry in `tokens` is then a placeholder. A step's other
// inputs are all known on the host, so the engine can queue a stream's next
// step while the device still computes the token it feeds.
struct StepBatch {
  std::span<const int32_t> tokens;
  std::span<const int32_t> offsets;       // num_seqs + 1, offsets[0] = 0
  std::span<const int32_t> starts;        // num_seqs
  std::span<const int32_t> block_tables;  // num_seqs x max_blocks, -1 where unused
  int32_t max_blocks = 0;
  std::span<const uint8_t> sample;          // num_seqs
  std::span<const SamplingParams> params;   // num_seqs
  std::span<const int64_t> draw_positions;  // num_seqs
  std::span<const int32_t> feed_previous;   // empty or num_seqs: -1, or a sequence of the last step
  size_t num_seqs() const { return starts.size(); }
};

// Checks feed_previous against the step launched before (its sample flags;
// empty: none): each entry -1 or a sampled sequence of it, and a sequence
// fed that way feeds one token. InvalidArgument naming the entry.
Status CheckFeedPrevious(const StepBatch& batch, std::span<const uint8_t> previous_sample);

struct ExecutorOptions {
  // Sequences and tokens one Step may hold (the engine never gives more).
  int32_t max_seqs = 1;
  int32_t max_tokens_per_step = 512;
  // The KV pool: tokens per block, and its size in bytes (kv_pool_bytes > 0)
  // or as a fraction of the device's free memory after the weights and
  // workspaces (CUDA; the CPU executor takes kv_pool_bytes, default 64 MiB).
  int32_t block_size = 16;
  uint64_t kv_pool_bytes = 0;
  double kv_pool_fraction = 0.0;
  // The longest sequence (prompt + generated), for block tables and workspaces.
  int32_t max_positions = 0;
  // What a GPU executor's GEMMs run on: each weight shape on the faster of
  // cuBLASLt and hearth's kernel over the batch sizes it serves (kTimed), or
  // every shape on one of them. The CPU executor has one kind.
  enum class Gemms { kTimed, kCublasLt, kHearth };
  Gemms gemms = Gemms::kTimed;
  // The CPU executor's threads per product (InvariantGemm: the same bits at
  // any count); 0: the machine's cores, at most 8.
  int32_t cpu_threads = 0;
};

// Thread-safety: one thread uses an Executor.
class Executor {
 public:
  virtual ~Executor() = default;
  virtual int32_t block_size() const = 0;
  virtual int32_t num_blocks() const = 0;  // in the pool
  virtual uint64_t device_memory_bytes() const = 0;
  // Runs the step; next[i] = the token drawn for sequence i where
  // batch.sample[i], else -1. An error is the whole step's (DeviceLost: the
  // CUDA context is gone). No step may be launched and not collected.
  virtual Status Step(const StepBatch& batch, std::span<int32_t> next) = 0;

  // Steps in a pipeline: Launch queues a step and returns, Collect waits for
  // the oldest step launched and not collected and gives its tokens as Step
  // does (next holds its num_seqs). At most kMaxLaunched steps are launched
  // and not collected; a step may feed the tokens of the one launched before
  // it (StepBatch::feed_previous). The batch's arrays must stay unchanged
  // until its Collect returns. After an error from either, no step is
  // launched any more (the device has finished what was queued).
  //
  // Here: Launch keeps the batch and Collect runs it through Step, so a
  // step's tokens take no longer than with Step (the CPU executor, test
  // executors). A device executor overrides both to queue the step on the
  // device and return at once.
  static constexpr int kMaxLaunched = 2;
  virtual Status Launch(const StepBatch& batch);
  virtual Status Collect(std::span<int32_t> next);
  // The same step, but for each sequence with sample[i] it writes the
  // float32 logits of its last token fed, in the order of those sequences
  // ([sampled x vocab]) instead of drawing (tests compare executors with
  // this).
  virtual Status StepLogits(const StepBatch& batch, std::span<float> logits) = 0;

 private:
  // After an error: no step is launched any more; returns `why`.
  Status DropLaunched(Status why);
  // What the default Launch and Collect keep: the steps launched, the
  // sample flags of the last one launched, the tokens of the last one run.
  std::vector<StepBatch> launched_;
  std::vector<uint8_t> last_sample_;
  std::vector<int32_t> last_drawn_, fed_;
};

// The CPU executor: float32 math (products over options.cpu_threads) over
// the checkpoint's F32, F16 or BF16 weights, a float32 KV pool in host
// memory. F32 weights are used in place; F16 and BF16 ones are widened
// once, here, into a private float32 copy (twice the checkpoint's bytes,
// per executor). The weights must be in host memory and outlive the
// executor. options.kv_pool_bytes 0: 64 MiB; max_positions 0:
// config.max_positions. device_memory_bytes() is 0.
// Batch-invariant, bit for bit: a token's logits do not depend on the other
// sequences of its step, on how its sequence's tokens were split into steps
// (one prefill, chunks, or one token a step); so a stream prefilled again
// with the tokens it had drawn draws what it would have drawn
// (invariant_gemm.h).
Result<std::unique_ptr<Executor>> CreateCpuExecutor(const ModelConfig& config,
                                                    const ModelWeights& weights,
                                                    const ExecutorOptions& options);

}  // namespace hearth::llm
