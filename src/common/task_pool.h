// A bounded pool for slow tasks that must not run on an I/O thread (a
// repository load waits for workers to start): at most `capacity` tasks
// queued or running, on at most `capacity` threads started as they are
// needed and joined by Stop().
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hearth/status.h"

namespace hearth {

class TaskPool {
 public:
  // `what` names the tasks in the refusal: "repository loads and unloads".
  TaskPool(size_t capacity, std::string what);
  ~TaskPool() { Stop(); }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  // Queues `task`. ResourceExhausted when `capacity` tasks are queued or
  // running ("the server has N <what> in progress, its limit; retry
  // later"), or when no thread can be started and none is running;
  // Unavailable once stopping. A refused task is not run.
  Status Submit(std::function<void()> task);
  // The same for a task whose caller waits for its outcome: runs `work`,
  // then `done` with what it returned, once the task no longer counts
  // towards the capacity (a caller answered may submit again at once).
  // A refused task runs neither: the caller answers with the refusal.
  Status Submit(std::function<Status()> work, std::function<void(Status)> done);
  // Runs what is queued, then joins every thread; Submit refuses from the
  // start of the call on. Idempotent.
  void Stop();
  // Tasks queued or running.
  size_t pending() const;

 private:
  void Loop();
  Status Queue(std::function<std::function<void()>()> task);

  const size_t capacity_;
  const std::string what_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  // Each task returns what is to run after it stops counting (or nothing).
  std::deque<std::function<std::function<void()>()>> queue_;
  std::vector<std::thread> threads_;
  size_t pending_ = 0;
  size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace hearth
