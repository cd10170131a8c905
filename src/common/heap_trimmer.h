// HeapTrimmer: gives the kernel back the memory the allocator holds free.
//
// glibc's malloc keeps what is freed in its arenas for reuse. After a burst
// that a client caused and then left (a gRPC stream flood: 1.4 GB of call
// state, all of it freed once the connection closed), the process kept that
// memory, free but resident (1.4 GB of it, 0.5 MB in use): the arenas' tops
// were in use, so free() itself never returned it. malloc_trim(0) does, page
// by page.
//
// A thread looks every `period` at how many bytes the arenas hold free
// (mallinfo2) and trims when that passes `threshold_bytes`. Looking walks
// the arenas' free lists under their locks: the period keeps that rare.
//
// Thread-safety: trims() may be called from any thread. The destructor stops
// and joins the thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace hearth {

class HeapTrimmer {
 public:
  HeapTrimmer(uint64_t threshold_bytes, std::chrono::milliseconds period);
  ~HeapTrimmer();
  HeapTrimmer(const HeapTrimmer&) = delete;
  HeapTrimmer& operator=(const HeapTrimmer&) = delete;

  // Trims done so far.
  uint64_t trims() const { return trims_.load(std::memory_order_relaxed); }

 private:
  void Run();

  const uint64_t threshold_bytes_;
  const std::chrono::milliseconds period_;
  std::atomic<uint64_t> trims_{0};
  std::mutex mu_;
  std::condition_variable wake_;
  bool quit_ = false;
  std::thread thread_;
};

}  // namespace hearth
