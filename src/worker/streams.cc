// The worker's side of streams (protocol/worker_protocol.h): requests
// opened and cancelled by the server, responses written into the ring under
// the window's credits.
#include <algorithm>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "worker/session.h"

namespace hearth {

using control::SlotTensor;

namespace {
constexpr uint64_t kAlign = 64;
uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
}  // namespace

Status WorkerSession::OpenStream(control::Open open) {
  const std::string what = "open message for request " + std::to_string(open.id);
  if (requests_.count(open.id) != 0) return InvalidArgument(what + ": it is open already");
  if (requests_.size() >= streams_)
    return InvalidArgument(what + ": " + std::to_string(requests_.size()) +
                           " requests are open, the most this worker holds");
  if (open.inputs.size() != inputs_.size())
    return InvalidArgument(what + ": " + std::to_string(open.inputs.size()) +
                           " inputs; the model has " + std::to_string(inputs_.size()));
  RETURN_IF_ERROR(MapSlot(open.slot_bytes));
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const std::string name = what + ": input " + Describe(inputs_[i]);
    // An optional input the request left out: no bytes and no shape (no
    // tensor has both: a scalar holds at least one element's bytes).
    if (open.inputs[i].bytes == 0 && open.inputs[i].shape.empty()) continue;
    RETURN_IF_ERROR(control::CheckShape(inputs_[i], batching(), 1, open.inputs[i].shape, name));
    RETURN_IF_ERROR(
        control::CheckSlotTensor(open.inputs[i], inputs_[i].dtype, 0, mapped_bytes_, slot_, name));
  }
  if (open.resume.bytes > 0)
    RETURN_IF_ERROR(control::CheckSlotTensor(open.resume, DType::kI64, 0, mapped_bytes_, slot_,
                                             what + ": resume tokens"));
  const uint64_t id = open.id;
  requests_.emplace(id, std::move(open));
  events_.push_back({StreamEvent::kOpened, id});
  return Status::Ok();
}

// A cancelled request ends at once with a final response of nothing: its
// inputs are the server's again.
Status WorkerSession::EndCancelled(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return Status::Ok();  // it had ended: crossed on the wire
  if (building_ == id) {
    building_.reset();
    written_ = building_from_;
  }
  return StreamRespond(id, true).status();
}

Status WorkerSession::TakeStreamMessage(int timeout_ms, bool* nothing) {
  *nothing = false;
  auto m = control::Receive(control_.get(), timeout_ms);
  if (!m.ok()) {
    if (m.status().code() == StatusCode::kDeadlineExceeded) {
      *nothing = true;
      return Status::Ok();
    }
    return m.status();
  }
  switch (m->kind) {
    case control::Kind::kRing: {
      const control::Ring& r = m->ring;
      if (ring_.bytes > 0 && !asked_ring_)
        return InvalidArgument("a ring message that was not asked for");
      if (r.offset % kAlign != 0 || r.bytes % kAlign != 0)
        return InvalidArgument("ring message: a ring at " + std::to_string(r.offset) + " of " +
                               std::to_string(r.bytes) + " bytes is not aligned to 64");
      if (!untaken_.empty())
        return InvalidArgument("ring message while responses in the old ring are not taken");
      RETURN_IF_ERROR(MapSlot(r.slot_bytes));
      ring_ = r;
      asked_ring_ = false;
      written_ = taken_ = 0;
      return Status::Ok();
    }
    case control::Kind::kOpen:
      if (ring_.bytes == 0) return InvalidArgument("a request opened before the ring was given");
      return OpenStream(std::move(m->open));
    case control::Kind::kCancel:
      // Ended from NextStreamEvent, where no response is being built.
      for (uint64_t id : m->cancel.ids)
        if (requests_.count(id) != 0 && cancels_.size() < control::kMaxStreams)
          cancels_.push_back(id);
      return Status::Ok();
    case control::Kind::kCredit:
      if (m->credit.responses > untaken_.size())
        return InvalidArgument("a credit for " + std::to_string(m->credit.responses) +
                               " responses; " + std::to_string(untaken_.size()) + " are not taken");
      for (uint32_t i = 0; i < m->credit.responses; ++i) {
        taken_ = untaken_.front();
        untaken_.pop_front();
      }
      return Status::Ok();
    case control::Kind::kRelease:
      if (m->release.ids.empty()) open_regions_.clear();
      for (uint64_t id : m->release.ids) open_regions_.erase(id);
      return Status::Ok();
    default:
      return InvalidArgument("unexpected control message of kind " +
                             std::to_string(static_cast<uint32_t>(m->kind)) + " for streams");
  }
}

Result<WorkerSession::StreamEvent> WorkerSession::NextStreamEvent(int timeout_ms) {
  if (!ready_) return FailedPrecondition("NextStreamEvent() before Ready()");
  if (!decoupled()) return FailedPrecondition("streams are for decoupled models");
  if (building_) return FailedPrecondition("NextStreamEvent() while a response is being built");
  for (;;) {
    while (!cancels_.empty()) {
      const uint64_t id = cancels_.front();
      cancels_.pop_front();
      if (requests_.count(id) == 0) continue;  // ended meanwhile
      RETURN_IF_ERROR(EndCancelled(id));
      return StreamEvent{StreamEvent::kCancelled, id};
    }
    while (!events_.empty()) {
      StreamEvent e = events_.front();
      events_.pop_front();
      // A request opened and ended (cancelled) before the caller heard of it.
      if (e.type == StreamEvent::kOpened && requests_.count(e.id) == 0) continue;
      return e;
    }
    bool nothing = false;
    Status taken = TakeStreamMessage(timeout_ms, &nothing);
    if (!taken.ok()) {
      if (taken.code() == StatusCode::kUnavailable) return StreamEvent{StreamEvent::kClosed, 0};
      return taken;
    }
    if (nothing) return StreamEvent{};
  }
}

const control::Open* WorkerSession::StreamRequest(uint64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

std::span<const std::byte> WorkerSession::StreamInput(uint64_t id, size_t i) const {
  const control::Open* open = StreamRequest(id);
  if (open == nullptr || i >= open->inputs.size()) return {};
  return {slot_ + open->inputs[i].offset, open->inputs[i].bytes};
}

std::span<const int64_t> WorkerSession::StreamResume(uint64_t id) const {
  const control::Open* open = StreamRequest(id);
  if (open == nullptr || open->resume.bytes == 0) return {};
  return {reinterpret_cast<const int64_t*>(slot_ + open->resume.offset),
          open->resume.bytes / sizeof(int64_t)};
}

// Waits until `needed` bytes from the write position fit in the ring: the
// server takes responses and credits them; when none is left untaken and
// they still do not fit, the ring grows (the response being built moves
// with it).
Status WorkerSession::WaitForRing(uint64_t needed) {
  for (;;) {
    const uint64_t at = written_ % ring_.bytes;
    const uint64_t skip = at + needed > ring_.bytes ? ring_.bytes - at : 0;
    if (written_ + skip + needed - taken_ <= ring_.bytes) return Status::Ok();
    bool nothing = false;
    if (!untaken_.empty()) {
      RETURN_IF_ERROR(TakeStreamMessage(-1, &nothing));
      continue;
    }
    // Alone in the ring and still too large: a larger ring.
    const uint64_t built = written_ - building_from_;
    const uint64_t want = std::max<uint64_t>(2 * ring_.bytes, AlignUp(2 * (built + needed)));
    if (want >= control::kMaxSlotBytes)
      return ResourceExhausted("a response of " + std::to_string(built + needed) +
                               " bytes is past the ring's limit");
    std::vector<std::byte> kept;
    for (size_t i = 0; i < built_.size(); ++i)
      if (built_present_[i])
        kept.insert(kept.end(), slot_ + built_[i].offset,
                    slot_ + built_[i].offset + built_[i].bytes);
    RETURN_IF_ERROR(control::SendRingGrow(control_.get(), control::RingGrow{want}));
    asked_ring_ = true;
    while (asked_ring_) RETURN_IF_ERROR(TakeStreamMessage(-1, &nothing));
    if (ring_.bytes < want)
      return InvalidArgument("the ring grew to " + std::to_string(ring_.bytes) +
                             " bytes, not the " + std::to_string(want) + " asked for");
    // The response built so far moves to the new ring's start.
    uint64_t at_new = 0;
    size_t from = 0;
    for (size_t i = 0; i < built_.size(); ++i) {
      if (!built_present_[i]) continue;
      at_new = AlignUp(at_new);
      std::copy(kept.begin() + static_cast<std::ptrdiff_t>(from),
                kept.begin() + static_cast<std::ptrdiff_t>(from + built_[i].bytes),
                slot_ + ring_.offset + at_new);
      from += built_[i].bytes;
      built_[i].offset = ring_.offset + at_new;
      at_new += built_[i].bytes;
    }
    building_from_ = 0;
    written_ = at_new;
  }
}

Status WorkerSession::SendEngineStats(const control::EngineStats& stats) {
  return control::SendEngineStats(control_.get(), stats);
}

Result<std::byte*> WorkerSession::StreamOutput(uint64_t id, size_t i,
                                               std::span<const int64_t> shape, uint64_t bytes) {
  if (!decoupled() || !ready_) return FailedPrecondition("StreamOutput() outside streams");
  if (requests_.count(id) == 0)
    return FailedPrecondition("request " + std::to_string(id) + " is not open");
  if (building_ && *building_ != id)
    return FailedPrecondition("a response for request " + std::to_string(*building_) +
                              " is being built; send it first");
  RETURN_IF_ERROR(CheckOutput(i, 1, shape, bytes));
  const std::string what = "output " + Describe(outputs_[i]);
  if (!building_) {
    building_ = id;
    building_from_ = written_;
    built_.assign(outputs_.size(), SlotTensor{});
    built_present_.assign(outputs_.size(), 0);
  }
  if (built_present_[i]) return InvalidArgument(what + " was given room in this response already");
  written_ = AlignUp(written_);
  RETURN_IF_ERROR(WaitForRing(bytes));
  uint64_t at = written_ % ring_.bytes;
  if (at + bytes > ring_.bytes) {
    written_ += ring_.bytes - at;  // wraps to the ring's start
    at = 0;
  }
  SlotTensor t;
  t.offset = ring_.offset + at;
  t.bytes = bytes;
  t.shape.assign(shape.begin(), shape.end());
  written_ += bytes;
  built_[i] = t;
  built_present_[i] = 1;
  return slot_ + t.offset;
}

Result<bool> WorkerSession::StreamRespond(uint64_t id, bool final, const Status& status) {
  if (!decoupled() || !ready_) return FailedPrecondition("StreamRespond() outside streams");
  if (requests_.count(id) == 0) {
    if (building_ == id) {
      building_.reset();
      written_ = building_from_;
    }
    return false;
  }
  if (building_ && *building_ != id)
    return FailedPrecondition("a response for request " + std::to_string(*building_) +
                              " is being built; send it first");
  while (untaken_.size() >= window_) {
    bool nothing = false;
    RETURN_IF_ERROR(TakeStreamMessage(-1, &nothing));
  }
  control::Response r;
  r.id = id;
  r.final = final || !status.ok();
  if (!status.ok()) {
    r.status_code = static_cast<uint32_t>(status.code());
    r.text = status.message();
    if (building_) written_ = building_from_;  // its outputs are not sent
    r.outputs.assign(outputs_.size(), SlotTensor{});
    r.present.assign(outputs_.size(), 0);
  } else if (building_) {
    r.outputs = std::move(built_);
    r.present = std::move(built_present_);
  } else {
    r.outputs.assign(outputs_.size(), SlotTensor{});
    r.present.assign(outputs_.size(), 0);
  }
  building_.reset();
  built_.clear();
  built_present_.clear();
  RETURN_IF_ERROR(control::SendResponse(control_.get(), r));
  untaken_.push_back(written_);
  if (r.final) {
    requests_.erase(id);
    if (requests_.empty()) ReleaseRetired();
  }
  return true;
}

}  // namespace hearth
