#include "server/worker_exchange.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <optional>
#include <utility>
#include <vector>

namespace hearth {
namespace {

class RealExchangeClock final : public ExchangeClock {
 public:
  Clock::time_point Now() const override { return Clock::now(); }
  Status WaitReadable(int fd, int timeout_ms) const override {
    pollfd p{fd, POLLIN, 0};
    for (;;) {
      const int n = ::poll(&p, 1, timeout_ms);
      if (n > 0) return Status::Ok();
      if (n == 0) return DeadlineExceeded("timeout");
      if (errno != EINTR) return ErrnoError("control poll", errno);
    }
  }
};

}  // namespace

const ExchangeClock& ExchangeClock::Real() {
  static const RealExchangeClock clock;
  return clock;
}

Answer Answer::Failed(const Status& why) {
  Answer a;
  a.ending = why.code() == StatusCode::kDeadlineExceeded  ? Ending::kTimedOut
             : why.code() == StatusCode::kInvalidArgument ? Ending::kMalformed
                                                          : Ending::kGone;
  a.why = why;
  return a;
}

WorkerExchange::WorkerExchange(int control, RequestSlot& slot, OutputSignature outputs,
                               uint64_t slot_limit, const ExchangeClock& clock)
    : control_(control), slot_(slot), outputs_(outputs), slot_limit_(slot_limit), clock_(clock) {}

bool WorkerExchange::GoneWhileIdle(int timeout_ms) const {
  return clock_.WaitReadable(control_, timeout_ms).ok();
}

Status WorkerExchange::Send(const control::Run& run) {
  // End-of-file, or it spoke unasked: whatever it says next is no answer to this run.
  pollfd gone{control_, POLLIN, 0};
  if (::poll(&gone, 1, 0) > 0)
    return Unavailable("the worker closed its control socket or spoke unasked before the run");
  return control::SendRun(control_, run);
}

Status WorkerExchange::Release(std::span<const uint64_t> ids) {
  return control::SendRelease(control_, ids);
}

Result<control::Message> WorkerExchange::Receive(std::initializer_list<control::Kind> kinds,
                                                 std::optional<Clock::time_point> deadline,
                                                 int timeout_ms) {
  if (deadline) {
    const int64_t left =
        std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - clock_.Now()).count();
    timeout_ms = static_cast<int>(std::clamp<int64_t>(left, 0, INT_MAX));
  }
  RETURN_IF_ERROR(clock_.WaitReadable(control_, timeout_ms));
  // Readable: a message, end-of-file or an error is there to be read.
  return control::ReceiveKind(control_, 0, kinds);
}

Answer WorkerExchange::Await(const control::Run& run, std::initializer_list<control::Kind> kinds,
                             std::optional<Clock::time_point> deadline, int timeout_ms) {
  Result<control::Message> m = Receive(kinds, deadline, timeout_ms);
  // The worker asks for more room for the outputs it places: each time for
  // more than the slot has, and a bounded number of times.
  for (int rounds = 0; m.ok() && m->kind == control::Kind::kDone && m->done.seq == run.seq &&
                       m->done.room_needed > 0;
       ++rounds) {
    if (m->done.room_needed <= slot_.size() || rounds >= kMaxRoomRounds) {
      m = InvalidArgument("it asked for room it had, or more than 16 times");
      break;
    }
    if (Status grown = slot_.Reserve(m->done.room_needed, slot_limit_); !grown.ok()) {
      Answer a;
      a.ending = Ending::kNoRoom;
      a.why = std::move(grown);
      return a;
    }
    Status sent = control::SendRoom(control_, control::Room{run.seq, slot_.size()});
    m = sent.ok() ? Receive(kinds, deadline, timeout_ms) : Result<control::Message>(sent);
  }
  if (!m.ok()) return Answer::Failed(m.status());
  Answer a;
  a.done = std::move(m->done);
  a.ending = a.done.seq == run.seq ? Ending::kAnswered : Ending::kOtherRun;
  return a;
}

Answer WorkerExchange::AwaitDone(const control::Run& run, Clock::time_point deadline) {
  return Await(run, {control::Kind::kDone}, deadline, 0);
}

Status WorkerExchange::CheckAnswer(const control::Run& run, const control::Done& d,
                                   int64_t rows) const {
  const std::span<const TensorSpec> specs = outputs_.specs;
  Status checked = d.outputs.size() == specs.size()
                       ? Status::Ok()
                       : InvalidArgument("answer for " + std::to_string(d.outputs.size()) +
                                         " outputs of " + std::to_string(specs.size()));
  const std::vector<uint64_t> output_room = control::SlotRooms(run, true);
  for (size_t i = 0; checked.ok() && i < d.outputs.size(); ++i) {
    const TensorSpec& spec = specs[i];
    const std::string what = "output " + Describe(spec);
    if (run.output_placed[i] && d.outputs[i] != run.outputs[i]) {
      checked = InvalidArgument(what + " is not where the server placed it");
      break;
    }
    checked = control::CheckShape(spec, outputs_.batching, rows, d.outputs[i].shape, what);
    if (checked.ok())
      checked = control::CheckSlotTensor(
          d.outputs[i], spec.dtype, 0, slot_.size(), slot_.data(), what,
          run.output_placed[i] ? std::optional(output_room[i]) : std::nullopt);
  }
  return checked;
}

}  // namespace hearth
