// The default pipeline of Executor (llm_model.h): Launch keeps the batch,
// Collect runs it through Step with the tokens it feeds from the step before.
#include <string>

#include "backends/llm/llm_model.h"

namespace hearth::llm {

Status CheckFeedPrevious(const StepBatch& batch, std::span<const uint8_t> previous_sample) {
  if (batch.feed_previous.empty()) return Status::Ok();
  if (batch.feed_previous.size() != batch.num_seqs() ||
      batch.offsets.size() != batch.num_seqs() + 1)
    return InvalidArgument("the step's feed_previous holds " +
                           std::to_string(batch.feed_previous.size()) + " entries for " +
                           std::to_string(batch.num_seqs()) + " sequences");
  for (size_t i = 0; i < batch.feed_previous.size(); ++i) {
    const int32_t j = batch.feed_previous[i];
    if (j < 0) continue;
    const std::string what = "sequence " + std::to_string(i) + " feeds the token drawn for ";
    if (static_cast<size_t>(j) >= previous_sample.size() || previous_sample[j] == 0)
      return InvalidArgument(what + "sequence " + std::to_string(j) +
                             " of the step before, which " +
                             (static_cast<size_t>(j) >= previous_sample.size()
                                  ? "had " + std::to_string(previous_sample.size()) + " sequences"
                                  : "drew none"));
    if (batch.offsets[i + 1] - batch.offsets[i] != 1)
      return InvalidArgument(what + "sequence " + std::to_string(j) +
                             " of the step before, and must feed that one token alone");
  }
  return Status::Ok();
}

Status Executor::DropLaunched(Status why) {
  launched_.clear();
  last_sample_.clear();
  return why;
}

Status Executor::Launch(const StepBatch& batch) {
  if (launched_.size() >= static_cast<size_t>(kMaxLaunched))
    return FailedPrecondition(std::to_string(kMaxLaunched) +
                              " steps are launched already, none collected");
  if (Status fed = CheckFeedPrevious(batch, last_sample_); !fed.ok()) return DropLaunched(fed);
  launched_.push_back(batch);
  last_sample_.assign(batch.sample.begin(), batch.sample.end());
  return Status::Ok();
}

Status Executor::Collect(std::span<int32_t> next) {
  if (launched_.empty()) return FailedPrecondition("no step is launched");
  StepBatch batch = launched_.front();
  launched_.erase(launched_.begin());
  if (!batch.feed_previous.empty()) {
    fed_.assign(batch.tokens.begin(), batch.tokens.end());
    for (size_t i = 0; i < batch.feed_previous.size(); ++i) {
      const int32_t j = batch.feed_previous[i];
      if (j < 0) continue;
      // Checked at Launch against the step before, which ran last.
      fed_[static_cast<size_t>(batch.offsets[i])] = last_drawn_.at(static_cast<size_t>(j));
    }
    batch.tokens = fed_;
    batch.feed_previous = {};
  }
  if (next.size() != batch.num_seqs()) {
    return DropLaunched(InvalidArgument("Collect: next holds " + std::to_string(next.size()) +
                                        " tokens for the step's " +
                                        std::to_string(batch.num_seqs()) + " sequences"));
  }
  if (Status ran = Step(batch, next); !ran.ok()) return DropLaunched(ran);
  last_drawn_.assign(next.begin(), next.end());
  return Status::Ok();
}

}  // namespace hearth::llm
