#include "server/worker_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>

extern char** environ;

namespace hearth {

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
  const int rc = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return ErrnoError("starting " + args[0], rc);
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

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

}  // namespace hearth
