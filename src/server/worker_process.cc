#include "server/worker_process.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

#include "common/proc_stat.h"

extern char** environ;

namespace hearth {
namespace {

// The children a WorkerProcess owns: ReapOrphans leaves them to their owner.
// Spawning and adopting hold `mu`, so that a sweep never takes a child
// between its birth and its registration.
struct OwnedChildren {
  std::mutex mu;
  std::set<pid_t> pids;
};

OwnedChildren& Owned() {
  static auto* owned = new OwnedChildren;  // never destroyed: used until exit
  return *owned;
}

std::atomic<bool> subreaper{false};

// Runs each posix_spawn on one thread that lives as long as the process. A
// worker's PR_SET_PDEATHSIG fires when the *thread* that started it exits,
// and the thread that starts a standby or a hot spare (a supervisor, a
// keeper) may end while the worker it started serves on under another. If
// that thread cannot be made, the caller's own thread spawns.
class Spawner {
 public:
  static Spawner& Get() {
    static auto* spawner = new Spawner;  // never destroyed: its thread runs until exit
    return *spawner;
  }
  int Run(const std::function<int()>& spawn) {
    std::unique_lock lock(mu_);
    if (!running_) return spawn();
    const uint64_t ticket = ++submitted_;
    queue_.push_back({ticket, &spawn});
    cv_.notify_all();
    cv_.wait(lock, [&] { return answered_.count(ticket) != 0; });
    const int rc = answered_[ticket];
    answered_.erase(ticket);
    return rc;
  }

 private:
  Spawner() {
    try {
      std::thread([this] { Loop(); }).detach();
      running_ = true;
    } catch (const std::system_error&) {
      running_ = false;
    }
  }
  void Loop() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !queue_.empty(); });
      const auto [ticket, spawn] = queue_.front();
      queue_.pop_front();
      lock.unlock();
      const int rc = (*spawn)();
      lock.lock();
      answered_[ticket] = rc;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;
  uint64_t submitted_ = 0;
  std::deque<std::pair<uint64_t, const std::function<int()>*>> queue_;
  std::map<uint64_t, int> answered_;
};

}  // namespace

Status WorkerProcess::Spawn(const std::vector<std::string>& args, int control, int slot) {
  if (pid_ > 0) return FailedPrecondition("a worker process is still running");
  // dup2 onto itself would keep close-on-exec: move anything at 3 or 4 out of the way.
  auto high = [](int fd, UniqueFd* moved) -> Result<int> {
    if (fd > 4) return fd;
    moved->Reset(::fcntl(fd, F_DUPFD_CLOEXEC, 10));
    if (!*moved) return ErrnoError("moving a worker's descriptors", errno);
    return moved->get();
  };
  UniqueFd moved_control, moved_slot;
  ASSIGN_OR_RETURN(const int c, high(control, &moved_control));
  ASSIGN_OR_RETURN(const int s, high(slot, &moved_slot));
  std::vector<std::string> copy = args;
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, c, 3);
  posix_spawn_file_actions_adddup2(&actions, s, 4);
  // Everything hearth opens is close-on-exec; this also drops descriptors
  // the server itself inherited without it, so the worker holds exactly 0-4.
  posix_spawn_file_actions_addclosefrom_np(&actions, 5);
  // The server keeps SIGTERM/SIGINT blocked for sigwait; a worker starts with none blocked.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  std::lock_guard lock(mu_);
  std::lock_guard owned(Owned().mu);
  const int rc = Spawner::Get().Run(
      [&] { return posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ); });
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return ErrnoError("starting " + args[0], rc);
  Owned().pids.insert(pid);
  pid_ = pid;
  return Status::Ok();
}

Status WorkerProcess::AdoptChild(pid_t pid) {
  std::lock_guard lock(mu_);
  if (pid_ > 0) return FailedPrecondition("a worker process is still running");
  if (pid <= 0) return InvalidArgument("pid " + std::to_string(pid));
  std::lock_guard owned(Owned().mu);
  const std::optional<ProcStat> st = ReadProcStat(pid);
  if (!st.has_value()) return NotFound("process " + std::to_string(pid) + " does not exist");
  if (st->parent != ::getpid())
    return FailedPrecondition("process " + std::to_string(pid) + " is not this process's child " +
                              "(its parent is " + std::to_string(st->parent) + ")");
  if (!Owned().pids.insert(pid).second)
    return FailedPrecondition("process " + std::to_string(pid) + " is already a worker's");
  pid_ = pid;
  return Status::Ok();
}

Status WorkerProcess::Adopt(WorkerProcess& other) {
  std::scoped_lock lock(mu_, other.mu_);
  if (pid_ > 0) return FailedPrecondition("a worker process is still running");
  pid_ = other.pid_.exchange(-1);
  return Status::Ok();
}

void WorkerProcess::Kill() {
  std::lock_guard lock(mu_);
  if (pid_ > 0) ::kill(pid_, SIGKILL);
}

int WorkerProcess::Reap(bool kill_first) {
  const pid_t pid = pid_.load();
  if (pid <= 0) return 0;
  if (kill_first) Kill();
  int status = 0;
  auto reaped = [&](pid_t r) {
    if (r != pid && !(r < 0 && errno == ECHILD)) return false;
    pid_ = -1;
    std::lock_guard owned(Owned().mu);
    Owned().pids.erase(pid);
    return true;
  };
  for (int i = 0; i < 200; ++i) {  // up to 2 s for a clean exit, then SIGKILL
    {
      std::lock_guard lock(mu_);
      if (reaped(::waitpid(pid, &status, WNOHANG))) return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard lock(mu_);
  ::kill(pid, SIGKILL);
  (void)reaped(::waitpid(pid, &status, 0));
  return status;
}

Status BecomeSubreaper() {
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (subreaper.load()) return Status::Ok();
  // The sweep first: a subreaper that nobody sweeps collects zombies.
  try {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(5));
        (void)ReapOrphans();
      }
    }).detach();  // runs until the process exits
  } catch (const std::system_error& e) {
    return ResourceExhausted("starting the sweep of orphaned processes: " + std::string(e.what()));
  }
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
    return ErrnoError("prctl(PR_SET_CHILD_SUBREAPER)", errno);
  subreaper = true;
  return Status::Ok();
}

bool IsSubreaper() { return subreaper.load(); }

int ReapOrphans() {
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return 0;
  const pid_t self = ::getpid();
  int reaped = 0;
  std::lock_guard owned(Owned().mu);
  while (const dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || end == e->d_name || *end != '\0') continue;
    if (Owned().pids.count(static_cast<pid_t>(pid)) != 0) continue;
    const std::optional<ProcStat> st = ReadProcStat(static_cast<pid_t>(pid));
    if (!st.has_value() || st->parent != self || st->state != 'Z') continue;
    int status = 0;
    if (::waitpid(static_cast<pid_t>(pid), &status, WNOHANG) == pid) ++reaped;
  }
  ::closedir(proc);
  return reaped;
}

std::optional<int> WorkerProcess::TryReap() {
  std::lock_guard lock(mu_);
  const pid_t pid = pid_.load();
  if (pid <= 0) return 0;
  int status = 0;
  const pid_t r = ::waitpid(pid, &status, WNOHANG);
  if (r == 0 || (r != pid && !(r < 0 && errno == ECHILD))) return std::nullopt;
  pid_ = -1;
  std::lock_guard owned(Owned().mu);
  Owned().pids.erase(pid);
  return status;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

}  // namespace hearth
