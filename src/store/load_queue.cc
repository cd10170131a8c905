#include "store/load_queue.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <utility>

namespace hearth::store {
namespace {

// `hearth load` requests running at once (each holds a thread and its
// staging buffers); more wait their turn in kMaxWaitingLoads.
constexpr size_t kMaxConcurrentLoads = 4;
// Loads asked for while kMaxConcurrentLoads run, kept in the order asked;
// past this many a load is answered RESOURCE_EXHAUSTED.
constexpr size_t kMaxWaitingLoads = 256;

}  // namespace

LoadQueue::LoadQueue(Device device, int threads) : device_(device), threads_(threads) {}

LoadQueue::~LoadQueue() {
  cancel_ = true;
  for (auto& [id, t] : running_) t.join();
}

Status LoadQueue::Init() {
  done_fd_.Reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!done_fd_) return ErrnoError("creating the event loop", errno);
  return Status::Ok();
}

Status LoadQueue::Submit(uint64_t connection_id, LoadJob job) {
  if (running_.size() >= kMaxConcurrentLoads) {
    if (waiting_.size() >= kMaxWaitingLoads)
      return ResourceExhausted(std::to_string(running_.size()) + " loads are running and " +
                               std::to_string(waiting_.size()) +
                               " waiting; try again when one has finished");
    waiting_.push_back({connection_id, std::move(job)});
    return Status::Ok();
  }
  Start(connection_id, std::move(job));
  return Status::Ok();
}

namespace {

// Opens the checkpoint and reads it, unless its files are those the job
// may reuse.
void Run(LoadDone& done, Device device, const LoadOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const protocol::LoadRequest& req = done.job.request;
  Result<Checkpoint> checkpoint = Checkpoint::Open(req.path);
  if (!checkpoint.ok()) {
    done.status = checkpoint.status();
    return;
  }
  if (!done.job.reuse_fingerprint.empty() &&
      checkpoint->Fingerprint() == done.job.reuse_fingerprint) {
    done.unchanged = true;
    return;
  }
  if (req.reuse_only) {
    done.status = FailedPrecondition(req.path + " has changed since version " +
                                     std::to_string(req.reuse_version) + " of " + req.name +
                                     " was loaded from it (reuse_only: nothing loaded)");
    return;
  }
  Result<LoadedModel> loaded = LoadCheckpoint(*checkpoint, device, options);
  if (!loaded.ok()) {
    done.status = loaded.status();
    return;
  }
  done.loaded = std::move(loaded).value();
  done.loaded.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void LoadQueue::Start(uint64_t connection_id, LoadJob job) {
  if (job.reuse_fingerprint.empty())
    spdlog::info("loading {} from {}", job.request.name, job.request.path);
  else
    spdlog::info("loading {} from {} unless its files are those of version {}", job.request.name,
                 job.request.path, job.request.reuse_version);
  const Device device = device_;
  const int threads = threads_;
  const uint64_t load_id = next_load_id_++;
  running_.emplace(load_id, std::thread([this, load_id, connection_id, job = std::move(job), device,
                                         threads]() mutable {
                     LoadOptions load;
                     load.threads = threads;
                     load.cancel = &cancel_;
                     LoadDone done;
                     done.load_id = load_id;
                     done.connection_id = connection_id;
                     done.job = std::move(job);
                     Run(done, device, load);
                     {
                       std::lock_guard lock(mu_);
                       done_.push_back(std::move(done));
                     }
                     const uint64_t one = 1;
                     [[maybe_unused]] ssize_t n = ::write(done_fd_.get(), &one, sizeof one);
                   }));
}

std::vector<LoadDone> LoadQueue::TakeFinished() {
  uint64_t count;
  [[maybe_unused]] ssize_t n = ::read(done_fd_.get(), &count, sizeof count);
  std::vector<LoadDone> done;
  {
    std::lock_guard lock(mu_);
    done.swap(done_);
  }
  for (const LoadDone& d : done) {
    if (auto t = running_.find(d.load_id); t != running_.end()) {
      t->second.join();
      running_.erase(t);
    }
  }
  return done;
}

void LoadQueue::StartWaiting(const std::function<bool(uint64_t)>& connected) {
  while (running_.size() < kMaxConcurrentLoads && !waiting_.empty()) {
    WaitingLoad w = std::move(waiting_.front());
    waiting_.pop_front();
    if (connected(w.connection_id)) Start(w.connection_id, std::move(w.job));
  }
}

}  // namespace hearth::store
