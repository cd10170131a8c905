// The CPU executor against itself composed differently (chunked, batched,
// resumed, on other thread counts: the same bits; other block tables, other
// dtypes), its checks, and the draw of SampleToken. The comparison with
// torch is test_llm_reference.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <ostream>
#include <string>
#include <vector>

#include "backends/llm/llm_model.h"
#include "llm_test_model.h"

namespace hearth::llm {
namespace {

using testing::HostModel;
using testing::MakeModel;
using testing::TinyConfig;

// A model, bound, with its executor.
struct Loaded {
  ModelConfig config;
  HostModel model;
  ModelWeights weights;
  std::unique_ptr<Executor> executor;
};

std::unique_ptr<Loaded> Load(const ModelConfig& c, uint64_t seed = 7, int32_t block_size = 4,
                             int32_t max_seqs = 4, int32_t cpu_threads = 0) {
  auto l = std::make_unique<Loaded>();
  l->config = c;
  l->model = MakeModel(c, seed);
  auto w = BindWeights(c, l->model.Views());
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  if (!w.ok()) return nullptr;
  l->weights = *w;
  ExecutorOptions o;
  o.max_seqs = max_seqs;
  o.max_tokens_per_step = 64;
  o.block_size = block_size;
  o.kv_pool_bytes = 1 << 20;
  o.cpu_threads = cpu_threads;
  auto e = CreateCpuExecutor(c, l->weights, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  if (!e.ok()) return nullptr;
  l->executor = std::move(e).value();
  return l;
}

// One sequence's part of a step.
struct Feed {
  Feed(std::vector<int32_t> t, int32_t s, std::vector<int32_t> b, bool draw = true,
       SamplingParams p = {}, int64_t position = 0)
      : tokens(std::move(t)),
        start(s),
        blocks(std::move(b)),
        sample(draw),
        params(p),
        draw_position(position) {}
  std::vector<int32_t> tokens;
  int32_t start;
  std::vector<int32_t> blocks;
  bool sample;
  SamplingParams params;
  int64_t draw_position;
};

// The arrays a StepBatch points into.
struct Batch {
  std::vector<int32_t> tokens, offsets{0}, starts, tables;
  std::vector<uint8_t> sample;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draws;
  int32_t max_blocks = 0;
  size_t sampled = 0;

  explicit Batch(const std::vector<Feed>& feeds) {
    for (const Feed& f : feeds) max_blocks = std::max(max_blocks, int32_t(f.blocks.size()));
    for (const Feed& f : feeds) {
      tokens.insert(tokens.end(), f.tokens.begin(), f.tokens.end());
      offsets.push_back(static_cast<int32_t>(tokens.size()));
      starts.push_back(f.start);
      std::vector<int32_t> row = f.blocks;
      row.resize(static_cast<size_t>(max_blocks), -1);
      tables.insert(tables.end(), row.begin(), row.end());
      sample.push_back(f.sample);
      params.push_back(f.params);
      draws.push_back(f.draw_position);
      sampled += f.sample;
    }
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

// The logits of the sampled sequences of one step, [sampled][vocab].
std::vector<std::vector<float>> StepLogits(Executor& e, const std::vector<Feed>& feeds,
                                           int64_t vocab) {
  const Batch b(feeds);
  std::vector<float> flat(b.sampled * static_cast<size_t>(vocab));
  const Status s = e.StepLogits(b.View(), flat);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<std::vector<float>> rows;
  for (size_t i = 0; i < b.sampled; ++i) {
    rows.emplace_back(flat.begin() + static_cast<ptrdiff_t>(i * vocab),
                      flat.begin() + static_cast<ptrdiff_t>((i + 1) * vocab));
  }
  return rows;
}

std::vector<int32_t> Tokens(int n, int salt, int vocab = 64) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (i * 17 + salt * 29 + 3) % vocab;
  return t;
}

std::vector<int32_t> Blocks(int first, int n) {
  std::vector<int32_t> b(static_cast<size_t>(n));
  std::iota(b.begin(), b.end(), first);
  return b;
}

std::vector<int32_t> Slice(const std::vector<int32_t>& v, int begin, int end) {
  return {v.begin() + begin, v.begin() + end};
}

// Bit for bit, with the first difference named.
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want,
                    const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << ": logit " << i << " is " << got[i] << ", not " << want[i] << " (differs by "
        << got[i] - want[i] << ")";
  }
}

// ---- batch invariance: a row's logits are bitwise the same whatever else
// its step holds, however its sequence was chunked, prefilled or decoded.

// The models these tests run on: the tiny Llama and Qwen2 (projections of
// 32 to 64 outputs, fewer than a register tile's rows and outputs at its
// edges), and a wider Llama (its lm_head 2000 x 136 per row, its down_proj
// summing 600: not a multiple of the 8 lanes).
enum class Shape { kTinyLlama, kTinyQwen2, kWideLlama };

const char* NameOf(Shape s) {
  return s == Shape::kTinyLlama ? "TinyLlama" : s == Shape::kTinyQwen2 ? "TinyQwen2" : "WideLlama";
}
void PrintTo(Shape s, std::ostream* os) { *os << NameOf(s); }

ModelConfig ConfigOf(Shape s) {
  if (s == Shape::kTinyQwen2) return TinyConfig(Family::kQwen2);
  ModelConfig c = TinyConfig(Family::kLlama);
  if (s == Shape::kWideLlama) {
    c.hidden_size = 136;
    c.intermediate_size = 600;
    c.head_dim = 34;
    c.vocab_size = 2000;
  }
  return c;
}

// A stream fed step by step: its prompt in chunks of `chunk`, then, one a
// step, the token it drew last. `drawn` may start with tokens drawn before
// it was interrupted (the end of its prompt); its next draw is then number
// drawn.size() of the stream.
struct Stream {
  Stream(std::vector<int32_t> p, int32_t c, std::vector<int32_t> b, SamplingParams sp,
         std::vector<int32_t> before = {})
      : prompt(std::move(p)),
        chunk(c),
        blocks(std::move(b)),
        params(sp),
        drawn(std::move(before)) {}
  std::vector<int32_t> prompt;
  int32_t chunk;
  std::vector<int32_t> blocks;
  SamplingParams params;
  std::vector<int32_t> drawn;
  int32_t fed = 0;
  std::map<int64_t, std::vector<float>> logits;  // by draw number, when stepped with logits

  Feed Next() const {
    const auto length = static_cast<int32_t>(prompt.size());
    if (fed < length) {
      const int32_t end = std::min(length, fed + chunk);
      return Feed(Slice(prompt, fed, end), fed, blocks, end == length, params,
                  static_cast<int64_t>(drawn.size()));
    }
    return Feed({drawn.back()}, fed, blocks, true, params, static_cast<int64_t>(drawn.size()));
  }
};

// One step of `streams`: by StepLogits, each sampled stream drawing with
// SampleToken from its logits (kept), or by Step.
void StepStreams(Executor& e, const std::vector<Stream*>& streams, int64_t vocab,
                 bool with_logits) {
  std::vector<Feed> feeds;
  for (const Stream* s : streams) feeds.push_back(s->Next());
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> next(streams.size(), -1);
  if (with_logits) {
    logits = StepLogits(e, feeds, vocab);
  } else {
    const Batch b(feeds);
    const Status status = e.Step(b.View(), next);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }
  size_t row = 0;
  for (size_t i = 0; i < streams.size(); ++i) {
    Stream& s = *streams[i];
    s.fed += static_cast<int32_t>(feeds[i].tokens.size());
    if (!feeds[i].sample) continue;
    const auto number = static_cast<int64_t>(s.drawn.size());
    if (with_logits) {
      ASSERT_LT(row, logits.size());
      s.drawn.push_back(SampleToken(logits[row], s.params, number));
      s.logits[number] = std::move(logits[row++]);
    } else {
      ASSERT_GE(next[i], 0);
      s.drawn.push_back(next[i]);
    }
  }
}

class CpuExecutorInvarianceTest : public ::testing::TestWithParam<Shape> {
 protected:
  ModelConfig Config() const { return ConfigOf(GetParam()); }
};

TEST_P(CpuExecutorInvarianceTest, ChunkedPrefillMatchesWhole) {
  // The logits after each chunk are those of a prefill of the prompt up to
  // there, in one step of a fresh executor. 50 tokens in one step take
  // the projections of 32 to 64 outputs past 1200 / out rows; chunks of
  // 1 to 17 stay below.
  const ModelConfig c = Config();
  const int n = 50;
  const std::vector<int32_t> prompt = Tokens(n, 1);
  std::map<int, std::vector<float>> whole;
  for (int end = 1; end <= n; ++end) {
    auto e = Load(c);
    whole[end] =
        StepLogits(*e->executor, {{Slice(prompt, 0, end), 0, Blocks(0, 13)}}, c.vocab_size)[0];
  }
  std::vector<int> one_by_one(n);
  std::iota(one_by_one.begin(), one_by_one.end(), 1);
  for (const std::vector<int>& cuts : std::vector<std::vector<int>>{
           {5, 10, 13, 30, 50}, one_by_one, {4, 8, 12, 40, 44, 50}, {3, 50}, {17, 34, 49, 50}}) {
    auto chunked = Load(c);
    int begin = 0;
    for (int end : cuts) {
      const auto last = StepLogits(
          *chunked->executor, {{Slice(prompt, begin, end), begin, Blocks(0, 13)}}, c.vocab_size);
      ExpectSameBits(last[0], whole[end],
                     "chunk " + std::to_string(begin) + " to " + std::to_string(end));
      begin = end;
    }
  }
}

TEST_P(CpuExecutorInvarianceTest, BatchMatchesEachAlone) {
  const ModelConfig c = Config();
  const std::vector<int32_t> a = Tokens(9, 1), b = Tokens(1, 2), d = Tokens(40, 3);
  // Step 1: three prefills together (50 rows); step 2: a decodes one, b
  // feeds a chunk of three, d is left out; step 3: d decodes, a feeds two.
  auto batched = Load(c);
  auto s1 =
      StepLogits(*batched->executor,
                 {{a, 0, Blocks(0, 4)}, {b, 0, Blocks(4, 2)}, {d, 0, Blocks(8, 11)}}, c.vocab_size);
  auto s2 = StepLogits(*batched->executor, {{{5}, 9, Blocks(0, 4)}, {{7, 8, 9}, 1, Blocks(4, 2)}},
                       c.vocab_size);
  auto s3 = StepLogits(*batched->executor, {{{11}, 40, Blocks(8, 11)}, {{1, 2}, 10, Blocks(0, 4)}},
                       c.vocab_size);

  auto alone_a = Load(c), alone_b = Load(c), alone_d = Load(c);
  auto a1 = StepLogits(*alone_a->executor, {{a, 0, Blocks(0, 4)}}, c.vocab_size);
  auto a2 = StepLogits(*alone_a->executor, {{{5}, 9, Blocks(0, 4)}}, c.vocab_size);
  auto a3 = StepLogits(*alone_a->executor, {{{1, 2}, 10, Blocks(0, 4)}}, c.vocab_size);
  auto b1 = StepLogits(*alone_b->executor, {{b, 0, Blocks(0, 2)}}, c.vocab_size);
  auto b2 = StepLogits(*alone_b->executor, {{{7, 8, 9}, 1, Blocks(0, 2)}}, c.vocab_size);
  auto d1 = StepLogits(*alone_d->executor, {{d, 0, Blocks(0, 11)}}, c.vocab_size);
  auto d3 = StepLogits(*alone_d->executor, {{{11}, 40, Blocks(0, 11)}}, c.vocab_size);

  ExpectSameBits(s1[0], a1[0], "a, step 1");
  ExpectSameBits(s1[1], b1[0], "b, step 1");
  ExpectSameBits(s1[2], d1[0], "d, step 1");
  ExpectSameBits(s2[0], a2[0], "a, step 2");
  ExpectSameBits(s2[1], b2[0], "b, step 2");
  ExpectSameBits(s3[0], d3[0], "d, step 3");
  ExpectSameBits(s3[1], a3[0], "a, step 3");
}

// The run that ResumedStreamDrawsWhatItWouldHaveDrawn interrupts and
// ThreadCountChangesNoBit repeats: stream a (a prompt of 6, then `draws`
// tokens) beside b (a prompt of 45 in chunks of 20, then decoding) and c
// (3, then decoding, sampled).
struct Uninterrupted {
  Stream a, b, c;
};
Uninterrupted RunUninterrupted(Executor& e, int64_t vocab, const SamplingParams& params,
                               int draws) {
  Uninterrupted u{{Tokens(6, 1), 6, Blocks(0, 8), params},
                  {Tokens(45, 2), 20, Blocks(8, 20), {}},
                  {Tokens(3, 3), 3, Blocks(28, 8), {0.7f, 1.0f, 0, 5}}};
  while (static_cast<int>(u.a.drawn.size()) < draws) {
    StepStreams(e, {&u.a, &u.b, &u.c}, vocab, true);
    if (::testing::Test::HasFatalFailure()) break;
  }
  return u;
}

TEST_P(CpuExecutorInvarianceTest, ResumedStreamDrawsWhatItWouldHaveDrawn) {
  // A stream interrupted after j draws is prefilled again (its prompt and
  // the j tokens, in one chunk or in chunks of 5, beside another stream),
  // and draws the rest: the logits of every later draw are those of the
  // uninterrupted run, bit for bit, and so are the tokens.
  const ModelConfig c = Config();
  const int draws = 24;
  for (const SamplingParams& params : {SamplingParams{}, SamplingParams{0.9f, 0.95f, 20, 77}}) {
    auto u_run = Load(c);
    const Uninterrupted u = RunUninterrupted(*u_run->executor, c.vocab_size, params, draws);
    ASSERT_FALSE(HasFatalFailure());
    for (int j : {1, 9, 20}) {
      for (int32_t chunk : {1000, 5}) {
        for (bool with_logits : {true, false}) {
          const std::string what = "resumed after " + std::to_string(j) + " draws, chunks of " +
                                   std::to_string(chunk) + (with_logits ? "" : ", by Step") +
                                   ", temperature " + std::to_string(params.temperature);
          std::vector<int32_t> resumed_prompt = u.a.prompt;
          resumed_prompt.insert(resumed_prompt.end(), u.a.drawn.begin(), u.a.drawn.begin() + j);
          Stream a{resumed_prompt, chunk, Blocks(0, 8), params,
                   std::vector<int32_t>(u.a.drawn.begin(), u.a.drawn.begin() + j)};
          Stream other{Tokens(30, 9), 30, Blocks(40, 20), {}};
          auto r = Load(c);
          while (static_cast<int>(a.drawn.size()) < draws) {
            StepStreams(*r->executor, {&other, &a}, c.vocab_size, with_logits);
            ASSERT_FALSE(HasFatalFailure()) << what;
          }
          EXPECT_EQ(a.drawn, u.a.drawn) << what;
          for (const auto& [number, logits] : a.logits) {
            ExpectSameBits(logits, u.a.logits.at(number),
                           what + ", draw " + std::to_string(number));
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuExecutorInvarianceTest,
                         ::testing::Values(Shape::kTinyLlama, Shape::kTinyQwen2, Shape::kWideLlama),
                         [](const auto& p) { return std::string(NameOf(p.param)); });

class CpuExecutorThreadsTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CpuExecutorThreadsTest, ThreadCountChangesNoBit) {
  // The uninterrupted run of three streams with products on 1, 2 and 3
  // threads (the wide Llama's first step splits its MLP products; the tiny
  // models' stay below InvariantGemm::kParallelMacs).
  const ModelConfig c = ConfigOf(GetParam());
  const SamplingParams hot{0.9f, 0.95f, 20, 77};
  std::vector<Uninterrupted> runs;
  for (int32_t threads : {1, 2, 3}) {
    auto e = Load(c, 7, 4, 4, threads);
    ASSERT_NE(e, nullptr);
    runs.push_back(RunUninterrupted(*e->executor, c.vocab_size, hot, 16));
    ASSERT_FALSE(HasFatalFailure());
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    const std::string what = std::to_string(i + 1) + " threads against 1";
    EXPECT_EQ(runs[i].a.drawn, runs[0].a.drawn) << what;
    EXPECT_EQ(runs[i].b.drawn, runs[0].b.drawn) << what;
    EXPECT_EQ(runs[i].c.drawn, runs[0].c.drawn) << what;
    for (Stream Uninterrupted::*s : {&Uninterrupted::a, &Uninterrupted::b, &Uninterrupted::c}) {
      for (const auto& [number, logits] : (runs[i].*s).logits) {
        ExpectSameBits(logits, (runs[0].*s).logits.at(number),
                       what + ", draw " + std::to_string(number));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuExecutorThreadsTest,
                         ::testing::Values(Shape::kTinyLlama, Shape::kTinyQwen2, Shape::kWideLlama),
                         [](const auto& p) { return std::string(NameOf(p.param)); });

// ---- the executor composed otherwise, and its dtypes

class CpuExecutorTest : public ::testing::TestWithParam<Family> {};

TEST_P(CpuExecutorTest, BlockTablesNeedNotBeContiguous) {
  const ModelConfig c = TinyConfig(GetParam());
  const std::vector<int32_t> a = Tokens(11, 4), b = Tokens(7, 5);
  auto ordered = Load(c, 7, 3);
  auto o1 =
      StepLogits(*ordered->executor, {{a, 0, Blocks(0, 4)}, {b, 0, Blocks(4, 3)}}, c.vocab_size);
  auto o2 = StepLogits(*ordered->executor, {{{3}, 11, Blocks(0, 4)}, {{4, 5}, 7, Blocks(4, 3)}},
                       c.vocab_size);
  // The same steps with the two sequences' blocks interleaved and reversed.
  auto scattered = Load(c, 7, 3);
  const std::vector<int32_t> ta = {20, 2, 13, 5}, tb = {9, 0, 17};
  auto p1 = StepLogits(*scattered->executor, {{a, 0, ta}, {b, 0, tb}}, c.vocab_size);
  auto p2 = StepLogits(*scattered->executor, {{{3}, 11, ta}, {{4, 5}, 7, tb}}, c.vocab_size);
  // Identical steps but for where the cache lives: identical bits.
  EXPECT_EQ(o1, p1);
  EXPECT_EQ(o2, p2);
}

TEST_P(CpuExecutorTest, SixteenBitWeightsAreWidenedExactly) {
  // The same values (rounded to bf16, then stored as F32 or BF16) give the
  // same logits: widening is exact, the math is the same float32.
  const ModelConfig bf16 = TinyConfig(GetParam(), DType::kBF16);
  auto narrow = Load(bf16);
  ModelConfig f32 = bf16;
  f32.dtype = DType::kF32;
  auto wide = std::make_unique<Loaded>();
  wide->config = f32;
  for (const HostModel::Tensor& t : narrow->model.tensors) {
    HostModel::Tensor w{t.name, DType::kF32, t.shape, std::vector<std::byte>(t.bytes.size() * 2)};
    for (size_t i = 0; i < t.bytes.size() / 2; ++i) {
      uint16_t h;
      std::memcpy(&h, t.bytes.data() + 2 * i, 2);
      const float v = BFloat16ToFloat(h);
      std::memcpy(w.bytes.data() + 4 * i, &v, 4);
    }
    wide->model.tensors.push_back(std::move(w));
  }
  auto w = BindWeights(f32, wide->model.Views());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ExecutorOptions o;
  o.max_seqs = 4;
  o.max_tokens_per_step = 64;
  o.block_size = 4;
  o.kv_pool_bytes = 1 << 20;
  auto e = CreateCpuExecutor(f32, *w, o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const std::vector<int32_t> prompt = Tokens(10, 6);
  EXPECT_EQ(StepLogits(**e, {{prompt, 0, Blocks(0, 3)}}, f32.vocab_size),
            StepLogits(*narrow->executor, {{prompt, 0, Blocks(0, 3)}}, f32.vocab_size));
}

INSTANTIATE_TEST_SUITE_P(Families, CpuExecutorTest,
                         ::testing::Values(Family::kLlama, Family::kQwen2), [](const auto& p) {
                           return p.param == Family::kQwen2 ? "Qwen2" : "Llama";
                         });

TEST(CpuExecutor, RopeScalingChangesPositionsOnly) {
  // llama3 scaling rescales the frequencies: the first token (position 0,
  // no rotation) is unchanged, later ones differ.
  ModelConfig plain = TinyConfig();
  ModelConfig scaled = plain;
  scaled.rope_scaling = {true, 8.0, 1.0, 4.0, 16};
  auto p = Load(plain), s = Load(scaled);
  const std::vector<int32_t> prompt = Tokens(12, 8);
  EXPECT_EQ(StepLogits(*p->executor, {{{prompt[0]}, 0, Blocks(0, 3)}}, plain.vocab_size),
            StepLogits(*s->executor, {{{prompt[0]}, 0, Blocks(0, 3)}}, plain.vocab_size));
  EXPECT_NE(StepLogits(*p->executor, {{Slice(prompt, 1, 12), 1, Blocks(0, 3)}}, plain.vocab_size),
            StepLogits(*s->executor, {{Slice(prompt, 1, 12), 1, Blocks(0, 3)}}, plain.vocab_size));
}

TEST(CpuExecutor, StepDrawsWhatItsLogitsSay) {
  const ModelConfig c = TinyConfig();
  auto logits_run = Load(c), step_run = Load(c);
  const std::vector<int32_t> a = Tokens(6, 1), b = Tokens(4, 2);
  SamplingParams greedy;
  SamplingParams hot{0.8f, 0.9f, 10, 1234};
  const std::vector<Feed> feeds = {{a, 0, Blocks(0, 2), true, greedy, 0},
                                   {b, 0, Blocks(2, 2), false, greedy, 0},
                                   {Tokens(3, 3), 0, Blocks(4, 1), true, hot, 5}};
  const auto logits = StepLogits(*logits_run->executor, feeds, c.vocab_size);
  ASSERT_EQ(logits.size(), 2u);
  const Batch batch(feeds);
  std::vector<int32_t> next(3, -7);
  ASSERT_TRUE(step_run->executor->Step(batch.View(), next).ok());
  EXPECT_EQ(next[0], SampleToken(logits[0], greedy, 0));
  EXPECT_EQ(next[0], std::max_element(logits[0].begin(), logits[0].end()) - logits[0].begin());
  EXPECT_EQ(next[1], -1);
  EXPECT_EQ(next[2], SampleToken(logits[1], hot, 5));
}

TEST(CpuExecutor, RefusesBadStepsAndChangesNothing) {
  const ModelConfig c = TinyConfig();
  auto e = Load(c, 7, 4, 2);
  ASSERT_EQ(e->executor->block_size(), 4);
  // [2 layers][k, v][2 kv heads][4 slots][8] floats of 4 bytes: 1 MiB / 1 KiB.
  ASSERT_EQ(e->executor->num_blocks(), 1024);
  EXPECT_EQ(e->executor->device_memory_bytes(), 0u);
  const std::vector<int32_t> prompt = Tokens(6, 1);
  auto refused = [&](std::vector<Feed> feeds, std::string_view part) {
    const Batch b(feeds);
    std::vector<float> logits(b.sampled * static_cast<size_t>(c.vocab_size));
    const Status s = e->executor->StepLogits(b.View(), logits);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(part), std::string::npos) << part << " not in " << s.message();
  };
  refused({{{3, 64}, 0, Blocks(0, 1)}}, "token 64 (at 1) is outside the vocabulary of 64");
  refused({{{3, -1}, 0, Blocks(0, 1)}}, "token -1");
  refused({{prompt, 0, {0}}}, "sequence 0 reaches position 5, 2 blocks of 4, past max_blocks 1");
  refused({{prompt, 0, {0, 1024}}}, "sequence 0's block 1 is 1024, not a block of the pool");
  refused({{prompt, 0, {0, -1, 3}}}, "sequence 0's block 1 is -1");
  refused({{prompt, 0, {0, 1}}, {prompt, 0, {2, 1}}},
          "block 1 is written by sequences 0 and 1 in one step");
  refused({{prompt, 125, Blocks(0, 33)}},
          "feeds positions 125 to 130, past the executor's "
          "max_positions 128");
  refused({{prompt, 0, Blocks(0, 2)}, {prompt, 0, Blocks(2, 2)}, {prompt, 0, Blocks(4, 2)}},
          "a step of 3 sequences (1 to 2)");
  refused({{{}, 0, Blocks(0, 2)}}, "a step of 0 tokens");
  refused({{prompt, 0, Blocks(0, 2), true, SamplingParams{-1.0f, 1.0f, 0, 0}, 0}},
          "temperature -1");
  refused({{prompt, 0, Blocks(0, 2), true, SamplingParams{1.0f, 0.0f, 0, 0}, 0}}, "top_p 0");
  refused({{std::vector<int32_t>(65, 1), 0, Blocks(0, 17)}}, "a step of 65 tokens (1 to 64)");
  {
    const Batch b({{prompt, 0, Blocks(0, 2)}});
    std::vector<float> small(10);
    EXPECT_EQ(e->executor->StepLogits(b.View(), small).code(), StatusCode::kInvalidArgument);
    std::vector<int32_t> next(2);
    EXPECT_EQ(e->executor->Step(b.View(), next).code(), StatusCode::kInvalidArgument);
  }
  // Blocks 0 and 1 were named by refused steps: nothing was written there.
  // Position 6 on top of a prefill of 0..5 gives what a fresh executor gives.
  auto fresh = Load(c, 7, 4, 2);
  StepLogits(*e->executor, {{prompt, 0, Blocks(0, 2)}}, c.vocab_size);
  StepLogits(*fresh->executor, {{prompt, 0, Blocks(0, 2)}}, c.vocab_size);
  EXPECT_EQ(StepLogits(*e->executor, {{{9}, 6, Blocks(0, 2)}}, c.vocab_size),
            StepLogits(*fresh->executor, {{{9}, 6, Blocks(0, 2)}}, c.vocab_size));
}

TEST(CpuExecutor, RefusesBadOptionsAndDevices) {
  const ModelConfig c = TinyConfig();
  HostModel m = MakeModel(c, 1);
  auto w = BindWeights(c, m.Views());
  ASSERT_TRUE(w.ok());
  ExecutorOptions o;
  o.kv_pool_bytes = 100;  // less than one block
  EXPECT_EQ(CreateCpuExecutor(c, *w, o).status().code(), StatusCode::kResourceExhausted);
  o.kv_pool_bytes = 0;  // 64 MiB
  auto fine = CreateCpuExecutor(c, *w, o);
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ((*fine)->num_blocks(), (64 << 20) / (2 * 2 * 2 * 16 * 8 * 4));
  o.max_positions = 129;
  EXPECT_EQ(CreateCpuExecutor(c, *w, o).status().code(), StatusCode::kInvalidArgument);
  o.max_positions = 0;
  o.block_size = 0;
  EXPECT_EQ(CreateCpuExecutor(c, *w, o).status().code(), StatusCode::kInvalidArgument);
  o.block_size = 16;
  m.views[3].device = Device::Cuda(0);
  auto cuda = CreateCpuExecutor(c, *w, o);
  ASSERT_FALSE(cuda.ok());
  EXPECT_NE(cuda.status().message().find("is on cuda:0"), std::string::npos)
      << cuda.status().message();
}

// ---- the draw

std::vector<float> Ramp(int n) {
  std::vector<float> l(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) l[static_cast<size_t>(i)] = 0.1f * static_cast<float>((i * 7) % n);
  return l;
}

TEST(SampleToken, GreedyIsTheFirstLargest) {
  EXPECT_EQ(SampleToken(std::vector<float>{1, 3, 2, 3}, {}, 0), 1);
  EXPECT_EQ(SampleToken(std::vector<float>{1, NAN, 2, 3}, {}, 0), 1);
  const std::vector<float> l = Ramp(50);
  const int32_t best = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  EXPECT_EQ(SampleToken(l, {}, 3), best);
  // top_k 1 and a tiny top_p leave only the largest, whatever the seed.
  for (uint64_t seed = 0; seed < 50; ++seed) {
    EXPECT_EQ(SampleToken(l, {1.5f, 1.0f, 1, seed}, seed), best);
    EXPECT_EQ(SampleToken(l, {1.5f, 1e-6f, 0, seed}, seed), best);
  }
}

TEST(SampleToken, KeyedBySeedAndPosition) {
  const std::vector<float> l(100, 0.0f);  // uniform: the draw is all Gumbel
  const SamplingParams p{1.0f, 1.0f, 0, 42};
  std::map<int32_t, int> seen;
  int differ = 0;
  for (int64_t pos = 0; pos < 200; ++pos) {
    const int32_t t = SampleToken(l, p, pos);
    EXPECT_EQ(t, SampleToken(l, p, pos));  // same seed, same position: same token
    ++seen[t];
    differ += t != SampleToken(l, {1.0f, 1.0f, 0, 43}, pos);
  }
  EXPECT_GT(seen.size(), 50u);  // 200 draws over 100 tokens
  EXPECT_GT(differ, 150);       // another seed: other tokens, nearly always
}

TEST(SampleToken, FollowsTheSoftmax) {
  // logits log(0.5), log(0.3), log(0.2): over 20000 positions the counts
  // are the probabilities (3 sigma ~ 0.01); temperature 2 flattens them.
  const std::vector<float> l = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  for (float temperature : {1.0f, 2.0f}) {
    double z = 0;
    std::vector<double> want;
    for (float x : l) {
      want.push_back(std::exp(x / temperature));
      z += want.back();
    }
    std::vector<int> count(3);
    const int n = 20000;
    for (int64_t pos = 0; pos < n; ++pos) ++count[SampleToken(l, {temperature, 1.0f, 0, 9}, pos)];
    for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(count[i] / double(n), want[i] / z, 0.015) << i;
  }
}

TEST(SampleToken, TopKAndTopPKeepTheirSets) {
  // Probabilities (temperature 1) 0.4, 0.3, 0.2, 0.1.
  const std::vector<float> l = {std::log(0.1f), std::log(0.4f), std::log(0.2f), std::log(0.3f)};
  auto drawn = [&](SamplingParams p) {
    std::vector<int> count(4);
    for (int64_t pos = 0; pos < 4000; ++pos) ++count[SampleToken(l, p, pos)];
    return count;
  };
  // top_k 2: tokens 1 and 3 only.
  auto k2 = drawn({1.0f, 1.0f, 2, 5});
  EXPECT_EQ(k2[0] + k2[2], 0);
  EXPECT_GT(k2[1], 0);
  EXPECT_GT(k2[3], 0);
  // top_p 0.65: 0.4 + 0.3 reach it, 0.4 alone does not.
  auto p65 = drawn({1.0f, 0.65f, 0, 5});
  EXPECT_EQ(p65[0] + p65[2], 0);
  EXPECT_GT(p65[1], 0);
  EXPECT_GT(p65[3], 0);
  // top_p 0.75: 0.2 is needed too.
  auto p75 = drawn({1.0f, 0.75f, 0, 5});
  EXPECT_EQ(p75[0], 0);
  EXPECT_GT(p75[2], 0);
  // top_k 3 first (1, 3, 2 renormalised: 4/9, 3/9, 2/9), then top_p 0.7: 7/9 >= 0.7.
  auto both = drawn({1.0f, 0.7f, 3, 5});
  EXPECT_EQ(both[0] + both[2], 0);
  // Ties at the k-th logit are all kept; tied probabilities kept together.
  const std::vector<float> tied = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  std::vector<int> count(5);
  for (int64_t pos = 0; pos < 3000; ++pos) {
    ++count[SampleToken(tied, {1.0f, 1.0f, 2, 1}, pos)];
    ++count[SampleToken(tied, {1.0f, 0.3f, 0, 2}, pos)];
  }
  EXPECT_EQ(count[0] + count[4], 0);
  EXPECT_GT(count[1], 0);
  EXPECT_GT(count[2], 0);
  EXPECT_GT(count[3], 0);
}

}  // namespace
}  // namespace hearth::llm
