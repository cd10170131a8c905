// Polls a condition with a deadline: for what a test cannot be told about
// (another process, a thread of the code under test). Timing out is a
// failure of the test, never a timing it depends on.
#pragma once

#include <chrono>
#include <thread>

namespace hearth {

// True once `condition()` holds; false if `limit` passes first. Polls every
// millisecond.
template <typename Condition>
bool Eventually(Condition condition, std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace hearth
