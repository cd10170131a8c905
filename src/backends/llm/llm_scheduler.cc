#include "backends/llm/llm_scheduler.h"

#include <algorithm>
#include <string>
#include <unordered_map>

namespace hearth::llm {

StepBatch PlannedStep::batch() const {
  StepBatch b;
  b.tokens = tokens;
  b.offsets = offsets;
  b.starts = starts;
  b.block_tables = block_tables;
  b.max_blocks = max_blocks;
  b.sample = sample;
  b.params = params;
  b.draw_positions = draw_positions;
  b.feed_previous = feed_previous;
  return b;
}

void PlannedStep::Clear() {
  tokens.clear();
  offsets.assign(1, 0);
  starts.clear();
  block_tables.clear();
  max_blocks = 0;
  sample.clear();
  params.clear();
  draw_positions.clear();
  feed_previous.clear();
  ids.clear();
  serials.clear();
  fed.clear();
}

Result<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerLimits& limits) {
  const auto bad = [](const std::string& what) {
    return InvalidArgument("llm scheduler: " + what);
  };
  if (limits.block_size < 1 || limits.block_size > 4096)
    return bad("block_size " + std::to_string(limits.block_size) + " is not from 1 to 4096");
  if (limits.num_blocks < 1) return bad("the KV pool holds no block");
  if (limits.max_seqs < 1) return bad("max_seqs " + std::to_string(limits.max_seqs) + " < 1");
  if (limits.max_tokens_per_step < limits.max_seqs)
    return bad("max_tokens_per_step " + std::to_string(limits.max_tokens_per_step) +
               " is under max_seqs " + std::to_string(limits.max_seqs) +
               " (every running sequence decodes a token a step)");
  if (limits.max_positions < 2)
    return bad("max_positions " + std::to_string(limits.max_positions) + " < 2");
  return std::unique_ptr<Scheduler>(new Scheduler(limits));
}

Scheduler::Scheduler(const SchedulerLimits& limits) : limits_(limits) {
  free_.reserve(static_cast<size_t>(limits.num_blocks));
  // A stack: block 0 is handed out first.
  for (int32_t b = limits.num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

int32_t Scheduler::BlocksFor(int64_t tokens) const {
  return static_cast<int32_t>((tokens + limits_.block_size - 1) / limits_.block_size);
}

Status Scheduler::Add(std::unique_ptr<Sequence> s) {
  if (s == nullptr || s->tokens.empty())
    return InvalidArgument("a sequence needs at least one token");
  if (sequences_.count(s->id) != 0)
    return InvalidArgument("sequence " + std::to_string(s->id) + " is held already");
  if (s->max_tokens < 1 || s->generated() > s->max_tokens)
    return InvalidArgument("max_tokens " + std::to_string(s->max_tokens) + " for a sequence with " +
                           std::to_string(s->generated()) + " generated");
  // The last token drawn is never fed: it needs no position in the cache.
  const int64_t longest = static_cast<int64_t>(s->prompt_length) + s->max_tokens;
  if (longest > limits_.max_positions)
    return InvalidArgument("the prompt's " + std::to_string(s->prompt_length) +
                           " tokens and max_tokens " + std::to_string(s->max_tokens) +
                           " come to more than the model's " +
                           std::to_string(limits_.max_positions) + " positions");
  if (BlocksFor(longest - 1) > limits_.num_blocks)
    return InvalidArgument("the prompt's " + std::to_string(s->prompt_length) +
                           " tokens and max_tokens " + std::to_string(s->max_tokens) + " need " +
                           std::to_string(BlocksFor(longest - 1)) + " KV blocks of " +
                           std::to_string(limits_.block_size) + " tokens; the pool has " +
                           std::to_string(limits_.num_blocks));
  s->cached = 0;
  s->blocks.clear();
  s->running = false;
  s->serial = next_serial_++;
  waiting_.push_back(s.get());
  sequences_.emplace(s->id, std::move(s));
  return Status::Ok();
}

Sequence* Scheduler::Find(uint64_t id) {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? nullptr : it->second.get();
}

void Scheduler::Release(Sequence& s) {
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) free_.push_back(*it);
  s.blocks.clear();
  s.cached = 0;
}

void Scheduler::Remove(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  Sequence* s = it->second.get();
  Release(*s);
  running_.erase(std::remove(running_.begin(), running_.end(), s), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), s), waiting_.end());
  sequences_.erase(it);
}

void Scheduler::Preempt(Sequence& s) {
  Release(s);
  s.running = false;
  running_.erase(std::remove(running_.begin(), running_.end(), &s), running_.end());
  waiting_.push_front(&s);
  ++preemptions_;
}

bool Scheduler::Reserve(Sequence& s, int64_t tokens) {
  const int32_t need = BlocksFor(tokens) - static_cast<int32_t>(s.blocks.size());
  if (need <= 0) return true;
  if (need > static_cast<int32_t>(free_.size())) return false;
  for (int32_t i = 0; i < need; ++i) {
    s.blocks.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

template <typename CachedOf, typename LengthOf>
void Scheduler::TakeChunks(int32_t& budget, const CachedOf& cached_of, const LengthOf& length_of,
                           std::vector<Row>& rows) {
  const auto chunk_for = [&](const Sequence& s, size_t cached) -> int32_t {
    const int64_t left = static_cast<int64_t>(length_of(s) - cached);
    const int64_t room =
        (static_cast<int64_t>(s.blocks.size()) + static_cast<int64_t>(free_.size())) *
            limits_.block_size -
        static_cast<int64_t>(cached);
    return static_cast<int32_t>(std::max<int64_t>(0, std::min({left, room, int64_t{budget}})));
  };
  for (Sequence* s : running_) {
    if (budget <= 0) break;
    const size_t cached = cached_of(*s);
    if (length_of(*s) - cached <= 1) continue;
    const int32_t chunk = chunk_for(*s, cached);
    if (chunk == 0) continue;
    Reserve(*s, static_cast<int64_t>(cached) + chunk);
    rows.push_back({s, chunk, -1, cached, length_of(*s)});
    budget -= chunk;
  }
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int32_t>(running_.size()) < limits_.max_seqs) {
    Sequence* s = waiting_.front();
    const size_t cached = cached_of(*s);
    const int32_t chunk = chunk_for(*s, cached);
    if (chunk == 0) break;  // first come, first served: the head waits for blocks
    waiting_.pop_front();
    s->running = true;
    s->order = next_order_++;
    running_.push_back(s);
    Reserve(*s, static_cast<int64_t>(cached) + chunk);
    rows.push_back({s, chunk, -1, cached, length_of(*s)});
    budget -= chunk;
  }
}

void Scheduler::WriteRows(const std::vector<Row>& rows, PlannedStep& step) {
  for (const Row& r : rows)
    step.max_blocks = std::max(step.max_blocks, static_cast<int32_t>(r.s->blocks.size()));
  const bool feeds =
      std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.feed >= 0; });
  for (const Row& r : rows) {
    const Sequence* s = r.s;
    step.ids.push_back(s->id);
    step.serials.push_back(s->serial);
    step.fed.push_back(r.fed);
    if (r.feed >= 0) {
      step.tokens.push_back(0);  // a placeholder: the device has the token
    } else {
      step.tokens.insert(step.tokens.end(), s->tokens.begin() + static_cast<ptrdiff_t>(r.start),
                         s->tokens.begin() + static_cast<ptrdiff_t>(r.start) + r.fed);
    }
    if (feeds) step.feed_previous.push_back(r.feed);
    step.offsets.push_back(static_cast<int32_t>(step.tokens.size()));
    step.starts.push_back(static_cast<int32_t>(r.start));
    step.block_tables.insert(step.block_tables.end(), s->blocks.begin(), s->blocks.end());
    step.block_tables.resize(step.block_tables.size() + step.max_blocks - s->blocks.size(), -1);
    step.sample.push_back(r.start + static_cast<size_t>(r.fed) == r.length ? 1 : 0);
    step.params.push_back(s->sampling);
    step.draw_positions.push_back(static_cast<int64_t>(r.length - s->prompt_length));
  }
}

bool Scheduler::Plan(PlannedStep& step) {
  const auto cached_of = [](const Sequence& s) { return s.cached; };
  const auto length_of = [](const Sequence& s) { return s.tokens.size(); };
  for (;;) {
    step.Clear();
    int32_t budget = limits_.max_tokens_per_step;
    std::vector<Row> chosen;

    // Decodes: every running sequence with one token left to feed. When
    // the pool runs dry, the latest admitted gives its blocks back.
    for (size_t i = 0; i < running_.size();) {
      Sequence* s = running_[i];
      if (s->tokens.size() - s->cached != 1) {
        ++i;
        continue;
      }
      bool fits = Reserve(*s, static_cast<int64_t>(s->tokens.size()));
      while (!fits) {
        Sequence* victim = running_.back();
        Preempt(*victim);
        if (victim == s) break;
        fits = Reserve(*s, static_cast<int64_t>(s->tokens.size()));
      }
      if (!fits) continue;  // s itself waits now; running_[i] is the next one
      chosen.push_back({s, 1, -1, s->cached, s->tokens.size()});
      --budget;
      ++i;
    }
    TakeChunks(budget, cached_of, length_of, chosen);

    if (chosen.empty()) {
      // Blocks held by sequences part way through their prefill, none able
      // to go on: the latest admitted gives its blocks back, and we plan
      // again (a sequence alone always fits: Add checked it).
      if (running_.empty()) return false;
      Preempt(*running_.back());
      continue;
    }
    WriteRows(chosen, step);
    return true;
  }
}

Sequence* Scheduler::Live(const PlannedStep& step, size_t i) {
  Sequence* s = Find(step.ids[i]);
  return s != nullptr && s->serial == step.serials[i] ? s : nullptr;
}

bool Scheduler::PlanAfter(const PlannedStep& launched, PlannedStep& step) {
  step.Clear();
  // What `launched` does to each of its sequences still held: the tokens it
  // feeds, and its row where it draws one (the token to come, which this
  // step feeds from the device).
  struct InFlight {
    int32_t fed = 0;
    int32_t row = -1;
  };
  std::unordered_map<const Sequence*, InFlight> flight;
  flight.reserve(launched.ids.size());
  for (size_t i = 0; i < launched.ids.size(); ++i)
    if (const Sequence* s = Live(launched, i))
      flight[s] = {launched.fed[i], launched.sample[i] != 0 ? static_cast<int32_t>(i) : -1};
  const auto in_flight = [&](const Sequence& s) {
    const auto it = flight.find(&s);
    return it == flight.end() ? InFlight{} : it->second;
  };
  // Tokens cached, and tokens known (the one to come included), once
  // `launched` is done.
  const auto cached_of = [&](const Sequence& s) {
    return s.cached + static_cast<size_t>(in_flight(s).fed);
  };
  const auto length_of = [&](const Sequence& s) {
    return s.tokens.size() + (in_flight(s).row >= 0 ? 1 : 0);
  };

  std::vector<Row> chosen;
  int32_t budget = limits_.max_tokens_per_step;
  // Decodes. None is preempted here: where the pool has no block for one,
  // the step is Plan's to make, once `launched` is collected.
  for (Sequence* s : running_) {
    const InFlight f = in_flight(*s);
    const size_t cached = cached_of(*s), length = length_of(*s);
    if (length - cached != 1) continue;
    // The token drawn in `launched` is its last: it ends there.
    if (f.row >= 0 && s->generated() + 1 >= s->max_tokens) continue;
    if (!Reserve(*s, static_cast<int64_t>(length))) return false;
    chosen.push_back({s, 1, f.row, cached, length});
    --budget;
  }
  TakeChunks(budget, cached_of, length_of, chosen);
  if (chosen.empty()) return false;
  WriteRows(chosen, step);
  return true;
}

void Scheduler::Commit(const PlannedStep& step, std::span<const int32_t> next) {
  for (size_t i = 0; i < step.ids.size(); ++i) {
    Sequence* s = Live(step, i);
    if (s == nullptr) continue;
    s->cached += static_cast<size_t>(step.fed[i]);
    if (step.sample[i] != 0) s->tokens.push_back(next[i]);
  }
}

}  // namespace hearth::llm
