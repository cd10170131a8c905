// A worker's life lock: a robust, process-shared pthread mutex in the first
// page of its request slot (kSlotHeaderBytes, before the slot's data). The
// worker's main thread takes it when its session opens and holds it until
// the process ends.
//
// Why: the kernel hands a robust mutex back (FUTEX_OWNER_DIED in its word)
// as soon as the owning thread leaves, before it tears down the process's
// memory. A dying worker's socket reaches end-of-file, and its pidfd
// signals, only after that teardown, which grows with the worker's private
// memory (on an H200 machine: 31 ms at 1 GB, 76 ms at 2 GB, against 0.2 ms
// for the lock; bench/results/2026-12-04-death-notice.md). So the server
// learns of a death sooner from the lock, and a hot spare takes over sooner.
//
// The server never takes the lock: its page is writable by the worker. It
// reads the futex word and sleeps on it with futex(2). A word that does not
// name the worker's thread when the watch starts gives no notice (the
// end-of-file still comes, later); a word that says its owner died is taken
// as the worker's death. A live worker can fake that only to be killed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "hearth/status.h"

namespace hearth::control {

// Bytes before a request slot's data: the life lock's page.
inline constexpr uint64_t kSlotHeaderBytes = 4096;

// Worker side: makes `header` (the slot's first page, mapped writable) a
// robust process-shared mutex and takes it for the calling thread, for good.
Status HoldLifeLock(void* header);
// Gives it back (a session that ends while its process goes on).
void ReleaseLifeLock(void* header);

// Server side: one thread that waits, on the lock at `header`, for the
// death of thread `tid`, and then calls `on_death` once (from that thread,
// with no lock of the caller's held). The page is kept mapped by `header`
// for as long as the thread runs. Destroying the watch stops it: the thread
// notices within 200 ms and ends on its own.
class LifeWatch {
 public:
  LifeWatch(std::shared_ptr<void> header, pid_t tid, std::function<void()> on_death);
  ~LifeWatch();
  LifeWatch(const LifeWatch&) = delete;
  LifeWatch& operator=(const LifeWatch&) = delete;

  // The lock said its owner died.
  bool dead() const;
  // Waits up to `timeout` for the watch to end (a death seen, or a lock that
  // does not name `tid`); whether it ended. For tests.
  bool WaitEnded(std::chrono::milliseconds timeout) const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace hearth::control
