// How a model's queue forms batches, on a clock the test drives: nothing
// here depends on how fast the machine is.
#include "server/job_queue.h"

#include <atomic>
#include <future>
#include <thread>

#include "gtest/gtest.h"

namespace hearth {
namespace {

// Time moves only when the test says. Waits re-check every millisecond of
// real time, so an Advance() is seen without any notification.
class FakeClock final : public QueueClock {
 public:
  Clock::time_point Now() const override {
    return Clock::time_point(Clock::duration(now_ns_.load()));
  }
  bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                 Clock::time_point until, const std::function<bool()>& ready) const override {
    while (!ready()) {
      if (Now() >= until) return ready();
      cv.wait_for(lock, std::chrono::milliseconds(1));
    }
    return true;
  }
  void Advance(std::chrono::microseconds d) {
    now_ns_ += std::chrono::duration_cast<Clock::duration>(d).count();
  }

 private:
  std::atomic<Clock::rep> now_ns_{
      std::chrono::duration_cast<Clock::duration>(std::chrono::hours(1)).count()};
};

struct Harness {
  FakeClock clock;
  JobQueue queue{16, &clock};
  std::vector<std::string> answered;  // ids of requests answered by the queue itself
  std::mutex mu;

  std::shared_ptr<Job> Make(const std::string& id, int64_t rows,
                            std::vector<int64_t> shape_key = {}) {
    auto job = std::make_shared<Job>();
    job->received = clock.Now();
    job->request.id = id;
    job->batch = rows;
    job->shape_key = std::move(shape_key);
    job->done = [this, id](Result<InferResponse> r) {
      std::lock_guard lock(mu);
      answered.push_back(id + ":" + (r.ok() ? "ok" : r.status().message()));
    };
    return job;
  }
  static std::vector<std::string> Ids(const std::vector<std::shared_ptr<Job>>& batch) {
    std::vector<std::string> ids;
    for (const auto& j : batch) ids.push_back(j->request.id);
    return ids;
  }
};

BatchPolicy Policy(int64_t max_batch, int delay_us, std::vector<int64_t> preferred = {}) {
  BatchPolicy p;
  p.max_batch = max_batch;
  p.max_delay = std::chrono::microseconds(delay_us);
  p.preferred = std::move(preferred);
  return p;
}

TEST(JobQueue, WithoutDelayTakesWhatIsQueuedUpToMaxBatch) {
  Harness h;
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(h.queue.Push(h.Make(id, 2)).ok());
  auto batch = h.queue.PopBatch(Policy(4, 0), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"a", "b"}));
  batch = h.queue.PopBatch(Policy(4, 0), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"c"}));
}

TEST(JobQueue, ABatchWaitsForMoreRowsUntilItsOldestRequestHasWaitedMaxDelay) {
  Harness h;
  ASSERT_TRUE(h.queue.Push(h.Make("a", 1)).ok());
  auto popped = std::async(
      std::launch::async, [&] { return h.queue.PopBatch(Policy(8, 1000), std::chrono::hours(1)); });
  // Time stands still: the batch is not complete, and it is not due.
  EXPECT_EQ(popped.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout);
  ASSERT_TRUE(h.queue.Push(h.Make("b", 1)).ok());
  h.clock.Advance(std::chrono::microseconds(999));
  EXPECT_EQ(popped.wait_for(std::chrono::milliseconds(20)), std::future_status::timeout);
  h.clock.Advance(std::chrono::microseconds(1));
  EXPECT_EQ(Harness::Ids(popped.get()), (std::vector<std::string>{"a", "b"}));
}

TEST(JobQueue, APreferredSizeDispatchesAtOnce) {
  Harness h;
  for (const char* id : {"a", "b"}) ASSERT_TRUE(h.queue.Push(h.Make(id, 2)).ok());
  // 4 rows is the largest preferred size: no waiting for the delay.
  auto batch = h.queue.PopBatch(Policy(8, 60'000'000, {2, 4}), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"a", "b"}));
}

TEST(JobQueue, RequestsOfDifferentShapesAreNotBatchedTogether) {
  Harness h;
  ASSERT_TRUE(h.queue.Push(h.Make("a", 1, {5})).ok());
  ASSERT_TRUE(h.queue.Push(h.Make("b", 1, {5})).ok());
  ASSERT_TRUE(h.queue.Push(h.Make("c", 1, {7})).ok());
  ASSERT_TRUE(h.queue.Push(h.Make("d", 1, {5})).ok());
  // The oldest sets the shape; d joins a and b past c, which runs next.
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"a", "b", "d"}));
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"c"}));
}

TEST(JobQueue, AlternatingShapesStillFormFullBatches) {
  Harness h;
  for (int i = 0; i < 8; ++i)
    ASSERT_TRUE(h.queue.Push(h.Make(std::string(1, static_cast<char>('a' + i)), 1, {i % 2})).ok());
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(4, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"a", "c", "e", "g"}));
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(4, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"b", "d", "f", "h"}));
}

// Higher levels (lower numbers) first; within a level, in arrival order;
// a batch of a higher level takes lower-level requests of its shape to
// fill its rows.
TEST(JobQueue, HigherPriorityLevelsRunFirstAndInOrderWithinALevel) {
  Harness h;
  auto push = [&](const char* id, uint64_t priority, std::vector<int64_t> shape) {
    auto job = h.Make(id, 1, std::move(shape));
    job->priority = priority;
    ASSERT_TRUE(h.queue.Push(std::move(job)).ok());
  };
  push("low1", 3, {1});
  push("high1", 1, {2});
  push("mid", 2, {2});
  push("high2", 1, {2});
  push("low2", 3, {2});
  auto batch = h.queue.PopBatch(Policy(2, 0), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"high1", "high2"}));
  batch = h.queue.PopBatch(Policy(2, 0), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"mid", "low2"}));
  batch = h.queue.PopBatch(Policy(2, 0), std::chrono::milliseconds(0));
  EXPECT_EQ(Harness::Ids(batch), (std::vector<std::string>{"low1"}));
}

TEST(JobQueue, RetriedRequestsRunAloneAndFirst) {
  Harness h;
  ASSERT_TRUE(h.queue.Push(h.Make("a", 1)).ok());
  auto crashed = h.Make("x", 1);
  crashed->crashes = 1;
  h.queue.PushFront(crashed);
  auto alone = h.Make("y", 1);
  alone->alone = true;
  h.queue.PushFront(alone);
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"y"}));
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"x"}));
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"a"}));
}

TEST(JobQueue, RequestsPastTheirDeadlineAreAnsweredAndNeverRun) {
  Harness h;
  auto late = h.Make("late", 1);
  late->deadline = h.clock.Now() + std::chrono::microseconds(10);
  ASSERT_TRUE(h.queue.Push(late).ok());
  ASSERT_TRUE(h.queue.Push(h.Make("fine", 1)).ok());
  h.clock.Advance(std::chrono::microseconds(10));
  EXPECT_EQ(Harness::Ids(h.queue.PopBatch(Policy(8, 0), std::chrono::milliseconds(0))),
            (std::vector<std::string>{"fine"}));
  std::lock_guard lock(h.mu);
  ASSERT_EQ(h.answered.size(), 1u);
  EXPECT_NE(h.answered[0].find("late:request 'late' timed out"), std::string::npos)
      << h.answered[0];
}

TEST(JobQueue, AFullQueueRefusesAndAClosedOneDrains) {
  Harness h;
  for (int i = 0; i < 16; ++i) ASSERT_TRUE(h.queue.Push(h.Make(std::to_string(i), 1)).ok());
  Status full = h.queue.Push(h.Make("17", 1));
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  h.queue.Close();
  EXPECT_EQ(h.queue.Push(h.Make("18", 1)).code(), StatusCode::kUnavailable);
  size_t drained = 0;
  for (auto b = h.queue.PopBatch(Policy(4, 1000), std::chrono::hours(1)); !b.empty();
       b = h.queue.PopBatch(Policy(4, 1000), std::chrono::hours(1)))
    drained += b.size();
  EXPECT_EQ(drained, 16u);
}

}  // namespace
}  // namespace hearth

namespace hearth {
namespace {

TEST(JobQueue, AFullQueueLetsGoOfRequestsWhoseClientsWentAwayToTakeALiveOne) {
  Harness h;
  std::vector<std::shared_ptr<std::atomic<bool>>> flags;
  for (int i = 0; i < 16; ++i) {
    auto job = h.Make(std::to_string(i), 1);
    flags.push_back(std::make_shared<std::atomic<bool>>(false));
    job->request.cancelled = flags.back();
    ASSERT_TRUE(h.queue.Push(job).ok());
  }
  EXPECT_EQ(h.queue.Push(h.Make("live-1", 1)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(h.queue.waiting(), 16u);
  // Two clients go away: their requests no longer count as waiting, and
  // give up their places.
  flags[3]->store(true);
  flags[9]->store(true);
  EXPECT_EQ(h.queue.size(), 16u);
  EXPECT_EQ(h.queue.waiting(), 14u);
  EXPECT_TRUE(h.queue.Push(h.Make("live-2", 1)).ok());
  EXPECT_EQ(h.queue.waiting(), 15u);
  EXPECT_EQ(h.queue.size(), 15u);  // both let go; one place taken
  {
    std::lock_guard lock(h.mu);
    ASSERT_EQ(h.answered.size(), 2u);
    EXPECT_NE(h.answered[0].find("3:request '3' was cancelled"), std::string::npos)
        << h.answered[0];
    EXPECT_NE(h.answered[1].find("9:request '9' was cancelled"), std::string::npos)
        << h.answered[1];
  }
  EXPECT_TRUE(h.queue.Push(h.Make("live-3", 1)).ok());
  EXPECT_EQ(h.queue.Push(h.Make("live-4", 1)).code(), StatusCode::kResourceExhausted);
  // The live requests keep their order behind the others.
  std::vector<std::string> order;
  h.queue.Close();
  for (auto b = h.queue.PopBatch(Policy(16, 0), std::chrono::hours(1)); !b.empty();
       b = h.queue.PopBatch(Policy(16, 0), std::chrono::hours(1))) {
    for (const std::string& id : Harness::Ids(b)) order.push_back(id);
  }
  ASSERT_EQ(order.size(), 16u);
  EXPECT_EQ(order[14], "live-2");
  EXPECT_EQ(order[15], "live-3");
}

TEST(JobQueue, ANudgeEndsAnIdleWaitAtOnce) {
  JobQueue q(4);
  BatchPolicy policy;
  // An hour of idle wait, ended by a nudge (repeated until the waiter is
  // waiting: one that came before it started would be none of its business).
  auto waiter = std::async(std::launch::async,
                           [&] { return q.PopBatch(policy, std::chrono::hours(1)).size(); });
  while (waiter.wait_for(std::chrono::milliseconds(1)) != std::future_status::ready) q.Nudge();
  EXPECT_EQ(waiter.get(), 0u);
}

}  // namespace
}  // namespace hearth
