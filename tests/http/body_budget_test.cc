// BodyBudget on its own: grants within the limit, first come first served,
// the finisher that breaks a deadlock, and Close.
#include "http/body_budget.h"

#include <gtest/gtest.h>

#include <vector>

namespace hearth {
namespace {

// Records the callbacks a holder gets.
struct Calls {
  std::vector<bool> results;
  BodyBudget::Granted Callback() {
    return [this](bool granted) { results.push_back(granted); };
  }
};

TEST(BodyBudget, GrantsWithinTheLimitAndQueuesInOrder) {
  BodyBudget budget(100);
  Calls a, b, c;
  EXPECT_EQ(budget.Acquire(1, 60, 0, a.Callback()), BodyBudget::Outcome::kGranted);
  EXPECT_EQ(budget.Acquire(2, 40, 0, b.Callback()), BodyBudget::Outcome::kGranted);
  EXPECT_EQ(budget.snapshot().held, 100u);
  // Nothing fits: 3 waits; a later small ask waits behind it, in order.
  EXPECT_EQ(budget.Acquire(3, 50, 0, c.Callback()), BodyBudget::Outcome::kWaiting);
  Calls d;
  EXPECT_EQ(budget.Acquire(4, 10, 0, d.Callback()), BodyBudget::Outcome::kWaiting);
  EXPECT_EQ(budget.snapshot().waiting, 2u);
  EXPECT_TRUE(c.results.empty());

  budget.Release(2, 40);  // 60 held: 3's 50 does not fit yet, and 4 stays behind it
  EXPECT_TRUE(c.results.empty());
  EXPECT_TRUE(d.results.empty());
  budget.Release(1, 60);  // both fit now
  EXPECT_EQ(c.results, std::vector<bool>{true});
  EXPECT_EQ(d.results, std::vector<bool>{true});
  const BodyBudget::Snapshot s = budget.snapshot();
  EXPECT_EQ(s.held, 60u);
  EXPECT_EQ(s.waiting, 0u);
  EXPECT_EQ(s.waits, 2u);
  EXPECT_EQ(s.peak, 100u);
  EXPECT_EQ(s.finishers, 0u);
}

TEST(BodyBudget, TheOldestWaiterFinishesWhenOnlyWaitersHoldBytes) {
  // Two bodies of 80 in chunks of 40, limit 100: each gets its first chunk
  // (80 held); 1 asks for its second (120 > 100) and waits while 2 still reads.
  BodyBudget budget(100);
  Calls one, two;
  ASSERT_EQ(budget.Acquire(1, 40, 0, one.Callback()), BodyBudget::Outcome::kGranted);
  ASSERT_EQ(budget.Acquire(2, 40, 0, two.Callback()), BodyBudget::Outcome::kGranted);
  ASSERT_EQ(budget.Acquire(1, 40, 40, one.Callback()), BodyBudget::Outcome::kWaiting);
  EXPECT_TRUE(one.results.empty());  // 2 holds bytes and is not waiting: it may yet give them back
  // Now 2 waits too: every byte held is a waiter's, and nothing would come
  // back. The oldest (1) is granted past the limit.
  ASSERT_EQ(budget.Acquire(2, 40, 40, two.Callback()), BodyBudget::Outcome::kWaiting);
  EXPECT_EQ(one.results, std::vector<bool>{true});
  EXPECT_TRUE(two.results.empty());
  BodyBudget::Snapshot s = budget.snapshot();
  EXPECT_EQ(s.held, 120u);
  EXPECT_EQ(s.finishers, 1u);
  // The finisher is not held back again until it is done...
  EXPECT_EQ(budget.Acquire(1, 10, 80, one.Callback()), BodyBudget::Outcome::kGranted);
  EXPECT_EQ(budget.snapshot().held, 130u);
  // ...and when it gives its bytes back, 2 goes on within the limit.
  budget.Release(1, 90);
  EXPECT_EQ(two.results, std::vector<bool>{true});
  s = budget.snapshot();
  EXPECT_EQ(s.held, 80u);
  EXPECT_EQ(s.peak, 130u);
  // One finisher at a time, and never more than the limit plus its body.
  EXPECT_EQ(s.finishers, 1u);
  budget.Release(2, 80);
  EXPECT_EQ(budget.snapshot().held, 0u);
  // Not the finisher any more: 1 waits like anyone else.
  Calls three;
  ASSERT_EQ(budget.Acquire(3, 100, 0, three.Callback()), BodyBudget::Outcome::kGranted);
  EXPECT_EQ(budget.Acquire(1, 10, 0, one.Callback()), BodyBudget::Outcome::kWaiting);
}

TEST(BodyBudget, ASoleWaiterWithNothingHeldByOthersIsNotAFinisherWhileOthersRead) {
  // A holder that is reading (not waiting) keeps the others waiting: its
  // bytes will come back.
  BodyBudget budget(10);
  Calls reader, waiter;
  ASSERT_EQ(budget.Acquire(1, 10, 0, reader.Callback()), BodyBudget::Outcome::kGranted);
  ASSERT_EQ(budget.Acquire(2, 5, 0, waiter.Callback()), BodyBudget::Outcome::kWaiting);
  EXPECT_TRUE(waiter.results.empty());
  EXPECT_EQ(budget.snapshot().finishers, 0u);
  budget.Release(1, 10);
  EXPECT_EQ(waiter.results, std::vector<bool>{true});
}

TEST(BodyBudget, AcquireNowNeverWaitsAndCounts) {
  BodyBudget budget(10);
  Calls a;
  ASSERT_EQ(budget.Acquire(1, 10, 0, a.Callback()), BodyBudget::Outcome::kGranted);
  budget.AcquireNow(4);  // past the limit
  EXPECT_EQ(budget.snapshot().held, 14u);
  EXPECT_EQ(budget.snapshot().peak, 14u);
  Calls b;
  EXPECT_EQ(budget.Acquire(2, 1, 0, b.Callback()), BodyBudget::Outcome::kWaiting);
  budget.Release(3, 4);
  EXPECT_TRUE(b.results.empty());  // 10 still held
  budget.Release(1, 10);
  EXPECT_EQ(b.results, std::vector<bool>{true});
}

TEST(BodyBudget, CloseFailsWaitersAndLaterAcquires) {
  BodyBudget budget(10);
  Calls a, b;
  ASSERT_EQ(budget.Acquire(1, 10, 0, a.Callback()), BodyBudget::Outcome::kGranted);
  ASSERT_EQ(budget.Acquire(2, 5, 0, b.Callback()), BodyBudget::Outcome::kWaiting);
  budget.Close();
  EXPECT_EQ(b.results, std::vector<bool>{false});
  EXPECT_EQ(budget.Acquire(3, 1, 0, a.Callback()), BodyBudget::Outcome::kClosed);
  budget.Release(1, 10);  // still fine after Close
  EXPECT_EQ(budget.snapshot().held, 0u);
}

}  // namespace
}  // namespace hearth
