#include "server/crash_retry.h"

namespace hearth {

void RetryAfterCrash(const std::shared_ptr<Job>& job, JobQueue& queue, const std::string& model,
                     const char* what) {
  if (++job->crashes >= kPoisonCrashes) {
    job->done(Internal(std::string(what) + ": this request took down " +
                       std::to_string(job->crashes) + " workers of '" + model +
                       "'; it is not retried"));
  } else {
    queue.PushFront(job);
  }
}

}  // namespace hearth
