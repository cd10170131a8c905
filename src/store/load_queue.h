// Loads asked for over the socket (`hearth load`): each runs on a thread of
// its own, a few at once; more wait their turn in the order asked. The event
// loop learns that loads have finished when fd() becomes readable, and
// registers what they loaded itself.
//
// Threading: the event loop's thread, except Cancel(), which any thread may
// call. The destructor cancels what runs and joins it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hearth/device.h"
#include "hearth/status.h"
#include "hearth/unique_fd.h"
#include "protocol/messages.h"
#include "store/loader.h"

namespace hearth::store {

// A load asked for over the socket.
struct LoadJob {
  protocol::LoadRequest request;
  bool v2 = false;  // asked with load-v2, answered with loaded-v2
  // Of the files request.reuse_version was read from, when the store holds
  // that version and read it from request.path; empty: nothing to reuse.
  std::string reuse_fingerprint;
};

struct LoadDone {
  uint64_t load_id = 0;
  uint64_t connection_id = 0;
  LoadJob job;
  // What it came to: the files opened have job.reuse_fingerprint (nothing
  // was read: `unchanged`), or `loaded` holds what was read, or `status`
  // says why neither.
  Status status;
  bool unchanged = false;
  LoadedModel loaded;
};

class LoadQueue {
 public:
  // Loads onto `device` with `threads` reader threads each (0 = automatic).
  LoadQueue(Device device, int threads);
  ~LoadQueue();
  LoadQueue(const LoadQueue&) = delete;
  LoadQueue& operator=(const LoadQueue&) = delete;

  Status Init();
  // Readable when loads have finished (TakeFinished).
  int fd() const { return done_fd_.get(); }

  // Starts the load for the connection, or queues it when enough run;
  // RESOURCE_EXHAUSTED, and nothing queued, when too many wait already. The
  // checkpoint is opened first; when its fingerprint is
  // job.reuse_fingerprint it is not read (LoadDone::unchanged), nor when it
  // is not and the request is reuse_only (FAILED_PRECONDITION).
  Status Submit(uint64_t connection_id, LoadJob job);

  // The loads that have finished since the last call, their threads joined.
  std::vector<LoadDone> TakeFinished();

  // Starts what waited while there is room, skipping loads whose client has
  // gone (`connected` says which are still there).
  void StartWaiting(const std::function<bool(uint64_t connection_id)>& connected);

  // The loaders check the flag between blocks; a load started after it fails
  // before reading, so waiting loads are answered as their turn comes.
  void Cancel() { cancel_ = true; }

 private:
  void Start(uint64_t connection_id, LoadJob job);

  const Device device_;
  const int threads_;
  UniqueFd done_fd_;
  std::atomic<bool> cancel_{false};
  std::mutex mu_;
  std::vector<LoadDone> done_;  // guarded by mu_
  uint64_t next_load_id_ = 1;
  std::map<uint64_t, std::thread> running_;
  struct WaitingLoad {
    uint64_t connection_id;
    LoadJob job;
  };
  std::deque<WaitingLoad> waiting_;  // in the order asked
};

}  // namespace hearth::store
