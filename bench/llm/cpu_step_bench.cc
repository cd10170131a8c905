// The CPU executor of backend llm on a small Llama-shaped model (random
// weights; hidden 1024, intermediate 2816, 4 layers, 16 heads over 4 KV
// heads, vocab 32000, float32): a prefill of 512 tokens and a decode step of
// 16 sequences at 128 positions each; the median of N runs.
//   cpu_step_bench [N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "backends/llm/llm_model.h"
#include "llm_test_model.h"

using namespace hearth::llm;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 5;
  ModelConfig c = testing::TinyConfig(Family::kLlama, hearth::DType::kF32);
  c.hidden_size = 1024;
  c.intermediate_size = 2816;
  c.num_layers = 4;
  c.num_heads = 16;
  c.num_kv_heads = 4;
  c.head_dim = 64;
  c.vocab_size = 32000;
  c.max_positions = 1024;
  testing::HostModel m = testing::MakeModel(c, 1);
  auto w = BindWeights(c, m.Views());
  if (!w.ok()) {
    fprintf(stderr, "%s\n", w.status().ToString().c_str());
    return 1;
  }
  ExecutorOptions o;
  o.max_seqs = 16;
  o.max_tokens_per_step = 512;
  o.block_size = 16;
  o.kv_pool_bytes = 1ull << 30;
  auto e = CreateCpuExecutor(c, *w, o);
  if (!e.ok()) {
    fprintf(stderr, "%s\n", e.status().ToString().c_str());
    return 1;
  }
  Executor& ex = **e;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };

  // Prefill: 512 tokens of one sequence, blocks 0..31, one sampled row.
  std::vector<int32_t> tokens(512), table(32);
  for (int i = 0; i < 512; ++i) tokens[i] = (i * 7919 + 13) % 32000;
  std::iota(table.begin(), table.end(), 0);
  std::vector<int32_t> offsets{0, 512}, starts{0};
  std::vector<uint8_t> sample{1};
  std::vector<SamplingParams> params(16);
  std::vector<int64_t> draws(16, 0);
  StepBatch b;
  b.tokens = tokens;
  b.offsets = offsets;
  b.starts = starts;
  b.block_tables = table;
  b.max_blocks = 32;
  b.sample = sample;
  b.params = std::span(params.data(), 1);
  b.draw_positions = std::span(draws.data(), 1);
  std::vector<int32_t> next(16);
  std::vector<double> prefill;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    if (!ex.Step(b, std::span(next.data(), 1)).ok()) return 1;
    prefill.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  // Decode: 16 sequences with 128 positions each (the prefill's blocks,
  // shared read-only: every sequence reads blocks 0..7 and writes its own 9th).
  std::vector<int32_t> dtok(16), doff(17), dstart(16, 128), dtable(16 * 9);
  std::vector<uint8_t> dsample(16, 1);
  for (int i = 0; i < 16; ++i) {
    dtok[i] = (i * 31 + 5) % 32000;
    doff[i + 1] = i + 1;
    for (int j = 0; j < 8; ++j) dtable[i * 9 + j] = j;
    dtable[i * 9 + 8] = 100 + i;
  }
  StepBatch d;
  d.tokens = dtok;
  d.offsets = doff;
  d.starts = dstart;
  d.block_tables = dtable;
  d.max_blocks = 9;
  d.sample = dsample;
  d.params = params;
  d.draw_positions = draws;
  std::vector<double> decode;
  for (int r = 0; r < reps * 4; ++r) {
    auto t0 = Clock::now();
    if (!ex.Step(d, next).ok()) return 1;
    decode.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  printf(
      "prefill 512 tokens: median %.1f ms (min %.1f) | decode 16 rows: median %.2f ms (min %.2f)\n",
      median(prefill), *std::min_element(prefill.begin(), prefill.end()), median(decode),
      *std::min_element(decode.begin(), decode.end()));
}
