#include "server/job_queue.h"

namespace hearth {
namespace {

class RealClock final : public QueueClock {
 public:
  Clock::time_point Now() const override { return Clock::now(); }
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 Clock::time_point until, const std::function<bool()>& ready) const override {
    return cv.wait_until(lock, until, ready);
  }
};

}  // namespace

const QueueClock& QueueClock::Real() {
  static const RealClock clock;
  return clock;
}

}  // namespace hearth
