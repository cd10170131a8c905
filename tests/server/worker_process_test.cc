// WorkerProcess's ownership of children it did not start (workers forked
// by a zygote and handed to the server, their subreaper), the sweep of
// orphans that nobody owns, and the watch for a worker's hang-up.
#include "server/worker_process.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include "server/hangup_watcher.h"

namespace hearth {
namespace {

// /proc/PID/stat's state and parent ('\0', 0 once the process is gone).
std::pair<char, pid_t> StateAndParent(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return {'\0', 0};
  const size_t close = line.rfind(')');
  char state = '\0';
  int parent = 0;
  if (close == std::string::npos ||
      std::sscanf(line.c_str() + close + 1, " %c %d", &state, &parent) != 2)
    return {'\0', 0};
  return {state, parent};
}

// Polls (with a deadline) until `pid` is in `state`.
bool WaitForState(pid_t pid, char state) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < deadline) {
    if (StateAndParent(pid).first == state) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// A child that waits until its pipe is closed, then exits with `code`.
pid_t ForkChild(int code, int* release) {
  int p[2];
  if (::pipe(p) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p[1]);
    char c;
    while (::read(p[0], &c, 1) > 0) {
    }
    ::_exit(code);
  }
  ::close(p[0]);
  *release = p[1];
  return pid;
}

TEST(WorkerProcessTest, AdoptsOnlyItsOwnChildrenAndOnlyOnce) {
  WorkerProcess parent;
  const Status not_ours = parent.AdoptChild(::getppid());
  EXPECT_EQ(not_ours.code(), StatusCode::kFailedPrecondition) << not_ours.ToString();
  EXPECT_NE(not_ours.message().find("is not this process's child"), std::string::npos);
  EXPECT_EQ(parent.pid(), -1);

  int release = -1;
  const pid_t child = ForkChild(7, &release);
  ASSERT_GT(child, 0);
  WorkerProcess a, b;
  ASSERT_TRUE(a.AdoptChild(child).ok());
  EXPECT_EQ(a.pid(), child);
  const Status twice = b.AdoptChild(child);
  EXPECT_EQ(twice.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(twice.message().find("already a worker's"), std::string::npos) << twice.ToString();
  EXPECT_EQ(a.AdoptChild(child).code(), StatusCode::kFailedPrecondition);  // a holds one
  ::close(release);
  EXPECT_EQ(DescribeExit(a.Reap(false)), "exited with status 7");
  EXPECT_EQ(a.pid(), -1);
}

TEST(WorkerProcessTest, TryReapWaitsForNothing) {
  int release = -1;
  const pid_t child = ForkChild(4, &release);
  ASSERT_GT(child, 0);
  WorkerProcess worker;
  ASSERT_TRUE(worker.AdoptChild(child).ok());
  EXPECT_FALSE(worker.TryReap().has_value()) << "a running child was reaped";
  EXPECT_EQ(worker.pid(), child);
  ::close(release);
  ASSERT_TRUE(WaitForState(child, 'Z'));
  const std::optional<int> status = worker.TryReap();
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(DescribeExit(*status), "exited with status 4");
  EXPECT_EQ(worker.pid(), -1);
  EXPECT_EQ(worker.TryReap(), std::optional<int>(0));  // nothing left: nothing to wait for
}

TEST(WorkerProcessTest, TheSweepReapsOrphansButLeavesOwnedChildrenToTheirOwner) {
  int release_orphan = -1, release_owned = -1;
  const pid_t orphan = ForkChild(0, &release_orphan);
  const pid_t owned = ForkChild(5, &release_owned);
  ASSERT_GT(orphan, 0);
  ASSERT_GT(owned, 0);
  WorkerProcess worker;
  ASSERT_TRUE(worker.AdoptChild(owned).ok());
  ::close(release_orphan);
  ::close(release_owned);
  ASSERT_TRUE(WaitForState(orphan, 'Z'));
  ASSERT_TRUE(WaitForState(owned, 'Z'));
  EXPECT_GE(ReapOrphans(), 1);
  EXPECT_EQ(StateAndParent(orphan).first, '\0') << "the orphan was not reaped";
  EXPECT_EQ(StateAndParent(owned).first, 'Z') << "the owned child was taken from its owner";
  EXPECT_EQ(DescribeExit(worker.Reap(false)), "exited with status 5");
}

TEST(WorkerProcessTest, ASubreaperIsHandedTheGrandchildrenOfItsDeadChildren) {
  ASSERT_TRUE(BecomeSubreaper().ok());
  EXPECT_TRUE(IsSubreaper());
  int p[2], release[2];
  ASSERT_EQ(::pipe(p), 0);
  ASSERT_EQ(::pipe(release), 0);
  const pid_t middle = ::fork();
  if (middle == 0) {
    ::close(p[0]);
    ::close(release[1]);
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      char c;
      while (::read(release[0], &c, 1) > 0) {
      }
      ::_exit(3);
    }
    (void)!::write(p[1], &grandchild, sizeof grandchild);
    ::_exit(0);
  }
  ::close(p[1]);
  ::close(release[0]);
  pid_t grandchild = -1;
  ASSERT_EQ(::read(p[0], &grandchild, sizeof grandchild), static_cast<ssize_t>(sizeof grandchild));
  ::close(p[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(middle, &status, 0), middle);
  // Its parent gone, the grandchild is this process's: adopted and reaped here.
  EXPECT_EQ(StateAndParent(grandchild).second, ::getpid());
  WorkerProcess worker;
  ASSERT_TRUE(worker.AdoptChild(grandchild).ok());
  ::close(release[1]);
  EXPECT_EQ(DescribeExit(worker.Reap(false)), "exited with status 3");
}

}  // namespace
}  // namespace hearth

namespace hearth {
namespace {

TEST(HangupWatcherTest, CallsBackWhenThePeerClosesAndNotOnceForgotten) {
  HangupWatcher watcher;
  ASSERT_TRUE(watcher.Start().ok());
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  std::promise<void> hung_up;
  auto id = watcher.Watch(sv[0], [&] { hung_up.set_value(); });
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  // Data is no hang-up: only the end is reported.
  ASSERT_EQ(::send(sv[1], "x", 1, 0), 1);
  ::close(sv[1]);
  EXPECT_EQ(hung_up.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  watcher.Forget(*id, sv[0]);
  watcher.Forget(*id, sv[0]);  // twice: nothing
  ::close(sv[0]);

  // The same descriptor number, watched afresh once the old one is forgotten.
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  std::promise<void> again;
  auto second = watcher.Watch(sv[0], [&] { again.set_value(); });
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_NE(*second, *id);
  ::close(sv[1]);
  EXPECT_EQ(again.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
  watcher.Forget(*second, sv[0]);
  ::close(sv[0]);
}

}  // namespace
}  // namespace hearth
