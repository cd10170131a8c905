// A model's request queue and how it forms batches (the config's
// dynamic_batching): bounded, retried requests first, requests past their
// deadline answered without running, batches only of requests whose shapes
// agree. Time comes from a QueueClock, so that tests can drive it.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/checked_size.h"
#include "hearth/status.h"
#include "server/inference_api.h"

namespace hearth {

using Clock = std::chrono::steady_clock;

// Now, and waits on a condition variable until a time point of that clock.
class QueueClock {
 public:
  virtual ~QueueClock() = default;
  virtual Clock::time_point Now() const = 0;
  // As std::condition_variable::wait_until with a predicate: true if
  // `ready` holds on return, false if `until` came first.
  virtual bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                         Clock::time_point until, const std::function<bool()>& ready) const = 0;
  // steady_clock itself.
  static const QueueClock& Real();
};

// A request whose batches took down this many workers is failed ("poison"),
// not retried: it, not the workers, is at fault.
inline constexpr int kPoisonCrashes = 3;

struct StreamProgress;  // server/stream_runner.h

struct Job {
  Clock::time_point received = Clock::now();
  Clock::time_point deadline = Clock::time_point::max();
  InferRequest request;
  std::function<void(Result<InferResponse>)> done;
  int64_t batch = 1;
  // Requests batch together only when their inputs' shapes beyond the batch
  // dimension are the same: the inputs' dims, concatenated.
  std::vector<int64_t> shape_key;
  // The priority level: lower runs first (1 is the highest).
  uint64_t priority = 0;
  int crashes = 0;     // workers taken down by batches this request was in (kPoisonCrashes)
  bool alone = false;  // its batch failed on its inputs: it runs alone now
  // A decoupled model's request: what its stream has sent so far, kept
  // when it goes on on another worker.
  std::shared_ptr<StreamProgress> stream;
};

// How a model's queue forms batches (the config's dynamic_batching).
struct BatchPolicy {
  int64_t max_batch = 1;
  std::chrono::microseconds max_delay{0};  // at most kMaxQueueDelayUs (the config checks it)
  std::vector<int64_t> preferred;          // sorted
};

// A bounded queue of jobs, in order of priority level and then of arrival;
// retried jobs go to the front.
class JobQueue {
 public:
  explicit JobQueue(size_t capacity, const QueueClock* clock = nullptr)
      : capacity_(capacity), clock_(clock != nullptr ? clock : &QueueClock::Real()) {}
  // Full, the queue first lets go of the requests whose clients went away
  // (answered as cancelled): they would never run, and must not keep a live
  // client's request out.
  Status Push(std::shared_ptr<Job> job) {
    std::vector<std::shared_ptr<Job>> abandoned;
    Status pushed = Status::Ok();
    {
      std::lock_guard lock(mu_);
      if (closed_) return Unavailable("the server is shutting down");
      if (jobs_.size() >= capacity_) {
        std::erase_if(jobs_, [&abandoned](std::shared_ptr<Job>& queued) {
          if (!queued->request.cancelled || !queued->request.cancelled->load()) return false;
          abandoned.push_back(std::move(queued));
          return true;
        });
      }
      if (jobs_.size() >= capacity_) {
        pushed =
            ResourceExhausted("queue full: " + std::to_string(capacity_) + " requests waiting");
      } else {
        // After every job of its level or a higher one (at once when all
        // share one level, the usual case).
        auto at = jobs_.end();
        while (at != jobs_.begin() && (*std::prev(at))->priority > job->priority) --at;
        jobs_.insert(at, std::move(job));
        WakeIdle();
        PokeWakers();
        forming_.notify_all();
      }
    }
    for (auto& gone : abandoned) {
      gone->done(Unavailable("request '" + gone->request.id +
                             "' was cancelled before it ran: its client went away"));
    }
    return pushed;
  }
  void PushFront(std::shared_ptr<Job> job) {
    std::lock_guard lock(mu_);
    jobs_.push_front(std::move(job));
    WakeIdle();
    PokeWakers();
    forming_.notify_all();
  }
  // Blocks for the next batch: the oldest request, then later ones while
  // their rows fit in max_batch. It returns as soon as the rows reach the
  // largest preferred size (or max_batch), else once the oldest request has
  // waited max_delay. A request that was in a batch that crashed a worker runs
  // alone, so that only the request at fault can become a poison batch.
  // Requests whose deadline passed are answered DEADLINE_EXCEEDED here and
  // never run. Empty once closed and drained.
  // Returns empty after `idle` with nothing queued, so the caller can look
  // after its worker.
  std::vector<std::shared_ptr<Job>> PopBatch(const BatchPolicy& policy,
                                             std::chrono::milliseconds idle) {
    std::vector<std::shared_ptr<Job>> batch;
    std::vector<std::shared_ptr<Job>> expired;
    std::unique_lock lock(mu_);
    const int64_t target = policy.preferred.empty() ? policy.max_batch : policy.preferred.back();
    const auto idle_until = clock_->Now() + idle;
    int64_t rows = 0;
    for (;;) {
      if (batch.empty() && !WaitForWork(lock, idle_until)) return {};
      const auto now = clock_->Now();
      // From the front: the oldest request sets the batch's shape; later
      // ones of the same shape join it, passing over requests of other
      // shapes (which keep their places for a batch of their own).
      for (size_t i = 0; i < jobs_.size() && i < kScanLimit;) {
        std::shared_ptr<Job>& job = jobs_[i];
        if (job->deadline <= now) {
          expired.push_back(std::move(job));
          jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        const bool alone = job->crashes > 0 || job->alone;
        if (!batch.empty()) {
          if (batch[0]->crashes > 0 || batch[0]->alone || rows + job->batch > policy.max_batch)
            break;
          if (alone || job->shape_key != batch[0]->shape_key) {
            ++i;
            continue;
          }
        }
        rows += job->batch;
        batch.push_back(std::move(job));
        jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(i));
        if (alone) break;
      }
      if (batch.empty()) {
        if (closed_ && jobs_.empty()) break;
        if (!expired.empty()) break;
        continue;
      }
      const bool full = rows >= target || batch[0]->crashes > 0 || batch[0]->alone ||
                        !jobs_.empty() || closed_ || policy.max_delay.count() == 0;
      if (full) break;
      // The batch waits for more rows until its oldest request has waited
      // max_delay, but never past the deadline of any request in it.
      auto until = SaturatingDeadline<Clock>(batch[0]->received,
                                             static_cast<uint64_t>(policy.max_delay.count()));
      for (const auto& job : batch) until = std::min(until, job->deadline);
      if (now >= until) break;
      clock_->WaitUntil(forming_, lock, until, [&] { return closed_ || !jobs_.empty(); });
      if (jobs_.empty()) break;
    }
    if (!jobs_.empty()) WakeIdle();  // more than this batch took: another worker's turn
    lock.unlock();
    // A request may have run out of time while its batch was forming.
    const auto now = clock_->Now();
    std::erase_if(batch, [&](std::shared_ptr<Job>& job) {
      if (job->deadline > now) return false;
      expired.push_back(std::move(job));
      return true;
    });
    for (auto& job : expired) {
      job->done(
          DeadlineExceeded("request '" + job->request.id + "' timed out after waiting " +
                           std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(
                                              clock_->Now() - job->received)
                                              .count()) +
                           " us in the queue"));
    }
    return batch;
  }
  size_t size() {
    std::lock_guard lock(mu_);
    return jobs_.size();
  }
  // The queued jobs whose clients are still there: one whose client went
  // away stays queued (counted by size()) until a pop, or a full queue's
  // Push, answers it cancelled.
  size_t waiting() {
    std::lock_guard lock(mu_);
    return static_cast<size_t>(std::count_if(jobs_.begin(), jobs_.end(), [](const auto& job) {
      return !job->request.cancelled || !job->request.cancelled->load();
    }));
  }
  void Close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    forming_.notify_all();
    while (!idle_.empty()) WakeIdle();
    PokeWakers();
  }
  // Makes every caller of PopBatch waiting idle return empty now, as if its
  // `idle` had passed (a worker has died: its supervisor looks at once).
  void Nudge() {
    std::lock_guard lock(mu_);
    ++nudges_;
    while (!idle_.empty()) WakeIdle();
    PokeWakers();
  }
  // An eventfd written whenever a job comes, the queue closes or is
  // nudged: a supervisor busy with its worker's streams waits on it beside
  // the worker's socket, and takes more when it has room.
  void AddWaker(int fd) {
    std::lock_guard lock(mu_);
    wakers_.push_back(fd);
  }
  void RemoveWaker(int fd) {
    std::lock_guard lock(mu_);
    std::erase(wakers_, fd);
  }
  bool closed() {
    std::lock_guard lock(mu_);
    return closed_;
  }
  // Fails everything still queued (no worker left to run it).
  void FailAll(const Status& why) {
    std::deque<std::shared_ptr<Job>> left;
    {
      std::lock_guard lock(mu_);
      left.swap(jobs_);
    }
    for (auto& job : left) job->done(why);
  }

 private:
  // A caller of PopBatch waiting for work. Idle callers are woken last in,
  // first out: under light load the worker that just finished (whose GPU
  // context is the one running) takes the next request, rather than the
  // worker idle the longest, which would make the GPU switch between worker
  // processes' contexts for every request.
  struct IdleWaiter {
    std::condition_variable cv;
    bool woken = false;
  };

  // mu_ held.
  void PokeWakers() {
    const uint64_t one = 1;
    for (int fd : wakers_) (void)!::write(fd, &one, sizeof one);
  }
  void WakeIdle() {
    if (idle_.empty()) return;
    IdleWaiter* w = idle_.back();
    idle_.pop_back();
    w->woken = true;
    w->cv.notify_one();
  }

  // Waits (mu_ held through `lock`) until a request is queued or the queue
  // closes; false if `until` came first with neither, or a Nudge().
  bool WaitForWork(std::unique_lock<std::mutex>& lock, Clock::time_point until) {
    IdleWaiter self;
    const uint64_t nudges = nudges_;
    while (!closed_ && jobs_.empty()) {
      if (nudges_ != nudges) return false;
      self.woken = false;
      idle_.push_back(&self);
      if (!clock_->WaitUntil(self.cv, lock, until, [&] { return self.woken; })) {
        std::erase(idle_, &self);
        return false;
      }
    }
    return true;
  }

  // How far past the front a batch looks for requests of its shape.
  static constexpr size_t kScanLimit = 4096;
  std::mutex mu_;
  std::condition_variable forming_;  // callers holding part of a batch, waiting for more
  std::vector<IdleWaiter*> idle_;
  std::deque<std::shared_ptr<Job>> jobs_;
  size_t capacity_;
  const QueueClock* clock_;
  bool closed_ = false;
  uint64_t nudges_ = 0;
  std::vector<int> wakers_;
};

}  // namespace hearth
