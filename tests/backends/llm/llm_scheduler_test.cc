// The continuous-batching scheduler against an executor whose "KV cache"
// holds the token ids themselves: each step writes the tokens fed at their
// positions in the sequence's blocks, and draws next = f(every token at
// positions 0..last, read back through the block table). A block handed to
// two sequences at once, a wrong position, a chunk fed twice or skipped, or
// a preempted sequence not fed again from the start all change what it
// draws, so each sequence's tokens must equal the same function run alone.
#include "backends/llm/llm_scheduler.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>

namespace hearth::llm {
namespace {

constexpr int32_t kVocab = 1000;

uint64_t Next(const std::vector<int32_t>& history) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : history) h = SplitMix64(h ^ static_cast<uint64_t>(t));
  return h % kVocab;
}

class TokenCacheExecutor {
 public:
  TokenCacheExecutor(int32_t block_size, int32_t num_blocks)
      : block_size_(block_size), cache_(static_cast<size_t>(block_size * num_blocks), -1) {}

  // Checks the batch's shape and runs it; next[i] per sampled sequence. A
  // sequence with feed_previous feeds what the step run before drew.
  void Step(const StepBatch& b, std::vector<int32_t>& next) {
    const size_t n = b.num_seqs();
    ASSERT_EQ(b.offsets.size(), n + 1);
    ASSERT_TRUE(b.feed_previous.empty() || b.feed_previous.size() == n);
    std::vector<int32_t> tokens(b.tokens.begin(), b.tokens.end());
    for (size_t i = 0; i < b.feed_previous.size(); ++i) {
      const int32_t j = b.feed_previous[i];
      if (j < 0) continue;
      ASSERT_EQ(b.offsets[i + 1] - b.offsets[i], 1);
      ASSERT_LT(static_cast<size_t>(j), last_.size());
      ASSERT_GE(last_[static_cast<size_t>(j)], 0) << "fed from a sequence that drew nothing";
      tokens[static_cast<size_t>(b.offsets[i])] = last_[static_cast<size_t>(j)];
    }
    ASSERT_EQ(b.block_tables.size(), n * static_cast<size_t>(b.max_blocks));
    next.assign(n, -1);
    std::set<int32_t> blocks_in_step;
    for (size_t i = 0; i < n; ++i) {
      const int32_t* table = b.block_tables.data() + i * static_cast<size_t>(b.max_blocks);
      const int32_t fed = b.offsets[i + 1] - b.offsets[i];
      ASSERT_GT(fed, 0);
      const int32_t end = b.starts[i] + fed;
      for (int32_t k = 0; k < (end + block_size_ - 1) / block_size_; ++k) {
        ASSERT_GE(table[k], 0) << "no block for position " << k * block_size_;
        ASSERT_TRUE(blocks_in_step.insert(table[k]).second) << "block " << table[k] << " twice";
      }
      for (int32_t j = 0; j < fed; ++j) {
        const int32_t pos = b.starts[i] + j;
        cache_[static_cast<size_t>(table[pos / block_size_] * block_size_ + pos % block_size_)] =
            tokens[static_cast<size_t>(b.offsets[i] + j)];
      }
      if (b.sample[i] == 0) continue;
      std::vector<int32_t> history;
      for (int32_t pos = 0; pos < end; ++pos)
        history.push_back(cache_[static_cast<size_t>(table[pos / block_size_] * block_size_ +
                                                     pos % block_size_)]);
      next[i] = static_cast<int32_t>(Next(history));
    }
    last_ = next;
  }

 private:
  int32_t block_size_;
  std::vector<int32_t> cache_;
  std::vector<int32_t> last_;  // what the last step drew
};

std::vector<int32_t> Alone(std::vector<int32_t> tokens, int64_t max_tokens) {
  const size_t prompt = tokens.size();
  while (static_cast<int64_t>(tokens.size() - prompt) < max_tokens)
    tokens.push_back(static_cast<int32_t>(Next(tokens)));
  return {tokens.begin() + static_cast<ptrdiff_t>(prompt), tokens.end()};
}

std::unique_ptr<Sequence> MakeSequence(uint64_t id, std::vector<int32_t> prompt,
                                       int64_t max_tokens) {
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->tokens = std::move(prompt);
  s->prompt_length = s->tokens.size();
  s->max_tokens = max_tokens;
  return s;
}

std::vector<int32_t> Prompt(uint64_t id, int length) {
  std::vector<int32_t> p;
  for (int i = 0; i < length; ++i) p.push_back(static_cast<int32_t>((id * 131 + i * 7) % kVocab));
  return p;
}

struct Outcome {
  std::map<uint64_t, std::vector<int32_t>> generated;
  int steps = 0;
  int planned_after = 0;  // steps planned by PlanAfter (pipelined)
  size_t most_in_a_step = 0;
};

// Runs every sequence to its max_tokens; each ends (and is removed) when it
// has them. Pipelined: as the engine runs them, each step's successor is
// planned (PlanAfter) before the step runs, from its tokens still unknown.
// `before_run` is called with each step before it runs.
Outcome RunAll(Scheduler& scheduler, TokenCacheExecutor& executor, bool pipelined = false,
               const std::function<void(const PlannedStep&, int)>& before_run = nullptr) {
  Outcome run;
  PlannedStep steps[2];
  int current = -1;
  std::vector<int32_t> next;
  for (;;) {
    if (current < 0) {
      if (!scheduler.Plan(steps[0])) break;
      current = 0;
    }
    PlannedStep& step = steps[current];
    PlannedStep& after = steps[1 - current];
    const bool chained = pipelined && scheduler.PlanAfter(step, after);
    if (chained) ++run.planned_after;
    ++run.steps;
    run.most_in_a_step = std::max(run.most_in_a_step, step.ids.size());
    EXPECT_LE(static_cast<int32_t>(step.tokens.size()), scheduler.limits().max_tokens_per_step);
    EXPECT_LE(static_cast<int32_t>(step.ids.size()), scheduler.limits().max_seqs);
    if (before_run) before_run(step, run.steps);
    executor.Step(step.batch(), next);
    scheduler.Commit(step, next);
    current = chained ? 1 - current : -1;
    std::vector<uint64_t> done;
    for (size_t i = 0; i < step.ids.size(); ++i) {
      Sequence* s = scheduler.Live(step, i);
      if (step.sample[i] == 0 || s == nullptr) continue;
      if (s->generated() >= s->max_tokens) done.push_back(s->id);
    }
    for (uint64_t id : done) {
      Sequence* s = scheduler.Find(id);
      run.generated[id] = {s->tokens.begin() + static_cast<ptrdiff_t>(s->prompt_length),
                           s->tokens.end()};
      scheduler.Remove(id);
    }
    if (run.steps > 100000) {
      ADD_FAILURE() << "no end in sight";
      break;
    }
  }
  EXPECT_FALSE(scheduler.busy());
  EXPECT_EQ(scheduler.blocks_used(), 0);
  return run;
}

class LlmSchedulerRun : public ::testing::TestWithParam<bool> {};  // pipelined or not

TEST_P(LlmSchedulerRun, ManySequencesEachEqualAlone) {
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 512,
                         .max_seqs = 8,
                         .max_tokens_per_step = 32,
                         .max_positions = 256};
  auto scheduler = Scheduler::Create(limits).value();
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  std::map<uint64_t, std::vector<int32_t>> expected;
  for (uint64_t id = 1; id <= 20; ++id) {
    const int length = 1 + static_cast<int>(id * 5 % 41);  // some prompts span several chunks
    const int64_t max_tokens = 1 + static_cast<int64_t>(id * 3 % 17);
    expected[id] = Alone(Prompt(id, length), max_tokens);
    ASSERT_TRUE(scheduler->Add(MakeSequence(id, Prompt(id, length), max_tokens)).ok());
  }
  const Outcome run = RunAll(*scheduler, executor, GetParam());
  EXPECT_EQ(run.generated, expected);
  EXPECT_EQ(run.most_in_a_step, 8u);  // the step is filled up to max_seqs
  EXPECT_EQ(scheduler->preemptions(), 0u);
  // Pipelined, every step after the first is planned before the one before
  // it has run: the pool never runs dry, so no decode waits for Plan.
  if (GetParam()) {
    EXPECT_EQ(run.planned_after, run.steps - 1);
  }
}

TEST_P(LlmSchedulerRun, ATinyPoolPreemptsAndEverySequenceStillEqualsItsRunAlone) {
  // 12 blocks of 4 tokens: two sequences of 20 tokens cannot both grow.
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 12,
                         .max_seqs = 6,
                         .max_tokens_per_step = 16,
                         .max_positions = 64};
  auto scheduler = Scheduler::Create(limits).value();
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  std::map<uint64_t, std::vector<int32_t>> expected;
  for (uint64_t id = 1; id <= 6; ++id) {
    expected[id] = Alone(Prompt(id, 9), 24);
    ASSERT_TRUE(scheduler->Add(MakeSequence(id, Prompt(id, 9), 24)).ok());
  }
  const Outcome run = RunAll(*scheduler, executor, GetParam());
  EXPECT_EQ(run.generated, expected);
  EXPECT_GT(scheduler->preemptions(), 0u);
}

TEST_P(LlmSchedulerRun, AResumedSequenceGoesOnFromItsTokens) {
  SchedulerLimits limits{.block_size = 8,
                         .num_blocks = 64,
                         .max_seqs = 2,
                         .max_tokens_per_step = 64,
                         .max_positions = 128};
  const std::vector<int32_t> whole = Alone(Prompt(3, 10), 30);
  auto scheduler = Scheduler::Create(limits).value();
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  // The client had the first 12 of them when its worker died.
  auto s = MakeSequence(3, Prompt(3, 10), 30);
  s->tokens.insert(s->tokens.end(), whole.begin(), whole.begin() + 12);
  ASSERT_TRUE(scheduler->Add(std::move(s)).ok());
  const Outcome run = RunAll(*scheduler, executor, GetParam());
  EXPECT_EQ(run.generated.at(3), whole);
  // One sequence: each of its 18 steps but the first (the prefill) is
  // planned by PlanAfter.
  if (GetParam()) {
    EXPECT_EQ(run.planned_after, 30 - 12 - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(Steps, LlmSchedulerRun, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "Pipelined" : "OneAtATime";
                         });

// A sequence removed (cancelled) while the step after its step is planned:
// that step's row for it is dropped at its commit, its blocks go back at
// once, and the others still equal their runs alone though the freed blocks
// serve them while the dropped row's write is still to run.
TEST(LlmScheduler, ASequenceRemovedWhileItsNextStepIsPlannedChangesNoOther) {
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 24,
                         .max_seqs = 3,
                         .max_tokens_per_step = 64,
                         .max_positions = 64};
  auto scheduler = Scheduler::Create(limits).value();
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  for (uint64_t id = 1; id <= 3; ++id)
    ASSERT_TRUE(scheduler->Add(MakeSequence(id, Prompt(id, 6), 20)).ok());
  bool removed = false;
  const Outcome run = RunAll(*scheduler, executor, true, [&](const PlannedStep& step, int n) {
    if (n < 5 || removed) return;
    ASSERT_EQ(step.ids.size(), 3u);
    scheduler->Remove(2);  // its step and the one after it both hold a row for it
    removed = true;
  });
  EXPECT_TRUE(removed);
  EXPECT_EQ(run.generated.count(2), 0u);
  EXPECT_EQ(run.generated.at(1), Alone(Prompt(1, 6), 20));
  EXPECT_EQ(run.generated.at(3), Alone(Prompt(3, 6), 20));
  EXPECT_GT(run.planned_after, 10);
}

// PlanAfter plans, before the launched step's tokens are known, what Plan
// would plan once it is committed: the decodes fed from the device, a
// prompt's next chunk, an admission; a sequence whose token there is its
// last is left out. It never preempts: a decode with no block is Plan's.
TEST(LlmScheduler, PlanAfterPlansWhatPlanWouldOnceTheStepIsCommitted) {
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 5,
                         .max_seqs = 2,
                         .max_tokens_per_step = 8,
                         .max_positions = 64};
  auto scheduler = Scheduler::Create(limits).value();
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  PlannedStep a, b, c, d;
  std::vector<int32_t> next;
  const auto run = [&](const PlannedStep& s) {
    executor.Step(s.batch(), next);
    scheduler->Commit(s, next);
  };
  ASSERT_TRUE(scheduler->Add(MakeSequence(1, Prompt(1, 3), 10)).ok());
  ASSERT_TRUE(scheduler->Plan(a));
  ASSERT_TRUE(scheduler->Add(MakeSequence(2, Prompt(2, 9), 1)).ok());
  // Sequence 1's token from a, and 7 of sequence 2's 9 (the rest of the budget).
  ASSERT_TRUE(scheduler->PlanAfter(a, b));
  EXPECT_EQ(b.ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(b.feed_previous, (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(b.fed, (std::vector<int32_t>{1, 7}));
  EXPECT_EQ(b.starts, (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(b.sample, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(b.draw_positions, (std::vector<int64_t>{1, 0}));
  const std::vector<int32_t> prompt2 = Prompt(2, 9);
  EXPECT_EQ(std::vector<int32_t>(b.tokens.begin() + 1, b.tokens.end()),
            std::vector<int32_t>(prompt2.begin(), prompt2.begin() + 7));
  run(a);
  // Sequence 1's token from b, and the last 2 of sequence 2's prompt.
  ASSERT_TRUE(scheduler->PlanAfter(b, c));
  EXPECT_EQ(c.ids, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(c.feed_previous, (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(c.starts, (std::vector<int32_t>{4, 7}));
  EXPECT_EQ(c.fed, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(c.sample, (std::vector<uint8_t>{1, 1}));
  EXPECT_EQ(c.draw_positions, (std::vector<int64_t>{2, 0}));
  run(b);
  // Sequence 2's token from c is its last (max_tokens 1): sequence 1 alone.
  ASSERT_TRUE(scheduler->PlanAfter(c, d));
  EXPECT_EQ(d.ids, (std::vector<uint64_t>{1}));
  EXPECT_EQ(d.feed_previous, (std::vector<int32_t>{0}));
  EXPECT_EQ(d.starts, (std::vector<int32_t>{5}));
  EXPECT_EQ(d.draw_positions, (std::vector<int64_t>{3}));
  run(c);
  const Sequence* two = scheduler->Find(2);
  ASSERT_NE(two, nullptr);
  EXPECT_EQ(std::vector<int32_t>(two->tokens.begin() + 9, two->tokens.end()),
            Alone(Prompt(2, 9), 1));
  scheduler->Remove(2);
  run(d);
  const Sequence* one = scheduler->Find(1);
  ASSERT_NE(one, nullptr);
  EXPECT_EQ(std::vector<int32_t>(one->tokens.begin() + 3, one->tokens.end()),
            Alone(Prompt(1, 3), 4));
  PlannedStep step, after;

  // Two sequences that fill the pool: the next positions need blocks that
  // only a preemption (Plan's to make) would free.
  auto full = Scheduler::Create({.block_size = 4,
                                 .num_blocks = 4,
                                 .max_seqs = 2,
                                 .max_tokens_per_step = 16,
                                 .max_positions = 64})
                  .value();
  ASSERT_TRUE(full->Add(MakeSequence(1, Prompt(1, 8), 9)).ok());
  ASSERT_TRUE(full->Add(MakeSequence(2, Prompt(2, 8), 9)).ok());
  ASSERT_TRUE(full->Plan(step));
  EXPECT_EQ(full->blocks_used(), 4);
  EXPECT_FALSE(full->PlanAfter(step, after));
  EXPECT_EQ(full->blocks_used(), 4);
  EXPECT_EQ(full->preemptions(), 0u);
}

TEST(LlmScheduler, RefusesWhatCouldNeverFitAndKeepsServing) {
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 4,
                         .max_seqs = 2,
                         .max_tokens_per_step = 8,
                         .max_positions = 64};
  auto scheduler = Scheduler::Create(limits).value();
  // 10 + 8 - 1 = 17 positions fed: 5 blocks of 4; the pool has 4.
  Status s = scheduler->Add(MakeSequence(1, Prompt(1, 10), 8));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the pool has 4"), std::string::npos) << s.message();
  s = scheduler->Add(MakeSequence(2, Prompt(2, 60), 8));
  EXPECT_NE(s.message().find("64 positions"), std::string::npos) << s.message();
  ASSERT_TRUE(scheduler->Add(MakeSequence(3, Prompt(3, 10), 7)).ok());
  EXPECT_EQ(scheduler->Add(MakeSequence(3, Prompt(3, 2), 1)).code(), StatusCode::kInvalidArgument);
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  EXPECT_EQ(RunAll(*scheduler, executor).generated.at(3), Alone(Prompt(3, 10), 7));
}

TEST(LlmScheduler, RemovingASequenceMidwayFreesItsBlocks) {
  SchedulerLimits limits{.block_size = 4,
                         .num_blocks = 32,
                         .max_seqs = 4,
                         .max_tokens_per_step = 64,
                         .max_positions = 64};
  auto scheduler = Scheduler::Create(limits).value();
  ASSERT_TRUE(scheduler->Add(MakeSequence(1, Prompt(1, 20), 30)).ok());
  ASSERT_TRUE(scheduler->Add(MakeSequence(2, Prompt(2, 5), 4)).ok());
  TokenCacheExecutor executor(limits.block_size, limits.num_blocks);
  PlannedStep step;
  std::vector<int32_t> next;
  ASSERT_TRUE(scheduler->Plan(step));
  executor.Step(step.batch(), next);
  scheduler->Commit(step, next);
  EXPECT_EQ(scheduler->blocks_used(), 5 + 2);  // 20 tokens in blocks of 4, and 5
  scheduler->Remove(1);                        // cancelled
  EXPECT_EQ(scheduler->blocks_used(), 2);
  const Outcome run = RunAll(*scheduler, executor);
  EXPECT_EQ(run.generated.at(2), Alone(Prompt(2, 5), 4));
  EXPECT_EQ(run.generated.count(1), 0u);
}

TEST(LlmScheduler, LimitsThatCannotWorkAreRefused) {
  EXPECT_FALSE(Scheduler::Create({.block_size = 0,
                                  .num_blocks = 4,
                                  .max_seqs = 1,
                                  .max_tokens_per_step = 8,
                                  .max_positions = 64})
                   .ok());
  EXPECT_FALSE(Scheduler::Create({.block_size = 4,
                                  .num_blocks = 0,
                                  .max_seqs = 1,
                                  .max_tokens_per_step = 8,
                                  .max_positions = 64})
                   .ok());
  EXPECT_FALSE(Scheduler::Create({.block_size = 4,
                                  .num_blocks = 4,
                                  .max_seqs = 16,
                                  .max_tokens_per_step = 8,
                                  .max_positions = 64})
                   .ok());
}

}  // namespace
}  // namespace hearth::llm
