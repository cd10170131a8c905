#include "store/load_queue.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
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

Status LoadQueue::Submit(uint64_t connection_id, protocol::LoadRequest request) {
  if (running_.size() >= kMaxConcurrentLoads) {
    if (waiting_.size() >= kMaxWaitingLoads)
      return ResourceExhausted(std::to_string(running_.size()) + " loads are running and " +
                               std::to_string(waiting_.size()) +
                               " waiting; try again when one has finished");
    waiting_.push_back({connection_id, std::move(request)});
    return Status::Ok();
  }
  Start(connection_id, std::move(request));
  return Status::Ok();
}

void LoadQueue::Start(uint64_t connection_id, protocol::LoadRequest req) {
  spdlog::info("loading {} from {}", req.name, req.path);
  const Device device = device_;
  const int threads = threads_;
  const uint64_t load_id = next_load_id_++;
  running_.emplace(
      load_id, std::thread([this, load_id, connection_id, req = std::move(req), device, threads] {
        LoadOptions load;
        load.threads = threads;
        load.cancel = &cancel_;
        Result<LoadedModel> result = LoadCheckpoint(req.path, device, load);
        {
          std::lock_guard lock(mu_);
          done_.push_back({load_id, connection_id, req.name, req.path, std::move(result)});
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
    if (connected(w.connection_id)) Start(w.connection_id, std::move(w.request));
  }
}

}  // namespace hearth::store
