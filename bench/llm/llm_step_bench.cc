// One decode step of the CUDA llm executor on a Llama 3.2 1B shape (hidden
// 2048, 16 layers, 32 heads, 8 KV heads of 64, intermediate 8192, vocabulary
// 128256, tied embeddings, bf16), random weights in device memory.
//
//   llm_step_bench [--seqs 1,16,64,256] [--context 512] [--iterations 50]
//                  [--profile-seqs 64] [--temperature 0] [--l2-prefetch 0,default,16:9]
//                  [--twice "gemm down_proj;attention + rope + kv write"]
//
// Every sequence is prefilled with --context tokens (steps of up to 2048
// tokens, timed: the prefill rate), then each batch size runs decode steps
// (CUDA graphs) of one token per sequence, greedy unless --temperature. It
// prints, per batch size, the median of CUDA-event times around Step (the
// inputs' upload, the graph, the tokens' download and the host's planning
// between them) against two floors at 4.0e12 B/s: the weights read once
// (the step's bytes at batch 1) and the weights plus every sequence's KV
// cache; and, per batch size, the wall time a step of --iterations steps
// run back to back, one at a time and overlapped (each launched before the
// one before it is collected, as the engine runs them). Then one step at
// --profile-seqs sequences kernel by kernel (an
// eager step with events around each launch), each against the bytes it
// must move. An event pair times a kernel alone, started after the one
// before it ended; in the graphs, with dependent launches, kernels overlap.
// --twice times the steps again with each named kernel launched twice: the
// difference is what the kernel costs in the graph. --target-warps sets
// the most warps hearth's kernel has at up to 16 rows (and so each shape's
// parts, at every row count), --spread-below the tiles below which it
// spreads a shape's parts over more CTAs at more rows.
//
// Lines:
//   decode seqs=64 context=512 ms=1.234 weight_floor_ms=0.618 of_weight_floor=0.50 ...
//     first_step_wall_ms=9.1 second_step_wall_ms=1.3 (the first step of a batch size
//     runs eagerly and captures its graph; host wall time)
//   decode-loop gemm=own fuse=on fold=1 seqs=64 steps=50 one_at_a_time_ms=1.3 overlapped_ms=1.2
//   kernel seqs=64 name="gemm gate_proj" launches=16 ms=0.321 floor_ms=0.134 of_floor=0.42
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/dependent_launch.h"
#include "backends/cuda/llm_executor.h"
#include "backends/cuda/llm_kernels.h"
#include "backends/cuda/tc_gemm.h"
#include "backends/llm/llm_model.h"
#include "hearth/arena.h"

namespace hearth::llm {
namespace {

constexpr double kBandwidth = 4.0e12;  // B/s: the H200's HBM3e, the floor's yardstick

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "llm_step_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Fail(std::string(what) + ": " + cudaGetErrorString(e));
}

void Check(const Status& s) {
  if (!s.ok()) Fail(s.ToString());
}

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoll(item));
  return v;
}

ModelConfig Llama1B();

// The 1B shape, or the 8B Llama-3 one (hidden 4096, 32 layers, 32 heads, 8
// KV heads, intermediate 14336, untied lm_head).
ModelConfig LlamaShape(const std::string& shape) {
  ModelConfig c = Llama1B();
  if (shape == "8b") {
    c.hidden_size = 4096;
    c.intermediate_size = 14336;
    c.num_layers = 32;
    c.head_dim = 128;
    c.tie_word_embeddings = false;
  }
  return c;
}

ModelConfig Llama1B() {
  ModelConfig c;
  c.family = Family::kLlama;
  c.architecture = "LlamaForCausalLM";
  c.hidden_size = 2048;
  c.intermediate_size = 8192;
  c.num_layers = 16;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 64;
  c.vocab_size = 128256;
  c.max_positions = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling = {true, 32.0, 1.0, 4.0, 8192};
  c.tie_word_embeddings = true;
  c.dtype = DType::kBF16;
  return c;
}

// Random device tensors under transformers' names.
class DeviceModel {
 public:
  explicit DeviceModel(const ModelConfig& c) {
    const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim,
                  im = c.intermediate_size;
    Add("model.embed_tokens.weight", {c.vocab_size, h}, 0.5f);
    Add("model.norm.weight", {h}, 1.0f);
    if (!c.tie_word_embeddings) Add("lm_head.weight", {c.vocab_size, h}, 0.03f);
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Add(p + "input_layernorm.weight", {h}, 1.0f);
      Add(p + "self_attn.q_proj.weight", {q, h}, 0.03f);
      Add(p + "self_attn.k_proj.weight", {kv, h}, 0.03f);
      Add(p + "self_attn.v_proj.weight", {kv, h}, 0.03f);
      Add(p + "self_attn.o_proj.weight", {h, q}, 0.03f);
      Add(p + "post_attention_layernorm.weight", {h}, 1.0f);
      Add(p + "mlp.gate_proj.weight", {im, h}, 0.03f);
      Add(p + "mlp.up_proj.weight", {im, h}, 0.03f);
      Add(p + "mlp.down_proj.weight", {h, im}, 0.015f);
    }
    // One allocation, the tensors packed in name order at 256 bytes, as the
    // store's arena holds a checkpoint.
    std::sort(views_.begin(), views_.end(),
              [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
    uint64_t total = 0;
    std::vector<uint64_t> offsets;
    for (const TensorView& t : views_) {
      offsets.push_back(total);
      total += (t.nbytes + 255) / 256 * 256;
    }
    Check(cudaMalloc(&base_, total), "cudaMalloc");
    for (size_t i = 0; i < views_.size(); ++i) {
      views_[i].data = static_cast<char*>(base_) + offsets[i];
      Check(cuda::LaunchFillRandom(const_cast<void*>(views_[i].data),
                                   static_cast<int64_t>(views_[i].nbytes / 2),
                                   cuda::ElemType::kBF16, scales_[views_[i].name], i + 1, nullptr),
            "fill");
    }
    Check(cudaDeviceSynchronize(), "filling the weights");
  }
  ~DeviceModel() { cudaFree(base_); }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;
  const std::vector<TensorView>& views() const { return views_; }

 private:
  void Add(std::string name, std::vector<int64_t> shape, float scale) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    scales_[name] = scale;
    views_.push_back(TensorView{std::move(name), DType::kBF16, std::move(shape), nullptr, 0,
                                static_cast<uint64_t>(n) * 2, Device::Cuda(0)});
  }
  std::vector<TensorView> views_;
  std::map<std::string, float> scales_;
  void* base_ = nullptr;
};

// The sequences' state: tokens fed so far and their blocks.
struct Sequences {
  int32_t block_size = 16;
  int32_t blocks_per_seq = 0;
  std::vector<int32_t> length;
  std::vector<int32_t> last_token;

  std::vector<int32_t> Table(int i) const {
    std::vector<int32_t> t(static_cast<size_t>(blocks_per_seq));
    for (int b = 0; b < blocks_per_seq; ++b) t[static_cast<size_t>(b)] = i * blocks_per_seq + b;
    return t;
  }
};

// A step's arrays.
struct Step {
  std::vector<int32_t> tokens, offsets{0}, starts, tables;
  std::vector<uint8_t> sample;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draws;
  int32_t max_blocks = 0;

  void Add(const std::vector<int32_t>& t, int32_t start, const std::vector<int32_t>& table,
           bool draw, const SamplingParams& p) {
    max_blocks = static_cast<int32_t>(table.size());
    tokens.insert(tokens.end(), t.begin(), t.end());
    offsets.push_back(static_cast<int32_t>(tokens.size()));
    starts.push_back(start);
    tables.insert(tables.end(), table.begin(), table.end());
    sample.push_back(draw);
    params.push_back(p);
    draws.push_back(start);
  }
  StepBatch View() const {
    StepBatch b;
    b.tokens = tokens;
    b.offsets = offsets;
    b.starts = starts;
    b.block_tables = tables;
    b.max_blocks = max_blocks;
    b.sample = sample;
    b.params = params;
    b.draw_positions = draws;
    return b;
  }
};

constexpr int32_t kPrefillTokens = 2048;

// `seqs` sequences of room for `positions` tokens each, and the executor
// options that hold exactly them.
std::pair<Sequences, ExecutorOptions> Room(int seqs, int positions, int context,
                                           double kv_bytes_per_token) {
  Sequences s;
  s.blocks_per_seq = positions / s.block_size + 1;
  s.length.assign(static_cast<size_t>(seqs), 0);
  s.last_token.assign(static_cast<size_t>(seqs), 0);
  ExecutorOptions o;
  o.max_seqs = seqs;
  o.max_tokens_per_step = std::max(kPrefillTokens, context);
  o.block_size = s.block_size;
  o.kv_pool_bytes = static_cast<uint64_t>(seqs) * static_cast<uint64_t>(s.blocks_per_seq) *
                    static_cast<uint64_t>(s.block_size) * static_cast<uint64_t>(kv_bytes_per_token);
  return {std::move(s), o};
}

// Prefills sequences [0, n) with `context` tokens each; returns the seconds.
double Prefill(Executor& e, Sequences& s, int n, int context, std::mt19937& rng, int64_t vocab) {
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  const auto start = std::chrono::steady_clock::now();
  int i = 0;
  while (i < n) {
    Step step;
    int32_t fed = 0;
    while (i < n && (fed == 0 || fed + context <= kPrefillTokens)) {
      std::vector<int32_t> t(static_cast<size_t>(context));
      for (int32_t& x : t) x = token(rng);
      step.Add(t, 0, s.Table(i), false, {});
      s.length[static_cast<size_t>(i)] = context;
      s.last_token[static_cast<size_t>(i)] = t.back();
      fed += context;
      ++i;
    }
    std::vector<int32_t> next(step.starts.size());
    Check(e.Step(step.View(), next));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One decode step of sequences [0, n): feeds each its last token.
void Decode(Executor& e, Sequences& s, int n, const SamplingParams& p) {
  Step step;
  for (int i = 0; i < n; ++i) {
    step.Add({s.last_token[static_cast<size_t>(i)]}, s.length[static_cast<size_t>(i)], s.Table(i),
             true, p);
  }
  std::vector<int32_t> next(static_cast<size_t>(n));
  Check(e.Step(step.View(), next));
  for (int i = 0; i < n; ++i) {
    ++s.length[static_cast<size_t>(i)];
    s.last_token[static_cast<size_t>(i)] = next[static_cast<size_t>(i)];
  }
}

// `steps` decode steps of sequences [0, n) back to back, as the engine runs
// them: one at a time (each collected before the next is built), or
// overlapped (each launched before the one before it is collected, feeding
// its tokens from the device). Returns the wall seconds.
double DecodeLoop(Executor& e, Sequences& s, int n, const SamplingParams& p, int steps,
                  bool overlapped) {
  const auto start = std::chrono::steady_clock::now();
  if (!overlapped) {
    for (int k = 0; k < steps; ++k) Decode(e, s, n, p);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::vector<int32_t> feed(static_cast<size_t>(n)), next(static_cast<size_t>(n));
  std::iota(feed.begin(), feed.end(), 0);
  Step batches[2];
  const auto build = [&](Step& step, bool fed) {
    step = Step();
    for (int i = 0; i < n; ++i) {
      const auto at = static_cast<size_t>(i);
      step.Add({fed ? 0 : s.last_token[at]}, s.length[at], s.Table(i), true, p);
    }
  };
  for (int k = 0; k < steps; ++k) {
    Step& step = batches[k % 2];
    build(step, k > 0);
    StepBatch view = step.View();
    if (k > 0) view.feed_previous = feed;
    Check(e.Launch(view));
    if (k > 0) {
      Check(e.Collect(next));
      for (int i = 0; i < n; ++i)
        s.last_token[static_cast<size_t>(i)] = next[static_cast<size_t>(i)];
    }
    for (int i = 0; i < n; ++i) ++s.length[static_cast<size_t>(i)];
  }
  Check(e.Collect(next));
  for (int i = 0; i < n; ++i) s.last_token[static_cast<size_t>(i)] = next[static_cast<size_t>(i)];
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Bytes each kernel kind must move in one decode step of `seqs` sequences
// at `context` keys (every launch of the step together).
double FloorBytes(const std::string& name, const ModelConfig& c, double seqs, double context) {
  const double h = static_cast<double>(c.hidden_size),
               im = static_cast<double>(c.intermediate_size),
               layers = static_cast<double>(c.num_layers), v = static_cast<double>(c.vocab_size),
               q = static_cast<double>(c.num_heads * c.head_dim),
               kv = static_cast<double>(c.num_kv_heads * c.head_dim);
  auto gemm = [&](double n, double k) { return layers * (n * k * 2 + seqs * (n + k) * 2); };
  if (name == "embed") return seqs * h * 6;
  if (name == "rmsnorm") return 2 * layers * (seqs * h * 12 + h * 2);
  if (name == "gemm q_proj") return gemm(q, h);
  if (name == "gemm k_proj" || name == "gemm v_proj") return gemm(kv, h);
  if (name == "gemm k_proj+v_proj") return 2 * gemm(kv, h) - layers * seqs * h * 2;
  if (name == "rope + kv write") return layers * seqs * (2 * q + 3 * kv) * 2;
  if (name == "attention") return layers * seqs * (context * kv * 2 * 2 + 2 * q * 2);
  if (name == "attention + rope + kv write")
    return FloorBytes("attention", c, seqs, context) + layers * seqs * 3 * kv * 2;
  if (name == "attention combine") return layers * seqs * q * (context / 256.0 * 4 + 2);
  if (name == "gemm o_proj") return gemm(h, q);
  if (name == "gemm gate_proj" || name == "gemm up_proj") return gemm(im, h);
  if (name == "gemm gate_proj+up_proj") return 2 * gemm(im, h) - layers * seqs * h * 2;
  if (name == "gemm q_proj + k/v") return gemm(q, h) + 2 * gemm(kv, h) - 2 * layers * seqs * h * 2;
  if (name == "gemm gate_proj+up_proj + swiglu")
    return 2 * gemm(im, h) - layers * seqs * (h + im) * 2;
  if (name == "swiglu") return layers * seqs * im * 6;
  if (name == "gemm down_proj") return gemm(h, im);
  if (name == "final rmsnorm") return seqs * h * 8 + h * 2;
  if (name == "gemm lm_head") return v * h * 2 + seqs * (h * 2 + v * 4);
  if (name == "sampling") return seqs * v * 4;
  return 0;
}

int Main(int argc, char** argv) {
  std::string seqs_text = "1,16,64,256";
  int context = 512, iterations = 50, profile_seqs = 64;
  float temperature = 0.0f;
  std::string shape = "1b";
  CLI::App app{"llm_step_bench: one decode step of the CUDA llm executor on a Llama shape"};
  app.add_option("--shape", shape, "1b (Llama 3.2 1B) or 8b (Llama 3 8B), random bf16 weights")
      ->check(CLI::IsMember({"1b", "8b"}));
  app.add_option("--seqs", seqs_text, "batch sizes");
  app.add_option("--context", context, "tokens prefilled per sequence")->check(CLI::PositiveNumber);
  app.add_option("--iterations", iterations, "timed steps per batch size")
      ->check(CLI::PositiveNumber);
  app.add_option("--profile-seqs", profile_seqs, "batch size of the per-kernel step (0: none)");
  app.add_option("--temperature", temperature, "0: greedy; else top_p 0.9 sampling");
  std::string pairing = "both";
  app.add_option("--pairing", pairing,
                 "k/v and gate/up GEMMs as strided pairs: on, off, or both (each timed in turn)")
      ->check(CLI::IsMember({"on", "off", "both"}));
  std::string gemm = "any";
  app.add_option("--gemm", gemm,
                 "GEMM engine: any (the faster per shape, timed), cublaslt, own (hearth's "
                 "kernel), or compare (cublaslt, own and any, each timed in turn)")
      ->check(CLI::IsMember({"any", "cublaslt", "own", "compare"}));
  std::string dependent = "on";
  app.add_option("--dependent", dependent,
                 "kernels as programmatic dependent launches (each may start before the one "
                 "before it ends): on, off, or both (each timed in turn)")
      ->check(CLI::IsMember({"on", "off", "both"}));
  std::string fuse = "on";
  app.add_option("--fuse", fuse,
                 "where hearth's kernel runs them at up to 16 rows, SwiGLU in the gate/up launch "
                 "and q_proj with k/v in one launch, and in decode steps RoPE with the KV write "
                 "in the attention: on, off, both (each timed in turn), swiglu, qkv or rope "
                 "(that one alone)")
      ->check(CLI::IsMember({"on", "off", "both", "swiglu", "qkv", "rope"}));
  std::string fold_text = "1";
  app.add_option("--fold-splits", fold_text,
                 "attention: a sequence of at most this many splits of 128 keys has them run by "
                 "one work item (no combine launch); a list times each in turn");
  std::string prefetch_text = "default";
  app.add_option("--l2-prefetch", prefetch_text,
                 "decode steps of up to ROWS sequences have the attention ask L2 for the "
                 "weights of o_proj and gate/up, MIB MiB at most (24 unless given): a list of "
                 "ROWS[:MIB], 0 (off) or default (the executor's), each timed in turn");
  std::string twice_text;
  app.add_option("--twice", twice_text,
                 "kernel names (those of the kernel lines), separated by ';': each in turn has its "
                 "launches run twice, after the step as it is, so that the difference is what the "
                 "kernel costs among the others in the graph (the step's values are then wrong)");
  int64_t target_warps = 0;
  app.add_option("--target-warps", target_warps,
                 "hearth's kernel at up to 16 rows: the most warps a launch's parts may give it, "
                 "which sets each shape's parts (0: the kernel's own, 2112)")
      ->check(CLI::NonNegativeNumber);
  int64_t spread_below = 0;
  app.add_option("--spread-below", spread_below,
                 "hearth's kernel at more than 16 rows: the tiles below which a launch spreads a "
                 "shape's parts over more CTAs (0: the kernel's own, 99)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  cuda::SetTcGemmTargetWarps(target_warps);
  cuda::SetTcGemmSpreadBelowTiles(spread_below);
  // The --twice variants: none (the step as it is), then each name.
  std::vector<std::string> twice_list{""};
  {
    std::stringstream in(twice_text);
    for (std::string name; std::getline(in, name, ';');) {
      if (name.empty()) Fail("--twice: an empty name in '" + twice_text + "'");
      twice_list.push_back(name);
    }
  }
  const bool show_twice = twice_list.size() > 1;
  struct Prefetch {
    std::string name;
    int32_t rows;
    uint64_t bytes;
  };
  std::vector<Prefetch> prefetch_list;
  {
    const CudaExecutorOptions defaults;
    std::stringstream in(prefetch_text);
    for (std::string item; std::getline(in, item, ',');) {
      if (item == "default") {
        prefetch_list.push_back({"default(" + std::to_string(defaults.l2_prefetch_rows) + ":" +
                                     std::to_string(defaults.l2_prefetch_bytes >> 20) + ")",
                                 defaults.l2_prefetch_rows, defaults.l2_prefetch_bytes});
        continue;
      }
      std::vector<std::string> fields;
      std::stringstream parts(item);
      for (std::string f; std::getline(parts, f, ':');) fields.push_back(f);
      try {
        if (fields.empty() || fields.size() > 2) throw std::invalid_argument(item);
        size_t used = 0;
        const int rows = std::stoi(fields[0], &used);
        if (used != fields[0].size()) throw std::invalid_argument(item);
        int mib = 24;
        if (fields.size() > 1) {
          mib = std::stoi(fields[1], &used);
          if (used != fields[1].size()) throw std::invalid_argument(item);
        }
        if (rows < 0 || mib < 0 || mib > 1024) throw std::out_of_range(item);
        prefetch_list.push_back(
            {rows == 0 ? "off" : std::to_string(rows) + ":" + std::to_string(mib), rows,
             uint64_t(mib) << 20});
      } catch (const std::exception&) {
        Fail("--l2-prefetch: " + item + " is not ROWS[:MIB] (MIB at most 1024), 0 or default");
      }
    }
    if (prefetch_list.empty()) Fail("--l2-prefetch needs at least one entry");
  }
  struct FuseMode {
    const char* name;
    bool swiglu, qkv, rope;
  };
  std::vector<FuseMode> fuse_modes;
  if (fuse == "on" || fuse == "both") fuse_modes.push_back({"on", true, true, true});
  if (fuse == "off" || fuse == "both") fuse_modes.push_back({"off", false, false, false});
  if (fuse == "swiglu") fuse_modes.push_back({"swiglu", true, false, false});
  if (fuse == "qkv") fuse_modes.push_back({"qkv", false, true, false});
  if (fuse == "rope") fuse_modes.push_back({"rope", false, false, true});
  std::vector<int64_t> fold_list;
  for (const int64_t f : ParseList(fold_text)) {
    if (f < 1) Fail("--fold-splits: " + std::to_string(f) + " is not a positive number");
    fold_list.push_back(f);
  }
  std::vector<bool> dependent_modes;
  if (dependent != "off") dependent_modes.push_back(true);
  if (dependent != "on") dependent_modes.push_back(false);
  std::vector<std::pair<std::string, GemmEngine>> engines;
  if (gemm == "cublaslt" || gemm == "compare")
    engines.emplace_back("cublaslt", GemmEngine::kCublasLt);
  if (gemm == "own" || gemm == "compare") engines.emplace_back("own", GemmEngine::kOwn);
  if (gemm == "any" || gemm == "compare") engines.emplace_back("any", GemmEngine::kAny);
  const std::vector<int64_t> seqs_list = ParseList(seqs_text);
  if (seqs_list.empty() || *std::min_element(seqs_list.begin(), seqs_list.end()) < 1) {
    Fail("--seqs needs positive batch sizes");
  }
  std::string why;
  if (!CudaAvailable(&why)) Fail("no CUDA device: " + why);
  Check(cudaSetDevice(0), "cudaSetDevice");

  const ModelConfig config = LlamaShape(shape);
  const DeviceModel model(config);
  auto bound = BindWeights(config, model.views());
  if (!bound.ok()) Fail(bound.status().ToString());
  const ModelWeights& weights = *bound;
  double weight_bytes = 0;
  for (const TensorView& t : model.views()) {
    // The lm_head (the embedding table where tied) is read whole, the norms
    // too; an untied embedding table only in the rows the step gathers.
    if (!config.tie_word_embeddings && t.name == "model.embed_tokens.weight") continue;
    weight_bytes += static_cast<double>(t.nbytes);
  }
  const double kv_bytes_per_token = static_cast<double>(config.num_layers) * 2 *
                                    static_cast<double>(config.num_kv_heads * config.head_dim) * 2;
  const SamplingParams params{temperature, temperature > 0 ? 0.9f : 1.0f, 0, 1};
  const int warmup = 3;
  const int max_seqs = static_cast<int>(*std::max_element(seqs_list.begin(), seqs_list.end()));
  std::mt19937 rng(7);

  std::vector<bool> pair_modes;
  if (pairing != "off") pair_modes.push_back(true);
  if (pairing != "on") pair_modes.push_back(false);
  for (const bool dependent_on : dependent_modes)
    for (const auto& [engine_name, engine] : engines)
      for (const bool pair : pair_modes)
        for (const FuseMode& fused : fuse_modes)
          for (const int64_t fold : fold_list)
            for (const Prefetch& prefetch : prefetch_list)
              for (const std::string& twice : twice_list) {
                cuda::SetDependentLaunch(dependent_on);
                const std::string twice_field = show_twice ? " twice=\"" + twice + "\"" : "";
                // Sequence 0 takes every batch size's steps.
                auto [s, o] =
                    Room(max_seqs,
                         context + (warmup + 3 * iterations) * static_cast<int>(seqs_list.size()),
                         context, kv_bytes_per_token);
                const auto created = std::chrono::steady_clock::now();
                CudaExecutorOptions options;
                options.pair_gemms = pair;
                options.gemm_engine = engine;
                options.fuse_swiglu = fused.swiglu;
                options.group_qkv = fused.qkv;
                options.fuse_rope_attention = fused.rope;
                options.attention_fold_splits = static_cast<int32_t>(fold);
                options.l2_prefetch_rows = prefetch.rows;
                options.l2_prefetch_bytes = prefetch.bytes;
                if (!twice.empty()) options.launch_twice = {twice};
                auto executor = CreateCudaExecutor(config, weights, 0, o, options);
                if (!executor.ok()) Fail(executor.status().ToString());
                CudaExecutor& e = **executor;
                std::printf(
                    "pairing=%s gemm=%s dependent=%s fuse=%s fold=%d prefetch=%s: executor created "
                    "in %.2f s, device memory %.2f GiB (KV pool %d blocks of %d)\n",
                    pair ? "on" : "off", engine_name.c_str(), dependent_on ? "on" : "off",
                    fused.name, static_cast<int>(fold), prefetch.name.c_str(),
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - created)
                        .count(),
                    static_cast<double>(e.device_memory_bytes()) / (1 << 30), e.num_blocks(),
                    e.block_size());
                std::printf("%s", e.DescribeGemms().c_str());
                const char* mode = pair ? "on" : "off";
                const double prefill_s = Prefill(e, s, max_seqs, context, rng, config.vocab_size);
                std::printf(
                    "prefill gemm=%s dependent=%s seqs=%d context=%d s=%.3f tokens_per_s=%.0f\n",
                    engine_name.c_str(), dependent_on ? "on" : "off", max_seqs, context, prefill_s,
                    max_seqs * static_cast<double>(context) / prefill_s);
                cudaEvent_t start = nullptr, stop = nullptr;
                Check(cudaEventCreate(&start), "cudaEventCreate");
                Check(cudaEventCreate(&stop), "cudaEventCreate");
                for (int64_t n : seqs_list) {
                  const int seqs = static_cast<int>(n);
                  // The first step of a batch size runs eagerly and captures its graph;
                  // the second replays it (host wall time, each synchronous).
                  double wall_ms[2] = {0.0, 0.0};
                  for (int i = 0; i < warmup; ++i) {
                    const auto began = std::chrono::steady_clock::now();
                    Decode(e, s, seqs, params);
                    if (i < 2)
                      wall_ms[i] = std::chrono::duration<double, std::milli>(
                                       std::chrono::steady_clock::now() - began)
                                       .count();
                  }
                  std::vector<double> ms;
                  for (int i = 0; i < iterations; ++i) {
                    Check(cudaEventRecord(start, e.stream()), "cudaEventRecord");
                    Decode(e, s, seqs, params);
                    Check(cudaEventRecord(stop, e.stream()), "cudaEventRecord");
                    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
                    float elapsed = 0;
                    Check(cudaEventElapsedTime(&elapsed, start, stop), "cudaEventElapsedTime");
                    ms.push_back(elapsed);
                  }
                  std::sort(ms.begin(), ms.end());
                  const double median = ms[ms.size() / 2];
                  double keys = 0;
                  for (int i = 0; i < seqs; ++i) keys += s.length[static_cast<size_t>(i)];
                  const double weight_floor = weight_bytes / kBandwidth * 1e3;
                  const double full_floor =
                      (weight_bytes + keys * kv_bytes_per_token) / kBandwidth * 1e3;
                  std::printf(
                      "decode pairing=%s gemm=%s dependent=%s fuse=%s fold=%d prefetch=%s%s "
                      "seqs=%d "
                      "context=%d ms=%.4f weight_floor_ms=%.4f of_weight_floor=%.2f "
                      "weight_kv_floor_ms=%.4f of_weight_kv_floor=%.2f tokens_per_s=%.0f "
                      "first_step_wall_ms=%.2f second_step_wall_ms=%.2f\n",
                      mode, engine_name.c_str(), dependent_on ? "on" : "off", fused.name,
                      static_cast<int>(fold), prefetch.name.c_str(), twice_field.c_str(), seqs,
                      context, median, weight_floor, weight_floor / median, full_floor,
                      full_floor / median, seqs / (median * 1e-3), wall_ms[0], wall_ms[1]);
                  // The steps back to back, as the engine's loop runs them.
                  const double apart = DecodeLoop(e, s, seqs, params, iterations, false);
                  const double overlapped = DecodeLoop(e, s, seqs, params, iterations, true);
                  std::printf(
                      "decode-loop gemm=%s fuse=%s fold=%d prefetch=%s%s seqs=%d steps=%d "
                      "one_at_a_time_ms=%.4f overlapped_ms=%.4f\n",
                      engine_name.c_str(), fused.name, static_cast<int>(fold),
                      prefetch.name.c_str(), twice_field.c_str(), seqs, iterations,
                      apart * 1e3 / iterations, overlapped * 1e3 / iterations);
                  std::fflush(stdout);
                }
                std::printf("decode graphs captured: %d\n", e.captured_graphs());
                if (!twice.empty() && e.launches_twice() == 0) {
                  Fail("--twice: no launch is named '" + twice +
                       "'; the names are those of the kernel lines (--profile-seqs)");
                }
                cudaEventDestroy(start);
                cudaEventDestroy(stop);
              }

  if (profile_seqs > 0) {
    // A second executor, every step eager with events around each kernel.
    auto [s, o] = Room(profile_seqs, context + warmup, context, kv_bytes_per_token);
    CudaExecutorOptions co;
    co.profile = true;
    co.gemm_engine = engines.back().second;
    co.fuse_swiglu = fuse_modes.front().swiglu;
    co.group_qkv = fuse_modes.front().qkv;
    co.fuse_rope_attention = fuse_modes.front().rope;
    co.attention_fold_splits = static_cast<int32_t>(fold_list.front());
    co.l2_prefetch_rows = prefetch_list.back().rows;
    co.l2_prefetch_bytes = prefetch_list.back().bytes;
    auto executor = CreateCudaExecutor(config, weights, 0, o, co);
    if (!executor.ok()) Fail(executor.status().ToString());
    CudaExecutor& e = **executor;
    std::printf("profile gemm=%s:\n%s", engines.back().first.c_str(), e.DescribeGemms().c_str());
    Prefill(e, s, profile_seqs, context, rng, config.vocab_size);
    for (int i = 0; i < warmup; ++i) Decode(e, s, profile_seqs, params);
    double total = 0, total_floor = 0;
    for (const KernelTime& k : e.LastStepKernelTimes()) {
      const double floor =
          FloorBytes(k.name, config, profile_seqs, context + warmup) / kBandwidth * 1e3;
      total += k.ms;
      total_floor += floor;
      std::printf("kernel seqs=%d name=\"%s\" launches=%d ms=%.4f floor_ms=%.4f of_floor=%.2f\n",
                  profile_seqs, k.name.c_str(), k.launches, k.ms, floor,
                  k.ms > 0 ? floor / k.ms : 0.0);
    }
    std::printf("kernel seqs=%d name=\"all\" ms=%.4f floor_ms=%.4f of_floor=%.2f\n", profile_seqs,
                total, total_floor, total > 0 ? total_floor / total : 0.0);
  }
  return 0;
}

}  // namespace
}  // namespace hearth::llm

int main(int argc, char** argv) { return hearth::llm::Main(argc, argv); }
