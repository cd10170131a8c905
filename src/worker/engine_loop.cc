#include "worker/engine_loop.h"

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace hearth {
namespace {

// The engine's responses, straight into the session's ring. Keeps which
// requests are open on the engine's side (added, not yet ended) and the
// first error of the session's, which ends the worker whatever the engine
// makes of it.
class SessionSink final : public ResponseSink {
 public:
  explicit SessionSink(WorkerSession& session) : session_(session) {}

  Result<std::byte*> Output(uint64_t id, size_t i, std::span<const int64_t> shape,
                            uint64_t bytes) override {
    if (!broken_.ok()) return broken_;
    if (open_.count(id) == 0)
      return Fail(FailedPrecondition("the engine gave an output to request " + std::to_string(id) +
                                     ", which it does not hold"));
    auto room = session_.StreamOutput(id, i, shape, bytes);
    if (!room.ok()) return Fail(room.status().WithContext("request " + std::to_string(id)));
    building_ = id;
    return *room;
  }

  Result<bool> End(uint64_t id, bool final, const Status& status) override {
    if (!broken_.ok()) return broken_;
    if (building_.has_value() && *building_ != id)
      return Fail(FailedPrecondition("the engine ended a response to request " +
                                     std::to_string(id) + " while one to request " +
                                     std::to_string(*building_) + " is half built"));
    auto sent = session_.StreamRespond(id, final, status);
    if (!sent.ok()) return Fail(sent.status());
    building_.reset();
    if (!*sent || final || !status.ok()) Forget(id);
    return *sent;
  }

  // The request's inputs, as the engine was given them: kept (the engine
  // keeps views of them) until the request ends.
  std::vector<EngineInput>& Inputs(uint64_t id) { return inputs_[id]; }
  void Added(uint64_t id) { open_.insert(id); }
  void Forget(uint64_t id) {
    open_.erase(id);
    inputs_.erase(id);
  }
  const Status& broken() const { return broken_; }
  const std::optional<uint64_t>& building() const { return building_; }
  const std::set<uint64_t>& open() const { return open_; }

  // Ends every open request with `why` (half-built response first: the
  // session sends nothing else while one is built), cancelling each in the
  // engine.
  Status EndAll(Engine& engine, const Status& why) {
    std::vector<uint64_t> ids;
    if (building_.has_value()) ids.push_back(*building_);
    for (uint64_t id : open_)
      if (id != building_) ids.push_back(id);
    for (uint64_t id : ids) {
      engine.Cancel(id);
      auto sent = session_.StreamRespond(id, true, why);
      if (!sent.ok()) return sent.status();
      building_.reset();
    }
    open_.clear();
    inputs_.clear();
    return Status::Ok();
  }

 private:
  Status Fail(Status s) {
    broken_ = s;
    return s;
  }

  WorkerSession& session_;
  std::set<uint64_t> open_;
  std::map<uint64_t, std::vector<EngineInput>> inputs_;
  std::optional<uint64_t> building_;
  Status broken_ = Status::Ok();
};

Status Open(WorkerSession& session, Engine& engine, SessionSink& sink, uint64_t id) {
  const control::Open* open = session.StreamRequest(id);
  if (open == nullptr) return Internal("request " + std::to_string(id) + " was opened, not held");
  std::vector<EngineInput>& inputs = sink.Inputs(id);
  inputs.resize(open->inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i)
    inputs[i] = {session.StreamInput(id, i), open->inputs[i].shape};
  const EngineRequest request{inputs, open->parameters_json, session.StreamResume(id)};
  const Status added = engine.Add(id, request);
  if (added.code() == StatusCode::kDeviceLost) return added;
  if (added.ok()) {
    sink.Added(id);
    return Status::Ok();
  }
  sink.Forget(id);
  return session.StreamRespond(id, true, added).status();
}

// The engine's counters go to the server when they changed, at most once
// every kStatsEvery steps while it is busy, and when it falls idle.
constexpr int kStatsEvery = 32;

Status MaybeSendCounters(WorkerSession& session, const Engine& engine, EngineCounters& sent,
                         int& steps) {
  const EngineCounters now = engine.counters();
  if (now == sent) return Status::Ok();
  if (engine.busy() && ++steps < kStatsEvery) return Status::Ok();
  steps = 0;
  sent = now;
  return session.SendEngineStats({now.kv_blocks_used, now.kv_blocks_total, now.preemptions});
}

}  // namespace

Status ServeStreams(WorkerSession& session, Engine& engine) {
  SessionSink sink(session);
  EngineCounters sent;
  int steps = 0;
  RETURN_IF_ERROR(MaybeSendCounters(session, engine, sent, steps));
  for (;;) {
    ASSIGN_OR_RETURN(const WorkerSession::StreamEvent event,
                     session.NextStreamEvent(engine.busy() ? 0 : -1));
    switch (event.type) {
      case WorkerSession::StreamEvent::kClosed:
        return Status::Ok();
      case WorkerSession::StreamEvent::kOpened:
        RETURN_IF_ERROR(Open(session, engine, sink, event.id));
        continue;
      case WorkerSession::StreamEvent::kCancelled:
        engine.Cancel(event.id);
        sink.Forget(event.id);
        // A cancel can leave the engine idle, and the loop then waits for
        // the next event: what it holds now is told before that wait.
        if (!engine.busy()) RETURN_IF_ERROR(MaybeSendCounters(session, engine, sent, steps));
        continue;
      case WorkerSession::StreamEvent::kNone:
        break;
    }
    if (!engine.busy()) continue;
    Status stepped = engine.Step(sink);
    if (!sink.broken().ok()) return sink.broken();
    if (stepped.code() == StatusCode::kDeviceLost) return stepped;
    if (stepped.ok() && sink.building().has_value())
      stepped = Internal("the engine's step left its response to request " +
                         std::to_string(*sink.building()) + " unsent");
    if (!stepped.ok()) RETURN_IF_ERROR(sink.EndAll(engine, stepped));
    RETURN_IF_ERROR(MaybeSendCounters(session, engine, sent, steps));
  }
}

}  // namespace hearth
