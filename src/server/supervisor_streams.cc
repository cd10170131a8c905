// A decoupled model's worker under its supervisor: streams (server/stream_runner.h).
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "server/model_runtime.h"
#include "server/stream_runner.h"
#include "server/supervisor.h"

namespace hearth {

namespace {
// While streams are in flight, how often their clients' cancellations
// (set from other threads) are looked at when the worker says nothing.
constexpr int kCancelCheckMs = 200;

int MillisUntil(Clock::time_point t, Clock::time_point now) {
  if (t == Clock::time_point::max()) return INT_MAX;
  if (t <= now) return 0;
  const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
  return static_cast<int>(std::min<int64_t>(ms, INT_MAX));
}
}  // namespace

bool WorkerSupervisor::FewestStreams(uint64_t mine) const {
  for (const auto& w : model_.workers)
    if (w.get() != this && w->ready() && w->streams_in_flight() < mine) return false;
  return true;
}

StreamModel StreamModelOf(const ModelRuntime& m) {
  StreamModel model;
  model.name = m.name;
  model.version = std::to_string(m.config().version);
  model.inputs = m.inputs;
  model.outputs = m.outputs;
  model.batching = m.batching();
  for (const TensorSpec& in : m.inputs) model.optional.push_back(m.IsOptionalInput(in.name));
  for (size_t i = 0; i < m.outputs.size(); ++i) {
    if (m.outputs[i].name != "token_ids" || m.outputs[i].dtype != DType::kI64) continue;
    model.counted_tokens = static_cast<int>(i);
    if (m.config().resumable) model.token_ids = static_cast<int>(i);
  }
  return model;
}

bool WorkerSupervisor::ServeStreams(int control, const control::Ready& ready,
                                    std::optional<control::Ring> ring, std::string* death,
                                    bool* answered) {
  const StreamModel model = StreamModelOf(model_);
  StreamRunner runner(model, control, slot_, ready.streams, kMaxSlotBytes, model_.stats,
                      *model_.queue);
  const pid_t pid = process_.pid();
  const auto lost = [&](const std::string& what) {
    *death = what;
    spdlog::warn("{} worker {} (pid {}) {} with {} streams in flight", model_.name, index_, pid,
                 what, runner.in_flight());
    runner.Abandon(what);
    streams_in_flight_ = 0;
    kv_blocks_used_ = 0;
    kv_blocks_total_ = 0;
    return false;
  };
  if (!runner.Begin(ring)) return lost(runner.why());
  UniqueFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake.valid()) {
    spdlog::error("{} worker {}: no eventfd ({}); its streams are taken one wake-up at a time",
                  model_.name, index_, std::strerror(errno));
  } else {
    model_.queue->AddWaker(wake.get());
  }
  struct Unwatch {
    JobQueue& queue;
    int fd;
    ~Unwatch() {
      if (fd >= 0) queue.RemoveWaker(fd);
    }
  } unwatch{*model_.queue, wake.valid() ? wake.get() : -1};

  for (;;) {
    ReapDying(false);
    // A failed placement's worker takes no new stream while another
    // placement serves; those it holds go on.
    const bool held_back =
        placement_.health.failed() && !model_.stopping && model_.ServedElsewhere(placement_);
    bool drained = false;  // the queue is closed and empty
    while (!held_back && runner.has_room()) {
      const uint64_t mine = runner.in_flight();
      if (mine > 0 && !FewestStreams(mine)) break;
      std::vector<std::shared_ptr<Job>> jobs =
          model_.queue->PopBatch(model_.policy, std::chrono::milliseconds(mine == 0 ? 100 : 0));
      if (jobs.empty()) {
        drained = model_.stopping && model_.queue->closed() && model_.queue->size() == 0;
        break;
      }
      const auto now = Clock::now();
      for (const auto& job : jobs) {
        if (job->request.cancelled && job->request.cancelled->load()) {
          job->done(Unavailable("request '" + job->request.id +
                                "' was cancelled before it ran: its client went away"));
          continue;
        }
        model_.stats.queue_us += static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::microseconds>(now - job->received).count());
        if (!runner.Open(job)) return lost(runner.why());
      }
      streams_in_flight_ = runner.in_flight();
    }
    streams_in_flight_ = runner.in_flight();
    if (runner.in_flight() == 0) {
      if (drained || (model_.stopping && model_.queue->closed() && model_.queue->size() == 0))
        return true;
      // Idle: a worker that died (or spoke unasked) is replaced now.
      pollfd p{control, POLLIN, 0};
      if (::poll(&p, 1, held_back ? 100 : 0) > 0) {
        if (!runner.Pump(0)) return lost(runner.why() == "died" ? "died while idle" : runner.why());
        kv_blocks_used_ = runner.engine_stats().kv_blocks_used;
        kv_blocks_total_ = runner.engine_stats().kv_blocks_total;
      } else if (life_ && life_->dead()) {
        return lost("died while idle");
      }
      continue;
    }
    // Streams in flight: wait for the worker, new work, a deadline, or the
    // next look at cancellations.
    const auto now = Clock::now();
    int timeout = std::min(kCancelCheckMs, MillisUntil(runner.NextDeadline(), now));
    if (options_.exec_timeout_ms > 0) {
      const auto hung_at =
          runner.last_heard() + std::chrono::milliseconds(options_.exec_timeout_ms);
      if (now >= hung_at)
        return lost("said nothing for --exec-timeout (" + std::to_string(options_.exec_timeout_ms) +
                    " ms)");
      timeout = std::min(timeout, MillisUntil(hung_at, now));
    }
    pollfd fds[2] = {{control, POLLIN, 0}, {wake.valid() ? wake.get() : -1, POLLIN, 0}};
    const int n = ::poll(fds, 2, timeout);
    if (n < 0 && errno != EINTR) return lost("could not be waited for");
    if (n > 0 && (fds[1].revents & POLLIN) != 0) {
      uint64_t count = 0;
      (void)!::read(wake.get(), &count, sizeof count);
    }
    // Its death, known from its life lock, once what it sent before is read.
    if ((n <= 0 || fds[0].revents == 0) && life_ && life_->dead()) return lost("died");
    if (n > 0 && fds[0].revents != 0) {
      if (!runner.Pump(0)) return lost(runner.why());
      streams_in_flight_ = runner.in_flight();
      kv_blocks_used_ = runner.engine_stats().kv_blocks_used;
      kv_blocks_total_ = runner.engine_stats().kv_blocks_total;
      if (!*answered && runner.responses() > 0) {
        *answered = true;
        NoteAnswered(false);
      }
    }
    if (!runner.CancelOver(Clock::now())) return lost(runner.why());
  }
}

}  // namespace hearth
