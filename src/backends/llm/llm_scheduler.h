// The continuous-batching scheduler of backend: llm: which sequences run in
// the next step, and which of their tokens, over a pool of KV blocks.
//
// Each step decodes one token of every running sequence that has all its
// tokens but the last in its blocks, and spends what is left of the step's
// token budget on prompts (chunked prefill): sequences part way through
// their prefill first, then waiting ones in the order they came. When the
// pool has no block for a running sequence's next token, the sequence
// admitted last is preempted: its blocks go back to the pool and it waits
// at the head of the queue, keeping its tokens, to be prefilled again (prompt
// and generated tokens together) when blocks free up. A preempted sequence
// is never failed: a request is refused at Add if even the whole pool could
// not hold it.
//
// Device-independent: it plans a StepBatch (llm_model.h) for an Executor and
// takes back the tokens drawn. Thread-safety: one thread uses a Scheduler.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "backends/llm/llm_model.h"
#include "hearth/status.h"

namespace hearth::llm {

// A stream being generated, as the scheduler sees it.
struct Sequence {
  uint64_t id = 0;
  std::vector<int32_t> tokens;  // the prompt, then every token generated (resumed ones too)
  size_t prompt_length = 0;
  size_t cached = 0;            // tokens whose keys and values are in `blocks`
  std::vector<int32_t> blocks;  // block ids of positions 0, block_size, ...
  SamplingParams sampling;
  int64_t max_tokens = 1;  // tokens it may generate in all
  uint64_t order = 0;      // when it was last admitted (preemption takes the latest)
  uint64_t serial = 0;     // given by Add: one number per sequence the scheduler ever held
  bool running = false;    // admitted: it may hold blocks and is in steps

  int64_t generated() const { return static_cast<int64_t>(tokens.size() - prompt_length); }
};

struct SchedulerLimits {
  int32_t block_size = 16;
  int32_t num_blocks = 0;             // in the pool
  int32_t max_seqs = 1;               // sequences in one step
  int32_t max_tokens_per_step = 512;  // tokens fed in one step, >= max_seqs
  int32_t max_positions = 0;          // the longest sequence
};

// What one step runs: the StepBatch's storage, and the sequences in its order
// (by id and serial: a sequence may be removed while its step runs, and
// Scheduler::Live says whether it is still held).
struct PlannedStep {
  std::vector<int32_t> tokens, offsets, starts, block_tables;
  int32_t max_blocks = 0;
  std::vector<uint8_t> sample;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draw_positions;
  std::vector<int32_t> feed_previous;  // empty, or per sequence (StepBatch)
  std::vector<uint64_t> ids, serials;
  std::vector<int32_t> fed;  // tokens fed per sequence

  StepBatch batch() const;
  void Clear();
};

class Scheduler {
 public:
  // InvalidArgument for limits that cannot work (no blocks, a budget under
  // max_seqs, ...).
  static Result<std::unique_ptr<Scheduler>> Create(const SchedulerLimits& limits);

  const SchedulerLimits& limits() const { return limits_; }
  // The blocks a sequence of `tokens` tokens holds.
  int32_t BlocksFor(int64_t tokens) const;
  // Queues a sequence (its tokens: the prompt and any resumed ones; it has
  // at least one). InvalidArgument if the id is held, if it has no token,
  // or if its prompt and max_tokens could never fit the positions or the
  // whole pool (the message gives the numbers).
  Status Add(std::unique_ptr<Sequence> sequence);
  // Drops a sequence (ended, cancelled), its blocks back to the pool. Ids
  // not held are ignored.
  void Remove(uint64_t id);
  Sequence* Find(uint64_t id);

  // Plans the next step into `step`; false when nothing can run.
  bool Plan(PlannedStep& step);
  // Plans into `step` the step after `launched`, before the tokens
  // `launched` draws are known: what Plan would plan once `launched` is
  // committed, each sequence that draws there feeding that token from the
  // device (feed_previous) at the position after it, beside prefill chunks
  // and admissions, whose tokens are known. Without preempting: false (and
  // no step) where a decode finds no block, or where there is nothing to
  // run. A sequence whose token there is its last (max_tokens) is left out;
  // one that ends there on EOS or a stop string is in it, and its row is
  // dropped when it is collected.
  bool PlanAfter(const PlannedStep& launched, PlannedStep& step);
  // The sequence of `step`'s row i, or nullptr when it was removed since.
  Sequence* Live(const PlannedStep& step, size_t i);
  // After the executor ran `step`: the tokens fed are cached, and each
  // sampled sequence gets its token (next[i], in the step's order). Rows of
  // sequences removed since are skipped. Steps are committed in the order
  // they were planned.
  void Commit(const PlannedStep& step, std::span<const int32_t> next);

  bool busy() const { return !sequences_.empty(); }
  size_t held() const { return sequences_.size(); }
  int32_t blocks_used() const { return limits_.num_blocks - static_cast<int32_t>(free_.size()); }
  uint64_t preemptions() const { return preemptions_; }

 private:
  explicit Scheduler(const SchedulerLimits& limits);
  void Preempt(Sequence& s);
  // Grows s's blocks to cover `tokens` tokens; false (nothing taken) when
  // the pool has too few.
  bool Reserve(Sequence& s, int64_t tokens);
  void Release(Sequence& s);

  // A row of a step being planned: `fed` tokens of s from position `start`
  // (of `length` known, the one to come included), and the row of the
  // launched step whose token it feeds (-1: its tokens are on the host).
  struct Row {
    Sequence* s;
    int32_t fed;
    int32_t feed;
    size_t start, length;
  };
  // Prefill chunks within `budget`: running sequences part way through their
  // tokens first, then the queue in order (admitting each), as far as the
  // pool's free blocks go. cached_of and length_of give a sequence's tokens
  // cached and known once the steps before this one are done.
  template <typename CachedOf, typename LengthOf>
  void TakeChunks(int32_t& budget, const CachedOf& cached_of, const LengthOf& length_of,
                  std::vector<Row>& rows);
  // Writes the rows into `step` (feed_previous only where one feeds).
  static void WriteRows(const std::vector<Row>& rows, PlannedStep& step);

  SchedulerLimits limits_;
  std::vector<int32_t> free_;  // free block ids (a stack)
  std::map<uint64_t, std::unique_ptr<Sequence>> sequences_;
  std::vector<Sequence*> running_;  // in admission order
  std::deque<Sequence*> waiting_;
  uint64_t next_order_ = 0;
  uint64_t next_serial_ = 0;
  uint64_t preemptions_ = 0;
};

}  // namespace hearth::llm
