#include "common/heap_trimmer.h"

#include <malloc.h>

namespace hearth {

HeapTrimmer::HeapTrimmer(uint64_t threshold_bytes, std::chrono::milliseconds period)
    : threshold_bytes_(threshold_bytes), period_(period), thread_([this] { Run(); }) {}

HeapTrimmer::~HeapTrimmer() {
  {
    std::lock_guard lock(mu_);
    quit_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HeapTrimmer::Run() {
  std::unique_lock lock(mu_);
  while (!wake_.wait_for(lock, period_, [this] { return quit_; })) {
    lock.unlock();
    // fordblks: bytes in free chunks of every arena (mmapped chunks are
    // returned by free() at once and are not counted).
    if (mallinfo2().fordblks > threshold_bytes_) {
      malloc_trim(0);
      trims_.fetch_add(1, std::memory_order_relaxed);
    }
    lock.lock();
  }
}

}  // namespace hearth
