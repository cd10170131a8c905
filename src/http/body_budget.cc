#include "http/body_budget.h"

#include <algorithm>
#include <utility>

namespace hearth {

BodyBudget::Outcome BodyBudget::Acquire(Holder holder, uint64_t bytes, uint64_t holding,
                                        Granted granted) {
  std::vector<Granted> ready;
  Outcome outcome;
  {
    std::lock_guard lock(mutex_);
    if (closed_) return Outcome::kClosed;
    // The finisher is not held back; the others keep their order.
    if (holder == finisher_ || (waiters_.empty() && held_ + bytes <= limit_)) {
      held_ += bytes;
      peak_ = std::max(peak_, held_);
      return Outcome::kGranted;
    }
    ++waits_;
    waiters_.push_back({holder, bytes, holding, std::move(granted)});
    waiting_held_ += holding;
    Pump(ready);  // it may be the deadlock's last waiter
    outcome = Outcome::kWaiting;
  }
  for (Granted& g : ready) g(true);
  return outcome;
}

void BodyBudget::AcquireNow(uint64_t bytes) {
  std::lock_guard lock(mutex_);
  held_ += bytes;
  peak_ = std::max(peak_, held_);
}

void BodyBudget::Release(Holder holder, uint64_t bytes) {
  std::vector<Granted> ready;
  {
    std::lock_guard lock(mutex_);
    held_ -= std::min(bytes, held_);
    if (holder == finisher_) finisher_ = 0;
    Pump(ready);
  }
  for (Granted& g : ready) g(true);
}

void BodyBudget::Close() {
  std::deque<Waiter> failed;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    failed.swap(waiters_);
    waiting_held_ = 0;
  }
  for (Waiter& w : failed) w.granted(false);
}

void BodyBudget::Grant(Waiter& waiter, std::vector<Granted>& ready) {
  held_ += waiter.bytes;
  peak_ = std::max(peak_, held_);
  waiting_held_ -= waiter.holding;
  ready.push_back(std::move(waiter.granted));
}

void BodyBudget::Pump(std::vector<Granted>& ready) {
  while (!waiters_.empty()) {
    Waiter& front = waiters_.front();
    if (held_ + front.bytes <= limit_) {
      Grant(front, ready);
      waiters_.pop_front();
      continue;
    }
    // Every byte held is a waiter's: none will come back unless one of them
    // finishes. The oldest goes ahead, past the limit.
    if (finisher_ == 0 && held_ == waiting_held_) {
      finisher_ = front.holder;
      ++finishers_;
      Grant(front, ready);
      waiters_.pop_front();
      continue;
    }
    break;
  }
}

BodyBudget::Snapshot BodyBudget::snapshot() const {
  std::lock_guard lock(mutex_);
  Snapshot s;
  s.limit = limit_;
  s.held = held_;
  s.peak = peak_;
  s.waiting = waiters_.size();
  s.waits = waits_;
  s.finishers = finishers_;
  return s;
}

}  // namespace hearth
