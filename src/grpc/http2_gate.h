// Http2Gate: the gRPC port's listener, in front of grpc++.
//
// grpc++ 1.51 bounds neither how fast a connection opens streams nor how many
// it resets, enforces SETTINGS_MAX_CONCURRENT_STREAMS only on a client that
// acknowledged its SETTINGS, and has no limit on connections: one raw HTTP/2
// connection opened 73,600 streams in 4 s and left the server at 1.5 GB. So
// the gate accepts each connection itself and hands grpc++ one end of a
// socketpair (grpc::AddInsecureChannelFromFd), then relays the bytes between
// the client and that socketpair on a thread of its own. It reads the frame
// headers that pass (never a payload) and enforces, per connection:
// - streams opened per second, a token bucket: past it the gate stops
//   reading the client's frames until a token is back, so a fast client is
//   paced and loses nothing;
// - open streams: a client that has more than max_open_streams streams that
//   it opened and the server has not ended ignores the SETTINGS it was sent,
//   and is closed;
// - resets: a client that resets streams faster than resets_per_second
//   (beyond a burst), or whose reset does not fit in the budget of all
//   connections together, is closed: HTTP/2 "rapid reset", CVE-2023-44487;
// - the connection preface must arrive within handshake_timeout;
// and over all connections: at most max_total_open_streams streams opened and
// not yet ended by grpc++, counting those of connections being closed (grpc++
// is sent RST_STREAM for them and the gate waits for their ends), past which
// new streams wait: a client that reconnects leaves no work behind in grpc++;
// at most max_connections at once (more wait in the kernel's backlog). Each direction of a
// connection buffers at most kGateBufferBytes; a side that does not read stops the other (TCP's
// flow control carries it back to the sender).
//
// Threads: one, started by Start(), relays every connection. Client() and
// stats() are thread-safe. The destructor closes every connection.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "hearth/status.h"
#include "server/local_peer.h"

namespace hearth {

inline constexpr size_t kGateBufferBytes = size_t{256} << 10;

struct Http2GateLimits {
  int max_connections = 1024;
  int max_open_streams = 256;  // twice the SETTINGS_MAX_CONCURRENT_STREAMS sent: room for races
  // Over all connections, those being closed included: past it, every new
  // stream waits until one ends.
  int max_total_open_streams = 4096;
  double streams_per_second = 100000;
  double stream_burst = 2000;
  double resets_per_second = 200;
  double reset_burst = 400;
  // Over all connections (a burst of as many): past it, the connection whose
  // reset does not fit is closed.
  double total_resets_per_second = 1000;
  std::chrono::milliseconds handshake_timeout{10'000};
};

struct Http2GateStats {
  uint64_t connections = 0;          // open now
  uint64_t accepted = 0;             // since the start
  uint64_t closed_open_streams = 0;  // closed for too many open streams
  uint64_t closed_resets = 0;        // closed for resetting too fast
  uint64_t closed_handshake = 0;     // closed for a preface late or not HTTP/2's
  uint64_t paced = 0;                // times a connection waited for a stream token
  uint64_t waited_total = 0;         // times a new stream waited for max_total_open_streams
};

class Http2Gate {
 public:
  // Binds host:port (0: any free port) and listens. `adopt` is given grpc's
  // end of each new connection's socketpair and owns it from then on; it is
  // called on the gate's thread.
  static Result<std::unique_ptr<Http2Gate>> Listen(const std::string& host, uint16_t port,
                                                   Http2GateLimits limits,
                                                   std::function<void(int fd)> adopt);
  ~Http2Gate();
  Http2Gate(const Http2Gate&) = delete;
  Http2Gate& operator=(const Http2Gate&) = delete;

  uint16_t port() const;
  // Starts the relay thread.
  void Start();
  // Closes the listener: new connections are refused, open ones go on.
  void StopAccepting();

  // The client behind grpc's peer string ("fd:N", N being grpc's end of a
  // connection the gate relays); nullopt for any other.
  std::optional<ClientConnection> Client(const std::string& peer) const;
  Http2GateStats stats() const;

 private:
  class Impl;
  explicit Http2Gate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace hearth
