// The control channel between `hearth serve` and one worker process: a
// SOCK_SEQPACKET socketpair, one message per packet, and a shared-memory
// slot (a memfd the server owns and only grows) that holds each batch's
// input and output bytes. Blocking reads on the socket are how both sides
// wait: no busy-waiting.
//
// A worker's life:
//   server -> worker  kSetup   queued before the worker is started: the
//                              model's parameters, the inputs and outputs its
//                              config declares (empty: the backend says),
//                              the config as JSON and the version directory.
//   worker -> server  kReady   the backend is built: its inputs and outputs
//                              (the signature; -1 for a variable dimension),
//                              the device and the memory it allocated. The
//                              server checks them against the config.
//   server -> worker  kRun     a batch is in the slot: where each input lies
//                              and its shape, where each output whose shape
//                              is known goes, and the free room after them.
//   worker -> server  kDone    the outputs' places and shapes, or an error;
//                              or `room_needed` > 0: the outputs need more
//                              room than the slot has, answered by
//   server -> worker  kRoom    the slot has grown to `slot_bytes`; the worker
//                              maps it again and sends kDone once more.
// A worker that fails before it is ready sends kDone with the error.
//
// A standby worker (started ahead of need, `--standby`) reads its setup,
// loads what it can without the device, and waits for
//   server -> worker  kStart   take over: attach and build the backend now;
// then goes on as above. End-of-file before kStart: it is not needed.
//
// A worker keeps the CUDA shared-memory regions its batches named open
// (a bounded number) until, between two batches,
//   server -> worker  kRelease these were unregistered: close them (no ids:
//                              close every one).
//
// A decoupled model (Setup::decoupled) holds streams instead of batches: up
// to Ready::streams requests at once, each answered by any number of
// responses, in any order among them. kRun and kDone are not used.
//   server -> worker  kRing     once the worker is accepted, and in answer to
//                               kRingGrow: where the worker writes responses'
//                               outputs, [offset, offset + bytes) of the slot.
//   server -> worker  kOpen     request `id` (never reused in this worker's
//                               life): its inputs where the server placed
//                               them in the slot (theirs until the request
//                               ends), its parameters, and, for a stream that
//                               resumes after its worker died, the token ids
//                               its client already has (`resume`).
//   worker -> server  kResponse a response to request `id`: outputs in the
//                               ring (those absent marked); `final` ends the
//                               request; an error is always final.
//   server -> worker  kCredit   the next `responses` responses, oldest first,
//                               were taken: their ring bytes are free again.
//   server -> worker  kCancel   requests `ids` are over (client gone, deadline):
//                               the worker ends each with a final kResponse
//                               (whose content is not read) and nothing else.
//   worker -> server  kRingGrow a response needs a ring of `bytes`; sent only
//                               when every response sent was taken; answered
//                               by kRing (the old ring is the server's again).
//   worker -> server  kEngineStats what the worker's engine holds now (its KV
//                               cache's blocks in use and in all) and how many
//                               streams it has preempted in its life; sent
//                               now and then, when they changed.
// A worker has at most Ready::window responses not yet taken, and writes
// each response after the last one not yet taken, wrapping to the ring's
// start, never over bytes not yet taken. A request's inputs are the
// server's again once its final kResponse came.
//
// The server lays the slot out; the worker checks every offset, size and
// shape against the slot and the signature, and the server checks the
// worker's answer the same way, so that neither side reads or writes past
// the slot whatever the other sends. Variable-size outputs (BYTES, or -1
// dimensions) are placed by the worker in the free room; BYTES tensors are
// KServe's binary form: per element a 4-byte little-endian length, then
// the bytes.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/tensor_spec.h"
#include "hearth/dtype.h"
#include "hearth/status.h"

namespace hearth::control {

inline constexpr uint32_t kMagic = 0x4b524f57;  // "WORK"

enum class Kind : uint32_t {
  kReady = 1,
  kRun = 2,
  kDone = 3,
  kSetup = 4,
  kRoom = 5,
  kStart = 8,
  kRelease = 9,
  kRing = 10,
  kOpen = 11,
  kResponse = 12,
  kCredit = 13,
  kCancel = 14,
  kRingGrow = 15,
  kEngineStats = 16,
};

// Limits every message is checked against before anything is allocated.
inline constexpr size_t kMaxSetupBytes = 192u << 10;   // one packet
inline constexpr size_t kMaxMessageBytes = 64u << 10;  // every other packet
inline constexpr size_t kMaxTensors = 256;             // inputs, and outputs
inline constexpr size_t kMaxRank = 16;
inline constexpr size_t kMaxNameBytes = 1024;
inline constexpr size_t kMaxTextBytes = 8192;
// A run's request parameters (decoupled models), as JSON.
inline constexpr size_t kMaxParametersBytes = 32u << 10;
// Slot offsets and sizes stay below 2^62, so that any sum of two is exact.
inline constexpr uint64_t kMaxSlotBytes = 1ull << 62;

using hearth::TensorSpec;

struct Setup {
  // The config's max_batch_size: 0 for a model that does not batch (its
  // tensors have no batch dimension; every run has one row).
  int32_t max_batch_size = 0;
  std::map<std::string, std::string> parameters;
  std::vector<TensorSpec> inputs, outputs;  // as the config declares them; empty: unsaid
  std::string config_json;                  // the model's config (Triton's JSON form)
  std::string version_dir;                  // DIR/<model>/<version>
  bool decoupled = false;                   // the worker holds streams (above)
};

// A phase of a worker's start ("attach", "imports") and how long it took.
struct StartPhase {
  std::string name;  // 1..kMaxStartPhaseNameBytes of [a-z0-9._-]
  uint64_t us = 0;
  bool operator==(const StartPhase&) const = default;
};
inline constexpr size_t kMaxStartPhases = 16;
inline constexpr size_t kMaxStartPhaseNameBytes = 32;
// Whether `name` may name a start phase.
bool IsStartPhaseName(std::string_view name);

struct Ready {
  std::vector<TensorSpec> inputs, outputs;
  uint64_t device_memory_bytes = 0;  // what the worker's own device buffers cost
  std::string text;                  // device and start-up timings, for the log
  // The backend reads inputs from and writes outputs to device memory: the
  // worker takes CUDA shared-memory regions where they lie, and its runs
  // may be compact (Run::compact).
  bool device_addresses = false;
  // The phases of its start, in order (at most kMaxStartPhases).
  std::vector<StartPhase> phases;
  // Decoupled models: the requests it holds at once (1..kMaxStreams), and
  // the responses it may send before they are taken (1..kMaxWindow).
  uint32_t streams = 1;
  uint32_t window = 1;
};
inline constexpr uint32_t kMaxStreams = 4096;
inline constexpr uint32_t kMaxWindow = 4096;

// A tensor in the slot: its bytes at [offset, offset + bytes) and its full
// shape (with the batch dimension when the model batches).
struct SlotTensor {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::vector<int64_t> shape;
  bool operator==(const SlotTensor&) const = default;
};

// A client's CUDA shared-memory region (Triton's cudasharedmemory
// extension) that a batch reads inputs from or writes outputs to: the CUDA
// IPC handle the client registered, which the worker opens itself, so that
// those bytes go device to device and never through the slot.
inline constexpr size_t kCudaIpcHandleBytes = 64;  // CU_IPC_HANDLE_SIZE
inline constexpr size_t kMaxRunRegions = 64;       // distinct regions in one run
// A region's name in a run, for the worker's errors: longer ones are cut.
inline constexpr size_t kMaxDeviceRegionNameBytes = 64;
inline constexpr size_t kMaxDeviceCopies = 1024;  // copies in one run

struct DeviceRegion {
  uint64_t id = 0;   // the server's registration id, never reused in its life
  std::string name;  // as registered (its first kMaxDeviceRegionNameBytes), for errors
  std::array<uint8_t, kCudaIpcHandleBytes> handle{};
  int32_t device = 0;      // the GPU the client registered it on
  uint64_t byte_size = 0;  // as registered: the worker checks it against the allocation
  bool operator==(const DeviceRegion&) const = default;
};

// `bytes` of input (or output) `tensor`, at `offset` into the tensor (one
// request's rows), come from (go to) `region_offset` of region `region` (an
// index into Run::regions). The copies of one tensor do not overlap. The
// slot keeps room for them, at the same offset into the tensor's place, so
// that a worker that cannot take device addresses copies through it; in a
// compact run (a worker that takes them) it does not.
struct DeviceCopy {
  uint32_t region = 0;
  bool output = false;
  uint32_t tensor = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t region_offset = 0;
  bool operator==(const DeviceCopy&) const = default;
};

struct Run {
  uint64_t seq = 0;
  int64_t rows = 0;         // the batch size (1 for a model that does not batch)
  uint64_t slot_bytes = 0;  // the slot's size now: map again if it grew
  std::vector<SlotTensor> inputs;
  // Per output: where it goes when the server knows its shape (bytes > 0 or
  // a shape with no element), else all zero: the worker places it.
  std::vector<SlotTensor> outputs;
  std::vector<uint8_t> output_placed;  // 1 where the server placed the output
  uint64_t free_offset = 0;            // the worker's room: [free_offset, slot_bytes)
  // Decoupled models: the request's parameters, a JSON object's text (or
  // empty). The server places no output for them.
  std::string parameters_json;
  // Inputs and outputs in clients' CUDA shared-memory regions; the decoder
  // checks every index, and that each copy lies inside its region and
  // inside its tensor's place in the slot (CheckDeviceCopies).
  std::vector<DeviceRegion> regions;
  std::vector<DeviceCopy> copies;
  // Only for a worker that said Ready::device_addresses: the bytes in
  // regions have no room in the slot. A tensor's place holds its other
  // bytes, in their order, one after the other (SlotRooms), so that a
  // client's region, however large, never grows the slot.
  bool compact = false;
};

struct Done {
  uint64_t seq = 0;
  uint32_t status_code = 0;  // 0 = OK, else a hearth StatusCode
  std::string text;          // the error
  // The error is the input's fault, not the worker's: run each request of
  // the batch alone, so that only the ones that cause it fail.
  bool retry_alone = false;
  uint64_t run_us = 0;       // time the backend took
  uint64_t room_needed = 0;  // > 0: grow the slot to at least this, then kRoom
  std::vector<SlotTensor> outputs;
  // Decoupled models only: 1 for each output this response holds (the
  // others' SlotTensors are all zero). Empty: every output.
  std::vector<uint8_t> present;
};

// Streams (above).
struct Ring {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t slot_bytes = 0;  // the slot's size now: map again if it grew
  bool operator==(const Ring&) const = default;
};

// A resumed stream's token ids (INT64) in the slot: kMaxResumeTokens at most.
inline constexpr uint64_t kMaxResumeTokens = 1u << 20;

struct Open {
  uint64_t id = 0;
  std::string request_id;   // the client's id for it (its first kMaxNameBytes), for logs
  uint64_t slot_bytes = 0;  // the slot's size now: map again if it grew
  std::vector<SlotTensor> inputs;
  std::string parameters_json;  // a JSON object's text, or empty
  // INT64 [n] in the slot; n == 0 (and bytes 0): not a resumed stream.
  SlotTensor resume;
};

struct Response {
  uint64_t id = 0;
  bool final = false;
  uint32_t status_code = 0;  // 0 = OK, else a hearth StatusCode (then final)
  std::string text;          // the error
  // Per output: its place in the ring and its shape where present[i], else
  // all zero.
  std::vector<SlotTensor> outputs;
  std::vector<uint8_t> present;
};

struct Credit {
  uint32_t responses = 0;
};

inline constexpr size_t kMaxCancelIds = 4096;
struct Cancel {
  std::vector<uint64_t> ids;
};

struct RingGrow {
  uint64_t bytes = 0;
};

// kv_blocks_used <= kv_blocks_total <= kMaxKvBlocks.
inline constexpr uint64_t kMaxKvBlocks = uint64_t{1} << 40;
struct EngineStats {
  uint64_t kv_blocks_used = 0;
  uint64_t kv_blocks_total = 0;
  uint64_t preemptions = 0;
  bool operator==(const EngineStats&) const = default;
};

// Registration ids of CUDA regions to close; none: all of them.
inline constexpr size_t kMaxReleaseIds = 1024;
struct Release {
  std::vector<uint64_t> ids;
};

struct Room {
  uint64_t seq = 0;
  uint64_t slot_bytes = 0;
};

Status SendSetup(int fd, const Setup& m);
Status SendReady(int fd, const Ready& m);
Status SendRun(int fd, const Run& m);
Status SendDone(int fd, const Done& m);
Status SendRoom(int fd, const Room& m);
Status SendRing(int fd, const Ring& m);
Status SendOpen(int fd, const Open& m);
Status SendResponse(int fd, const Response& m);
Status SendCredit(int fd, const Credit& m);
Status SendCancel(int fd, std::span<const uint64_t> ids);
Status SendRingGrow(int fd, const RingGrow& m);
Status SendEngineStats(int fd, const EngineStats& m);
Status SendStart(int fd);
// Between batches: close the client CUDA regions of `ids` kept open (they
// were unregistered); no ids: every one.
Status SendRelease(int fd, std::span<const uint64_t> ids = {});

// What came: exactly one of the members is set, by `kind`.
struct Message {
  Kind kind = Kind::kDone;
  Setup setup;
  Ready ready;
  Run run;
  Done done;
  Room room;
  Release release;
  Ring ring;
  Open open;
  Response response;
  Credit credit;
  Cancel cancel;
  RingGrow ring_grow;
  EngineStats engine_stats;
};

// Waits up to timeout_ms (-1: forever; 0: only looks) for the next message and decodes it,
// checking every count and length against the packet and the limits above.
// Unavailable("control channel closed") when the peer is gone;
// DeadlineExceeded("timeout") when nothing came in time; InvalidArgument
// naming what is malformed otherwise.
Result<Message> Receive(int fd, int timeout_ms);
// The setup message, left queued (MSG_PEEK) for whoever reads next.
Result<Setup> PeekSetup(int fd, int timeout_ms);
// Receive, then InvalidArgument unless the message is of one of `kinds`.
Result<Message> ReceiveKind(int fd, int timeout_ms, std::initializer_list<Kind> kinds);

// Bytes of a tensor of `spec.dtype` with `shape`; BYTES tensors have no
// fixed size (nullopt), nor do shapes with a negative dimension. Errors for
// a product past 2^62 name `what`.
Result<std::optional<uint64_t>> FixedBytes(DType dtype, std::span<const int64_t> shape,
                                           const std::string& what);

// Checks `shape` (a full shape) against `spec` for a batch of `rows`
// (batching: a leading dimension equal to rows; -1 matches any size >= 0).
Status CheckShape(const TensorSpec& spec, bool batching, int64_t rows,
                  std::span<const int64_t> shape, const std::string& what);

// Checks that [t.offset, t.offset + t.bytes) lies inside [lo, hi) and that
// t.bytes is what t.shape needs (fixed types) or that the bytes are
// `count` well-formed BYTES elements (when `data` is the slot's base; the
// BYTES check is skipped when `data` is null). `room`: the bytes its place
// holds when fewer than t.bytes (a compact run's tensor with copies).
Status CheckSlotTensor(const SlotTensor& t, DType dtype, uint64_t lo, uint64_t hi,
                       const std::byte* data, const std::string& what,
                       std::optional<uint64_t> room = std::nullopt);

// Every device copy of `run` names a region and a tensor it has (an output
// only where the server placed it), lies inside both, and overlaps no other
// copy of its tensor.
Status CheckDeviceCopies(const Run& run);

// Per input (output: false) or output of a run whose copies were checked:
// the bytes its place in the slot holds. Its SlotTensor's bytes, less, in a
// compact run, those of its copies.
std::vector<uint64_t> SlotRooms(const Run& run, bool output);

}  // namespace hearth::control
