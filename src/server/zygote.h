// The zygote of a `backend: python` model (parameters.zygote, on by
// default): one exec'd process per model that has imported torch, hearth
// and the model's model.py, never touches a device, and forks the model's
// workers on request (python/hearth/_zygote.py has its side and its
// protocol). A forked worker skips the seconds those imports take and
// creates its own CUDA context after the fork.
//
// Each forked worker is this process's child: the zygote forks through a
// child that exits at once, and this process is a subreaper
// (PR_SET_CHILD_SUBREAPER), so the worker is handed here; the supervisor
// adopts its pid (WorkerProcess::AdoptChild, which checks the parent) and
// kills, waits for and reports it as it does an exec'd one.
//
// The zygote is kept like a worker: a thread watches it, starts another
// when it dies (with back-off), and gives up, logging why, after repeated
// failures. One that refuses (a device was initialised in it, or threads
// run in it), or whose start fails (model.py raised), turns the model to
// exec'd workers for the runtime's life: those report the same failure
// through the usual path. Orphaned descendants, handed here now that this
// process is a subreaper, are reaped by the sweep BecomeSubreaper starts.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "server/worker_process.h"

namespace hearth {

class WorkerZygote {
 public:
  // Starts a zygote process into `process`, its control socket (the
  // server's end) into `control`.
  using Starter = std::function<Status(WorkerProcess& process, UniqueFd* control)>;

  // `model`: for the log. `ready_timeout`: how long a start (its imports)
  // and a fork request may take.
  WorkerZygote(std::string model, Starter start, std::chrono::milliseconds ready_timeout);
  // Stops, and waits for the keeper thread (which kills the zygote).
  ~WorkerZygote();
  WorkerZygote(const WorkerZygote&) = delete;
  WorkerZygote& operator=(const WorkerZygote&) = delete;

  // Makes this process a subreaper and starts the thread that keeps the
  // zygote. An error: no zygote (the model's workers are exec'd).
  Status Start();
  // Tells the keeper thread to stop, the zygote with it, and returns; forks
  // waiting for it are answered Unavailable. Idempotent.
  void Stop();

  // Forks a worker with `args` (hearth.backend_worker's arguments) whose
  // control socket and slot are `control` and `slot`; returns its pid, this
  // process's child, which the caller adopts. Waits for a zygote that is
  // starting. Unavailable: there is no zygote to fork from (it refused,
  // failed, or stops), or it died during the request; another error: this
  // fork failed. After any error the caller must not hand `control` to
  // another process: a worker may have been forked with it.
  Result<pid_t> Fork(const std::vector<std::string>& args, int control, int slot);

  // The zygote's pid while one is ready, else 0.
  pid_t pid() const { return ready_pid_.load(); }
  uint64_t forks() const { return forks_.load(); }
  uint64_t restarts() const { return restarts_.load(); }
  // Why workers are exec'd, once the zygote is given up; empty until then.
  std::string off_reason() const;

 private:
  enum class State { kStarting, kReady, kOff };
  void Keep();
  // Starts one zygote and waits for its first message: true once ready;
  // false with *fatal set when it refused or failed (no other attempt).
  bool StartOne(bool* fatal, std::string* why);
  // Polls the live zygote's socket for its end and the wake descriptor for
  // Stop; returns when either comes.
  void Watch();
  void TurnOff(const std::string& why);
  bool stopping() const { return stopping_.load(); }

  const std::string model_;
  const Starter start_;
  const std::chrono::milliseconds ready_timeout_;

  mutable std::mutex mu_;  // state_, off_reason_
  std::condition_variable cv_;
  State state_ = State::kStarting;
  std::string off_reason_;
  std::atomic<bool> stopping_{false};
  std::atomic<pid_t> ready_pid_{0};
  std::atomic<uint64_t> forks_{0}, restarts_{0};

  // One request at a time on the socket; held by the keeper while it
  // replaces the process and its socket.
  std::mutex fork_mu_;
  WorkerProcess process_;
  UniqueFd control_;
  UniqueFd wake_;  // an eventfd: Stop() writes it
  std::thread thread_;
};

}  // namespace hearth
