// The live sequences of a model with sequence_batching (Triton's sequence
// batcher, as hearth runs it). The requests of one sequence run one at a
// time, in the order they came: a request whose sequence has one running
// waits here (at most kMaxWaitingPerSequence), not in the model's queue.
// Each request is handed on with the model's control inputs (START, END,
// READY, CORRID) and its sequence's implicit state as inputs; the state
// outputs of its answer become the sequence's state, and are taken out of
// the answer. The state is held here, by the server, not by a worker: a
// worker that dies mid-sequence loses nothing (its batch is run again, with
// the same state, by another), and any worker may run any request. Sequences
// idle past max_sequence_idle_microseconds are freed; at most max_sequences
// are live.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "server/inference_api.h"
#include "server/model_config.h"

namespace hearth {

inline constexpr size_t kMaxWaitingPerSequence = 64;

class SequenceTable : public std::enable_shared_from_this<SequenceTable> {
 public:
  using Clock = std::chrono::steady_clock;
  using Done = std::function<void(Result<InferResponse>)>;
  // Hands a request, its sequence's inputs added, to the model's queue;
  // `done` is how it is to be answered.
  using Dispatch = std::function<void(InferRequest, Done)>;

  SequenceTable(
      std::string model, SequenceBatching config, int max_sequences, bool batching,
      std::function<Clock::time_point()> now = [] { return Clock::now(); });

  // Takes `request` (admitted and validated: it names its sequence) into
  // its sequence, and dispatches it now, or once the sequence's earlier
  // requests are answered. An error (nothing dispatched, `done` not
  // called): a request of a sequence that was never started (or has ended,
  // or was freed when idle), a start past max_sequences, too many requests
  // waiting on their sequence, a sequence id of the wrong kind for the
  // CORRID input; then `request` and `done` are left as they were.
  Status Submit(InferRequest& request, Done& done, const Dispatch& dispatch);

  // Answers every request waiting on its sequence with `why` and forgets
  // every sequence (the model is going away).
  void FailAll(const Status& why);

  // Live sequences, for /metrics and tests.
  size_t size();

 private:
  struct Waiting {
    InferRequest request;
    Done done;
    Dispatch dispatch;
  };
  struct State {
    std::vector<int64_t> shape;  // per sample
    std::shared_ptr<const std::vector<std::byte>> bytes;
  };
  struct Sequence {
    bool running = false;
    bool ended = false;  // its END has been dispatched: nothing more may come but a START
    Clock::time_point last_used;
    std::vector<State> states;  // as config_.states
    std::deque<Waiting> waiting;
  };

  // Adds the control and state inputs to `request` and the state outputs
  // to what it asks for; returns the `done` that takes the state back.
  Done Prepare(const std::string& key, Sequence& sequence, InferRequest& request, Done done);
  void Finish(const std::string& key, bool end, std::vector<State> states, bool has_states);
  // Dispatches `next` (its sequence marked running); no lock held.
  void Run(const std::string& key, Waiting next);
  std::vector<State> Initial() const;
  void FreeIdle(Clock::time_point now);  // mu_ held

  const std::string model_;
  const SequenceBatching config_;
  const size_t max_sequences_;
  const bool batching_;
  const std::function<Clock::time_point()> now_;
  std::mutex mu_;
  std::map<std::string, Sequence> sequences_;
};

}  // namespace hearth
