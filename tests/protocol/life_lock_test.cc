// The life lock (protocol/life_lock.h): a watch sees its holder's death
// through the lock, and nothing else as a death.
#include "protocol/life_lock.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>

#include "gtest/gtest.h"

namespace hearth::control {
namespace {

// A shared anonymous page, as a slot's header is shared with its worker.
std::shared_ptr<void> SharedPage() {
  void* p =
      ::mmap(nullptr, kSlotHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  EXPECT_NE(p, MAP_FAILED);
  return std::shared_ptr<void>(p, [](void* q) { ::munmap(q, kSlotHeaderBytes); });
}

// A child that takes the lock, says so on a pipe, then does what `then`
// says: 'k' waits to be killed, 'r' gives the lock back and waits, 'e' exits
// 0 holding it once a byte comes on *go (written by the caller).
pid_t Holder(void* header, char then, int* go = nullptr) {
  int ready[2], gate[2];
  EXPECT_EQ(::pipe(ready), 0);
  EXPECT_EQ(::pipe(gate), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    ::close(gate[1]);
    if (!HoldLifeLock(header).ok()) ::_exit(2);
    if (then == 'r') ReleaseLifeLock(header);
    const char c = 1;
    if (::write(ready[1], &c, 1) != 1) ::_exit(3);
    if (then == 'e') {
      char g = 0;
      ::_exit(::read(gate[0], &g, 1) == 1 ? 0 : 4);
    }
    for (;;) ::pause();
  }
  ::close(ready[1]);
  ::close(gate[0]);
  char c = 0;
  EXPECT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  if (go != nullptr) {
    *go = gate[1];
  } else {
    ::close(gate[1]);
  }
  return pid;
}

// Generous: a hang guard, never a measure.
constexpr auto kGuard = std::chrono::seconds(60);

TEST(LifeLock, AWatchSeesItsHolderKilled) {
  const auto page = SharedPage();
  const pid_t pid = Holder(page.get(), 'k');
  std::atomic<int> told{0};
  LifeWatch watch(page, pid, [&] { ++told; });
  EXPECT_FALSE(watch.dead());
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(watch.WaitEnded(kGuard));
  EXPECT_TRUE(watch.dead());
  EXPECT_EQ(told.load(), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status));
}

TEST(LifeLock, AHolderThatExitsIsDeadToo) {
  const auto page = SharedPage();
  int go = -1;
  const pid_t pid = Holder(page.get(), 'e', &go);
  LifeWatch watch(page, pid, [] {});
  const char c = 1;
  ASSERT_EQ(::write(go, &c, 1), 1);
  ::close(go);
  ASSERT_TRUE(watch.WaitEnded(kGuard));
  EXPECT_TRUE(watch.dead());
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
}

TEST(LifeLock, ALockGivenBackOrHeldByAnotherIsNoDeath) {
  const auto page = SharedPage();
  // Given back before the watch: the word names nobody, the watch ends at once.
  const pid_t released = Holder(page.get(), 'r');
  {
    LifeWatch watch(page, released, [] { ADD_FAILURE() << "a death told"; });
    ASSERT_TRUE(watch.WaitEnded(kGuard));
    EXPECT_FALSE(watch.dead());
  }
  ASSERT_EQ(::kill(released, SIGKILL), 0);
  ASSERT_EQ(::waitpid(released, nullptr, 0), released);
  // Held by one process, watched for another (a pid the lock does not name).
  const pid_t holder = Holder(page.get(), 'k');
  {
    LifeWatch watch(page, holder + 1, [] { ADD_FAILURE() << "a death told"; });
    ASSERT_TRUE(watch.WaitEnded(kGuard));
    EXPECT_FALSE(watch.dead());
  }
  ASSERT_EQ(::kill(holder, SIGKILL), 0);
  ASSERT_EQ(::waitpid(holder, nullptr, 0), holder);
}

TEST(LifeLock, AStoppedWatchTellsNothing) {
  const auto page = SharedPage();
  const pid_t pid = Holder(page.get(), 'k');
  auto told = std::make_shared<std::atomic<int>>(0);
  {
    LifeWatch watch(page, pid, [told] { ++*told; });
  }
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_EQ(::waitpid(pid, nullptr, 0), pid);
  // A second watch on the dead holder's word: it names nobody now.
  LifeWatch after(page, pid, [] { ADD_FAILURE() << "a death told"; });
  ASSERT_TRUE(after.WaitEnded(kGuard));
  EXPECT_EQ(told->load(), 0);
}

TEST(LifeLock, NoHeaderNoWatch) {
  LifeWatch watch(nullptr, ::getpid(), [] { ADD_FAILURE() << "a death told"; });
  EXPECT_TRUE(watch.WaitEnded(std::chrono::milliseconds(0)));
  EXPECT_FALSE(watch.dead());
}

}  // namespace
}  // namespace hearth::control
