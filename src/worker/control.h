// The control channel between `hearth serve` and one `hearth-worker`: a
// SOCK_SEQPACKET socketpair, one fixed-layout message per packet. The request
// and answer bytes travel through the worker's shared-memory slot; this
// channel only says "run batch N" and "done". Blocking reads on it are how
// both sides wait: no busy-waiting.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hearth/status.h"

namespace hearth::control {

inline constexpr uint32_t kMagic = 0x4b524f57;  // "WORK"

enum class Kind : uint32_t {
  kReady = 1,  // worker -> server: attached, backend built, slot mapped
  kRun = 2,    // server -> worker: run the batch now in the slot
  kDone = 3,   // worker -> server: outputs are in the slot (or an error)
  // server -> worker, the first message, queued before the worker is even
  // started: the model's parameters (config-sized, so never in argv).
  kParameters = 4,
};

// The encoded parameters (count, then length-prefixed names and values) of
// one kParameters message; larger sets are refused by SendParameters.
inline constexpr size_t kMaxParametersPayload = 80u << 10;

struct Message {
  Kind kind = Kind::kReady;
  uint64_t seq = 0;
  int64_t batch = 0;
  uint64_t device_memory_bytes = 0;  // kReady: what the worker's own CUDA state costs
  uint32_t status_code = 0;          // kDone: 0 = OK, else a hearth StatusCode
  uint64_t run_us = 0;               // kDone: time the backend took, in microseconds
  std::string text;                  // kDone error message, kReady device name
};

Status Send(int fd, const Message& m);
// Waits up to timeout_ms (-1: forever). Unavailable("closed") when the peer is
// gone; kResourceExhausted-free: a timeout returns FailedPrecondition("timeout").
Result<Message> Receive(int fd, int timeout_ms);

// The parameters message. Send: InvalidArgument if they encode to more than
// kMaxParametersPayload bytes. Receive: waits up to timeout_ms for it, and
// checks every length against the packet.
Status SendParameters(int fd, const std::map<std::string, std::string>& parameters);
Result<std::map<std::string, std::string>> ReceiveParameters(int fd, int timeout_ms);

// One input or output as the slot sees it.
struct SlotTensor {
  std::string name;
  uint64_t bytes_per_sample = 0;
};

// Byte layout of a worker's slot: each input then each output, at 64-byte
// aligned offsets, each sized for max_batch samples.
struct SlotLayout {
  std::vector<uint64_t> input_offsets, output_offsets;
  std::vector<uint64_t> input_bytes_per_sample, output_bytes_per_sample;
  uint64_t total = 0;
  // InvalidArgument naming the input or output whose size, offset or
  // alignment would pass 2^63 bytes.
  static Result<SlotLayout> Make(const std::vector<SlotTensor>& inputs,
                                 const std::vector<SlotTensor>& outputs, int max_batch);
};

}  // namespace hearth::control
