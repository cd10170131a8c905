#include "server/server.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>

#include "backends/backend.h"
#include "common/checked_size.h"
#include "common/trusted_path.h"
#include "hearth/arena.h"
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "hearth/store.h"
#include "server/model_config.h"
#include "worker/control.h"

extern char** environ;

// A model's parameters must fit in the one control message that carries them.
static_assert(4 + 8 * hearth::kMaxModelParameters + hearth::kMaxModelParameterBytes <=
              hearth::control::kMaxParametersPayload);

namespace hearth {
namespace {

using Clock = std::chrono::steady_clock;

struct Job {
  Clock::time_point received = Clock::now();
  Clock::time_point deadline = Clock::time_point::max();
  InferRequest request;
  std::function<void(Result<InferResponse>)> done;
  int64_t batch = 1;
  int crashes = 0;  // workers taken down by batches this request was in
};

// How a model's queue forms batches (the config's dynamic_batching).
struct BatchPolicy {
  int64_t max_batch = 1;
  std::chrono::microseconds max_delay{0};  // at most kMaxQueueDelayUs (the config checks it)
  std::vector<int64_t> preferred;          // sorted
};

// A bounded FIFO of jobs; retried jobs go to the front.
class JobQueue {
 public:
  explicit JobQueue(size_t capacity) : capacity_(capacity) {}
  Status Push(std::shared_ptr<Job> job) {
    std::lock_guard lock(mu_);
    if (closed_) return Unavailable("the server is shutting down");
    if (jobs_.size() >= capacity_)
      return ResourceExhausted("queue full: " + std::to_string(capacity_) + " requests waiting");
    jobs_.push_back(std::move(job));
    WakeIdle();
    forming_.notify_all();
    return Status::Ok();
  }
  void PushFront(std::shared_ptr<Job> job) {
    std::lock_guard lock(mu_);
    jobs_.push_front(std::move(job));
    WakeIdle();
    forming_.notify_all();
  }
  // Blocks for the next batch: the oldest request, then later ones while
  // their rows fit in max_batch. It returns as soon as the rows reach the
  // largest preferred size (or max_batch), else once the oldest request has
  // waited max_delay. A request that was in a batch that crashed a worker runs
  // alone, so that only the request at fault can become a poison batch.
  // Requests whose deadline passed are answered DEADLINE_EXCEEDED here and
  // never run. Empty once closed and drained.
  // Returns empty after `idle` with nothing queued, so the caller can look
  // after its worker.
  std::vector<std::shared_ptr<Job>> PopBatch(const BatchPolicy& policy,
                                             std::chrono::milliseconds idle) {
    std::vector<std::shared_ptr<Job>> batch;
    std::vector<std::shared_ptr<Job>> expired;
    std::unique_lock lock(mu_);
    const int64_t target = policy.preferred.empty() ? policy.max_batch : policy.preferred.back();
    const auto idle_until = Clock::now() + idle;
    int64_t rows = 0;
    for (;;) {
      if (batch.empty() && !WaitForWork(lock, idle_until)) return {};
      const auto now = Clock::now();
      while (!jobs_.empty()) {
        std::shared_ptr<Job>& front = jobs_.front();
        if (front->deadline <= now) {
          expired.push_back(std::move(front));
          jobs_.pop_front();
          continue;
        }
        const bool alone = front->crashes > 0;
        if (!batch.empty() &&
            (alone || batch[0]->crashes > 0 || rows + front->batch > policy.max_batch))
          break;
        rows += front->batch;
        batch.push_back(std::move(front));
        jobs_.pop_front();
        if (alone) break;
      }
      if (batch.empty()) {
        if (closed_ && jobs_.empty()) break;
        if (!expired.empty()) break;
        continue;
      }
      const bool full = rows >= target || batch[0]->crashes > 0 || !jobs_.empty() || closed_ ||
                        policy.max_delay.count() == 0;
      if (full) break;
      // The batch waits for more rows until its oldest request has waited
      // max_delay, but never past the deadline of any request in it.
      auto until = SaturatingDeadline<Clock>(batch[0]->received,
                                             static_cast<uint64_t>(policy.max_delay.count()));
      for (const auto& job : batch) until = std::min(until, job->deadline);
      if (now >= until) break;
      forming_.wait_until(lock, until, [&] { return closed_ || !jobs_.empty(); });
      if (jobs_.empty()) break;
    }
    if (!jobs_.empty()) WakeIdle();  // more than this batch took: another worker's turn
    lock.unlock();
    // A request may have run out of time while its batch was forming.
    const auto now = Clock::now();
    std::erase_if(batch, [&](std::shared_ptr<Job>& job) {
      if (job->deadline > now) return false;
      expired.push_back(std::move(job));
      return true;
    });
    for (auto& job : expired) {
      job->done(
          DeadlineExceeded("request '" + job->request.id + "' timed out after waiting " +
                           std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(
                                              Clock::now() - job->received)
                                              .count()) +
                           " us in the queue"));
    }
    return batch;
  }
  size_t size() {
    std::lock_guard lock(mu_);
    return jobs_.size();
  }
  void Close() {
    std::lock_guard lock(mu_);
    closed_ = true;
    forming_.notify_all();
    while (!idle_.empty()) WakeIdle();
  }
  // Fails everything still queued (no worker left to run it).
  void FailAll(const Status& why) {
    std::deque<std::shared_ptr<Job>> left;
    {
      std::lock_guard lock(mu_);
      left.swap(jobs_);
    }
    for (auto& job : left) job->done(why);
  }

 private:
  // A caller of PopBatch waiting for work. Idle callers are woken last in,
  // first out: under light load the worker that just finished (whose GPU
  // context is the one running) takes the next request, rather than the
  // worker idle the longest, which would make the GPU switch between worker
  // processes' contexts for every request.
  struct IdleWaiter {
    std::condition_variable cv;
    bool woken = false;
  };

  // mu_ held.
  void WakeIdle() {
    if (idle_.empty()) return;
    IdleWaiter* w = idle_.back();
    idle_.pop_back();
    w->woken = true;
    w->cv.notify_one();
  }

  // Waits (mu_ held through `lock`) until a request is queued or the queue
  // closes; false if `until` came first with neither.
  bool WaitForWork(std::unique_lock<std::mutex>& lock, Clock::time_point until) {
    IdleWaiter self;
    while (!closed_ && jobs_.empty()) {
      self.woken = false;
      idle_.push_back(&self);
      if (!self.cv.wait_until(lock, until, [&] { return self.woken; })) {
        std::erase(idle_, &self);
        return false;
      }
    }
    return true;
  }

  std::mutex mu_;
  std::condition_variable forming_;  // callers holding part of a batch, waiting for more
  std::vector<IdleWaiter*> idle_;
  std::deque<std::shared_ptr<Job>> jobs_;
  size_t capacity_;
  bool closed_ = false;
};

struct ModelRuntime;

// One worker process and the thread that supervises it.
class WorkerSupervisor {
 public:
  WorkerSupervisor(ModelRuntime& model, int index, const ServerOptions& options)
      : model_(model), index_(index), options_(options) {}
  ~WorkerSupervisor();
  Status Init();
  // Starts the supervisor thread; ResourceExhausted if the system has no
  // thread to give (RLIMIT_NPROC, pids.max), and then nothing was started.
  Status Start() {
    try {
      thread_ = std::thread([this] { Loop(); });
    } catch (const std::system_error& e) {
      return ResourceExhausted("starting a worker's supervisor thread: " + std::string(e.what()));
    }
    return Status::Ok();
  }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  // SIGKILL for a worker process that is still starting (it holds no
  // request): stopping must not wait out --ready-timeout for it. Call after
  // setting the model's stopping flag.
  void KillIfStarting();
  pid_t pid() const { return pid_.load(); }
  int index() const { return index_; }
  bool ready() const { return ready_.load(); }
  uint64_t restarts() const { return restarts_.load(); }
  uint64_t device_memory_bytes() const { return device_memory_bytes_.load(); }

 private:
  void Loop();
  Result<pid_t> Spawn(UniqueFd* control);
  // Waits for the worker's exit (SIGKILL first if asked, or after 2 s);
  // returns its wait status.
  int Reap(pid_t pid, bool kill_first);
  // Runs one batch of requests on the live worker; false if the worker is gone.
  bool RunBatch(int control, const std::vector<std::shared_ptr<Job>>& jobs);
  // Tells the model how this worker's first start ended (once).
  void Settle();

  ModelRuntime& model_;
  int index_;
  const ServerOptions& options_;
  std::thread thread_;
  // pid_ changes under pid_mu_, so that KillIfStarting never signals a pid
  // that Reap has already collected (and the kernel may have reused).
  std::mutex pid_mu_;
  std::atomic<pid_t> pid_{-1};
  std::atomic<bool> ready_{false};
  std::atomic<uint64_t> restarts_{0}, device_memory_bytes_{0};
  bool settled_ = false;  // supervisor thread only
  UniqueFd slot_fd_;
  std::byte* slot_ = nullptr;
  uint64_t seq_ = 0;
};

// One served model version: its queue, its workers and their totals. Built
// and started by the model's builder thread (Impl::Build), published to
// requests once a worker is ready, then never replaced or freed until the
// server is destroyed, so that requests may hold a plain pointer to it.
struct ModelRuntime {
  std::string name;
  ModelConfig config_;
  Device device;
  std::string store_socket;
  uint64_t store_version = 0;
  std::vector<IoSpec> inputs, outputs;
  control::SlotLayout layout;
  std::unique_ptr<JobQueue> queue;
  std::vector<std::unique_ptr<WorkerSupervisor>> workers;
  std::atomic<int> ready_workers{0};
  std::atomic<bool> stopping{false};
  std::atomic<bool> abandoning{false};  // RequestStop(true): starting workers are not waited for
  // Set once requests can reach it; before that, worker start failures are
  // the builder's to report (once per reason).
  std::atomic<bool> published{false};
  int worker_count = 1;
  // Start-up: how many workers' first start has ended, and the last reason a
  // worker could not start. Guarded by state_mu; state_cv is notified on
  // each and when stopping is set (it also ends the supervisors' backoff).
  std::mutex state_mu;
  std::condition_variable state_cv;
  int settled_workers = 0;
  std::string last_worker_error;
  // Called (from a supervisor thread, no lock held) when the last worker's
  // first start is over; set before the workers start.
  std::function<void()> on_all_settled;
  // Totals for /metrics and the summary logged at shutdown.
  std::atomic<uint64_t> batches{0}, requests{0}, run_us{0}, request_us{0};
  std::atomic<uint64_t> success{0}, failure{0}, rows{0}, queue_us{0}, input_us{0}, output_us{0};
  std::atomic<int64_t> pending{0};
  static constexpr int64_t kBatchBuckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  std::atomic<uint64_t> batch_bucket[std::size(kBatchBuckets)] = {};
  uint64_t arena_bytes = 0;
  BatchPolicy policy;

  const ModelConfig& config() const { return config_; }
  int max_batch() const { return std::max(1, config().max_batch_size); }

  // Stops taking requests and makes every supervisor wind down: queued
  // requests are still run by workers that are up. Workers still starting
  // are killed if `abandon_starting` (they hold no request; waiting for them
  // could take --ready-timeout), else left to start and help drain the queue.
  void RequestStop(bool abandon_starting) {
    {
      std::lock_guard lock(state_mu);
      if (abandon_starting) abandoning = true;
      stopping = true;
    }
    state_cv.notify_all();
    if (queue) queue->Close();
    if (abandon_starting)
      for (auto& w : workers) w->KillIfStarting();
  }
  // Sleeps for `d` unless stopping is (or becomes) set; false if stopping.
  bool WaitUnlessStopping(std::chrono::milliseconds d) {
    std::unique_lock lock(state_mu);
    return !state_cv.wait_for(lock, d, [&] { return stopping.load(); });
  }
  std::string LastWorkerError() {
    std::lock_guard lock(state_mu);
    return last_worker_error;
  }
  bool AllSettled() {
    std::lock_guard lock(state_mu);
    return settled_workers == worker_count;
  }
};

WorkerSupervisor::~WorkerSupervisor() {
  Join();
  if (slot_ != nullptr) ::munmap(slot_, model_.layout.total);
}

Status WorkerSupervisor::Init() {
  // memfd names are at most 249 bytes; the name is only for /proc listings.
  const std::string name = "hearth-slot-" + model_.name.substr(0, 200);
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return ErrnoError("memfd_create for a request slot", errno);
  slot_fd_.Reset(fd);
  if (::ftruncate(fd, static_cast<off_t>(model_.layout.total)) != 0)
    return ErrnoError("sizing a request slot of " + std::to_string(model_.layout.total) + " bytes",
                      errno);
  void* p = ::mmap(nullptr, model_.layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError("mapping a request slot", errno);
  slot_ = static_cast<std::byte*>(p);
  return Status::Ok();
}

void WorkerSupervisor::KillIfStarting() {
  std::lock_guard lock(pid_mu_);
  if (pid_ > 0 && !ready_) ::kill(pid_, SIGKILL);
}

void WorkerSupervisor::Settle() {
  if (settled_) return;
  settled_ = true;
  bool all = false;
  {
    std::lock_guard lock(model_.state_mu);
    all = ++model_.settled_workers == model_.worker_count;
  }
  model_.state_cv.notify_all();
  if (all && model_.on_all_settled) model_.on_all_settled();
}

// The worker gets exactly five descriptors: 0-2 (the server's stdio), 3
// (control) and 4 (slot; the worker closes it once mapped). Its parameters are queued on the
// control socket before it starts, never put in argv (whose size is limited, and which any local
// user can read in /proc).
Result<pid_t> WorkerSupervisor::Spawn(UniqueFd* control) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return ErrnoError("socketpair", errno);
  UniqueFd mine(sv[0]), theirs(sv[1]);
  const ModelConfig& c = model_.config();
  RETURN_IF_ERROR(control::SendParameters(mine.get(), c.parameters).WithContext(c.config_path));
  // dup2 onto itself would keep close-on-exec: move anything at 3 or 4 out of the way.
  auto high = [](UniqueFd& fd) {
    if (fd.get() <= 4) fd.Reset(::fcntl(fd.get(), F_DUPFD_CLOEXEC, 10));
  };
  high(theirs);
  high(slot_fd_);
  if (!theirs || !slot_fd_) return ErrnoError("moving a worker's descriptors", errno);
  std::vector<std::string> args = {options_.worker_path,
                                   "--store-socket",
                                   model_.store_socket,
                                   "--model",
                                   c.name,
                                   "--version",
                                   std::to_string(model_.store_version),
                                   "--backend",
                                   c.backend,
                                   "--max-batch",
                                   std::to_string(model_.max_batch()),
                                   "--control-fd",
                                   "3",
                                   "--slot-fd",
                                   "4",
                                   "--slot-bytes",
                                   std::to_string(model_.layout.total)};
  if (c.allow_tf32) args.push_back("--allow-tf32");
  if (!c.fault_kind.empty()) {
    char value[64];
    std::snprintf(value, sizeof value, "%.17g", c.fault_on_value);
    args.insert(args.end(), {"--fault-kind", c.fault_kind, "--fault-on-value", value});
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, theirs.get(), 3);
  posix_spawn_file_actions_adddup2(&actions, slot_fd_.get(), 4);
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
  const int rc = posix_spawn(&pid, argv[0], &actions, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return ErrnoError("starting " + options_.worker_path, rc);
  *control = std::move(mine);
  return pid;
}

int WorkerSupervisor::Reap(pid_t pid, bool kill_first) {
  if (pid <= 0) return 0;
  if (kill_first) ::kill(pid, SIGKILL);
  int status = 0;
  auto reaped = [&](pid_t r) {
    if (r != pid && !(r < 0 && errno == ECHILD)) return false;
    pid_ = -1;
    return true;
  };
  for (int i = 0; i < 200; ++i) {  // up to 2 s for a clean exit, then SIGKILL
    {
      std::lock_guard lock(pid_mu_);
      if (reaped(::waitpid(pid, &status, WNOHANG))) return status;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard lock(pid_mu_);
  ::kill(pid, SIGKILL);
  (void)reaped(::waitpid(pid, &status, 0));
  return status;
}

// "exited with status 1", "killed by signal 9".
std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "wait status " + std::to_string(status);
}

bool WorkerSupervisor::RunBatch(int control, const std::vector<std::shared_ptr<Job>>& jobs) {
  const control::SlotLayout& layout = model_.layout;
  const auto dispatched = Clock::now();
  for (const auto& job : jobs) {
    model_.queue_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(dispatched - job->received).count());
  }
  // The one copy of each input on the host: from the request (a view into
  // the HTTP body for binary inputs, decoded bytes for JSON) into the slot.
  int64_t rows = 0;
  for (const auto& job : jobs) {
    for (size_t i = 0; i < model_.inputs.size(); ++i) {
      const uint64_t row_bytes = layout.input_bytes_per_sample[i];
      for (const InferTensor& t : job->request.inputs) {
        if (t.name == model_.inputs[i].name)
          std::memcpy(slot_ + layout.input_offsets[i] + static_cast<uint64_t>(rows) * row_bytes,
                      t.data.data(), t.data.size());
      }
    }
    rows += job->batch;
  }
  model_.input_us += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - dispatched).count());
  control::Message run;
  run.kind = control::Kind::kRun;
  run.seq = ++seq_;
  run.batch = rows;
  Status sent = control::Send(control, run);
  Result<control::Message> done = sent.ok() ? control::Receive(control, options_.exec_timeout_ms)
                                            : Result<control::Message>(sent);
  if (!done.ok() || done->kind != control::Kind::kDone || done->seq != run.seq) {
    const bool timeout = !done.ok() && done.status().message() == "timeout";
    spdlog::warn("{} worker {} (pid {}) {} while running a batch of {} rows from {} requests",
                 model_.name, index_, pid_.load(), timeout ? "ran past --exec-timeout" : "died",
                 rows, jobs.size());
    // Back to the front in their order; each now runs alone (PopBatch).
    for (auto it = jobs.rbegin(); it != jobs.rend(); ++it) {
      const auto& job = *it;
      if (++job->crashes >= 3) {
        job->done(Internal("poison batch: this request took down " + std::to_string(job->crashes) +
                           " workers of '" + model_.name + "'; it is not retried"));
      } else {
        model_.queue->PushFront(job);
      }
    }
    return false;
  }
  model_.batches += 1;
  model_.rows += static_cast<uint64_t>(rows);
  model_.run_us += done->run_us;
  for (size_t b = 0; b < std::size(ModelRuntime::kBatchBuckets); ++b) {
    if (rows <= ModelRuntime::kBatchBuckets[b]) {
      model_.batch_bucket[b] += 1;
      break;
    }
  }
  const auto outputs_start = Clock::now();
  if (done->status_code != 0) {
    for (const auto& job : jobs)
      job->done(Status(static_cast<StatusCode>(done->status_code), done->text));
    return true;
  }
  // Each response's outputs are views into the slot, borrowed for the
  // duration of `done` (inference_api.h): the slot is written again only by
  // the next batch, which this thread starts after every `done` returned.
  rows = 0;
  for (const auto& job : jobs) {
    InferResponse response;
    response.model = model_.name;
    response.version = std::to_string(model_.config().version);
    response.id = job->request.id;
    for (size_t i = 0; i < model_.outputs.size(); ++i) {
      const IoSpec& spec = model_.outputs[i];
      const auto& wanted = job->request.outputs;
      if (!wanted.empty() &&
          std::none_of(wanted.begin(), wanted.end(),
                       [&](const RequestedOutput& o) { return o.name == spec.name; }))
        continue;
      InferTensor t;
      t.name = spec.name;
      t.dtype = spec.dtype;
      if (model_.config().max_batch_size > 0) t.shape.push_back(job->batch);
      t.shape.insert(t.shape.end(), spec.dims.begin(), spec.dims.end());
      const uint64_t row_bytes = layout.output_bytes_per_sample[i];
      const std::byte* src =
          slot_ + layout.output_offsets[i] + static_cast<uint64_t>(rows) * row_bytes;
      t.data = TensorData::Borrowed(
          std::span<const std::byte>(src, row_bytes * static_cast<uint64_t>(job->batch)));
      response.outputs.push_back(std::move(t));
    }
    rows += job->batch;
    model_.requests += 1;
    model_.request_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - job->received)
            .count());
    job->done(std::move(response));
  }
  model_.output_us += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - outputs_start).count());
  return true;
}

// The wait before starting a worker again after `failures` deaths in a row
// with no batch answered in between: none after a worker that did useful work
// (a replacement serves again at once), then 100 ms doubling up to 5 s for a
// worker that keeps dying before it answers anything.
std::chrono::milliseconds RestartBackoff(int failures) {
  if (failures <= 1) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(std::min(100 << std::min(failures - 2, 6), 5000));
}

void WorkerSupervisor::Loop() {
  int failures = 0;  // deaths in a row without an answered batch
  // The last attempt died before it said ready (for any reason).
  bool last_died_starting = false;
  while (!model_.stopping) {
    const auto backoff = RestartBackoff(failures);
    if (backoff.count() > 0 && !model_.WaitUnlessStopping(backoff)) break;
    UniqueFd control;
    auto pid = Spawn(&control);
    if (!pid.ok()) {
      if (model_.published)
        spdlog::error("{} worker {}: {}", model_.name, index_, pid.status().ToString());
      {
        std::lock_guard lock(model_.state_mu);
        model_.last_worker_error = "a worker could not be started: " + pid.status().message();
      }
      Settle();
      failures = std::max(failures + 1, 2);  // cannot even start one: wait before trying again
      continue;
    }
    {
      std::lock_guard lock(pid_mu_);
      pid_ = *pid;
    }
    // RequestStop(true) may have come after the loop's check, and seen no
    // pid to kill yet.
    if (model_.abandoning) {
      Reap(*pid, true);
      break;
    }
    const auto started = Clock::now();
    auto ready = control::Receive(control.get(), options_.ready_timeout_ms);
    if (!ready.ok() || ready->kind != control::Kind::kReady) {
      std::string why = ready.ok() ? ready->text : ready.status().message();
      if (ready.ok() && ready->kind != control::Kind::kDone) why = "an unexpected control message";
      if (!ready.ok() && ready.status().message() == "timeout")
        why = "no ready message within " + std::to_string(options_.ready_timeout_ms) + " ms";
      // One that closed its socket has exited or is exiting: wait for it, to
      // see why. One that hung or said something else is killed.
      const bool closed = !ready.ok() && ready.status().code() == StatusCode::kUnavailable;
      const int status = Reap(*pid, !closed);
      if (model_.stopping) break;
      // A SIGKILL while starting is either from outside (an operator, a
      // test), which says nothing about the worker, or the kernel's OOM
      // killer (a max_batch_size whose buffers do not fit), which will
      // happen again. One is restarted at once, unless the attempt before
      // died starting too: then it counts as a failure like any other (back-off,
      // and the model settles as failed), so that an OOM never respawns in
      // a tight loop.
      const bool sigkilled = closed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      const bool free_retry = sigkilled && !last_died_starting;
      last_died_starting = true;
      // Without the worker's index or pid: the same failure of every worker
      // and every attempt is one reason, logged once by the builder.
      const std::string reason = sigkilled ? "killed by SIGKILL while starting (out of memory?)"
                                           : why + " (" + DescribeExit(status) + ")";
      if (model_.published) {
        spdlog::error("{} worker {} (pid {}) failed to start: {}", model_.name, index_, *pid,
                      reason);
      } else {
        spdlog::debug("{} worker {} (pid {}) failed to start: {}", model_.name, index_, *pid,
                      reason);
      }
      {
        std::lock_guard lock(model_.state_mu);
        model_.last_worker_error = "a worker failed to start: " + reason;
      }
      if (!free_retry) {
        Settle();
        ++failures;
      }
      continue;
    }
    last_died_starting = false;
    spdlog::info("{} worker {} ready: pid {} on {} in {:.0f} ms ({} MiB of its own device buffers)",
                 model_.name, index_, *pid, ready->text,
                 std::chrono::duration<double, std::milli>(Clock::now() - started).count(),
                 ready->device_memory_bytes >> 20);
    ++model_.ready_workers;
    ready_ = true;
    device_memory_bytes_ = ready->device_memory_bytes;
    Settle();
    bool alive = true;
    while (alive) {
      std::vector<std::shared_ptr<Job>> jobs =
          model_.queue->PopBatch(model_.policy, std::chrono::milliseconds(100));
      if (jobs.empty()) {
        if (model_.stopping) break;
        // Idle: a worker that died between batches (end-of-file on its
        // control socket) is replaced now, not when the next request finds it.
        pollfd p{control.get(), POLLIN, 0};
        if (::poll(&p, 1, 0) > 0) {
          spdlog::warn("{} worker {} (pid {}) died while idle", model_.name, index_, pid_.load());
          alive = false;
        }
        continue;
      }
      alive = RunBatch(control.get(), jobs);
      if (alive) failures = 0;
    }
    --model_.ready_workers;
    ready_ = false;
    control.Reset();  // end-of-file: a live worker exits by itself
    Reap(*pid, !alive);
    if (alive) break;  // queue closed: shutting down
    ++restarts_;
    ++failures;
  }
}

// A model directory and what the server has made of it. A builder (one of
// the server's pool) reads the directory, config and checkpoint, starts the
// workers, and either publishes the model (once one worker is ready) or
// records why not and queues it to be tried again later, until the server
// stops.
struct ModelSlot {
  ModelDirectory dir;
  // Builder only (one builder works on a slot at a time): failed attempts so
  // far, and the last failure logged (each distinct one is logged once).
  int failed_attempts = 0;
  std::string logged;
  // The served model, once published; never changed afterwards.
  std::atomic<ModelRuntime*> served{nullptr};

  mutable std::mutex mu;                // guards the members below
  std::unique_ptr<ModelRuntime> owned;  // what `served` points to
  ModelRuntime* building = nullptr;     // being started by the builder, not yet published
  Status status = Unavailable("it is being loaded");  // while not served: why
  // The first attempt has ended: published with every worker's first start
  // over, or failed. Start() waits for this.
  bool settled = false;

  // What the store holds for this model (builder thread only): a retry with
  // an unchanged checkpoint file reuses it instead of reading it again.
  struct Loaded {
    std::string key;  // path, device, inode, size, mtime of the file loaded
    std::string socket;
    uint64_t version = 0;
    uint64_t arena_bytes = 0;
  } loaded;
};

// Wait between attempts to bring up a model that failed: 1, 2, 4, then every 5 s.
std::chrono::milliseconds RetryDelay(int attempt) {
  return std::chrono::milliseconds(std::min(1000 << std::min(attempt, 3), 5000));
}

}  // namespace

class Server::Impl {
 public:
  explicit Impl(ServerOptions options) : options_(std::move(options)) {}
  ~Impl() { Shutdown(); }

  Status Start() {
    const auto started = Clock::now();
    {
      // Shutdown() waits for this block, so that it never sees the slots or
      // the builders half made.
      std::lock_guard lifecycle(lifecycle_mu_);
      if (stopping_) return Unavailable("the server was shut down before it started");
      RETURN_IF_ERROR(SetUpRunDirectory());
      ASSIGN_OR_RETURN(std::vector<ModelDirectory> dirs, ListModelDirectories(options_.repository));
      if (dirs.empty())
        spdlog::warn("model repository {} holds no model directories", options_.repository);
      for (ModelDirectory& d : dirs) {
        auto slot = std::make_unique<ModelSlot>();
        slot->dir = std::move(d);
        const std::string name = slot->dir.name;
        slots_.emplace(name, std::move(slot));
      }
      {
        std::lock_guard lock(events_mu_);
        for (auto& [name, slot] : slots_) build_queue_.emplace(started, slot.get());
      }
      // A bounded pool, however many models: a thread per model would meet
      // the pids or RLIMIT_NPROC limit with a large repository.
      const size_t want = std::min(kMaxBuilders, slots_.size());
      for (size_t i = 0; i < want; ++i) {
        try {
          builders_.emplace_back([this] { BuilderLoop(); });
        } catch (const std::system_error& e) {
          if (builders_.empty())
            return ResourceExhausted("starting the threads that load models: " +
                                     std::string(e.what()));
          spdlog::warn("loading models with {} threads instead of {}: {}", builders_.size(), want,
                       e.what());
          break;
        }
      }
    }
    // Listen as soon as every model is either up or has failed once (and is
    // being retried in the background); a model still starting at the
    // deadline is served when it is ready.
    const auto deadline = started + std::chrono::milliseconds(options_.ready_timeout_ms);
    {
      std::unique_lock lock(events_mu_);
      events_cv_.wait_until(lock, deadline, [&] { return AllSettled(); });
    }
    if (stopping_) return Unavailable("the server was shut down while it was starting");
    for (auto& [name, slot] : slots_) {
      ModelRuntime* m = slot->served.load();
      if (m == nullptr) continue;
      spdlog::info("model {}: {} of {} workers ready {:.3f} s after start-up began", name,
                   m->ready_workers.load(), m->worker_count,
                   std::chrono::duration<double>(Clock::now() - started).count());
    }
    started_ = true;
    return Status::Ok();
  }

  void Shutdown() {
    if (shut_down_.exchange(true)) return;
    {
      std::lock_guard lock(events_mu_);
      stopping_ = true;
    }
    events_cv_.notify_all();
    // First, so that a builder reading a large checkpoint into a store
    // returns now instead of at the end of the load.
    {
      std::lock_guard lock(stores_mu_);
      for (auto& [device, s] : stores_) s.store->CancelLoads();
    }
    std::lock_guard lifecycle(lifecycle_mu_);
    for (auto& [name, slot] : slots_) {
      std::lock_guard lock(slot->mu);
      if (slot->building != nullptr) slot->building->RequestStop(true);
      // A served model's starting workers are needed only if none is up to
      // run what is queued.
      if (ModelRuntime* m = slot->owned.get())
        m->RequestStop(m->ready_workers.load() > 0 || m->queue->size() == 0);
    }
    for (std::thread& b : builders_) b.join();
    builders_.clear();
    for (auto& [name, slot] : slots_) {
      ModelRuntime* m = slot->served.load();
      if (m == nullptr) continue;
      for (auto& w : m->workers) w->Join();
      m->queue->FailAll(Unavailable("the server is shutting down"));
      if (const uint64_t n = m->batches.load(), r = m->requests.load(); n > 0 && r > 0) {
        spdlog::info(
            "model {}: {} requests in {} batches; mean {:.3f} ms per batch in the backend, "
            "{:.3f} ms from request to answer in the server",
            name, r, n, m->run_us.load() / 1e3 / n, m->request_us.load() / 1e3 / r);
      }
    }
    {
      std::lock_guard lock(stores_mu_);
      for (auto& [device, s] : stores_) {
        s.store->Stop();
        if (s.thread.joinable()) s.thread.join();
      }
      stores_.clear();  // each store removes its socket
    }
    // Only what this server made: the directory, if it created it, and only
    // once it is empty.
    if (made_run_dir_ && ::rmdir(run_dir_.c_str()) != 0)
      spdlog::warn("cannot remove the run directory {}: {}", run_dir_, std::strerror(errno));
  }

  bool Ready() const {
    if (!started_ || shut_down_) return false;
    for (const auto& [name, slot] : slots_) {
      const ModelRuntime* m = slot->served.load();
      if (m != nullptr && m->ready_workers.load() == 0) return false;
    }
    return true;
  }
  bool Live() const { return !shut_down_; }

  // The served model, or why there is none: NotFound for an unknown model or
  // a version other than the served one, Unavailable naming the path and the
  // reason for a model whose directory, config, checkpoint or workers fail.
  Result<ModelRuntime*> Find(const std::string& model, const std::string& version) const {
    auto it = slots_.find(model);
    if (it == slots_.end()) return NotFound("unknown model '" + model + "'");
    const ModelSlot& slot = *it->second;
    ModelRuntime* m = slot.served.load();
    if (m == nullptr) {
      std::lock_guard lock(slot.mu);
      return Unavailable("model '" + model + "' is not served: " + slot.status.message());
    }
    if (!version.empty() && version != std::to_string(m->config().version))
      return NotFound("model '" + model + "' has no served version '" + version + "'");
    return m;
  }

  Result<ModelMetadata> Metadata(const std::string& model, const std::string& version) const {
    ASSIGN_OR_RETURN(ModelRuntime * m, Find(model, version));
    ModelMetadata md;
    md.name = model;
    md.versions = {std::to_string(m->config().version)};
    md.platform = "hearth_" + m->config().backend;
    md.max_batch_size = m->config().max_batch_size;
    auto convert = [&](const std::vector<IoSpec>& specs, std::vector<TensorMetadata>* out) {
      for (const IoSpec& s : specs) {
        TensorMetadata t{s.name, s.dtype, {}};
        if (md.max_batch_size > 0) t.shape.push_back(-1);
        t.shape.insert(t.shape.end(), s.dims.begin(), s.dims.end());
        out->push_back(std::move(t));
      }
    };
    convert(m->inputs, &md.inputs);
    convert(m->outputs, &md.outputs);
    return md;
  }

  Result<bool> ModelReady(const std::string& model, const std::string& version) const {
    ASSIGN_OR_RETURN(ModelRuntime * m, Find(model, version));
    if (shut_down_) return Unavailable("the server is shutting down");
    if (m->ready_workers.load() == 0) {
      const std::string last = m->LastWorkerError();
      return Unavailable("model '" + model + "' has no worker ready" +
                         (last.empty() ? "" : ": " + last));
    }
    return true;
  }

  void Infer(InferRequest request, std::function<void(Result<InferResponse>)> done) {
    auto found = Find(request.model, request.version);
    if (!found.ok()) return done(found.status());
    ModelRuntime& m = **found;
    ++m.pending;
    done = [&m, done = std::move(done)](Result<InferResponse> r) {
      (r.ok() ? m.success : m.failure) += 1;
      --m.pending;
      done(std::move(r));
    };
    auto job = std::make_shared<Job>();
    // Never trust sizes: the slot is only as large as max_batch allows.
    int64_t batch = 1;
    for (size_t i = 0; i < m.inputs.size(); ++i) {
      const IoSpec& spec = m.inputs[i];
      auto it = std::find_if(request.inputs.begin(), request.inputs.end(),
                             [&](const InferTensor& t) { return t.name == spec.name; });
      if (it == request.inputs.end())
        return done(InvalidArgument("missing input '" + spec.name + "'"));
      if (it->dtype != spec.dtype)
        return done(InvalidArgument("input '" + spec.name + "' has the wrong datatype"));
      const int64_t b = m.config().max_batch_size > 0 && !it->shape.empty() ? it->shape[0] : 1;
      if (i == 0) batch = b;
      if (b != batch || b < 1 || b > m.max_batch())
        return done(InvalidArgument("input '" + spec.name + "': batch " + std::to_string(b) +
                                    " is not valid"));
      // Checked although the slot layout bounds it (row bytes x max_batch
      // fit): the comparison must not wrap whatever the batch.
      Result<uint64_t> expected = CountBytes(m.layout.input_bytes_per_sample[i],
                                             static_cast<uint64_t>(b), "input '" + spec.name + "'");
      if (!expected.ok()) return done(expected.status());
      if (it->data.size() != *expected)
        return done(InvalidArgument("input '" + spec.name + "' has " +
                                    std::to_string(it->data.size()) + " bytes, expected " +
                                    std::to_string(*expected)));
    }
    if (request.inputs.size() != m.inputs.size())
      return done(InvalidArgument("model '" + m.name + "' takes " +
                                  std::to_string(m.inputs.size()) + " inputs"));
    job->batch = batch;
    const uint64_t timeout_us =
        request.timeout_us > 0 ? request.timeout_us : m.config().default_timeout_us;
    // Saturating: a timeout too large to represent is no deadline, not one in the past.
    if (timeout_us > 0) job->deadline = SaturatingDeadline<Clock>(job->received, timeout_us);
    job->done = std::move(done);
    job->request = std::move(request);
    if (Status s = m.queue->Push(job); !s.ok()) job->done(s);
  }

  std::string MetricsText() const {
    // Served models only: one that is not served has no workers or counters.
    std::vector<std::pair<std::string, const ModelRuntime*>> served;
    for (const auto& [name, slot] : slots_)
      if (const ModelRuntime* m = slot->served.load()) served.emplace_back(name, m);
    std::string out;
    auto family = [&](const char* name, const char* type, const char* help) {
      out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    };
    auto sample = [&](const std::string& name, const std::string& labels, double value) {
      char text[64];
      std::snprintf(text, sizeof text, "%.17g", value);
      out += name + "{" + labels + "} " + text + "\n";
    };
    auto per_model = [&](const char* name, const char* type, const char* help, auto value) {
      family(name, type, help);
      for (const auto& [model, m] : served)
        sample(name, "model=\"" + model + "\"", static_cast<double>(value(*m)));
    };
    per_model("hearth_inference_request_success", "counter", "Requests answered successfully.",
              [](const ModelRuntime& m) { return m.success.load(); });
    per_model("hearth_inference_request_failure", "counter", "Requests answered with an error.",
              [](const ModelRuntime& m) { return m.failure.load(); });
    per_model("hearth_inference_count", "counter",
              "Inferences (rows, counting every batch member).",
              [](const ModelRuntime& m) { return m.rows.load(); });
    per_model("hearth_inference_exec_count", "counter", "Batches executed by workers.",
              [](const ModelRuntime& m) { return m.batches.load(); });
    per_model("hearth_inference_request_duration_us", "counter",
              "Total time from request to answer of successful requests, microseconds.",
              [](const ModelRuntime& m) { return m.request_us.load(); });
    per_model("hearth_inference_queue_duration_us", "counter",
              "Total time requests waited in the queue, microseconds.",
              [](const ModelRuntime& m) { return m.queue_us.load(); });
    per_model("hearth_inference_compute_input_duration_us", "counter",
              "Total time copying inputs into worker slots, microseconds.",
              [](const ModelRuntime& m) { return m.input_us.load(); });
    per_model("hearth_inference_compute_infer_duration_us", "counter",
              "Total time the backends ran, as measured in the workers, microseconds.",
              [](const ModelRuntime& m) { return m.run_us.load(); });
    per_model("hearth_inference_compute_output_duration_us", "counter",
              "Total time splitting outputs back into responses, microseconds.",
              [](const ModelRuntime& m) { return m.output_us.load(); });
    per_model("hearth_inference_pending_request_count", "gauge",
              "Requests accepted and not yet answered.",
              [](const ModelRuntime& m) { return m.pending.load(); });
    per_model("hearth_inference_queued_request_count", "gauge",
              "Requests waiting in the queue for a worker.",
              [](const ModelRuntime& m) { return m.queue->size(); });
    family("hearth_inference_batch_size", "histogram", "Rows per executed batch.");
    for (const auto& [model, m] : served) {
      uint64_t cumulative = 0;
      for (size_t b = 0; b < std::size(ModelRuntime::kBatchBuckets); ++b) {
        cumulative += m->batch_bucket[b].load();
        sample(
            "hearth_inference_batch_size_bucket",
            "model=\"" + model + "\",le=\"" + std::to_string(ModelRuntime::kBatchBuckets[b]) + "\"",
            static_cast<double>(cumulative));
      }
      sample("hearth_inference_batch_size_bucket", "model=\"" + model + "\",le=\"+Inf\"",
             static_cast<double>(m->batches.load()));
      sample("hearth_inference_batch_size_sum", "model=\"" + model + "\"",
             static_cast<double>(m->rows.load()));
      sample("hearth_inference_batch_size_count", "model=\"" + model + "\"",
             static_cast<double>(m->batches.load()));
    }
    auto per_worker = [&](const char* name, const char* type, const char* help, auto value) {
      family(name, type, help);
      for (const auto& [model, m] : served)
        for (const auto& w : m->workers)
          sample(name, "model=\"" + model + "\",worker=\"" + std::to_string(w->index()) + "\"",
                 static_cast<double>(value(*w)));
    };
    per_worker("hearth_worker_restarts", "counter", "Times the worker process was replaced.",
               [](const WorkerSupervisor& w) { return w.restarts(); });
    per_worker("hearth_worker_ready", "gauge", "1 while the worker process is serving.",
               [](const WorkerSupervisor& w) { return w.ready() ? 1 : 0; });
    per_worker(
        "hearth_worker_device_memory_bytes", "gauge",
        "Device memory the worker's backend allocated itself (its CUDA context not included).",
        [](const WorkerSupervisor& w) { return w.device_memory_bytes(); });
    family("hearth_shared_weights_bytes", "gauge",
           "Bytes of each model's weights, held once in the store.");
    for (const auto& [model, m] : served)
      sample("hearth_shared_weights_bytes",
             "model=\"" + model + "\",device=\"" + m->device.ToString() + "\"",
             static_cast<double>(m->arena_bytes));
    family("hearth_device_memory_accounted_bytes", "gauge",
           "Shared weights counted once plus the workers' own allocations, per device (contexts "
           "not included).");
    std::map<std::string, uint64_t> per_device;
    for (const auto& [model, m] : served) {
      per_device[m->device.ToString()] += m->arena_bytes;
      for (const auto& w : m->workers) per_device[m->device.ToString()] += w->device_memory_bytes();
    }
    for (const auto& [device, bytes] : per_device)
      sample("hearth_device_memory_accounted_bytes", "device=\"" + device + "\"",
             static_cast<double>(bytes));
    return out;
  }

  std::vector<int> WorkerPids(const std::string& model) const {
    std::vector<int> pids;
    auto it = slots_.find(model);
    if (it == slots_.end()) return pids;
    const ModelRuntime* m = it->second->served.load();
    if (m == nullptr) return pids;
    for (const auto& w : m->workers)
      if (w->pid() > 0) pids.push_back(w->pid());
    return pids;
  }

 private:
  struct RunningStore {
    std::unique_ptr<Store> store;
    std::thread thread;
    std::string socket;
  };

  // events_mu_ held.
  bool AllSettled() const {
    if (stopping_) return true;
    for (const auto& [name, slot] : slots_) {
      std::lock_guard lock(slot->mu);
      if (!slot->settled) return false;
    }
    return true;
  }

  void NotifySettled(ModelSlot& slot) {
    {
      std::lock_guard lock(slot.mu);
      slot.settled = true;
    }
    {
      std::lock_guard lock(events_mu_);  // AllSettled reads under it
    }
    events_cv_.notify_all();
  }

  // The sockets' directory: private (0700, ours, no symlink, trusted
  // ancestors), so that no other local user can replace the store's socket
  // and hand workers impostor weights. A new mkdtemp directory unless the
  // options name one, which is then checked (and created if missing).
  Status SetUpRunDirectory() {
    if (options_.run_dir.empty()) {
      ASSIGN_OR_RETURN(run_dir_, MakePrivateDirectory("serve-", kMaxRunDirLength));
      made_run_dir_ = true;
    } else {
      if (options_.run_dir.size() > kMaxRunDirLength)
        return InvalidArgument("run directory " + options_.run_dir + ": " +
                               std::to_string(options_.run_dir.size()) +
                               " bytes, too long for its sockets' paths (at most " +
                               std::to_string(kMaxRunDirLength) + ")");
      struct stat st {};
      const bool existed = ::lstat(options_.run_dir.c_str(), &st) == 0;
      RETURN_IF_ERROR(EnsureTrustedDirectory(options_.run_dir, 0700));
      run_dir_ = options_.run_dir;
      made_run_dir_ = !existed;
    }
    spdlog::info("run directory {}", run_dir_);
    return Status::Ok();
  }

  // A store's socket path, "<run dir>/store-cuda<N>.sock", must fit
  // sockaddr_un's sun_path with its NUL: the run directory may take what the
  // longest name leaves.
  static constexpr size_t kLongestSocketName = sizeof("/store-cuda4294967295.sock") - 1;
  static constexpr size_t kMaxRunDirLength = sizeof(sockaddr_un::sun_path) - 1 - kLongestSocketName;

  Result<std::string> StoreFor(Device device) {
    std::lock_guard lock(stores_mu_);
    const std::string key = device.ToString();
    auto it = stores_.find(key);
    if (it != stores_.end()) return it->second.socket;
    if (stopping_) return Unavailable("the server is shutting down");
    StoreOptions so;
    so.socket_path = run_dir_ + "/store-" +
                     (device.is_cuda() ? "cuda" + std::to_string(device.index) : "cpu") + ".sock";
    so.device = device;
    so.show_progress = true;
    const std::string socket = so.socket_path;
    ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Create(std::move(so)));
    Store* raw = store.get();
    std::thread thread;
    try {
      thread = std::thread([raw] {
        if (Status s = raw->Run(); !s.ok()) spdlog::error("store: {}", s.ToString());
      });
    } catch (const std::system_error& e) {
      return ResourceExhausted("starting the store's thread: " + std::string(e.what()));
    }
    RunningStore& rs = stores_[key];
    rs.socket = socket;
    rs.store = std::move(store);
    rs.thread = std::move(thread);
    return rs.socket;
  }

  // Checks the config against the checkpoint, lays out the slot, and has the
  // store hold the weights (reusing what it holds if the file is unchanged).
  Status Prepare(ModelSlot& slot, ModelRuntime& m) {
    const ModelConfig& c = m.config();
    ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(c.checkpoint_path));
    std::vector<TensorView> views;
    for (const TensorInfo& t : ckpt.tensors())
      views.push_back({t.name, t.dtype, t.shape, nullptr, 0, t.nbytes, Device::Host()});
    auto sig = BackendSignature(c.backend, views);
    if (!sig.ok()) return sig.status().WithContext(c.checkpoint_path);
    m.inputs = sig->first;
    m.outputs = sig->second;
    auto check = [&](const std::vector<IoConfig>& want, const std::vector<IoSpec>& have,
                     const char* what) -> Status {
      for (const IoConfig& io : want) {
        auto it = std::find_if(have.begin(), have.end(),
                               [&](const IoSpec& s) { return s.name == io.name; });
        if (it == have.end())
          return InvalidArgument(c.config_path + ": " + what + " '" + io.name + "': the " +
                                 c.backend + " backend has no such " + what);
        if (it->dtype != io.dtype || it->dims != io.dims) {
          return InvalidArgument(c.config_path + ": " + what + " '" + io.name +
                                 "': dims or data_type do not agree with " + c.checkpoint_path +
                                 ", whose tensors give " + std::string(DTypeName(it->dtype)) + " " +
                                 ShapeString(it->dims));
        }
      }
      if (want.size() != have.size())
        return InvalidArgument(c.config_path + ": " + what + ": the " + c.backend +
                               " backend has " + std::to_string(have.size()) +
                               ", the config lists " + std::to_string(want.size()));
      return Status::Ok();
    };
    RETURN_IF_ERROR(check(c.inputs, m.inputs, "input"));
    RETURN_IF_ERROR(check(c.outputs, m.outputs, "output"));
    auto slot_tensors = [&](const std::vector<IoSpec>& specs, const char* what,
                            std::vector<control::SlotTensor>* out) -> Status {
      for (const IoSpec& s : specs) {
        Result<uint64_t> bytes = s.bytes_per_sample();
        if (!bytes.ok()) return bytes.status().WithContext(c.checkpoint_path + ": " + what);
        out->push_back({s.name, *bytes});
      }
      return Status::Ok();
    };
    std::vector<control::SlotTensor> in, out;
    RETURN_IF_ERROR(slot_tensors(m.inputs, "input", &in));
    RETURN_IF_ERROR(slot_tensors(m.outputs, "output", &out));
    Result<control::SlotLayout> layout = control::SlotLayout::Make(in, out, m.max_batch());
    if (!layout.ok()) return layout.status().WithContext(c.checkpoint_path);
    m.layout = std::move(layout).value();

    m.device = options_.device.is_cuda() && c.kind_gpu
                   ? Device::Cuda(c.gpus.empty() ? options_.device.index : c.gpus[0])
                   : Device::Host();
    ASSIGN_OR_RETURN(m.store_socket, StoreFor(m.device));
    std::error_code ec;
    const std::string absolute = std::filesystem::absolute(c.checkpoint_path, ec).string();
    if (ec) return InvalidArgument(c.checkpoint_path + ": " + ec.message());
    struct stat st {};
    if (::fstat(ckpt.fd(), &st) != 0) return ErrnoError("fstat " + c.checkpoint_path, errno);
    const std::string key = absolute + "|" + m.device.ToString() + "|" + std::to_string(st.st_dev) +
                            ":" + std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) +
                            ":" + std::to_string(st.st_mtim.tv_sec) + "." +
                            std::to_string(st.st_mtim.tv_nsec);
    if (slot.loaded.version == 0 || slot.loaded.key != key ||
        slot.loaded.socket != m.store_socket) {
      if (slot.loaded.version != 0) {
        // What an earlier attempt loaded from a file that has changed since.
        if (auto dropped = AttachClient(slot.loaded.socket).Unload(c.name, slot.loaded.version);
            !dropped.ok())
          spdlog::warn("model {}: dropping version {} from the store: {}", c.name,
                       slot.loaded.version, dropped.status().message());
        slot.loaded = {};
      }
      auto loaded = AttachClient(m.store_socket).Load(c.name, absolute);
      if (!loaded.ok()) return loaded.status().WithContext(c.checkpoint_path);
      slot.loaded = {key, m.store_socket, loaded->version, loaded->arena_size};
    }
    m.store_version = slot.loaded.version;
    m.arena_bytes = slot.loaded.arena_bytes;
    m.worker_count = options_.workers > 0 ? options_.workers : c.instance_count;
    m.queue = std::make_unique<JobQueue>(std::max<uint64_t>(1, c.max_queue_size));
    m.policy.max_batch = m.max_batch();
    m.policy.max_delay = std::chrono::microseconds(c.max_queue_delay_us);
    m.policy.preferred.assign(c.preferred_batch_sizes.begin(), c.preferred_batch_sizes.end());
    std::sort(m.policy.preferred.begin(), m.policy.preferred.end());
    return Status::Ok();
  }

  // Stops a runtime that was never published, and frees it.
  void Discard(ModelSlot& slot, std::unique_ptr<ModelRuntime> m) {
    {
      std::lock_guard lock(slot.mu);
      if (slot.building == m.get()) slot.building = nullptr;
    }
    m->RequestStop(true);
    for (auto& w : m->workers) w->Join();
  }

  // One attempt: config, checkpoint, store, workers. Returns the runtime once
  // one of its workers is ready (its other workers may still be starting);
  // an error naming the path and the reason otherwise.
  Result<std::unique_ptr<ModelRuntime>> TryBuild(ModelSlot& slot) {
    RETURN_IF_ERROR(slot.dir.status);
    ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(slot.dir.path));
    auto m = std::make_unique<ModelRuntime>();
    m->name = slot.dir.name;
    m->config_ = std::move(config);
    RETURN_IF_ERROR(Prepare(slot, *m));
    for (int i = 0; i < m->worker_count; ++i) {
      auto w = std::make_unique<WorkerSupervisor>(*m, i, options_);
      RETURN_IF_ERROR(w->Init().WithContext("model '" + slot.dir.name + "'"));
      m->workers.push_back(std::move(w));
    }
    // Once published, the slot is settled when every worker's first start
    // is over (Publish covers the workers that settled before it).
    m->on_all_settled = [this, &slot, runtime = m.get()] {
      if (runtime->published) NotifySettled(slot);
    };
    {
      // From here Shutdown() can stop it (the workers list is complete).
      std::lock_guard lock(slot.mu);
      if (stopping_) return Unavailable("the server is shutting down");
      slot.building = m.get();
    }
    for (auto& w : m->workers) {
      if (Status started = w->Start(); !started.ok()) {
        Discard(slot, std::move(m));  // stops the workers already started
        return started.WithContext("model '" + slot.dir.name + "'");
      }
    }
    {
      std::unique_lock lock(m->state_mu);
      m->state_cv.wait(lock, [&] {
        return m->stopping.load() || m->ready_workers.load() > 0 ||
               m->settled_workers == m->worker_count;
      });
    }
    if (m->ready_workers.load() > 0 && !m->stopping) return m;
    const bool stopping = m->stopping.load();
    const std::string why = m->LastWorkerError();
    Discard(slot, std::move(m));
    if (stopping) return Unavailable("the server is shutting down");
    return Unavailable("no worker could start; " + why);
  }

  // One builder of the pool: takes the model due first, makes one attempt
  // at it, and queues it again for later if that failed, until the server
  // stops.
  void BuilderLoop() {
    std::unique_lock lock(events_mu_);
    while (!stopping_) {
      if (build_queue_.empty()) {
        events_cv_.wait(lock, [&] { return stopping_ || !build_queue_.empty(); });
        continue;
      }
      auto first = build_queue_.begin();
      if (first->first > Clock::now()) {
        events_cv_.wait_until(lock, first->first);
        continue;
      }
      ModelSlot* slot = first->second;
      build_queue_.erase(first);
      lock.unlock();
      const bool again = BuildOnce(*slot);
      lock.lock();
      if (again && !stopping_) {
        build_queue_.emplace(Clock::now() + RetryDelay(slot->failed_attempts - 1), slot);
        events_cv_.notify_all();  // it may be due before what the others wait for
      }
    }
  }

  // One attempt at a model: publishes it, or records and logs (once per
  // distinct reason) why not. True if it is to be tried again. Nothing it
  // throws (no thread to be had, no memory) escapes to the builder: that is
  // this model's failure, retried like any other.
  bool BuildOnce(ModelSlot& slot) {
    Result<std::unique_ptr<ModelRuntime>> built = [&]() -> Result<std::unique_ptr<ModelRuntime>> {
      try {
        return TryBuild(slot);
      } catch (const std::exception& e) {
        return Internal("model '" + slot.dir.name + "': " + e.what());
      }
    }();
    if (built.ok()) {
      Publish(slot, std::move(built).value());
      return false;
    }
    if (stopping_) {
      NotifySettled(slot);
      return false;
    }
    ++slot.failed_attempts;
    {
      std::lock_guard lock(slot.mu);
      slot.status = built.status();
    }
    NotifySettled(slot);
    if (built.status().message() != slot.logged) {
      slot.logged = built.status().message();
      spdlog::error("model {} is not served: {} (retried in the background until it can be)",
                    slot.dir.name, slot.logged);
    }
    return true;
  }

  // Makes a runtime with a ready worker reachable by requests, unless the
  // server is stopping (then it is discarded).
  void Publish(ModelSlot& slot, std::unique_ptr<ModelRuntime> owned) {
    ModelRuntime* m = owned.get();
    {
      // Under the lock that Shutdown() takes to find runtimes to stop:
      // either it finds this one published, or this sees stopping_.
      std::lock_guard lock(slot.mu);
      if (!stopping_) {
        slot.building = nullptr;
        m->published = true;
        slot.owned = std::move(owned);
        slot.status = Status::Ok();
        slot.served.store(m);
      }
    }
    if (owned) {
      Discard(slot, std::move(owned));
      NotifySettled(slot);
      return;
    }
    const ModelConfig& c = m->config();
    spdlog::info("model {} version {}: {} on {}, {} workers{}", c.name, c.version, c.backend,
                 m->device.ToString(), m->worker_count,
                 slot.failed_attempts > 0
                     ? ", served after " + std::to_string(slot.failed_attempts + 1) + " attempts"
                     : "");
    // The workers that settled before `published` was set did not notify.
    if (m->AllSettled()) NotifySettled(slot);
  }

  ServerOptions options_;
  std::string run_dir_;
  bool made_run_dir_ = false;
  // Held by Start() while it makes the run directory, the slots and the
  // builders, and by Shutdown() from the moment it has set stopping_.
  std::mutex lifecycle_mu_;
  // Fixed once Start() has listed the repository.
  std::map<std::string, std::unique_ptr<ModelSlot>> slots_;
  static constexpr size_t kMaxBuilders = 8;
  std::vector<std::thread> builders_;
  // Models due for an attempt, by when (guarded by events_mu_).
  std::multimap<Clock::time_point, ModelSlot*> build_queue_;
  std::mutex stores_mu_;
  std::map<std::string, RunningStore> stores_;
  // Start()'s wait for the models to settle, and the builders' waits for
  // work; stopping_ ends both.
  mutable std::mutex events_mu_;
  std::condition_variable events_cv_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> started_{false}, shut_down_{false};
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Create(ServerOptions options) {
  if (options.worker_path.empty() || ::access(options.worker_path.c_str(), X_OK) != 0)
    return NotFound("worker executable '" + options.worker_path + "' not found");
  return std::unique_ptr<Server>(new Server(std::make_unique<Impl>(std::move(options))));
}

Status Server::Start() { return impl_->Start(); }
void Server::Shutdown() { impl_->Shutdown(); }
bool Server::Live() const { return impl_->Live(); }
bool Server::Ready() const { return impl_->Ready(); }
std::string Server::ServerVersion() const { return "0.1.0"; }
std::vector<std::string> Server::Extensions() const { return {"binary_tensor_data"}; }
Result<ModelMetadata> Server::Metadata(const std::string& m, const std::string& v) const {
  return impl_->Metadata(m, v);
}
Result<bool> Server::ModelReady(const std::string& m, const std::string& v) const {
  return impl_->ModelReady(m, v);
}
void Server::Infer(InferRequest r, std::function<void(Result<InferResponse>)> done) {
  impl_->Infer(std::move(r), std::move(done));
}
std::vector<int> Server::WorkerPids(const std::string& model) const {
  return impl_->WorkerPids(model);
}
std::string Server::MetricsText() const { return impl_->MetricsText(); }

}  // namespace hearth
