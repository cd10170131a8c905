// The server's side of a decoupled model's worker (protocol/worker_protocol.h,
// "streams"): up to its capacity of requests open at once, each request's
// inputs in a region of the slot of its own, responses read from the ring
// the worker writes them into, copied out and checked, then handed to the
// request's client (or joined into its one answer), and credited back in
// one message per read. A stream whose worker dies goes on elsewhere from
// where it stopped when the model can resume it (StreamModel::token_ids).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/status.h"
#include "protocol/worker_protocol.h"
#include "server/job_queue.h"
#include "server/model_stats.h"
#include "server/request_slot.h"
#include "server/response_assembly.h"

namespace hearth {

// Regions of a slot: first fit, 64-byte aligned, never past its size.
class SlotSpace {
 public:
  explicit SlotSpace(uint64_t size = 0);
  // The offset of `bytes` (at least 1) taken, or none when no free run is
  // long enough.
  std::optional<uint64_t> Take(uint64_t bytes);
  // Gives back the region Take returned at `offset`; false if there is none.
  bool Give(uint64_t offset);
  // The slot is now `size` bytes (never less than before).
  void Grow(uint64_t size);
  uint64_t size() const { return size_; }
  uint64_t taken_bytes() const;

 private:
  std::map<uint64_t, uint64_t> free_;   // offset -> bytes, coalesced
  std::map<uint64_t, uint64_t> taken_;  // offset -> bytes
  uint64_t size_ = 0;
};

// What a stream's request keeps across the workers it runs on.
struct StreamProgress {
  // The token ids its client has: the model's `token_ids` output of every
  // response sent (or joined), in order.
  std::vector<int64_t> token_ids;
  uint64_t responses = 0;  // sent to the client, or joined
  // A request answered once (not streamed): the pieces so far.
  std::vector<JoinedOutput> joined;
  int resumes = 0;  // workers it went on from
};

// What a runner needs of its model.
struct StreamModel {
  std::string name;
  std::string version;
  std::span<const TensorSpec> inputs, outputs;
  // Per input: a request may leave it out (it reaches the worker absent:
  // no bytes and no shape). Empty: none is optional.
  std::vector<bool> optional;
  bool batching = false;  // tensors have a batch dimension (of 1)
  // The output `token_ids` (INT64 [-1]) of a model that resumes streams
  // (parameters.resumable); -1: a stream whose worker died after it sent
  // something ends with an error.
  int token_ids = -1;
  // The output `token_ids` of any model (INT64): its ids are counted
  // (ModelStats::stream_tokens), whether or not the model resumes.
  int counted_tokens = -1;
};

// The ring a runner gives its worker at first, and the most the slot may
// grow to for its requests and ring.
inline constexpr uint64_t kInitialRingBytes = 1u << 20;

class StreamRunner {
 public:
  // `requeue`: where a stream goes when its worker is gone (the model's
  // queue, at the front; RetryAfterCrash decides whether it may go on).
  StreamRunner(const StreamModel& model, int control, RequestSlot& slot, uint32_t capacity,
               uint64_t slot_limit, ModelStats& stats, JobQueue& queue);

  // Gives the worker its ring: a new one, or `given` (a hot spare's, placed
  // at the slot's start by the runner that warmed it up). False: the worker
  // is gone (why()).
  bool Begin(std::optional<control::Ring> given = std::nullopt);
  const control::Ring& ring() const { return ring_; }

  size_t in_flight() const { return streams_.size(); }
  bool has_room() const { return streams_.size() < capacity_; }

  // Places the job's inputs (and the token ids its client has, when it
  // resumes) and opens it on the worker. A job at fault (its parameters
  // over the limit, its inputs past the slot's) is answered and true
  // returned; false: the worker is gone, and the job went back to the queue
  // as it was.
  bool Open(const std::shared_ptr<Job>& job);

  // Reads every message the worker has sent, waiting up to timeout_ms (-1:
  // for ever) for the first, and credits the responses taken. False: the
  // worker is gone or broke the protocol (why(), and whether it is
  // malformed(): then it is to be killed).
  bool Pump(int timeout_ms);

  // Cancels (kCancel, one message) the streams whose client went away or
  // whose deadline passed, each answered with why. False: the worker is gone.
  bool CancelOver(Clock::time_point now);
  // The earliest deadline of a stream not yet cancelled (max: none).
  Clock::time_point NextDeadline() const;
  // When the worker last spoke (or the last stream was opened).
  Clock::time_point last_heard() const { return last_heard_; }

  // The worker is gone: each stream goes on elsewhere (back to the queue's
  // front, as RetryAfterCrash allows) or, when it sent something and the
  // model cannot resume, ends with an error naming `what` happened.
  void Abandon(const std::string& what);

  const std::string& why() const { return why_; }
  uint64_t responses() const { return responses_; }  // taken from this worker
  // What the worker's engine last said it holds (kEngineStats; zero until it does).
  const control::EngineStats& engine_stats() const { return engine_stats_; }
  bool malformed() const { return malformed_; }

 private:
  struct Stream {
    std::shared_ptr<Job> job;
    uint64_t region = 0;     // its inputs' place in the slot
    bool cancelled = false;  // kCancel sent: its job is answered; waiting for its final response
  };
  bool HandleResponse(control::Response& r);
  bool GrowRing(uint64_t bytes);
  // A region of `bytes`, the slot growing for it if need be.
  Result<uint64_t> Place(uint64_t bytes);
  // The stream's job answered with `why`, a kCancel queued for the worker.
  void Cancel(uint64_t id, Stream& s, const Status& why);
  bool FlushCancels();
  bool Gone(std::string why, bool malformed);
  void Finish(std::map<uint64_t, Stream>::iterator it);

  const StreamModel& model_;
  int control_;
  RequestSlot& slot_;
  uint32_t capacity_;
  uint64_t slot_limit_;
  ModelStats& stats_;
  JobQueue& queue_;
  SlotSpace space_;
  control::Ring ring_;
  uint64_t next_id_ = 0;
  std::map<uint64_t, Stream> streams_;
  std::vector<uint64_t> to_cancel_;
  Clock::time_point last_heard_ = Clock::now();
  std::string why_;
  bool malformed_ = false;
  control::EngineStats engine_stats_;
  uint64_t responses_ = 0;
};

// A stream request's response: its outputs the client asked for (all when
// it named none), as InferTensors owning their bytes.
InferResponse StreamResponse(const StreamModel& model, const Job& job,
                             std::vector<std::optional<InferTensor>>& outputs);

}  // namespace hearth
