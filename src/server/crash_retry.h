// What becomes of a request whose run took its worker down: it runs again,
// alone, until it has taken down kPoisonCrashes workers (server/job_queue.h);
// then it, not the workers, is at fault, and it is failed.
#pragma once

#include <memory>
#include <string>

#include "server/job_queue.h"

namespace hearth {

// Back to the front of `queue` (PopBatch then runs it alone), or answered
// Internal as `what` ("poison batch") once it has taken down
// kPoisonCrashes workers of `model`.
void RetryAfterCrash(const std::shared_ptr<Job>& job, JobQueue& queue, const std::string& model,
                     const char* what);

}  // namespace hearth
