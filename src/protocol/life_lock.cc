#include "protocol/life_lock.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <system_error>
#include <thread>

namespace hearth::control {
namespace {

static_assert(sizeof(pthread_mutex_t) <= kSlotHeaderBytes);

// The futex word of a glibc mutex, which the kernel's robust-list handling
// updates: the owner's thread id, FUTEX_WAITERS, FUTEX_OWNER_DIED.
std::atomic<uint32_t>* Word(void* header) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(int));
  return reinterpret_cast<std::atomic<uint32_t>*>(static_cast<std::byte*>(header) +
                                                  offsetof(pthread_mutex_t, __data.__lock));
}

// How often a watch looks whether it was stopped.
constexpr auto kPoll = std::chrono::milliseconds(200);

}  // namespace

Status HoldLifeLock(void* header) {
  auto* mutex = static_cast<pthread_mutex_t*>(header);
  pthread_mutexattr_t attr;
  if (int rc = pthread_mutexattr_init(&attr); rc != 0)
    return ErrnoError("pthread_mutexattr_init", rc);
  int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (rc == 0) rc = pthread_mutex_init(mutex, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) return ErrnoError("making the life lock", rc);
  rc = pthread_mutex_lock(mutex);
  if (rc == EOWNERDEAD) rc = pthread_mutex_consistent(mutex);
  if (rc != 0) return ErrnoError("taking the life lock", rc);
  return Status::Ok();
}

void ReleaseLifeLock(void* header) { pthread_mutex_unlock(static_cast<pthread_mutex_t*>(header)); }

struct LifeWatch::State {
  std::shared_ptr<void> header;
  pid_t tid = 0;
  std::function<void()> on_death;
  std::atomic<bool> stop{false}, dead{false};
  mutable std::mutex mu;
  mutable std::condition_variable ended_cv;
  bool ended = false;  // under mu

  // The word names tid (or says tid's death, once it has named it).
  bool Names(uint32_t v) const { return (v & FUTEX_TID_MASK) == static_cast<uint32_t>(tid); }

  // Runs once the word has named tid.
  void Run() {
    std::atomic<uint32_t>* const word = Word(header.get());
    while (!stop.load()) {
      uint32_t v = word->load();
      if ((v & FUTEX_OWNER_DIED) != 0) {
        // Under mu: once the watch is destroyed, on_death neither runs nor will.
        std::lock_guard lock(mu);
        if (stop.load()) break;
        dead.store(true);
        on_death();
        break;
      }
      if (!Names(v)) break;  // not held by tid any more (given back): no notice
      // The kernel wakes a waiter of a dead owner's word only when
      // FUTEX_WAITERS is set.
      if ((v & FUTEX_WAITERS) == 0) {
        if (!word->compare_exchange_strong(v, v | FUTEX_WAITERS)) continue;
        v |= FUTEX_WAITERS;
      }
      const timespec timeout{0, std::chrono::nanoseconds(kPoll).count()};
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, v, &timeout, nullptr, 0);
    }
    std::lock_guard lock(mu);
    ended = true;
    ended_cv.notify_all();
  }
};

LifeWatch::LifeWatch(std::shared_ptr<void> header, pid_t tid, std::function<void()> on_death)
    : state_(std::make_shared<State>()) {
  state_->header = std::move(header);
  state_->tid = tid;
  state_->on_death = std::move(on_death);
  // Armed only if the word names tid now: a word left by an earlier holder
  // (its death included) says nothing of this one.
  if (state_->header == nullptr || tid <= 0 || !state_->Names(Word(state_->header.get())->load())) {
    state_->ended = true;
    return;
  }
  try {
    std::thread([state = state_] { state->Run(); }).detach();
  } catch (const std::system_error&) {
    state_->ended = true;  // no thread: no notice, the end-of-file still comes
  }
}

LifeWatch::~LifeWatch() {
  std::lock_guard lock(state_->mu);
  state_->stop.store(true);
}

bool LifeWatch::dead() const { return state_->dead.load(); }

bool LifeWatch::WaitEnded(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(state_->mu);
  return state_->ended_cv.wait_for(lock, timeout, [&] { return state_->ended; });
}

}  // namespace hearth::control
