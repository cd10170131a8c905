#include "server/stream_runner.h"

#include <algorithm>
#include <cstring>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "server/crash_retry.h"

namespace hearth {

namespace {
constexpr uint64_t kAlign = 64;
uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
}  // namespace

SlotSpace::SlotSpace(uint64_t size) { Grow(size); }

std::optional<uint64_t> SlotSpace::Take(uint64_t bytes) {
  bytes = AlignUp(std::max<uint64_t>(bytes, 1));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t at = it->first;
    const uint64_t left = it->second - bytes;
    free_.erase(it);
    if (left > 0) free_.emplace(at + bytes, left);
    taken_.emplace(at, bytes);
    return at;
  }
  return std::nullopt;
}

bool SlotSpace::Give(uint64_t offset) {
  auto it = taken_.find(offset);
  if (it == taken_.end()) return false;
  uint64_t at = it->first, bytes = it->second;
  taken_.erase(it);
  // Joined with the free runs on either side.
  auto next = free_.lower_bound(at);
  if (next != free_.end() && next->first == at + bytes) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == at) {
      at = prev->first;
      bytes += prev->second;
      free_.erase(prev);
    }
  }
  free_.emplace(at, bytes);
  return true;
}

void SlotSpace::Grow(uint64_t size) {
  size = size / kAlign * kAlign;
  if (size <= size_) return;
  const uint64_t old = size_;
  size_ = size;
  // The new bytes join the last free run when it ends where they begin.
  if (!free_.empty()) {
    auto last = std::prev(free_.end());
    if (last->first + last->second == old) {
      last->second += size - old;
      return;
    }
  }
  free_.emplace(old, size - old);
}

uint64_t SlotSpace::taken_bytes() const {
  uint64_t n = 0;
  for (const auto& [at, bytes] : taken_) n += bytes;
  return n;
}

StreamRunner::StreamRunner(const StreamModel& model, int control, RequestSlot& slot,
                           uint32_t capacity, uint64_t slot_limit, ModelStats& stats,
                           JobQueue& queue)
    : model_(model),
      control_(control),
      slot_(slot),
      capacity_(std::max<uint32_t>(capacity, 1)),
      slot_limit_(slot_limit),
      stats_(stats),
      queue_(queue),
      space_(slot.size()) {}

bool StreamRunner::Gone(std::string why, bool malformed) {
  if (why_.empty()) {
    why_ = std::move(why);
    malformed_ = malformed;
  }
  return false;
}

Result<uint64_t> StreamRunner::Place(uint64_t bytes) {
  if (auto at = space_.Take(bytes)) return *at;
  // Twice the slot, or what it lacks: a few doublings cover a stream's
  // worth of requests.
  const uint64_t want = std::max(2 * slot_.size(), slot_.size() + AlignUp(bytes));
  RETURN_IF_ERROR(slot_.Reserve(std::min(want, slot_limit_), slot_limit_));
  space_.Grow(slot_.size());
  if (auto at = space_.Take(bytes)) return *at;
  return ResourceExhausted("model '" + model_.name + "': " + std::to_string(bytes) +
                           " bytes of inputs do not fit in the worker's slot (at most " +
                           std::to_string(slot_limit_) + " bytes, " +
                           std::to_string(space_.taken_bytes()) + " of them in use)");
}

bool StreamRunner::Begin(std::optional<control::Ring> given) {
  if (given.has_value()) {
    // The warm-up's runner took the ring first, at the slot's start.
    auto at = space_.Take(given->bytes);
    if (!at.has_value() || *at != given->offset)
      return Gone("the hot spare's ring does not lie where its slot says", false);
    ring_ = *given;
    return true;
  }
  Result<uint64_t> at = Place(kInitialRingBytes);
  if (!at.ok()) return Gone(at.status().message(), false);
  ring_ = control::Ring{*at, kInitialRingBytes, slot_.size()};
  Status sent = control::SendRing(control_, ring_);
  if (!sent.ok()) return Gone("died (" + sent.message() + ")", false);
  return true;
}

bool StreamRunner::Open(const std::shared_ptr<Job>& job) {
  if (job->stream == nullptr) job->stream = std::make_shared<StreamProgress>();
  const StreamProgress& progress = *job->stream;
  const auto answer = [&](const Status& why) {
    job->done(why.WithContext("model '" + model_.name + "'"));
    return true;
  };
  // Inputs one after the other, 64-byte aligned, then the resume tokens.
  std::vector<const InferTensor*> tensors;
  uint64_t bytes = 0;
  for (size_t i = 0; i < model_.inputs.size(); ++i) {
    const TensorSpec& spec = model_.inputs[i];
    auto it = std::find_if(job->request.inputs.begin(), job->request.inputs.end(),
                           [&](const InferTensor& t) { return t.name == spec.name; });
    if (it == job->request.inputs.end() && i < model_.optional.size() && model_.optional[i]) {
      tensors.push_back(nullptr);  // absent
      continue;
    }
    if (it == job->request.inputs.end())
      return answer(InvalidArgument("input '" + spec.name + "' is missing"));
    if (it->shm && it->shm->cuda)
      return answer(InvalidArgument("input '" + spec.name +
                                    "': a stream's inputs cannot be in CUDA shared memory"));
    tensors.push_back(&*it);
    bytes = AlignUp(bytes) + it->data.size();
  }
  const uint64_t resume_at = AlignUp(bytes);
  const uint64_t resume_bytes = progress.token_ids.size() * sizeof(int64_t);
  bytes = resume_at + resume_bytes;
  if (progress.token_ids.size() > control::kMaxResumeTokens)
    return answer(ResourceExhausted("the stream has " + std::to_string(progress.token_ids.size()) +
                                    " tokens, past what it can resume from"));
  Result<uint64_t> region = Place(bytes);
  if (!region.ok()) return answer(region.status());
  control::Open open;
  open.id = ++next_id_;
  open.request_id = job->request.id;
  open.slot_bytes = slot_.size();
  open.parameters_json = job->request.parameters_json;
  uint64_t at = *region;
  for (const InferTensor* t : tensors) {
    if (t == nullptr) {
      open.inputs.push_back({0, 0, {}});
      continue;
    }
    at = AlignUp(at);
    const auto data = t->data.bytes();
    if (!data.empty()) std::memcpy(slot_.data() + at, data.data(), data.size());
    open.inputs.push_back({at, data.size(), t->shape});
    at += data.size();
  }
  open.resume = {
      *region + resume_at, resume_bytes, {static_cast<int64_t>(progress.token_ids.size())}};
  if (resume_bytes > 0)
    std::memcpy(slot_.data() + open.resume.offset, progress.token_ids.data(), resume_bytes);
  if (progress.token_ids.empty()) open.resume.offset = 0;
  Status sent = control::SendOpen(control_, open);
  if (!sent.ok()) {
    space_.Give(*region);
    // Refused by the encoder: the request's fault, and nothing was sent.
    if (sent.code() == StatusCode::kInvalidArgument) return answer(sent);
    queue_.PushFront(job);
    return Gone("died (" + sent.message() + ")", false);
  }
  if (streams_.empty()) last_heard_ = Clock::now();
  streams_.emplace(open.id, Stream{job, *region, false});
  stats_.streams_opened += 1;
  if (progress.responses > 0) stats_.streams_resumed += 1;
  return true;
}

void StreamRunner::Finish(std::map<uint64_t, Stream>::iterator it) {
  space_.Give(it->second.region);
  streams_.erase(it);
}

void StreamRunner::Cancel(uint64_t id, Stream& s, const Status& why) {
  if (s.cancelled) return;
  s.cancelled = true;
  s.job->done(why);
  to_cancel_.push_back(id);
}

bool StreamRunner::FlushCancels() {
  if (to_cancel_.empty()) return true;
  Status sent = control::SendCancel(control_, to_cancel_);
  to_cancel_.clear();
  if (!sent.ok()) return Gone("died (" + sent.message() + ")", false);
  return true;
}

InferResponse StreamResponse(const StreamModel& model, const Job& job,
                             std::vector<std::optional<InferTensor>>& outputs) {
  InferResponse response;
  response.model = model.name;
  response.version = model.version;
  response.id = job.request.id;
  const auto& wanted = job.request.outputs;
  for (auto& t : outputs) {
    if (!t.has_value()) continue;
    const bool asked =
        wanted.empty() || std::any_of(wanted.begin(), wanted.end(),
                                      [&](const RequestedOutput& o) { return o.name == t->name; });
    if (asked) response.outputs.push_back(std::move(*t));
  }
  return response;
}

bool StreamRunner::HandleResponse(control::Response& r) {
  auto it = streams_.find(r.id);
  if (it == streams_.end())
    return Gone("sent a response for request " + std::to_string(r.id) + ", which is not open",
                true);
  Stream& s = it->second;
  ++responses_;
  if (s.cancelled) {
    // Its job is answered; what it sends until its final response is not read.
    if (r.final) Finish(it);
    return true;
  }
  Job& job = *s.job;
  if (r.status_code != 0) {
    // Counted failed by the job's done (Server::Impl::Counted), as every request.
    job.done(Status(static_cast<StatusCode>(r.status_code), r.text));
    Finish(it);
    return true;
  }
  // Checked, then copied out of the ring, then the copy's BYTES checked:
  // the worker may write the ring again once this is credited, or before.
  if (r.outputs.size() != model_.outputs.size() || r.present.size() != model_.outputs.size()) {
    job.done(Internal("model '" + model_.name + "': the worker's response is malformed"));
    Finish(it);
    return Gone("sent a response for " + std::to_string(r.outputs.size()) + " outputs of " +
                    std::to_string(model_.outputs.size()),
                true);
  }
  std::vector<std::optional<InferTensor>> outputs(model_.outputs.size());
  for (size_t i = 0; i < model_.outputs.size(); ++i) {
    if (!r.present[i]) continue;
    const TensorSpec& spec = model_.outputs[i];
    const std::string what = "output " + Describe(spec);
    const control::SlotTensor& t = r.outputs[i];
    Status checked = control::CheckShape(spec, model_.batching, 1, t.shape, what);
    if (checked.ok())
      checked = control::CheckSlotTensor(t, spec.dtype, ring_.offset, ring_.offset + ring_.bytes,
                                         nullptr, what);
    std::vector<std::byte> bytes;
    if (checked.ok()) {
      bytes.assign(slot_.data() + t.offset, slot_.data() + t.offset + t.bytes);
      if (spec.dtype == DType::kBytes) {
        Result<uint64_t> count = ShapeElements(t.shape, what);
        checked = count.ok() ? ValidateBytesTensor(bytes, *count, what) : count.status();
      }
    }
    if (!checked.ok()) {
      job.done(Internal("model '" + model_.name +
                        "': the worker's response is malformed: " + checked.message()));
      Finish(it);
      return Gone("sent a malformed response: " + checked.message(), true);
    }
    outputs[i] = InferTensor(spec.name, spec.dtype, t.shape, std::move(bytes));
  }
  StreamProgress& progress = *job.stream;
  if (model_.token_ids >= 0 && outputs[static_cast<size_t>(model_.token_ids)].has_value()) {
    const auto b = outputs[static_cast<size_t>(model_.token_ids)]->data.bytes();
    const size_t n = b.size() / sizeof(int64_t);
    const size_t had = progress.token_ids.size();
    progress.token_ids.resize(had + n);
    if (n > 0) std::memcpy(progress.token_ids.data() + had, b.data(), n * sizeof(int64_t));
  }
  if (model_.counted_tokens >= 0 && outputs[static_cast<size_t>(model_.counted_tokens)].has_value())
    stats_.stream_tokens +=
        outputs[static_cast<size_t>(model_.counted_tokens)]->data.size() / sizeof(int64_t);
  stats_.stream_responses += 1;
  if (progress.responses == 0)
    stats_.CountFirstResponse(static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - job.received)
            .count()));
  ++progress.responses;
  const bool streaming = static_cast<bool>(job.request.on_response);
  if (!streaming) {
    Status joined = Status::Ok();
    if (progress.joined.size() != model_.outputs.size())
      progress.joined.resize(model_.outputs.size());
    for (size_t i = 0; i < outputs.size() && joined.ok(); ++i)
      if (outputs[i].has_value())
        joined = JoinPiece(progress.joined[i], model_.outputs[i], outputs[i]->shape,
                           outputs[i]->data.bytes());
    if (!joined.ok()) {
      // Its last response ended it: there is nothing left to cancel.
      if (r.final) {
        job.done(joined);
        Finish(it);
      } else {
        Cancel(it->first, s, joined);
      }
      return true;
    }
    if (!r.final) return true;
    std::vector<std::optional<InferTensor>> whole(model_.outputs.size());
    for (size_t i = 0; i < model_.outputs.size(); ++i) {
      JoinedOutput& j = progress.joined[i];
      if (!j.seen) continue;
      InferTensor t(model_.outputs[i].name, model_.outputs[i].dtype, j.shape);
      if (t.dtype == DType::kBytes) {
        std::vector<std::byte> out;
        for (const std::string& e : j.elements) {
          const auto len = static_cast<uint32_t>(e.size());
          const auto* l = reinterpret_cast<const std::byte*>(&len);
          out.insert(out.end(), l, l + 4);
          const auto* c = reinterpret_cast<const std::byte*>(e.data());
          out.insert(out.end(), c, c + e.size());
        }
        t.data = std::move(out);
      } else {
        t.data = std::move(j.bytes);
      }
      whole[i] = std::move(t);
    }
    stats_.requests += 1;
    stats_.request_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - job.received).count());
    job.done(StreamResponse(model_, job, whole));
    Finish(it);
    return true;
  }
  if (r.final) {
    stats_.requests += 1;
    stats_.request_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - job.received).count());
    job.done(StreamResponse(model_, job, outputs));
    Finish(it);
    return true;
  }
  const bool go_on = job.request.on_response(StreamResponse(model_, job, outputs));
  if (!go_on || (job.request.cancelled && job.request.cancelled->load()))
    Cancel(it->first, s,
           Unavailable("request '" + job.request.id + "' was cancelled: its client went away"));
  return true;
}

bool StreamRunner::GrowRing(uint64_t bytes) {
  if (bytes > slot_limit_ / 2)
    return Gone("asked for a response ring of " + std::to_string(bytes) +
                    " bytes, past the limit of " + std::to_string(slot_limit_ / 2),
                true);
  Result<uint64_t> at = Place(bytes);
  if (!at.ok()) return Gone(at.status().message(), false);
  const uint64_t old = ring_.offset;
  ring_ = control::Ring{*at, AlignUp(bytes), slot_.size()};
  Status sent = control::SendRing(control_, ring_);
  // The worker asked with every response taken, and writes nothing in the
  // old ring since: its bytes may hold requests' inputs now.
  space_.Give(old);
  if (!sent.ok()) return Gone("died (" + sent.message() + ")", false);
  return true;
}

bool StreamRunner::Pump(int timeout_ms) {
  uint32_t taken = 0;
  bool ok = true;
  for (bool first = true; ok; first = false) {
    Result<control::Message> m = control::Receive(control_, first ? timeout_ms : 0);
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kDeadlineExceeded) break;
      if (m.status().code() == StatusCode::kUnavailable) return Gone("died", false);
      return Gone("sent a malformed message (" + m.status().message() + ")", true);
    }
    last_heard_ = Clock::now();
    switch (m->kind) {
      case control::Kind::kResponse:
        ok = HandleResponse(m->response);
        ++taken;
        break;
      case control::Kind::kRingGrow:
        ok = GrowRing(m->ring_grow.bytes);
        break;
      case control::Kind::kEngineStats: {
        // Preemptions count up over the worker's life: a smaller count is a
        // broken worker's, and is not taken.
        const uint64_t had = engine_stats_.preemptions;
        engine_stats_ = m->engine_stats;
        if (engine_stats_.preemptions > had)
          stats_.preemptions += engine_stats_.preemptions - had;
        else
          engine_stats_.preemptions = had;
        break;
      }
      case control::Kind::kDone:
        // Fail(): the worker says why it stops.
        return Gone("stopped: " + m->done.text, false);
      default:
        return Gone("sent a message of kind " + std::to_string(static_cast<uint32_t>(m->kind)) +
                        " among streams",
                    true);
    }
    // Credits go back before the window can fill.
    if (ok && taken >= control::kMaxWindow / 2) {
      if (Status s = control::SendCredit(control_, control::Credit{taken}); !s.ok())
        return Gone("died (" + s.message() + ")", false);
      taken = 0;
    }
  }
  if (!ok) return false;
  if (taken > 0) {
    if (Status s = control::SendCredit(control_, control::Credit{taken}); !s.ok())
      return Gone("died (" + s.message() + ")", false);
  }
  return FlushCancels();
}

bool StreamRunner::CancelOver(Clock::time_point now) {
  for (auto& [id, s] : streams_) {
    if (s.cancelled) continue;
    const Job& job = *s.job;
    if (job.request.cancelled && job.request.cancelled->load()) {
      Cancel(id, s,
             Unavailable("request '" + job.request.id + "' was cancelled: its client went away"));
    } else if (now >= job.deadline) {
      Cancel(id, s,
             DeadlineExceeded("request '" + job.request.id + "' ran past its timeout after " +
                              std::to_string(job.stream->responses) + " responses"));
    }
  }
  return FlushCancels();
}

Clock::time_point StreamRunner::NextDeadline() const {
  Clock::time_point next = Clock::time_point::max();
  for (const auto& [id, s] : streams_)
    if (!s.cancelled) next = std::min(next, s.job->deadline);
  return next;
}

void StreamRunner::Abandon(const std::string& what) {
  for (auto& [id, s] : streams_) {
    if (s.cancelled) continue;
    const std::shared_ptr<Job>& job = s.job;
    const uint64_t sent = job->stream->responses;
    if (sent > 0 && model_.token_ids < 0) {
      job->done(Internal("model '" + model_.name + "': the worker serving this stream " + what +
                         " after " + std::to_string(sent) +
                         " responses; the model cannot resume a stream (parameters.resumable)"));
      continue;
    }
    if (sent > 0) ++job->stream->resumes;
    // Counts towards poison as a batch that took its worker down does.
    RetryAfterCrash(job, queue_, model_.name, "poison stream");
  }
  streams_.clear();
}

}  // namespace hearth
