// Feeds the server's side of the worker protocol (src/protocol/
// worker_protocol.h) every packet a worker could send, through a real
// SOCK_SEQPACKET socketpair, and checks its promises: a packet is decoded or
// refused with InvalidArgument naming the fault (an empty one reads as the
// peer gone), never anything else; what is accepted keeps the limits the
// decoder promises, and a ready, room, ring, open, response, credit, cancel
// or ring-grow message that is accepted encodes again to one that decodes
// the same.
//
// Input: one control packet.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "protocol/worker_protocol.h"

namespace {

using namespace hearth;
using namespace hearth::control;

void Require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "broken guarantee: %s\n", what);
    __builtin_trap();
  }
}

struct Pair {
  int worker = -1, server = -1;
  Pair() {
    int fds[2];
    Require(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) == 0, "a socketpair");
    worker = fds[0];
    server = fds[1];
    const int bytes = 4 << 20;  // room for the largest packet a test sends
    ::setsockopt(worker, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
    ::setsockopt(server, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
  }
};

Pair& Sockets() {
  static Pair pair;
  return pair;
}

bool SameReady(const Ready& a, const Ready& b) {
  return a.inputs == b.inputs && a.outputs == b.outputs &&
         a.device_memory_bytes == b.device_memory_bytes && a.text == b.text &&
         a.device_addresses == b.device_addresses && a.phases == b.phases &&
         a.streams == b.streams && a.window == b.window;
}

bool SameOpen(const Open& a, const Open& b) {
  return a.id == b.id && a.request_id == b.request_id && a.slot_bytes == b.slot_bytes &&
         a.inputs == b.inputs && a.parameters_json == b.parameters_json && a.resume == b.resume;
}

bool SameResponse(const Response& a, const Response& b) {
  return a.id == b.id && a.final == b.final && a.status_code == b.status_code && a.text == b.text &&
         a.outputs == b.outputs && a.present == b.present;
}

// An accepted message encoded again by `send`, then decoded: what comes back.
template <typename Send>
Message Again(Pair& p, Kind kind, Send send, const char* what) {
  Require(send(p.worker).ok(), what);
  Result<Message> again = Receive(p.server, 1000);
  Require(again.ok() && again->kind == kind, what);
  return std::move(*again);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > kMaxSetupBytes + 64) return 0;  // past any limit: refused by its length alone
  Pair& p = Sockets();
  if (::send(p.worker, data, size, 0) != static_cast<ssize_t>(size)) return 0;
  Result<Message> m = Receive(p.server, 1000);
  if (!m.ok()) {
    const StatusCode code = m.status().code();
    Require(code == StatusCode::kInvalidArgument || (size == 0 && code == StatusCode::kUnavailable),
            "a malformed packet is InvalidArgument");
    Require(!m.status().message().empty(), "a refusal says why");
    return 0;
  }
  switch (m->kind) {
    case Kind::kReady: {
      Require(m->ready.phases.size() <= kMaxStartPhases, "start phases within the limit");
      for (const StartPhase& phase : m->ready.phases)
        Require(IsStartPhaseName(phase.name), "start phase names as promised");
      Require(m->ready.streams >= 1 && m->ready.streams <= kMaxStreams && m->ready.window >= 1 &&
                  m->ready.window <= kMaxWindow,
              "streams and window within the limits");
      const Message again = Again(
          p, Kind::kReady, [&](int fd) { return SendReady(fd, m->ready); }, "ready encodes again");
      Require(SameReady(again.ready, m->ready), "ready round trip");
      break;
    }
    case Kind::kRoom: {
      const Message again = Again(
          p, Kind::kRoom, [&](int fd) { return SendRoom(fd, m->room); }, "room encodes again");
      Require(again.room.seq == m->room.seq && again.room.slot_bytes == m->room.slot_bytes,
              "room round trip");
      break;
    }
    case Kind::kRing: {
      const Ring& r = m->ring;
      Require(r.bytes > 0 && r.slot_bytes < kMaxSlotBytes && r.offset + r.bytes <= r.slot_bytes,
              "a ring inside its slot");
      const Message again = Again(
          p, Kind::kRing, [&](int fd) { return SendRing(fd, r); }, "ring encodes again");
      Require(again.ring == r, "ring round trip");
      break;
    }
    case Kind::kOpen: {
      const Open& o = m->open;
      Require(o.slot_bytes < kMaxSlotBytes, "an open's slot within the limit");
      Require(o.inputs.size() <= kMaxTensors, "an open's inputs within the limit");
      Require(o.parameters_json.size() <= kMaxParametersBytes, "parameters within the limit");
      Require(o.resume.shape.size() == 1 && o.resume.shape[0] >= 0 &&
                  static_cast<uint64_t>(o.resume.shape[0]) <= kMaxResumeTokens &&
                  o.resume.bytes == static_cast<uint64_t>(o.resume.shape[0]) * sizeof(int64_t) &&
                  o.resume.offset + o.resume.bytes <= o.slot_bytes,
              "resume tokens INT64 [n] inside the slot");
      const Message again = Again(
          p, Kind::kOpen, [&](int fd) { return SendOpen(fd, o); }, "open encodes again");
      Require(SameOpen(again.open, o), "open round trip");
      break;
    }
    case Kind::kResponse: {
      const Response& r = m->response;
      Require(r.present.size() == r.outputs.size() && r.outputs.size() <= kMaxTensors,
              "a response's presence flags, one per output");
      Require(r.status_code == 0 || r.final, "an error response is final");
      Require(r.text.size() <= kMaxTextBytes, "a response's text within the limit");
      const Message again = Again(
          p, Kind::kResponse, [&](int fd) { return SendResponse(fd, r); },
          "response encodes again");
      Require(SameResponse(again.response, r), "response round trip");
      break;
    }
    case Kind::kCredit: {
      Require(m->credit.responses >= 1 && m->credit.responses <= kMaxWindow,
              "a credit within the window's limit");
      const Message again = Again(
          p, Kind::kCredit, [&](int fd) { return SendCredit(fd, m->credit); },
          "credit encodes again");
      Require(again.credit.responses == m->credit.responses, "credit round trip");
      break;
    }
    case Kind::kCancel: {
      Require(!m->cancel.ids.empty() && m->cancel.ids.size() <= kMaxCancelIds,
              "a cancel of 1 to kMaxCancelIds requests");
      const Message again = Again(
          p, Kind::kCancel, [&](int fd) { return SendCancel(fd, m->cancel.ids); },
          "cancel encodes again");
      Require(again.cancel.ids == m->cancel.ids, "cancel round trip");
      break;
    }
    case Kind::kRingGrow: {
      Require(m->ring_grow.bytes > 0 && m->ring_grow.bytes < kMaxSlotBytes,
              "a ring asked for within the limit");
      const Message again = Again(
          p, Kind::kRingGrow, [&](int fd) { return SendRingGrow(fd, m->ring_grow); },
          "ring-grow encodes again");
      Require(again.ring_grow.bytes == m->ring_grow.bytes, "ring-grow round trip");
      break;
    }
    case Kind::kEngineStats: {
      Require(m->engine_stats.kv_blocks_used <= m->engine_stats.kv_blocks_total &&
                  m->engine_stats.kv_blocks_total <= kMaxKvBlocks,
              "engine statistics within the limits");
      const Message again = Again(
          p, Kind::kEngineStats, [&](int fd) { return SendEngineStats(fd, m->engine_stats); },
          "engine-stats encodes again");
      Require(again.engine_stats == m->engine_stats, "engine-stats round trip");
      break;
    }
    default:
      break;
  }
  return 0;
}
