// The worker's side of the control channel (protocol/worker_protocol.h):
// what every worker process runs, whatever its backend. hearth-worker uses
// it for the built-in and plug-in C++ backends; libhearth's C ABI exposes it
// (hearth_worker_*) to workers written in other languages, such as the
// Python backend's.
//
// Thread-safety: one thread drives a session.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attach/client_region.h"
#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "protocol/worker_protocol.h"

namespace hearth {

// Called when the slot is mapped (again: it only grows) and before it is
// unmapped, e.g. to page-lock it for GPU copies.
struct SlotHooks {
  std::function<Status(void* data, uint64_t bytes)> mapped;
  std::function<void(void* data)> unmapping;
};

class WorkerSession {
 public:
  // Takes both descriptors, and reads the setup message that the server
  // queued before it started this process (waiting up to timeout_ms).
  static Result<std::unique_ptr<WorkerSession>> Open(int control_fd, int slot_fd, int timeout_ms,
                                                     SlotHooks hooks = {});
  ~WorkerSession();
  WorkerSession(const WorkerSession&) = delete;
  WorkerSession& operator=(const WorkerSession&) = delete;

  const control::Setup& setup() const { return setup_; }
  bool batching() const { return setup_.max_batch_size > 0; }
  // A decoupled model holds streams (the Stream* calls below), not batches.
  bool decoupled() const { return setup_.decoupled; }
  int max_rows() const { return setup_.max_batch_size > 0 ? setup_.max_batch_size : 1; }

  // A standby worker, its loading done, waits here (for ever) until the
  // server puts it to work (kStart). Unavailable when the server closed the
  // channel instead: the standby is not needed, and should exit quietly.
  Status WaitForStart();

  // A phase of the start (before Ready): sent with the ready message, for
  // the server's log and metrics. InvalidArgument for a name that is not
  // control::IsStartPhaseName's, or past control::kMaxStartPhases phases.
  Status AddStartPhase(std::string name, uint64_t us);

  // The backend is built and takes these inputs and gives these outputs (per
  // sample; -1 where a dimension varies). After this, Next() serves batches.
  Status Ready(std::vector<control::TensorSpec> inputs, std::vector<control::TensorSpec> outputs,
               uint64_t device_memory_bytes, std::string text);
  // Tells the server why this worker cannot start (or must stop): the
  // reason that the model's status and log show.
  void Fail(const Status& why);

  // Blocks for the next batch. True: a batch is current (its inputs checked
  // against the slot and the signature); false: the server has closed the
  // channel, and the worker should exit. An error is a malformed message:
  // the worker should report it (Fail) and exit.
  Result<bool> Next();

  bool in_batch() const { return in_batch_; }
  int64_t rows() const { return run_.rows; }
  size_t input_count() const { return inputs_.size(); }
  // Input i's bytes in the slot (KServe's BYTES form for BYTES tensors) and
  // its full shape; valid until Done(). With device addresses, the bytes of
  // the input that are not in CUDA regions (the backend reads
  // input_address(i)).
  std::span<const std::byte> input(size_t i) const;
  const std::vector<int64_t>& input_shape(size_t i) const { return run_.inputs[i].shape; }
  const std::vector<control::TensorSpec>& inputs() const { return inputs_; }
  const std::vector<control::TensorSpec>& outputs() const { return outputs_; }
  // The request's parameters as a JSON object's text (decoupled models; may
  // be empty).
  const std::string& parameters_json() const { return run_.parameters_json; }

  // Inputs and outputs in clients' CUDA shared-memory regions (Run::copies)
  // are copied by the session: inputs into the slot before Next() returns,
  // outputs from the slot before Done() answers. A worker whose backend
  // takes device addresses on `device` calls TakeDeviceAddresses(device)
  // once before Ready() (the server then gives bytes in regions no room in
  // the slot: Run::compact), and gives the backend input_address(i) and
  // output_address(i, room): a region's own address where one region holds
  // a whole tensor (nothing is copied at all), else a device buffer the
  // session fills from the slot and the regions (and empties into them).
  // Regions stay open between batches until the server says they were
  // unregistered. A batch whose regions cannot be opened or copied is answered with the
  // error (each of its requests then runs alone, so that only the one at
  // fault fails) and is never handed out.
  Status TakeDeviceAddresses(int device);
  const void* input_address(size_t i) const { return input_at_[i]; }
  Result<void*> output_address(size_t i, std::byte* room);

  // Room in the slot for output i of `shape` (its full shape) and `bytes`
  // (for BYTES the serialised size; for other types it must be what the
  // shape needs). The room is valid until the next Output() or Done(): a
  // later output may make the slot grow and move. Fixed-shape outputs are
  // where the server placed them, so backends whose outputs all have fixed
  // shapes may take every output's room before writing any.
  Result<std::byte*> Output(size_t i, std::span<const int64_t> shape, uint64_t bytes);
  // Ends the batch: OK once every output has been given room and written,
  // else the error for all of its requests (`retry_alone`: the inputs caused
  // it; the server runs each request of the batch alone).
  Status Done(const Status& status, bool retry_alone = false);

  // ---- Streams: a decoupled model's requests (protocol/worker_protocol.h) ----
  // How many requests it holds at once (the config's max_streams, 1 by
  // default) and how many responses it may send before the server took
  // them; sent with Ready().
  uint32_t stream_capacity() const { return streams_; }
  struct StreamEvent {
    enum Type {
      kNone,       // nothing came in time
      kOpened,     // a new request: StreamInput() and the others name it by id
      kCancelled,  // the request is over (client gone, deadline): it is already
                   // ended on the server's side; send nothing more for it
      kClosed,     // the server has closed the channel: exit
    } type = kNone;
    uint64_t id = 0;
  };
  // The next thing the server says, waiting up to timeout_ms (0: only looks;
  // -1: for ever). Credits and the ring are looked after inside. An error
  // is a malformed message: report it (Fail) and exit.
  Result<StreamEvent> NextStreamEvent(int timeout_ms);
  // An open request's input i (bytes in the slot, its shape), the client's
  // id, its parameters (a JSON object's text, or empty) and, when it
  // resumes a stream, the token ids its client already has. Valid until its
  // final response or its cancellation; null (or empty) for an id that is
  // not open.
  const control::Open* StreamRequest(uint64_t id) const;
  std::span<const std::byte> StreamInput(uint64_t id, size_t i) const;
  std::span<const int64_t> StreamResume(uint64_t id) const;
  // Room in the response ring for output i of the response being built for
  // `id`, as Output() for a batch. The room is valid until that response is
  // sent; one response is built at a time.
  // The engine's counters, for the server's metrics (kEngineStats).
  Status SendEngineStats(const control::EngineStats& stats);
  Result<std::byte*> StreamOutput(uint64_t id, size_t i, std::span<const int64_t> shape,
                                  uint64_t bytes);
  // Sends the response built for `id` (the outputs given room since its
  // last response; the others absent), `final` to end the request, or with
  // an error `status` (always final). Waits while Ready's window of
  // responses is out. False: `id` is not open (it was cancelled): nothing
  // was sent.
  Result<bool> StreamRespond(uint64_t id, bool final, const Status& status = Status::Ok());

 private:
  WorkerSession(UniqueFd control, UniqueFd slot, SlotHooks hooks)
      : control_(std::move(control)), slot_fd_(std::move(slot)), hooks_(std::move(hooks)) {}
  Status MapSlot(uint64_t bytes);
  void ReleaseRetired();
  // Output i of full `shape` (`rows` rows where the model batches) and
  // `bytes`: a shape its spec allows, the bytes that shape needs (fixed
  // types), under the slot's limit.
  Status CheckOutput(size_t i, int64_t rows, std::span<const int64_t> shape, uint64_t bytes) const;
  // Streams: takes one message from the server that is not for the caller
  // (credits, a ring, a request opened or cancelled: queued as events).
  Status TakeStreamMessage(int timeout_ms, bool* nothing);
  Status OpenStream(control::Open open);
  Status EndCancelled(uint64_t id);
  Status WaitForRing(uint64_t needed);
  Status CheckRun();

  // The batch's device copies: regions opened, inputs placed. An error
  // that is not DeviceLost is the batch's (its regions), not the worker's.
  Status StartDeviceCopies();
  Status FinishDeviceCopies();
  // Copies a tensor's bytes between its place in the slot and a device
  // buffer, skipping the parts that `copies` (sorted, of one tensor) cover;
  // in a compact run those have no room in the slot.
  Status CopyGaps(int device, std::byte* device_bytes, std::byte* slot_bytes, uint64_t bytes,
                  const std::vector<const control::DeviceCopy*>& copies, bool to_device);
  Status CopyQueued(int device, void* dst, const void* src, uint64_t bytes);
  Status WaitForQueued();
  int CopyDevice(const control::DeviceRegion& region) const {
    return device_ >= 0 ? device_ : region.device;
  }

  UniqueFd control_, slot_fd_;
  SlotHooks hooks_;
  control::Setup setup_;
  std::vector<control::TensorSpec> inputs_, outputs_;
  std::vector<control::StartPhase> phases_;  // until Ready
  bool ready_ = false;
  std::byte* slot_ = nullptr;  // the data: the mapping starts kSlotHeaderBytes before
  uint64_t mapped_bytes_ = 0;
  void* life_ = nullptr;  // the slot's header page, its life lock held (life_lock.h)
  // Mappings replaced by a larger one during the current batch.
  std::vector<std::pair<std::byte*, uint64_t>> retired_;
  control::Run run_;
  bool in_batch_ = false;
  std::vector<control::SlotTensor> answer_;
  std::vector<bool> given_;
  uint64_t cursor_ = 0;  // next free byte for outputs the worker places
  std::chrono::steady_clock::time_point started_;
  int device_ = -1;  // TakeDeviceAddresses
  // Client CUDA regions kept open between batches, by registration id
  // (never reused by the server), each until the server says it was
  // unregistered (kRelease); at most kMaxOpenRegions, the least recently
  // used closed first.
  static constexpr size_t kMaxOpenRegions = 256;
  struct OpenRegion {
    control::DeviceRegion region;
    std::unique_ptr<ClientRegion> mapping;
    uint64_t last_used = 0;  // run seq
  };
  std::map<uint64_t, OpenRegion> open_regions_;
  std::vector<ClientRegion*> regions_;  // this batch's, by Run::regions index
  std::vector<const void*> input_at_;
  std::vector<uint64_t> input_room_;  // input i's bytes in the slot (control::SlotRooms)
  std::vector<DeviceStaging> input_staging_, output_staging_;
  std::vector<uint8_t> output_staged_;  // output i went to output_staging_[i]
  std::vector<int> queued_on_;          // devices with copies not yet waited for

  // Streams.
  uint32_t streams_ = 1, window_ = 1;
  std::map<uint64_t, control::Open> requests_;  // open, by id
  std::deque<StreamEvent> events_;              // requests opened, not yet told
  std::deque<uint64_t> cancels_;                // requests cancelled, not yet ended
  control::Ring ring_;                          // bytes 0: none yet
  bool asked_ring_ = false;                     // kRingGrow sent, kRing not yet come
  // The ring in bytes written since it was given: responses lie at
  // [taken_, written_) of that count (modulo its size), oldest first; each
  // response's end is in untaken_ until a credit frees it.
  uint64_t written_ = 0, taken_ = 0;
  std::deque<uint64_t> untaken_;
  // The response being built: its request, where it began in the count, and
  // its outputs so far.
  std::optional<uint64_t> building_;
  uint64_t building_from_ = 0;
  std::vector<control::SlotTensor> built_;
  std::vector<uint8_t> built_present_;
};

}  // namespace hearth
