// BodyBudget: the request body bytes that the HTTP front-end holds across all
// of its connections (HttpOptions::max_inflight_bytes).
//
// A connection takes bytes as its body arrives, a chunk at a time, and gives
// them all back once its response is written or it closes. A chunk that does
// not fit waits, first come first served, and its connection stops reading
// meanwhile (the client is held back by TCP flow control, not by our memory).
//
// Waiting alone could deadlock: when every byte held belongs to a connection
// that is itself waiting for more, nothing would ever be given back. Then the
// oldest waiter becomes the *finisher*: it is granted past the limit until it
// gives its bytes back (its request answered), so that it can finish. There is
// at most one finisher at a time, so the bytes held never exceed the limit plus
// one body (a body is never larger than the limit: the front-end answers 413),
// plus what AcquireNow took.
//
// Thread-safe. `granted` callbacks run outside the lock, on the thread that
// freed the bytes (Release, Close) or that asked (Acquire never calls it).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

namespace hearth {

class BodyBudget {
 public:
  // Identifies one holder (a connection) across its calls; never 0.
  using Holder = uint64_t;
  // true: the bytes are the holder's; false: the budget was closed instead.
  using Granted = std::function<void(bool granted)>;

  explicit BodyBudget(uint64_t limit) : limit_(limit) {}
  BodyBudget(const BodyBudget&) = delete;
  BodyBudget& operator=(const BodyBudget&) = delete;

  enum class Outcome { kGranted, kWaiting, kClosed };
  // Takes `bytes` more for `holder`, which already holds `holding` (what it
  // would give back). kGranted: taken now. kWaiting: `granted` runs once they
  // are taken (or with false on Close); the holder must not ask again or
  // release until then. kClosed: Close() was called; nothing taken.
  Outcome Acquire(Holder holder, uint64_t bytes, uint64_t holding, Granted granted);

  // Takes `bytes` at once, past the limit if need be. For small bodies,
  // which the front-end bounds by their number (one per connection), so that
  // connections sending large bodies cannot hold up small requests.
  void AcquireNow(uint64_t bytes);

  // Gives back `bytes` that `holder` was granted (all it holds: a holder
  // releases once per request). Ends its time as the finisher, if it was.
  void Release(Holder holder, uint64_t bytes);

  // Fails every waiter and every later Acquire. For shutting down.
  void Close();

  struct Snapshot {
    uint64_t limit = 0;
    uint64_t held = 0;
    uint64_t peak = 0;       // most held at once
    uint64_t waiting = 0;    // holders waiting now
    uint64_t waits = 0;      // Acquires that had to wait, ever
    uint64_t finishers = 0;  // holders granted past the limit, ever
  };
  Snapshot snapshot() const;

 private:
  struct Waiter {
    Holder holder;
    uint64_t bytes;
    uint64_t holding;
    Granted granted;
  };
  // Grants what can be granted, in order; appends their callbacks to `ready`.
  void Pump(std::vector<Granted>& ready);
  void Grant(Waiter& waiter, std::vector<Granted>& ready);

  const uint64_t limit_;
  mutable std::mutex mutex_;
  uint64_t held_ = 0;
  uint64_t waiting_held_ = 0;  // bytes held by holders that are waiting
  uint64_t peak_ = 0;
  uint64_t waits_ = 0;
  uint64_t finishers_ = 0;
  Holder finisher_ = 0;  // 0: none
  bool closed_ = false;
  std::deque<Waiter> waiters_;
};

}  // namespace hearth
