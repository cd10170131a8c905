#include "common/task_pool.h"

#include <system_error>
#include <utility>

namespace hearth {

TaskPool::TaskPool(size_t capacity, std::string what)
    : capacity_(capacity < 1 ? 1 : capacity), what_(std::move(what)) {}

Status TaskPool::Submit(std::function<void()> task) {
  return Queue([task = std::move(task)] {
    task();
    return std::function<void()>();
  });
}

Status TaskPool::Submit(std::function<Status()> work, std::function<void(Status)> done) {
  return Queue([work = std::move(work), done = std::move(done)]() -> std::function<void()> {
    Status status = work();
    return [done, status = std::move(status)] { done(status); };
  });
}

Status TaskPool::Queue(std::function<std::function<void()>()> task) {
  std::lock_guard lock(mu_);
  if (stopping_) return Unavailable("the server is shutting down");
  if (pending_ >= capacity_)
    return ResourceExhausted("the server has " + std::to_string(pending_) + " " + what_ +
                             " in progress, its limit; retry later");
  // Each queued task has an idle thread to take it, or a new one, up to
  // `capacity` threads (one still running a task's answer takes the next
  // when it is done).
  if (queue_.size() >= idle_ && threads_.size() < capacity_) {
    try {
      threads_.emplace_back([this] { Loop(); });
    } catch (const std::system_error& e) {
      // No thread now: one that is running takes the task when it is done.
      if (threads_.empty())
        return ResourceExhausted("cannot start a thread for " + what_ + ": " + e.what());
    }
  }
  queue_.push_back(std::move(task));
  ++pending_;
  wake_.notify_one();
  return Status::Ok();
}

void TaskPool::Loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<std::function<void()>()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::function<void()> after = task();
    task = nullptr;  // what it holds goes before the count says it is done
    lock.lock();
    --pending_;
    if (after) {
      lock.unlock();
      after();
      after = nullptr;
      lock.lock();
    }
  }
}

void TaskPool::Stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  wake_.notify_all();
  for (std::thread& t : threads) t.join();
}

size_t TaskPool::pending() const {
  std::lock_guard lock(mu_);
  return pending_;
}

}  // namespace hearth
