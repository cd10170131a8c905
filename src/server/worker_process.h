// One worker process, owned: the destructor kills and reaps it if it is
// still there, so that no path leaves a worker behind or a zombie. Exec'd
// by the server, or forked by a zygote (server/zygote.h) and handed to the
// server, its subreaper: either way this process's child, which is what
// makes its pid safe to signal until it is reaped here.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"

namespace hearth {

class WorkerProcess {
 public:
  WorkerProcess() = default;
  ~WorkerProcess() { Reap(true); }
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Starts argv[0] with exactly five descriptors: 0-2 (ours), 3 = control
  // and 4 = slot; nothing else is inherited, and no signal is blocked.
  // FailedPrecondition if a process is still owned.
  Status Spawn(const std::vector<std::string>& argv, int control, int slot);
  // Waits for the process to exit (SIGKILL first if asked, or after 2 s
  // without an exit) and returns its wait status; 0 if there is none.
  int Reap(bool kill_first);
  // The wait status if the process has exited (reaped now), nullopt while
  // it runs; 0 if there is none.
  std::optional<int> TryReap();
  // SIGKILL, if the process is still ours (never a pid already reaped,
  // which the kernel may have given to another process). Any thread.
  void Kill();
  // Takes over `other`'s process (a standby being put to work): this one
  // owns, kills and reaps it from now on, `other` owns nothing.
  // FailedPrecondition if this one still owns a process.
  Status Adopt(WorkerProcess& other);
  // Takes `pid`, a child this process did not start itself (a worker forked
  // by a zygote and reparented here): checked to be this process's child and
  // no other WorkerProcess's. FailedPrecondition if one is still owned.
  Status AdoptChild(pid_t pid);
  pid_t pid() const { return pid_.load(); }

 private:
  std::mutex mu_;  // pid_ changes under it
  std::atomic<pid_t> pid_{-1};
};

// Makes this process the subreaper of its descendants
// (PR_SET_CHILD_SUBREAPER): a process whose parent exits is handed here, not
// to init. It also starts a thread that runs ReapOrphans() every 5 s until
// the process exits, whatever else stops. Idempotent.
Status BecomeSubreaper();
bool IsSubreaper();

// Reaps the children that have exited and that no WorkerProcess owns
// (descendants handed here as their parents died); returns how many.
int ReapOrphans();

// "exited with status 1", "killed by signal 9".
std::string DescribeExit(int status);

}  // namespace hearth
