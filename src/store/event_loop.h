// The store's event loop: one thread, one epoll set, serving every client
// connection. It accepts connections (accepting.cc), reads their requests and
// sends the replies within the store's limits (serving.cc), answers the
// requests (requests.cc), and wakes for its timers: accepts resumed after a
// backoff, descriptors sent and not yet seen read, attaches that wait and
// connections that stall (event_loop.cc).
//
// Every resource a client can make the store hold is counted here against
// StoreLimits: connections, descriptors sent but not read, bytes of
// unfinished messages and of queued replies.
//
// Threading: Run() and everything it calls on one thread; Stop() and
// CancelLoads() from any thread, Stop() from a signal handler too.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "hearth/manifest.h"
#include "hearth/status.h"
#include "hearth/store.h"
#include "hearth/unique_fd.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "store/connection.h"
#include "store/limits.h"
#include "store/load_queue.h"
#include "store/log_limiter.h"
#include "store/registry.h"

namespace hearth::store {

// How often descriptors sent but not seen read are looked at again (see
// RefreshInFlight for why a wakeup alone is not enough).
inline constexpr std::chrono::milliseconds kInFlightSweep(1000);

class EventLoop {
 public:
  // Serves the models of `registry`, which outlives the loop.
  EventLoop(const StoreOptions& options, Registry* registry);

  // Creates the epoll set and the eventfds, and resolves (and logs) the limits.
  Status Init();
  // Watches the listening socket, bound and listening, and the eventfds.
  Status Listen(UniqueFd listener);

  // Serves until Stop().
  Status Run();
  // Async-signal-safe.
  void Stop();
  // See Store::CancelLoads. Any thread.
  void CancelLoads() { loads_.Cancel(); }
  // Closes the listening socket and every connection; their leases end.
  void CloseAll();

 private:
  static constexpr uint64_t kStopTag = 1, kListenTag = 2, kLoadTag = 3, kFirstConnection = 16;

  Status Watch(int fd, uint32_t events, uint64_t tag);
  Connection* FindConnection(uint64_t id);

  // ---- timers (event_loop.cc) ------------------------------------------------

  int TimeoutMs() const;
  void RunTimers();
  // Attaches wait for the store-wide descriptor cap, or connections are not
  // read for the store-wide reply budget.
  bool SomethingWaits() const { return !deferred_.empty() || !output_waiters_.empty(); }
  void ExpireWaitingAttaches(Clock::time_point now);
  void CloseStalledConnections(Clock::time_point now);

  // ---- accepting (accepting.cc) ----------------------------------------------

  void AcceptSome();
  void PauseAccepting(int err);
  void Admit(UniqueFd fd);
  bool Authorized(uid_t uid, gid_t gid) const;
  static void Refuse(int fd, const Status& why);

  // ---- serving connections (serving.cc) --------------------------------------

  void MarkReady(Connection& c);
  void ServiceReady();
  void OnConnectionEvent(uint64_t id, uint32_t events);
  bool MayRead(const Connection& c) const;
  Connection::Pause WhyNotRead(const Connection& c) const;
  void NotePause(Connection& c);
  void Service(uint64_t id);
  bool ReadOne(Connection& c);
  void ChargePartial(Connection& c);
  bool RefreshInFlight(Connection& c);
  void ReleaseUnread(size_t n);
  void Reject(uint64_t id, const Status& why);
  void Close(uint64_t id);
  void Queue(Connection& c, protocol::MessageType type, const std::vector<std::byte>& payload,
             UniqueFd fd = UniqueFd());
  void ReleaseQueued(size_t n);
  void QueueError(Connection& c, const Status& status);
  bool Flush(Connection& c);
  static void SendAndForget(int fd, const Status& status);

  // ---- answering requests (requests.cc) --------------------------------------

  Status Handle(Connection& c, const protocol::Message& m);
  void HandleAttach(Connection& c, const protocol::AttachRequest& req);
  void HandleLoad(Connection& c, LoadJob job);
  void FinishLoads();
  StoreStatus Report();

  StoreOptions options_;
  StoreLimits limits_;
  Registry* const registry_;
  UniqueFd epoll_, stop_fd_, listen_;
  bool stopping_ = false;
  uint64_t next_connection_id_ = kFirstConnection;
  Connections connections_;
  std::vector<uint64_t> ready_;  // connections to service after this round of events
  std::vector<std::byte> frame_buffer_ =
      std::vector<std::byte>(protocol::kFrameHeaderBytes + protocol::kMaxFramePayload + 1);

  // What is held against the limits.
  size_t unread_fds_ = 0;                 // queued or in flight, all connections
  size_t in_flight_fds_ = 0;              // in flight, all connections
  size_t partial_bytes_ = 0;              // assemblers' allocations, all connections
  size_t queued_bytes_ = 0;               // replies queued in the store, all connections
  std::deque<uint64_t> deferred_;         // connections whose attach waits for unread_fds_ to drop
  std::vector<uint64_t> output_waiters_;  // connections not read while queued_bytes_ is at its max
  Clock::time_point next_wait_check_;
  // What the status reply reports besides the current totals (docs/protocol.md).
  std::map<std::string, uint64_t> counters_;
  Clock::time_point next_sweep_;
  bool accept_paused_ = false;
  Clock::time_point accept_resume_at_;
  std::chrono::milliseconds accept_backoff_{0};
  LogLimiter accept_log_, refuse_log_, reject_log_, cap_log_;
  // Last, so that its loads are cancelled and joined before the rest goes.
  LoadQueue loads_;
};

}  // namespace hearth::store
