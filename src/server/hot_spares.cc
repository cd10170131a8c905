#include "server/hot_spares.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>

#include "server/batch_layout.h"
#include "server/model_runtime.h"
#include "server/stream_runner.h"
#include "server/supervisor.h"
#include "server/worker_exchange.h"

namespace hearth {
namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The warm-up batch's one request: one row (where the model batches), each
// required input zeros of its dtype and shape, a variable dimension as 1, a BYTES
// element empty (its 4-byte length 0); every output asked for.
Result<std::shared_ptr<Job>> WarmUpJob(const ModelRuntime& model) {
  auto job = std::make_shared<Job>();
  job->request.model = model.name;
  job->request.id = "hot-spare-warm-up";
  job->done = [](const Result<InferResponse>&) {};
  // Optional inputs are left out, unless all are optional: then the first
  // is given (a model of optional inputs wants one of them).
  bool all_optional = true;
  for (const TensorSpec& spec : model.inputs) all_optional &= model.IsOptionalInput(spec.name);
  bool given_one = false;
  for (const TensorSpec& spec : model.inputs) {
    if (model.IsOptionalInput(spec.name) && !(all_optional && !given_one)) continue;
    given_one = true;
    std::vector<int64_t> shape;
    if (model.batching()) shape.push_back(1);
    for (int64_t d : spec.dims) shape.push_back(d < 0 ? 1 : d);
    // BYTES: 4 bytes (a zero length) an element.
    const std::optional<uint64_t> bytes =
        TensorBytes(spec.dtype == DType::kBytes ? DType::kI32 : spec.dtype, shape);
    if (!bytes.has_value() || *bytes > kMaxSlotBytes)
      return InvalidArgument("input " + Describe(spec) + " is too large for a warm-up batch");
    job->request.inputs.emplace_back(spec.name, spec.dtype, std::move(shape),
                                     std::vector<std::byte>(*bytes));
  }
  return job;
}

// Clears the keeper's record of the spare being started as it goes out of
// scope (before the spare itself, declared earlier, is destroyed).
class StartingScope {
 public:
  StartingScope(std::mutex& mu, WorkerProcess*& starting) : mu_(mu), starting_(starting) {}
  ~StartingScope() {
    std::lock_guard lock(mu_);
    starting_ = nullptr;
  }
  StartingScope(const StartingScope&) = delete;
  StartingScope& operator=(const StartingScope&) = delete;

 private:
  std::mutex& mu_;
  WorkerProcess*& starting_;
};

}  // namespace

Result<std::unique_ptr<HotSpareKeeper>> HotSpareKeeper::Create(ModelRuntime& model,
                                                               ModelPlacement& placement,
                                                               const ServerOptions& options) {
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) return ErrnoError("eventfd for the keeper of the hot spares", errno);
  return std::unique_ptr<HotSpareKeeper>(
      new HotSpareKeeper(model, placement, options, std::move(wake)));
}

HotSpareKeeper::~HotSpareKeeper() {
  Stop();
  Join();
}

Status HotSpareKeeper::Start() {
  std::lock_guard lock(mu_);
  if (started_ || stopping_) return Status::Ok();
  RETURN_IF_ERROR(model_.StartThread(
      thread_, finished_, [this] { Loop(); }, "the keeper of the hot spares"));
  started_ = true;
  return Status::Ok();
}

void HotSpareKeeper::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    if (starting_ != nullptr) starting_->Kill();
  }
  Wake();
}

void HotSpareKeeper::Join() {
  if (thread_.joinable()) thread_.join();
}

void HotSpareKeeper::Wake() {
  const uint64_t one = 1;
  // Only EAGAIN can fail it (the counter at its maximum): it is readable then.
  (void)!::write(wake_.get(), &one, sizeof one);
}

bool HotSpareKeeper::stopping() const {
  std::lock_guard lock(mu_);
  return stopping_ || model_.stopping.load();
}

std::unique_ptr<HotSpare> HotSpareKeeper::Take() {
  std::unique_ptr<HotSpare> spare;
  {
    std::lock_guard lock(mu_);
    if (stopping_ || model_.stopping.load() || ready_.empty()) return nullptr;
    // The oldest: the longest warm.
    spare = std::move(ready_.front());
    ready_.erase(ready_.begin());
  }
  takeovers_ += 1;
  failures_ = 0;  // it was of use: the next one starts at once
  Wake();
  return spare;
}

int HotSpareKeeper::ready_count() const {
  std::lock_guard lock(mu_);
  return static_cast<int>(ready_.size());
}

uint64_t HotSpareKeeper::device_memory_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t bytes = 0;
  for (const auto& s : ready_) bytes += s->ready.ready.device_memory_bytes;
  return bytes;
}

std::vector<HotSpareInfo> HotSpareKeeper::Describe() const {
  std::lock_guard lock(mu_);
  std::vector<HotSpareInfo> out;
  for (const auto& s : ready_)
    out.push_back({s->process.pid(), s->ready.ready.device_memory_bytes, s->warm_up_us});
  return out;
}

void HotSpareKeeper::Loop() {
  const size_t want = static_cast<size_t>(std::max(0, model_.config().standby_workers));
  Clock::time_point next_start = Clock::now();
  auto back_off = [&](const std::string& what) {
    const auto wait = RestartBackoff(failures_.fetch_add(1) + 2);
    next_start = Clock::now() + wait;
    spdlog::warn("{}: {}; another in {} ms", model_.name, what, wait.count());
  };
  for (;;) {
    // What to watch: the wake-up, and each ready spare's socket, on which
    // a spare that waits says nothing (end-of-file: it died).
    std::vector<pollfd> fds = {{wake_.get(), POLLIN, 0}};
    std::vector<const HotSpare*> watched;
    {
      std::lock_guard lock(mu_);
      if (stopping_ || model_.stopping.load()) break;
      for (const auto& s : ready_) {
        fds.push_back({s->control.get(), POLLIN | POLLRDHUP, 0});
        watched.push_back(s.get());
      }
    }
    const bool short_of_spares = watched.size() < want;
    const auto now = Clock::now();
    // A spare taken since the last failure clears the back-off (Take).
    if (short_of_spares && (now >= next_start || failures_.load() == 0)) {
      if (Status made = MakeOne(); !made.ok() && !stopping()) back_off(made.message());
      continue;
    }
    int timeout_ms = -1;
    if (short_of_spares)
      timeout_ms =
          static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(next_start - now).count());
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0 && errno != EINTR) {
      spdlog::error("{}: the keeper of the hot spares on {} cannot wait: {}", model_.name,
                    placement_.device_name, std::strerror(errno));
      break;
    }
    if (fds[0].revents != 0) {
      uint64_t count = 0;
      (void)!::read(wake_.get(), &count, sizeof count);
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      std::unique_ptr<HotSpare> gone;
      {
        // Unless it was taken meanwhile (its socket is then its
        // supervisor's, and nothing of the keeper's).
        std::lock_guard lock(mu_);
        auto it = std::find_if(ready_.begin(), ready_.end(),
                               [&](const auto& s) { return s.get() == watched[i - 1]; });
        if (it == ready_.end()) continue;
        gone = std::move(*it);
        ready_.erase(it);
      }
      const pid_t pid = gone->process.pid();
      // One that spoke unasked is killed, as a worker that does is.
      const int status = gone->process.Reap(true);
      if (!stopping())
        back_off("the hot spare (pid " + std::to_string(pid) + ") on " + placement_.device_name +
                 " died while it waited (" + DescribeExit(status) + ")");
    }
  }
  // Released: each spare's socket closed, its process killed and reaped.
  std::vector<std::unique_ptr<HotSpare>> left;
  {
    std::lock_guard lock(mu_);
    left.swap(ready_);
  }
}

Status HotSpareKeeper::MakeOne() {
  auto spare = std::make_unique<HotSpare>();
  const auto started = Clock::now();
  if (Status s = StartHotSpareProcess(model_, placement_, options_, spare->process, spare->slot,
                                      &spare->control);
      !s.ok()) {
    return s.WithContext("a hot spare could not be started on " + placement_.device_name);
  }
  const pid_t pid = spare->process.pid();
  const std::string which =
      "the hot spare (pid " + std::to_string(pid) + ") on " + placement_.device_name;
  {
    std::lock_guard lock(mu_);
    // Stopped meanwhile: `spare` is killed and reaped on return.
    if (stopping_) return Status::Ok();
    starting_ = &spare->process;
  }
  const StartingScope starting(mu_, starting_);
  Result<control::Message> ready =
      control::ReceiveKind(spare->control.get(), options_.ready_timeout_ms,
                           {control::Kind::kReady, control::Kind::kDone});
  Status accepted = Status::Ok();
  if (ready.ok() && ready->kind == control::Kind::kReady)
    accepted = model_.AcceptSignature(ready->ready.inputs, ready->ready.outputs);
  if (!ready.ok() || ready->kind != control::Kind::kReady || !accepted.ok()) {
    std::string why = !ready.ok()                           ? ready.status().message()
                      : ready->kind == control::Kind::kDone ? ready->done.text
                                                            : accepted.message();
    if (!ready.ok() && ready.status().code() == StatusCode::kDeadlineExceeded)
      why = "no ready message within " + std::to_string(options_.ready_timeout_ms) + " ms";
    const int status = spare->process.Reap(true);
    if (stopping()) return Status::Ok();
    return Unavailable(which + " failed to start: " + why + " (" + DescribeExit(status) + ")");
  }
  spare->ready = std::move(*ready);
  if (Status warm = WarmUp(*spare); !warm.ok()) {
    const int status = spare->process.Reap(true);
    if (stopping()) return Status::Ok();
    return Unavailable(which + " " + warm.message() + " (" + DescribeExit(status) + ")");
  }
  const uint64_t device_memory = spare->ready.ready.device_memory_bytes;
  const uint64_t warm_up_us = spare->warm_up_us;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return Status::Ok();
    ready_.push_back(std::move(spare));
  }
  spdlog::info(
      "{}: hot spare ready on {}: pid {} in {:.0f} ms, its warm-up batch in {:.1f} ms ({} MiB of "
      "its own device buffers)",
      model_.name, placement_.device_name, pid, Ms(Clock::now() - started), warm_up_us / 1e3,
      device_memory >> 20);
  return Status::Ok();
}

Status HotSpareKeeper::WarmUp(HotSpare& spare) {
  auto kept = [&](const std::string& why) {
    spdlog::warn("{}: the warm-up batch of the hot spare (pid {}) on {} failed: {}; it is kept",
                 model_.name, spare.process.pid(), placement_.device_name, why);
    return Status::Ok();
  };
  auto lost = [](const std::string& what) { return Unavailable(what + " in its warm-up batch"); };
  Result<std::shared_ptr<Job>> job = WarmUpJob(model_);
  if (!job.ok()) return kept(job.status().message());
  if (model_.config().decoupled) return WarmUpStreams(spare, *job);
  const std::vector<std::shared_ptr<Job>> jobs = {*job};
  // As RunBatch lays a batch out, for a worker that says what this one said.
  Result<BatchLayout> laid_out =
      LayOutBatch({model_.inputs, model_.outputs, model_.batching(), model_.config().decoupled},
                  jobs, spare.ready.ready.device_addresses);
  if (!laid_out.ok()) return kept(laid_out.status().message());
  control::Run& run = laid_out->run;
  run.seq = 1;
  if (Status s = spare.slot.Reserve(InitialSlotBytes(run), kMaxSlotBytes); !s.ok())
    return kept(s.message());
  run.slot_bytes = spare.slot.size();
  for (const HostCopy& c : laid_out->host_copies)
    std::memcpy(spare.slot.data() + c.slot_offset, c.bytes.data(), c.bytes.size());

  WorkerExchange exchange(spare.control.get(), spare.slot,
                          OutputSignature{model_.outputs, model_.batching()}, kMaxSlotBytes);
  const auto sent_at = Clock::now();
  if (Status sent = exchange.Send(run); !sent.ok()) {
    // Refused by the encoder: nothing was sent, and the spare is fine.
    if (sent.code() == StatusCode::kInvalidArgument) return kept(sent.message());
    return lost("died (" + sent.message() + ")");
  }
  const Answer answer =
      exchange.AwaitDone(run, sent_at + std::chrono::milliseconds(options_.exec_timeout_ms));
  spare.warm_up_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - sent_at).count());
  switch (answer.ending) {
    case Ending::kAnswered:
      // What execute() makes of zeros says nothing about the process.
      if (answer.done.status_code != 0) return kept(answer.done.text);
      return Status::Ok();
    case Ending::kGone:
      return lost("died");
    case Ending::kTimedOut:
      return lost("ran past --exec-timeout");
    case Ending::kNoRoom:
      return lost("asked for more room than a slot may have (" + answer.why.message() + ")");
    case Ending::kOtherRun:
      return lost("answered another run");
    case Ending::kMalformed:
      return lost("sent a malformed answer (" + answer.why.message() + ")");
  }
  return lost("ended in an unknown way");
}

// A decoupled model's spare: given its stream ring (which the supervisor
// that adopts it keeps), then one stream of zeros, cancelled at its first
// response (or answered with the model's error, which says nothing about
// the process).
Status HotSpareKeeper::WarmUpStreams(HotSpare& spare, const std::shared_ptr<Job>& job) {
  const pid_t pid = spare.process.pid();
  auto lost = [](const std::string& what) { return Unavailable(what + " in its warm-up stream"); };
  const StreamModel model = StreamModelOf(model_);
  // Not the model's: a warm-up counts nothing, and nothing of it is retried.
  ModelStats stats;
  JobQueue retries(1);
  StreamRunner runner(model, spare.control.get(), spare.slot, spare.ready.ready.streams,
                      kMaxSlotBytes, stats, retries);
  if (!runner.Begin()) return lost(runner.why());
  spare.ring = runner.ring();
  Status answered = Status::Ok();
  job->request.on_response = [](const InferResponse&) { return false; };
  job->done = [&answered](Result<InferResponse> r) { answered = r.status(); };
  const auto sent_at = Clock::now();
  const auto deadline = sent_at + std::chrono::milliseconds(options_.exec_timeout_ms);
  if (!runner.Open(job)) return lost(runner.why());
  while (runner.in_flight() > 0) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return lost("ran past --exec-timeout");
    if (!runner.Pump(static_cast<int>(left))) return lost(runner.why());
  }
  spare.warm_up_us = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - sent_at).count());
  // Cancelled at its first response: Unavailable, as a client gone.
  if (!answered.ok() && answered.code() != StatusCode::kUnavailable)
    spdlog::warn("{}: the warm-up stream of the hot spare (pid {}) on {} failed: {}; it is kept",
                 model_.name, pid, placement_.device_name, answered.message());
  return Status::Ok();
}

}  // namespace hearth
