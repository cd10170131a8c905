// The conversation with one ready worker over its control socket and its
// request slot (protocol/worker_protocol.h): a run sent, the worker's
// requests for room served, its answer (a batch's kDone) received within its time and
// checked before a byte of it is read, and a worker that closed its socket,
// sent what is no answer or ran past its time reported as such. It knows no
// process, queue or model: what becomes of the requests is its caller's
// (server/supervisor.h), as is the layout of the slot (server/batch_layout.h).
// A decoupled model's worker holds streams instead: server/stream_runner.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "common/tensor_spec.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/request_slot.h"

namespace hearth {

using Clock = std::chrono::steady_clock;

// Time as an exchange sees it: now, and a wait for the worker to speak.
// Tests replace it with a clock they drive. Implementations are
// thread-safe.
class ExchangeClock {
 public:
  virtual ~ExchangeClock() = default;
  virtual Clock::time_point Now() const = 0;
  // Waits up to timeout_ms (-1: for ever) for `fd` to be readable (a
  // message, end-of-file or an error): OK, or DeadlineExceeded("timeout")
  // when the time came first.
  virtual Status WaitReadable(int fd, int timeout_ms) const = 0;
  // steady_clock and poll(2).
  static const ExchangeClock& Real();
};

// How waiting for an answer ended.
enum class Ending {
  kAnswered,   // the run's kDone came; it may carry the model's error
  kGone,       // the socket closed, or a send or receive on it failed: the worker died
  kTimedOut,   // nothing came within the run's time
  kMalformed,  // a message that is no answer: undecodable, of a kind not expected, or
               // room asked for that the slot had, or more than kMaxRoomRounds times
  kOtherRun,   // an answer with another run's sequence number
  kNoRoom,     // the slot cannot grow to what the worker asked for: it would wait for ever
};

struct Answer {
  Ending ending = Ending::kAnswered;
  // kAnswered and kOtherRun: what came.
  control::Done done;
  // Every other ending: what went wrong (for kNoRoom, why the slot did not grow).
  Status why;
  // A failed send or receive as an ending: DeadlineExceeded is kTimedOut,
  // InvalidArgument kMalformed, anything else kGone.
  static Answer Failed(const Status& why);
};

// The outputs a worker's answers are checked against: the model's
// signature, and whether its tensors have a batch dimension.
struct OutputSignature {
  std::span<const TensorSpec> specs;
  bool batching = false;
};

// One ready worker's side of the conversation: its control socket and its
// slot, both owned by the caller and outliving the exchange. One thread at
// a time; nothing here blocks but for the waits on the socket, each
// bounded by the clock.
class WorkerExchange {
 public:
  // How often the worker may ask for room for one answer.
  static constexpr int kMaxRoomRounds = 16;

  // `slot_limit`: the most the slot may grow to for the worker's requests
  // for room.
  WorkerExchange(int control, RequestSlot& slot, OutputSignature outputs, uint64_t slot_limit,
                 const ExchangeClock& clock = ExchangeClock::Real());

  // Whether the worker, given no run, closed its socket or spoke unasked
  // within timeout_ms: either way it is done for.
  bool GoneWhileIdle(int timeout_ms) const;
  // Sends `run`, whose inputs are in the slot. Unavailable when the worker
  // was gone before it got it (closed, or spoke unasked); InvalidArgument
  // when the encoder refused it (over a message's limits), and then nothing
  // was sent and the worker is fine; another error: the socket failed.
  Status Send(const control::Run& run);
  // Between runs: close the CUDA regions of `ids` kept open (none: all).
  Status Release(std::span<const uint64_t> ids = {});

  // After Send: the run's kDone, by `deadline` however many times the slot
  // grows for it.
  Answer AwaitDone(const control::Run& run, Clock::time_point deadline);
  // The checks of a batch's kDone (status 0) of `rows` rows before a byte
  // of it is read: one tensor per output, each where the run placed it or
  // inside the slot, of its shape and size.
  Status CheckAnswer(const control::Run& run, const control::Done& done, int64_t rows) const;

 private:
  // The next answer to `run` of one of `kinds`, serving requests for room
  // (in a kDone): waits up to timeout_ms each, or until `deadline` in all
  // when it is set.
  Answer Await(const control::Run& run, std::initializer_list<control::Kind> kinds,
               std::optional<Clock::time_point> deadline, int timeout_ms);
  Result<control::Message> Receive(std::initializer_list<control::Kind> kinds,
                                   std::optional<Clock::time_point> deadline, int timeout_ms);

  int control_;
  RequestSlot& slot_;
  OutputSignature outputs_;
  uint64_t slot_limit_;
  const ExchangeClock& clock_;
};

}  // namespace hearth
