// Feeds the server's side of the worker protocol (src/protocol/
// worker_protocol.h) every packet a worker could send, through a real
// SOCK_SEQPACKET socketpair, and checks its promises: a packet is decoded or
// refused with InvalidArgument naming the fault (an empty one reads as the
// peer gone), never anything else; a ready message or a room request that is
// accepted encodes again to one that decodes the same.
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
         a.device_addresses == b.device_addresses && a.phases == b.phases;
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
  if (m->kind == Kind::kReady) {
    Require(m->ready.phases.size() <= kMaxStartPhases, "start phases within the limit");
    for (const StartPhase& phase : m->ready.phases)
      Require(IsStartPhaseName(phase.name), "start phase names as promised");
    Require(SendReady(p.worker, m->ready).ok(), "an accepted ready encodes again");
    Result<Message> again = Receive(p.server, 1000);
    Require(again.ok() && again->kind == Kind::kReady && SameReady(again->ready, m->ready),
            "ready round trip");
  } else if (m->kind == Kind::kRoom) {
    Require(SendRoom(p.worker, m->room).ok(), "an accepted room request encodes again");
    Result<Message> again = Receive(p.server, 1000);
    Require(again.ok() && again->kind == Kind::kRoom && again->room.seq == m->room.seq &&
                again->room.slot_bytes == m->room.slot_bytes,
            "room round trip");
  }
  return 0;
}
