#include "common/task_pool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>

namespace hearth {
namespace {

using namespace std::chrono_literals;

// Tasks that park until opened, counting how many are parked at once.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  int parked = 0;
  int ran = 0;

  void Park() {
    std::unique_lock lock(mu);
    ++parked;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
    --parked;
    ++ran;
  }
  bool WaitParked(int n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, 60s, [&] { return parked >= n; });
  }
  void Open() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
};

TEST(TaskPool, RunsUpToItsCapacityAtOnceAndRefusesPastIt) {
  Gate gate;
  TaskPool pool(3, "repository loads and unloads");
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(pool.Submit([&] { gate.Park(); }).ok());
  // All three run at once, each on a thread of its own.
  ASSERT_TRUE(gate.WaitParked(3));
  EXPECT_EQ(pool.pending(), 3u);
  const Status refused = pool.Submit([] {});
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            "the server has 3 repository loads and unloads in progress, its limit; retry later");
  gate.Open();
  pool.Stop();
  EXPECT_EQ(gate.ran, 3);
  EXPECT_EQ(pool.pending(), 0u);
}

TEST(TaskPool, StopRunsWhatIsQueuedThenRefuses) {
  Gate gate;
  TaskPool pool(4, "tasks");
  int after = 0;
  ASSERT_TRUE(pool.Submit([&] { gate.Park(); }).ok());
  ASSERT_TRUE(gate.WaitParked(1));
  ASSERT_TRUE(pool.Submit([&] { ++after; }).ok());
  gate.Open();
  pool.Stop();
  EXPECT_EQ(gate.ran, 1);
  EXPECT_EQ(after, 1);
  EXPECT_EQ(pool.Submit([] {}).code(), StatusCode::kUnavailable);
  pool.Stop();  // again: nothing to do
}

TEST(TaskPool, ACallerAnsweredMaySubmitAgainAtOnceWhenThePoolIsFull) {
  Gate gate;
  TaskPool pool(2, "repository loads and unloads");
  ASSERT_TRUE(pool.Submit([&] { gate.Park(); }).ok());
  ASSERT_TRUE(gate.WaitParked(1));
  // The second task's answer submits a third: the second no longer counts.
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Status> again;
  ASSERT_TRUE(pool.Submit([] { return Status::Ok(); },
                          [&](Status) {
                            Status s = pool.Submit([] {});
                            std::lock_guard lock(mu);
                            again = s;
                            cv.notify_all();
                          })
                  .ok());
  {
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 60s, [&] { return again.has_value(); }));
  }
  EXPECT_TRUE(again->ok()) << again->ToString();
  gate.Open();
  pool.Stop();
}

TEST(TaskPool, ARefusedTaskRunsNeitherPart) {
  Gate gate;
  TaskPool pool(1, "tasks");
  ASSERT_TRUE(pool.Submit([&] { gate.Park(); }).ok());
  bool ran = false;
  const Status refused = pool.Submit(
      [&] {
        ran = true;
        return Status::Ok();
      },
      [&](Status) { ran = true; });
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  gate.Open();
  pool.Stop();
  EXPECT_FALSE(ran);
}

// Each answer (run once its task no longer counts) submits the next: a
// caller answered is never refused, however busy the machine.
TEST(TaskPool, TasksSubmittedOneAfterAnotherAllRun) {
  TaskPool pool(1, "tasks");
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(pool.Submit([] { return Status::Ok(); },
                            [&](Status) {
                              std::lock_guard lock(mu);
                              ++done;
                              cv.notify_all();
                            })
                    .ok())
        << i;
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 60s, [&] { return done == i + 1; }));
  }
  pool.Stop();
  EXPECT_EQ(done, 50);
}

}  // namespace
}  // namespace hearth
