#include "worker/session.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>

#include "common/bytes_tensor.h"
#include "common/checked_size.h"
#include "protocol/life_lock.h"

namespace hearth {

using control::SlotTensor;
using control::TensorSpec;

namespace {
bool ParseStreams(const std::string& text, uint64_t* n) {
  if (text.empty() || text.size() > 6) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  if (v < 1 || v > control::kMaxStreams) return false;
  *n = v;
  return true;
}
}  // namespace

Result<std::unique_ptr<WorkerSession>> WorkerSession::Open(int control_fd, int slot_fd,
                                                           int timeout_ms, SlotHooks hooks) {
  std::unique_ptr<WorkerSession> s(
      new WorkerSession(UniqueFd(control_fd), UniqueFd(slot_fd), std::move(hooks)));
  // The life lock first, by the thread that opens the session: the server
  // watches it to learn of this process's death before its memory is torn
  // down. Without it the server learns later, from the socket.
  {
    struct stat st {};
    if (::fstat(s->slot_fd_.get(), &st) == 0 &&
        static_cast<uint64_t>(st.st_size) >= control::kSlotHeaderBytes) {
      void* p = ::mmap(nullptr, control::kSlotHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                       s->slot_fd_.get(), 0);
      if (p != MAP_FAILED) {
        if (control::HoldLifeLock(p).ok()) {
          s->life_ = p;
        } else {
          ::munmap(p, control::kSlotHeaderBytes);
        }
      }
    }
  }
  auto m = control::ReceiveKind(control_fd, timeout_ms, {control::Kind::kSetup});
  if (!m.ok()) return m.status().WithContext("reading the model's setup");
  s->setup_ = std::move(m->setup);
  if (s->setup_.decoupled) {
    // The server checked the config's max_streams; checked again here,
    // against the protocol's limit.
    if (auto it = s->setup_.parameters.find("max_streams"); it != s->setup_.parameters.end()) {
      uint64_t n = 0;
      if (!ParseStreams(it->second, &n))
        return InvalidArgument("parameters.max_streams '" + it->second.substr(0, 32) +
                               "' is not a whole number from 1 to " +
                               std::to_string(control::kMaxStreams));
      s->streams_ = static_cast<uint32_t>(n);
    }
    // Room for a response per stream and a few more: a step of every stream
    // is sent while the server takes the last.
    s->window_ = std::min(control::kMaxWindow, std::max<uint32_t>(16, 2 * s->streams_));
  }
  return s;
}

WorkerSession::~WorkerSession() {
  ReleaseRetired();
  if (slot_ != nullptr) {
    if (hooks_.unmapping) hooks_.unmapping(slot_);
    ::munmap(slot_ - control::kSlotHeaderBytes, control::kSlotHeaderBytes + mapped_bytes_);
  }
  if (life_ != nullptr) {
    control::ReleaseLifeLock(life_);
    ::munmap(life_, control::kSlotHeaderBytes);
  }
}

void WorkerSession::ReleaseRetired() {
  for (const auto& [data, bytes] : retired_) {
    if (hooks_.unmapping) hooks_.unmapping(data);
    ::munmap(data - control::kSlotHeaderBytes, control::kSlotHeaderBytes + bytes);
  }
  retired_.clear();
}

Status WorkerSession::WaitForStart() {
  if (ready_) return FailedPrecondition("the worker has already said it is ready");
  return control::ReceiveKind(control_.get(), -1, {control::Kind::kStart}).status();
}

Status WorkerSession::AddStartPhase(std::string name, uint64_t us) {
  if (ready_) return FailedPrecondition("the worker has already said it is ready");
  if (!control::IsStartPhaseName(name))
    return InvalidArgument("start phase '" + name.substr(0, 64) +
                           "': a name is 1 to 32 characters of a-z, 0-9, '.', '_' and '-'");
  if (phases_.size() >= control::kMaxStartPhases)
    return InvalidArgument("more than " + std::to_string(control::kMaxStartPhases) +
                           " start phases");
  phases_.push_back({std::move(name), us});
  return Status::Ok();
}

Status WorkerSession::Ready(std::vector<TensorSpec> inputs, std::vector<TensorSpec> outputs,
                            uint64_t device_memory_bytes, std::string text) {
  if (ready_) return FailedPrecondition("the worker has already said it is ready");
  if (inputs.size() > control::kMaxTensors || outputs.size() > control::kMaxTensors)
    return InvalidArgument("more than " + std::to_string(control::kMaxTensors) +
                           " inputs or outputs");
  control::Ready r{inputs,          outputs,      device_memory_bytes,
                   std::move(text), device_ >= 0, std::move(phases_),
                   streams_,        window_};
  phases_.clear();
  RETURN_IF_ERROR(control::SendReady(control_.get(), r));
  inputs_ = std::move(inputs);
  outputs_ = std::move(outputs);
  ready_ = true;
  return Status::Ok();
}

Status WorkerSession::TakeDeviceAddresses(int device) {
  if (ready_) return FailedPrecondition("device addresses are taken before the worker is ready");
  if (device < 0) return InvalidArgument("device " + std::to_string(device));
  device_ = device;
  return Status::Ok();
}

void WorkerSession::Fail(const Status& why) {
  control::Done d;
  d.status_code =
      static_cast<uint32_t>(why.code() == StatusCode::kOk ? StatusCode::kInternal : why.code());
  d.text = why.message();
  d.seq = in_batch_ ? run_.seq : 0;
  (void)control::SendDone(control_.get(), d);
}

// The slot only grows (the server seals it against shrinking), so a larger
// size is mapped afresh. The old mapping stays until the batch is over: the
// views of its inputs handed out so far point into it (same memfd, same
// pages, so they stay right).
Status WorkerSession::MapSlot(uint64_t bytes) {
  if (bytes <= mapped_bytes_) return Status::Ok();
  struct stat st {};
  if (::fstat(slot_fd_.get(), &st) != 0) return ErrnoError("fstat of the request slot", errno);
  if (static_cast<uint64_t>(st.st_size) < control::kSlotHeaderBytes + bytes)
    return InvalidArgument("the server says the slot has " + std::to_string(bytes) +
                           " bytes of data; it has " + std::to_string(st.st_size) +
                           " bytes with its header");
  void* p = ::mmap(nullptr, control::kSlotHeaderBytes + bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   slot_fd_.get(), 0);
  if (p == MAP_FAILED) return ErrnoError("mapping the request slot", errno);
  if (slot_ != nullptr) retired_.emplace_back(slot_, mapped_bytes_);
  slot_ = static_cast<std::byte*>(p) + control::kSlotHeaderBytes;
  mapped_bytes_ = bytes;
  if (hooks_.mapped) RETURN_IF_ERROR(hooks_.mapped(slot_, bytes));
  return Status::Ok();
}

// Everything the server said about this batch, checked before any byte of
// the slot is touched.
// `input_room`: control::SlotRooms(run, false).
Status CheckRunAgainst(const control::Run& run, const std::vector<TensorSpec>& inputs,
                       const std::vector<TensorSpec>& outputs, bool batching, int max_rows,
                       bool device_addresses, const std::vector<uint64_t>& input_room) {
  if (run.rows < 1 || run.rows > max_rows)
    return InvalidArgument("batch of " + std::to_string(run.rows) + " rows outside [1, " +
                           std::to_string(max_rows) + "]");
  if (run.inputs.size() != inputs.size() || run.outputs.size() != outputs.size())
    return InvalidArgument("run message for " + std::to_string(run.inputs.size()) + " inputs and " +
                           std::to_string(run.outputs.size()) + " outputs; the model has " +
                           std::to_string(inputs.size()) + " and " +
                           std::to_string(outputs.size()));
  if (run.slot_bytes >= control::kMaxSlotBytes || run.free_offset > run.slot_bytes)
    return InvalidArgument("run message: free room at " + std::to_string(run.free_offset) +
                           " in a slot of " + std::to_string(run.slot_bytes) + " bytes");
  if (run.compact && !device_addresses)
    return InvalidArgument(
        "run message: a compact run for a worker that takes no device addresses");
  for (const control::DeviceCopy& c : run.copies)
    if ((c.output ? outputs : inputs)[c.tensor].dtype == DType::kBytes)
      return InvalidArgument("run message: a device copy of BYTES " +
                             std::string(c.output ? "output " : "input ") +
                             std::to_string(c.tensor));
  const std::vector<uint64_t> output_room = control::SlotRooms(run, true);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string what = "input " + Describe(inputs[i]);
    RETURN_IF_ERROR(control::CheckShape(inputs[i], batching, run.rows, run.inputs[i].shape, what));
    RETURN_IF_ERROR(control::CheckSlotTensor(run.inputs[i], inputs[i].dtype, 0, run.free_offset,
                                             nullptr, what, input_room[i]));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!run.output_placed[i]) continue;
    const std::string what = "output " + Describe(outputs[i]);
    RETURN_IF_ERROR(
        control::CheckShape(outputs[i], batching, run.rows, run.outputs[i].shape, what));
    RETURN_IF_ERROR(control::CheckSlotTensor(run.outputs[i], outputs[i].dtype, 0, run.free_offset,
                                             nullptr, what, output_room[i]));
  }
  return Status::Ok();
}

Result<bool> WorkerSession::Next() {
  if (!ready_) return FailedPrecondition("Next() before Ready()");
  if (in_batch_) return FailedPrecondition("Next() before the last batch's Done()");
  if (decoupled())
    return FailedPrecondition(
        "a decoupled model's worker takes streams (NextStreamEvent), not batches");
  for (;;) {
    auto m =
        control::ReceiveKind(control_.get(), -1, {control::Kind::kRun, control::Kind::kRelease});
    if (!m.ok()) {
      if (m.status().code() == StatusCode::kUnavailable) return false;
      return m.status();
    }
    if (m->kind == control::Kind::kRelease) {
      if (m->release.ids.empty()) open_regions_.clear();
      for (uint64_t id : m->release.ids) open_regions_.erase(id);
      continue;
    }
    ReleaseRetired();
    run_ = std::move(m->run);
    input_room_ = control::SlotRooms(run_, false);
    RETURN_IF_ERROR(CheckRunAgainst(run_, inputs_, outputs_, batching(), max_rows(), device_ >= 0,
                                    input_room_));
    RETURN_IF_ERROR(MapSlot(run_.slot_bytes));
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (inputs_[i].dtype == DType::kBytes) {
        const SlotTensor& t = run_.inputs[i];
        ASSIGN_OR_RETURN(uint64_t count, ShapeElements(t.shape, inputs_[i].name));
        RETURN_IF_ERROR(ValidateBytesTensor(std::span(slot_ + t.offset, t.bytes), count,
                                            "input '" + inputs_[i].name + "'"));
      }
    }
    answer_.assign(outputs_.size(), SlotTensor{});
    given_.assign(outputs_.size(), false);
    cursor_ = run_.free_offset;
    in_batch_ = true;
    started_ = std::chrono::steady_clock::now();
    Status copied = StartDeviceCopies();
    if (copied.ok()) return true;
    if (copied.code() == StatusCode::kDeviceLost) return copied;
    // The batch's regions are at fault, not this worker: answer it, and
    // wait for the next one.
    RETURN_IF_ERROR(Done(copied, /*retry_alone=*/true));
  }
}

Status WorkerSession::CopyGaps(int device, std::byte* device_bytes, std::byte* slot_bytes,
                               uint64_t bytes,
                               const std::vector<const control::DeviceCopy*>& copies,
                               bool to_device) {
  uint64_t at = 0;
  uint64_t skipped = 0;  // bytes of copies before `at` that have no room in the slot
  auto copy = [&](uint64_t from, uint64_t to) {
    if (to <= from) return Status::Ok();
    std::byte* slot_at = slot_bytes + (from - skipped);
    return to_device ? CopyQueued(device, device_bytes + from, slot_at, to - from)
                     : CopyQueued(device, slot_at, device_bytes + from, to - from);
  };
  for (const control::DeviceCopy* c : copies) {
    RETURN_IF_ERROR(copy(at, c->offset));
    at = c->offset + c->bytes;  // checked: the copies do not overlap
    if (run_.compact) skipped += c->bytes;
  }
  return copy(at, bytes);
}

namespace {
// The copies of input (or output) `tensor`, by offset.
std::vector<const control::DeviceCopy*> CopiesOf(const control::Run& run, bool output,
                                                 size_t tensor) {
  std::vector<const control::DeviceCopy*> out;
  for (const control::DeviceCopy& c : run.copies)
    if (c.output == output && c.tensor == tensor) out.push_back(&c);
  std::sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  return out;
}

// Errors of a copy itself (not of opening a region) may leave the context
// unusable: the worker is replaced rather than trusted with the next batch.
Status Sticky(Status s) {
  if (s.ok() || s.code() == StatusCode::kDeviceLost) return s;
  return Status(StatusCode::kDeviceLost, s.message());
}
}  // namespace

Status WorkerSession::StartDeviceCopies() {
  input_at_.resize(inputs_.size());
  for (size_t i = 0; i < inputs_.size(); ++i) input_at_[i] = slot_ + run_.inputs[i].offset;
  output_staged_.assign(outputs_.size(), 0);
  regions_.clear();
  if (run_.copies.empty()) return Status::Ok();
  for (const control::DeviceRegion& g : run_.regions) {
    auto it = open_regions_.find(g.id);
    if (it != open_regions_.end() &&
        (it->second.region.handle != g.handle || it->second.region.byte_size != g.byte_size ||
         it->second.region.device != g.device)) {
      open_regions_.erase(it);  // not what was opened under that id: opened again
      it = open_regions_.end();
    }
    if (it == open_regions_.end()) {
      auto opened = ClientRegion::Open(CopyDevice(g), g.handle, g.byte_size);
      if (!opened.ok())
        return opened.status().WithContext("CUDA shared-memory region '" + g.name + "' (device " +
                                           std::to_string(g.device) + ")");
      it = open_regions_.emplace(g.id, OpenRegion{g, std::move(opened).value(), 0}).first;
    }
    it->second.last_used = run_.seq;
    regions_.push_back(it->second.mapping.get());
  }
  // Over the bound: the least recently used that this batch does not use.
  while (open_regions_.size() > kMaxOpenRegions) {
    auto oldest = open_regions_.end();
    for (auto e = open_regions_.begin(); e != open_regions_.end(); ++e)
      if (e->second.last_used != run_.seq &&
          (oldest == open_regions_.end() || e->second.last_used < oldest->second.last_used))
        oldest = e;
    if (oldest == open_regions_.end()) break;
    open_regions_.erase(oldest);
  }
  input_staging_.resize(inputs_.size());
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const std::vector<const control::DeviceCopy*> copies = CopiesOf(run_, false, i);
    if (copies.empty()) continue;
    const SlotTensor& t = run_.inputs[i];
    std::byte* slot_bytes = slot_ + t.offset;
    if (device_ < 0) {
      // Through the slot: the backend reads host memory.
      for (const control::DeviceCopy* c : copies)
        RETURN_IF_ERROR(
            Sticky(CopyQueued(CopyDevice(run_.regions[c->region]), slot_bytes + c->offset,
                              regions_[c->region]->data() + c->region_offset, c->bytes)));
      continue;
    }
    if (copies.size() == 1 && copies[0]->offset == 0 && copies[0]->bytes == t.bytes) {
      input_at_[i] = regions_[copies[0]->region]->data() + copies[0]->region_offset;
      continue;
    }
    ASSIGN_OR_RETURN(std::byte * staged, input_staging_[i].Reserve(device_, t.bytes));
    RETURN_IF_ERROR(Sticky(CopyGaps(device_, staged, slot_bytes, t.bytes, copies, true)));
    for (const control::DeviceCopy* c : copies)
      RETURN_IF_ERROR(Sticky(CopyQueued(device_, staged + c->offset,
                                        regions_[c->region]->data() + c->region_offset, c->bytes)));
    input_at_[i] = staged;
  }
  return Sticky(WaitForQueued());
}

// Copies are queued on the legacy stream of their device and waited for
// once, all of them, before the batch goes on.
Status WorkerSession::CopyQueued(int device, void* dst, const void* src, uint64_t bytes) {
  if (std::find(queued_on_.begin(), queued_on_.end(), device) == queued_on_.end())
    queued_on_.push_back(device);
  return CopyAnywhere(device, dst, src, bytes, /*wait=*/false);
}

Status WorkerSession::WaitForQueued() {
  Status s = Status::Ok();
  for (int device : queued_on_)
    if (Status w = WaitForCopies(device); s.ok()) s = w;
  queued_on_.clear();
  return s;
}

Result<void*> WorkerSession::output_address(size_t i, std::byte* room) {
  if (!in_batch_ || i >= outputs_.size() || device_ < 0 || run_.copies.empty()) return room;
  const std::vector<const control::DeviceCopy*> copies = CopiesOf(run_, true, i);
  if (copies.empty()) return room;
  const SlotTensor& t = run_.outputs[i];
  if (copies.size() == 1 && copies[0]->offset == 0 && copies[0]->bytes == t.bytes)
    return static_cast<void*>(regions_[copies[0]->region]->data() + copies[0]->region_offset);
  output_staging_.resize(outputs_.size());
  ASSIGN_OR_RETURN(std::byte * staged, output_staging_[i].Reserve(device_, t.bytes));
  output_staged_[i] = 1;
  return static_cast<void*>(staged);
}

Status WorkerSession::FinishDeviceCopies() {
  for (size_t i = 0; i < outputs_.size() && !run_.copies.empty(); ++i) {
    const std::vector<const control::DeviceCopy*> copies = CopiesOf(run_, true, i);
    if (copies.empty()) continue;
    const SlotTensor& t = run_.outputs[i];
    std::byte* slot_bytes = slot_ + t.offset;
    if (device_ >= 0 && !output_staged_[i]) continue;  // written in its region directly
    std::byte* from = slot_bytes;
    if (output_staged_[i]) {
      ASSIGN_OR_RETURN(from, output_staging_[i].Reserve(device_, t.bytes));
      RETURN_IF_ERROR(Sticky(CopyGaps(device_, from, slot_bytes, t.bytes, copies, false)));
    }
    // Staged outputs leave on the stream their gaps took (the worker's).
    for (const control::DeviceCopy* c : copies)
      RETURN_IF_ERROR(Sticky(
          CopyQueued(output_staged_[i] ? device_ : CopyDevice(run_.regions[c->region]),
                     regions_[c->region]->data() + c->region_offset, from + c->offset, c->bytes)));
  }
  return Sticky(WaitForQueued());
}

std::span<const std::byte> WorkerSession::input(size_t i) const {
  return {slot_ + run_.inputs[i].offset, input_room_[i]};
}

Status WorkerSession::CheckOutput(size_t i, int64_t rows, std::span<const int64_t> shape,
                                  uint64_t bytes) const {
  if (i >= outputs_.size())
    return InvalidArgument("output #" + std::to_string(i) + ": the model has " +
                           std::to_string(outputs_.size()) + " outputs");
  const TensorSpec& spec = outputs_[i];
  const std::string what = "output " + Describe(spec);
  RETURN_IF_ERROR(control::CheckShape(spec, batching(), rows, shape, what));
  ASSIGN_OR_RETURN(std::optional<uint64_t> fixed, control::FixedBytes(spec.dtype, shape, what));
  if (fixed.has_value() && *fixed != bytes)
    return InvalidArgument(what + ": " + std::to_string(bytes) + " bytes for shape " +
                           ShapeString(shape) + ", which needs " + std::to_string(*fixed));
  if (bytes >= control::kMaxSlotBytes)
    return InvalidArgument(what + ": " + std::to_string(bytes) + " bytes is past the limit");
  return Status::Ok();
}

Result<std::byte*> WorkerSession::Output(size_t i, std::span<const int64_t> shape, uint64_t bytes) {
  if (!in_batch_) return FailedPrecondition("Output() outside a batch");
  RETURN_IF_ERROR(CheckOutput(i, run_.rows, shape, bytes));
  const TensorSpec& spec = outputs_[i];
  const std::string what = "output " + Describe(spec);
  SlotTensor t;
  t.shape.assign(shape.begin(), shape.end());
  t.bytes = bytes;
  if (run_.output_placed[i]) {
    if (run_.outputs[i].shape != t.shape)
      return InvalidArgument(what + ": shape " + ShapeString(shape) + " where the server expects " +
                             ShapeString(run_.outputs[i].shape));
    t.offset = run_.outputs[i].offset;
  } else {
    // Placed by the worker in the free room, 64-byte aligned; the slot
    // grows (kDone with room_needed, answered by kRoom) when it is short.
    const uint64_t at = (cursor_ + 63) / 64 * 64;
    const uint64_t end = at + bytes;  // both below 2^62: exact
    if (end > run_.slot_bytes) {
      control::Done ask;
      ask.seq = run_.seq;
      ask.room_needed = end;
      RETURN_IF_ERROR(control::SendDone(control_.get(), ask));
      ASSIGN_OR_RETURN(control::Message room,
                       control::ReceiveKind(control_.get(), -1, {control::Kind::kRoom}));
      if (room.room.seq != run_.seq || room.room.slot_bytes < end ||
          room.room.slot_bytes >= control::kMaxSlotBytes)
        return InvalidArgument("the slot did not grow to the " + std::to_string(end) +
                               " bytes asked for (" + std::to_string(room.room.slot_bytes) + ")");
      RETURN_IF_ERROR(MapSlot(room.room.slot_bytes));
      run_.slot_bytes = room.room.slot_bytes;
    }
    t.offset = at;
    cursor_ = end;
  }
  answer_[i] = t;
  given_[i] = true;
  return slot_ + t.offset;
}

Status WorkerSession::Done(const Status& status, bool retry_alone) {
  if (!in_batch_) return FailedPrecondition("Done() outside a batch");
  control::Done d;
  d.seq = run_.seq;
  d.run_us = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                       std::chrono::steady_clock::now() - started_)
                                       .count());
  Status s = status;
  for (size_t i = 0; s.ok() && i < outputs_.size(); ++i) {
    if (!given_[i]) s = Internal("output " + Describe(outputs_[i]) + " was not given room");
  }
  if (s.ok()) {
    s = FinishDeviceCopies();
    retry_alone = retry_alone || (!s.ok() && s.code() != StatusCode::kDeviceLost);
  }
  regions_.clear();  // they stay open (open_regions_) for the next batches
  if (s.code() == StatusCode::kDeviceLost) {
    in_batch_ = false;
    return s;
  }
  if (s.ok()) {
    d.outputs = std::move(answer_);
  } else {
    d.status_code = static_cast<uint32_t>(s.code());
    d.text = s.message();
    d.retry_alone = retry_alone;
  }
  in_batch_ = false;
  answer_.clear();
  ReleaseRetired();
  return control::SendDone(control_.get(), d);
}

}  // namespace hearth
