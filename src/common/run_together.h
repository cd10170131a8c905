// Running a few tasks at once (one per device, say) and waiting for all.
#pragma once

#include <functional>
#include <system_error>
#include <thread>
#include <vector>

namespace hearth {

// Runs every task at once, each on a thread of its own but the last (on the
// caller's), and returns when all are done. A task that gets no thread
// (RLIMIT_NPROC) runs on the caller's thread in its turn.
inline void RunTogether(const std::vector<std::function<void()>>& tasks) {
  std::vector<std::thread> threads;
  for (size_t i = 0; i + 1 < tasks.size(); ++i) {
    try {
      threads.emplace_back(tasks[i]);
    } catch (const std::system_error&) {
      tasks[i]();
    }
  }
  if (!tasks.empty()) tasks.back()();
  for (std::thread& t : threads) t.join();
}

}  // namespace hearth
