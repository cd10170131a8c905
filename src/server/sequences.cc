#include "server/sequences.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <utility>

namespace hearth {
namespace {

template <typename T>
std::vector<std::byte> BytesOf(T value) {
  std::vector<std::byte> out(sizeof(T));
  std::memcpy(out.data(), &value, sizeof(T));
  return out;
}

// A START, END or READY flag as its input's type gives it.
std::vector<std::byte> Flag(const SequenceControl& control, bool on) {
  const double value = on ? control.true_value : control.false_value;
  switch (control.dtype) {
    case DType::kF32:
      return BytesOf(static_cast<float>(value));
    case DType::kBool:
      return BytesOf(static_cast<uint8_t>(value != 0 ? 1 : 0));
    default:
      return BytesOf(static_cast<int32_t>(value));
  }
}

// The correlation id as CORRID's type gives it (a 32-bit type: its low 32 bits).
std::vector<std::byte> CorrelationId(const SequenceControl& control, const InferRequest& r) {
  switch (control.dtype) {
    case DType::kU64:
    case DType::kI64:
      return BytesOf(r.sequence_number);
    case DType::kU32:
    case DType::kI32:
      return BytesOf(static_cast<uint32_t>(r.sequence_number & 0xffffffffu));
    default: {  // BYTES: one element, the id as text
      const std::string& text = r.sequence_id;
      std::vector<std::byte> out = BytesOf(static_cast<uint32_t>(text.size()));
      const auto* p = reinterpret_cast<const std::byte*>(text.data());
      out.insert(out.end(), p, p + text.size());
      return out;
    }
  }
}

std::string Describe(const InferRequest& r) {
  return r.sequence_id_is_string ? "'" + r.sequence_id + "'" : r.sequence_id;
}

}  // namespace

SequenceTable::SequenceTable(std::string model, SequenceBatching config, int max_sequences,
                             bool batching, std::function<Clock::time_point()> now)
    : model_(std::move(model)),
      config_(std::move(config)),
      max_sequences_(static_cast<size_t>(std::max(1, max_sequences))),
      batching_(batching),
      now_(std::move(now)) {}

Status SequenceTable::Submit(InferRequest& request, Done& done, const Dispatch& dispatch) {
  for (const SequenceControl& c : config_.controls) {
    if (c.kind == SequenceControl::Kind::kCorrid && c.dtype != DType::kBytes &&
        request.sequence_id_is_string)
      return InvalidArgument("model '" + model_ + "' takes its correlation id as " +
                             std::string(DTypeName(c.dtype)) + " (input '" + c.input +
                             "'): give sequence_id as an integer, not the string " +
                             Describe(request));
  }
  const std::string key = (request.sequence_id_is_string ? "s:" : "n:") + request.sequence_id;
  std::unique_lock lock(mu_);
  const Clock::time_point now = now_();
  FreeIdle(now);
  auto it = sequences_.find(key);
  if (!request.sequence_start) {
    if (it == sequences_.end())
      return InvalidArgument(
          "inference request for sequence " + Describe(request) + " to model '" + model_ +
          "' must specify the START flag on the first request of the "
          "sequence (sequence_start: true); a sequence idle for " +
          std::to_string(config_.max_idle_us) + " us or past its END is no longer live");
    if (it->second.ended)
      return InvalidArgument("sequence " + Describe(request) + " of model '" + model_ +
                             "' has ended (its END request came): start it again with "
                             "sequence_start: true");
  } else if (it == sequences_.end()) {
    if (sequences_.size() >= max_sequences_)
      return Unavailable("model '" + model_ + "' holds " + std::to_string(sequences_.size()) +
                         " live sequences, its limit (parameters.max_sequences): end one, or "
                         "wait for an idle one to be freed");
    it = sequences_.emplace(key, Sequence{}).first;
  }
  Sequence& sequence = it->second;
  const bool busy = sequence.running || !sequence.waiting.empty();
  if (busy && sequence.waiting.size() >= kMaxWaitingPerSequence)
    return ResourceExhausted("sequence " + Describe(request) + " of model '" + model_ + "' has " +
                             std::to_string(sequence.waiting.size()) +
                             " requests waiting for the one running, its limit");
  sequence.last_used = now;
  // A START (after an END, say) begins a new life of the same id.
  if (request.sequence_start) sequence.ended = false;
  if (request.sequence_end) sequence.ended = true;
  Waiting waiting{std::move(request), std::move(done), dispatch};
  if (busy) {
    sequence.waiting.push_back(std::move(waiting));
    return Status::Ok();
  }
  sequence.running = true;
  lock.unlock();
  Run(key, std::move(waiting));
  return Status::Ok();
}

void SequenceTable::Run(const std::string& key, Waiting next) {
  std::unique_lock lock(mu_);
  auto it = sequences_.find(key);
  if (it == sequences_.end()) {  // forgotten by FailAll meanwhile
    lock.unlock();
    next.done(Unavailable("model '" + model_ + "' is going away"));
    return;
  }
  Sequence& sequence = it->second;
  if (next.request.sequence_start) sequence.states = Initial();
  Done done = Prepare(key, sequence, next.request, std::move(next.done));
  lock.unlock();
  next.dispatch(std::move(next.request), std::move(done));
}

std::vector<SequenceTable::State> SequenceTable::Initial() const {
  std::vector<State> states;
  for (const SequenceState& s : config_.states) {
    const uint64_t bytes = TensorBytes(s.dtype, s.initial_dims).value_or(0);
    states.push_back(
        {s.initial_dims, s.initial_data.empty()
                             ? std::make_shared<const std::vector<std::byte>>(bytes)
                             : std::make_shared<const std::vector<std::byte>>(s.initial_data)});
  }
  return states;
}

SequenceTable::Done SequenceTable::Prepare(const std::string& key, Sequence& sequence,
                                           InferRequest& request, Done done) {
  std::vector<int64_t> one;
  if (batching_) one.push_back(1);
  for (const SequenceControl& c : config_.controls) {
    std::vector<int64_t> shape = one;
    shape.push_back(1);
    std::vector<std::byte> bytes;
    switch (c.kind) {
      case SequenceControl::Kind::kStart:
        bytes = Flag(c, request.sequence_start);
        break;
      case SequenceControl::Kind::kEnd:
        bytes = Flag(c, request.sequence_end);
        break;
      case SequenceControl::Kind::kReady:
        bytes = Flag(c, true);
        break;
      case SequenceControl::Kind::kCorrid:
        bytes = CorrelationId(c, request);
        break;
    }
    request.inputs.emplace_back(c.input, c.dtype, std::move(shape), std::move(bytes));
  }
  for (size_t i = 0; i < config_.states.size(); ++i) {
    const State& state = sequence.states[i];
    std::vector<int64_t> shape = one;
    shape.insert(shape.end(), state.shape.begin(), state.shape.end());
    request.inputs.emplace_back(config_.states[i].input, config_.states[i].dtype, std::move(shape),
                                TensorData::Shared(*state.bytes, state.bytes));
  }
  // Asked for some outputs only: the states too, which the answer then loses.
  if (!request.outputs.empty()) {
    for (const SequenceState& s : config_.states) {
      RequestedOutput o;
      o.name = s.output;
      request.outputs.push_back(std::move(o));
    }
  }
  return [weak = weak_from_this(), key, end = request.sequence_end, batching = batching_,
          outputs = config_.states, done = std::move(done)](Result<InferResponse> r) {
    std::vector<State> states;
    bool complete = r.ok();
    if (r.ok()) {
      for (const SequenceState& s : outputs) {
        auto at = std::find_if(r->outputs.begin(), r->outputs.end(),
                               [&](const InferTensor& t) { return t.name == s.output; });
        if (at == r->outputs.end() || (batching && at->shape.empty())) {
          complete = false;
          continue;
        }
        const std::span<const std::byte> bytes = at->data.bytes();
        states.push_back(
            {std::vector<int64_t>(at->shape.begin() + (batching ? 1 : 0), at->shape.end()),
             std::make_shared<const std::vector<std::byte>>(bytes.begin(), bytes.end())});
        r->outputs.erase(at);
      }
    }
    if (auto self = weak.lock()) self->Finish(key, end, std::move(states), complete);
    done(std::move(r));
  };
}

void SequenceTable::Finish(const std::string& key, bool end, std::vector<State> states,
                           bool has_states) {
  std::vector<Waiting> refused;
  std::optional<Waiting> next;
  {
    std::lock_guard lock(mu_);
    auto it = sequences_.find(key);
    if (it == sequences_.end()) return;
    Sequence& sequence = it->second;
    sequence.running = false;
    sequence.last_used = now_();
    if (has_states) sequence.states = std::move(states);
    bool over = end;
    while (!sequence.waiting.empty()) {
      Waiting w = std::move(sequence.waiting.front());
      sequence.waiting.pop_front();
      if (over && !w.request.sequence_start) {
        refused.push_back(std::move(w));
        continue;
      }
      next = std::move(w);
      break;
    }
    if (next) {
      sequence.running = true;
    } else if (over) {
      sequences_.erase(it);
    }
  }
  for (Waiting& w : refused)
    w.done(InvalidArgument("sequence " + Describe(w.request) + " of model '" + model_ +
                           "' ended before this request ran: start it again with "
                           "sequence_start: true"));
  if (next) Run(key, std::move(*next));
}

void SequenceTable::FreeIdle(Clock::time_point now) {
  const auto idle =
      std::chrono::microseconds(std::min<uint64_t>(config_.max_idle_us, uint64_t{1} << 50));
  std::erase_if(sequences_, [&](const auto& entry) {
    const Sequence& s = entry.second;
    return !s.running && s.waiting.empty() && now - s.last_used > idle;
  });
}

void SequenceTable::FailAll(const Status& why) {
  std::vector<Waiting> waiting;
  {
    std::lock_guard lock(mu_);
    for (auto& [key, sequence] : sequences_)
      for (Waiting& w : sequence.waiting) waiting.push_back(std::move(w));
    sequences_.clear();
  }
  for (Waiting& w : waiting) w.done(why);
}

size_t SequenceTable::size() {
  std::lock_guard lock(mu_);
  return sequences_.size();
}

}  // namespace hearth
