#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <system_error>

#include "common/checked_size.h"
#include "common/float16.h"
#include "server/batch_layout.h"
#include "server/crash_retry.h"
#include "server/model_runtime.h"
#include "server/response_assembly.h"

namespace hearth {

Status WorkerSupervisor::Init() {
  ASSIGN_OR_RETURN(slot_, RequestSlot::Create("hearth-slot-" + model_.name));
  return Status::Ok();
}

Status WorkerSupervisor::Start() {
  return model_.StartThread(
      thread_, finished_, [this] { Loop(); }, "a worker's supervisor thread");
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
  // The last first start may have failed, after other workers were ready
  // (whose Replenish found the model not yet settled).
  if (all && model_.config().standby_hot && model_.ready_workers.load() > 0)
    model_.StartHotSpareKeepers();
}

namespace {

// hearth-worker's arguments for a worker of `model` on `placement` (a
// zygote's: the first placement's, which it never attaches).
std::vector<std::string> WorkerArguments(const ModelRuntime& model, const ModelPlacement& placement,
                                         const ServerOptions& options, bool standby) {
  const ModelConfig& c = model.config();
  std::vector<std::string> args = {options.worker_path,
                                   "--store-socket",
                                   placement.store_socket,
                                   "--model",
                                   c.name,
                                   "--version",
                                   std::to_string(placement.store_version),
                                   "--backend",
                                   c.backend,
                                   "--max-batch",
                                   std::to_string(model.max_batch()),
                                   "--control-fd",
                                   "3",
                                   "--slot-fd",
                                   "4",
                                   "--parent-pid",
                                   std::to_string(::getpid())};
  // The device: a standby's hint, and where a worker that attaches no
  // weights (a backend: python model without them) learns it.
  args.insert(args.end(), {"--device", placement.memory.ToString()});
  if (standby) args.push_back("--standby");
  if (c.allow_tf32) args.push_back("--allow-tf32");
  if (!c.fault_kind.empty()) {
    char value[64];
    std::snprintf(value, sizeof value, "%.17g", c.fault_on_value);
    args.insert(args.end(), {"--fault-kind", c.fault_kind, "--fault-on-value", value});
  }
  return args;
}

// A fresh slot and control socketpair for one process, its setup queued on
// the server's end (`mine`) before the process starts: never put in argv
// (whose size is limited, and which any local user can read in /proc). A
// fresh slot for each process: whatever an earlier one did to its slot
// (grown it, say) goes with it.
Status OpenChannel(const ModelRuntime& model, RequestSlot& slot, UniqueFd* mine, UniqueFd* theirs) {
  ASSIGN_OR_RETURN(slot, RequestSlot::Create("hearth-slot-" + model.name));
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return ErrnoError("socketpair", errno);
  mine->Reset(sv[0]);
  theirs->Reset(sv[1]);
  return control::SendSetup(mine->get(), model.setup).WithContext(model.config().config_path);
}

// Starts a worker process of `model` on `placement` (attached to the copy of
// the weights in that device's store) with exactly five descriptors: 0-2 (the
// server's stdio), 3 (control) and 4 (slot): forked from the model's zygote
// where it has one, else exec'd. A standby waits after its setup for kStart.
Status StartWorkerProcess(const ModelRuntime& model, const ModelPlacement& placement,
                          const ServerOptions& options, bool standby, WorkerProcess& process,
                          RequestSlot& slot, UniqueFd* control) {
  const std::vector<std::string> args = WorkerArguments(model, placement, options, standby);
  UniqueFd mine, theirs;
  if (model.zygote != nullptr) {
    RETURN_IF_ERROR(OpenChannel(model, slot, &mine, &theirs));
    auto forked = model.zygote->Fork({args.begin() + 1, args.end()}, theirs.get(), slot.fd());
    Status adopted = forked.ok() ? process.AdoptChild(*forked) : forked.status();
    if (adopted.ok()) {
      *control = std::move(mine);
      return Status::Ok();
    }
    if (forked.ok()) {
      // Not ours to kill by pid: closing its socket makes it exit, and it
      // is reaped as an orphan if it is this process's child at all.
      spdlog::warn("{}: a worker forked from the zygote (pid {}) cannot be adopted: {}", model.name,
                   *forked, adopted.message());
    } else if (adopted.code() != StatusCode::kUnavailable) {
      spdlog::warn("{}: {}; exec'ing a worker instead", model.name, adopted.message());
    }
    if (model.stopping) return Unavailable("model '" + model.name + "' stops");
    // A forked process may hold `theirs`: the exec'd one gets a channel of its own.
  }
  RETURN_IF_ERROR(OpenChannel(model, slot, &mine, &theirs));
  RETURN_IF_ERROR(process.Spawn(args, theirs.get(), slot.fd()));
  *control = std::move(mine);
  return Status::Ok();
}

}  // namespace

std::unique_ptr<WorkerZygote> MakeZygote(const ModelRuntime& model, const ServerOptions& options) {
  const ModelConfig& c = model.config();
  if (!c.zygote || c.backend != "python" || model.placements.empty()) return nullptr;
  // Its arguments are taken now: it starts while the stores load the
  // weights (and attaches none, so the version they get to does not matter
  // to it).
  std::vector<std::string> args = WorkerArguments(model, *model.placements.front(), options, false);
  args.push_back("--zygote");
  auto start = [&model, args = std::move(args)](WorkerProcess& process, UniqueFd* control) {
    RequestSlot slot;
    UniqueFd mine, theirs;
    RETURN_IF_ERROR(OpenChannel(model, slot, &mine, &theirs));
    RETURN_IF_ERROR(process.Spawn(args, theirs.get(), slot.fd()));
    *control = std::move(mine);
    return Status::Ok();
  };
  return std::make_unique<WorkerZygote>(model.name, start,
                                        std::chrono::milliseconds(options.ready_timeout_ms));
}

Status StartHotSpareProcess(const ModelRuntime& model, const ModelPlacement& placement,
                            const ServerOptions& options, WorkerProcess& process, RequestSlot& slot,
                            UniqueFd* control) {
  return StartWorkerProcess(model, placement, options, false, process, slot, control);
}

Status WorkerSupervisor::Spawn(UniqueFd* control, std::optional<control::Message>* adopted,
                               std::optional<control::Ring>* ring) {
  if (placement_.hot_spares != nullptr) {
    // A spare that died since it was ready is found so by Loop, as any
    // worker that dies: reaped, and this supervisor starts another.
    if (std::unique_ptr<HotSpare> spare = placement_.hot_spares->Take()) {
      const pid_t pid = spare->process.pid();
      Status taken = process_.Adopt(spare->process);
      if (taken.ok()) {
        slot_ = std::move(spare->slot);
        *control = std::move(spare->control);
        *adopted = std::move(spare->ready);
        *ring = spare->ring;
        spdlog::info("{} worker {}: the hot spare (pid {}) takes over", model_.name, index_, pid);
        return Status::Ok();
      }
      spdlog::warn("{} worker {}: the hot spare (pid {}) could not take over ({})", model_.name,
                   index_, pid, taken.message());
    }
  }
  if (std::unique_ptr<StandbyWorker> standby = model_.TakeStandby(placement_)) {
    // A standby that died while it waited fails the send (or, dying after
    // it, is seen as a worker that died starting); either way it is reaped
    // with `standby`, and a fresh process is started.
    const pid_t pid = standby->process.pid();
    Status sent = control::SendStart(standby->control.get());
    if (sent.ok()) sent = process_.Adopt(standby->process);
    if (sent.ok()) {
      slot_ = std::move(standby->slot);
      *control = std::move(standby->control);
      spdlog::debug("{} worker {}: the standby worker (pid {}) takes over", model_.name, index_,
                    pid);
      return Status::Ok();
    }
    spdlog::warn(
        "{} worker {}: the standby worker (pid {}) could not take over ({}); starting "
        "a fresh one",
        model_.name, index_, pid, sent.message());
  }
  return StartWorkerProcess(model_, placement_, options_, false, process_, slot_, control);
}

void WorkerSupervisor::Replenish() {
  const int want = model_.config().standby_workers;
  if (want <= 0 || !model_.AllSettled()) return;
  if (model_.config().standby_hot) {
    model_.StartHotSpareKeepers();
    return;
  }
  std::lock_guard lock(placement_.standby_mu);
  while (!model_.stopping && static_cast<int>(placement_.standbys.size()) < want) {
    auto s = std::make_unique<StandbyWorker>();
    if (Status started = StartWorkerProcess(model_, placement_, options_, true, s->process, s->slot,
                                            &s->control);
        !started.ok()) {
      // Not fatal: a worker that dies is then started afresh, as without standbys.
      spdlog::warn("{}: a standby worker could not be started: {}", model_.name, started.message());
      return;
    }
    spdlog::debug("{}: standby worker started: pid {}", model_.name, s->process.pid());
    placement_.standbys.push_back(std::move(s));
  }
}

namespace {

uint64_t Since(Clock::time_point t) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count());
}

}  // namespace

// More than a worker keeps open (WorkerSession::kMaxOpenRegions).
constexpr size_t kMaxNamedRegions = 512;

bool WorkerSupervisor::ReleaseRegionsIfUnregistered(WorkerExchange& exchange) {
  if (model_.shared_memory == nullptr) return true;
  // Nothing to look at unless a region was unregistered since the last
  // look, or a batch named one that already was (UnregisterCuda flags
  // before it counts).
  const uint64_t now = model_.shared_memory->CudaUnregistrations();
  if (now == told_unregistrations_ && !look_at_named_) return true;
  told_unregistrations_ = now;
  look_at_named_ = false;
  if (named_regions_.size() > kMaxNamedRegions) {
    // Past what the worker keeps open, it has closed some itself: all
    // closed, tracking starts again from none.
    named_regions_.clear();
    return exchange.Release().ok();
  }
  std::vector<uint64_t> gone;
  for (auto it = named_regions_.begin(); it != named_regions_.end();) {
    if (it->second->unregistered.load()) {
      gone.push_back(it->first);
      it = named_regions_.erase(it);
    } else {
      ++it;
    }
  }
  return gone.empty() || exchange.Release(gone).ok();
}

bool WorkerSupervisor::RunBatch(WorkerExchange& exchange,
                                const std::vector<std::shared_ptr<Job>>& popped) {
  // A run names at most so many CUDA regions and copies: the requests past
  // them go back to the front of the queue, in order, for the next batch.
  const size_t fit = JobsThatFit(popped, kMaxSlotBytes);
  for (size_t k = popped.size(); k > fit; --k) model_.queue->PushFront(popped[k - 1]);
  const std::vector<std::shared_ptr<Job>> jobs(popped.begin(),
                                               popped.begin() + static_cast<std::ptrdiff_t>(fit));
  const auto dispatched = Clock::now();
  for (const auto& job : jobs)
    model_.stats.queue_us += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(dispatched - job->received).count());
  const bool batching = model_.batching();
  int64_t rows = 0;
  for (const auto& job : jobs) rows += job->batch;
  auto fail_all = [&](const Status& why) {
    for (const auto& job : jobs) job->done(why);
  };

  Result<BatchLayout> laid_out =
      LayOutBatch({model_.inputs, model_.outputs, batching, model_.config().decoupled}, jobs,
                  device_addresses_);
  if (!laid_out.ok()) {
    fail_all(laid_out.status().WithContext("model '" + model_.name + "'"));
    return true;
  }
  BatchLayout& layout = *laid_out;
  control::Run& run = layout.run;
  run.seq = ++seq_;
  if (Status s = slot_.Reserve(InitialSlotBytes(run), kMaxSlotBytes); !s.ok()) {
    fail_all(s.WithContext("model '" + model_.name + "'"));
    return true;
  }
  run.slot_bytes = slot_.size();

  // The one copy of each input on the host: from the request (a view into
  // the HTTP body for binary inputs, decoded bytes for JSON) into the slot.
  // Inputs in CUDA regions keep their room but are the worker's to copy.
  for (const HostCopy& c : layout.host_copies)
    std::memcpy(slot_.data() + c.slot_offset, c.bytes.data(), c.bytes.size());
  const uint64_t input_us = Since(dispatched);
  model_.stats.input_us += input_us;

  const auto handed_over = Clock::now();
  // One deadline for the whole batch, however many times the slot grows.
  const auto deadline = handed_over + std::chrono::milliseconds(options_.exec_timeout_ms);
  // A worker that died before it got this batch (killed while idle, say) did
  // not die of it: its requests go back as they were, not counted as a crash.
  auto requeue_unharmed = [&] {
    spdlog::warn("{} worker {} (pid {}) was gone before it got a batch of {} requests", model_.name,
                 index_, process_.pid(), jobs.size());
    for (auto it = jobs.rbegin(); it != jobs.rend(); ++it) model_.queue->PushFront(*it);
    return false;
  };
  const Status sent = exchange.Send(run);
  // What the worker may now keep open (session.h).
  if (sent.ok() && !run.regions.empty()) {
    auto named = [&](const std::shared_ptr<const CudaSharedMemoryEntry>& entry) {
      named_regions_.emplace(entry->id, entry);
      look_at_named_ =
          look_at_named_ || entry->unregistered.load() || named_regions_.size() > kMaxNamedRegions;
    };
    for (const auto& job : jobs) {
      for (const InferTensor& in : job->request.inputs)
        if (in.shm && in.shm->cuda) named(in.shm->cuda);
      for (const RequestedOutput& o : job->request.outputs)
        if (o.shm && o.shm->cuda) named(o.shm->cuda);
    }
  }
  if (!sent.ok() && sent.code() == StatusCode::kUnavailable) return requeue_unharmed();
  if (!sent.ok() && sent.code() == StatusCode::kInvalidArgument) {
    // Refused by the encoder (over a message's limits), so nothing was
    // sent: the batch fails, not the worker.
    fail_all(sent.WithContext("model '" + model_.name + "'"));
    return true;
  }
  const Answer answer = sent.ok() ? exchange.AwaitDone(run, deadline) : Answer::Failed(sent);
  if (answer.ending == Ending::kNoRoom) {
    spdlog::warn("{} worker {}: {}", model_.name, index_, answer.why.message());
    fail_all(answer.why.WithContext("model '" + model_.name + "': the outputs"));
    return false;  // it waits for room that will not come: replace it
  }
  if (answer.ending != Ending::kAnswered) {
    const std::string what =
        answer.ending == Ending::kTimedOut ? "ran past --exec-timeout"
        : answer.ending == Ending::kGone
            ? "died"
            : "sent a malformed answer (" +
                  (answer.ending == Ending::kMalformed ? answer.why.message()
                   : answer.done.text.empty()          ? std::string("wrong sequence number")
                                              : "it refused the batch: " + answer.done.text) +
                  ")";
    spdlog::warn("{} worker {} (pid {}) {} while running a batch of {} rows from {} requests",
                 model_.name, index_, process_.pid(), what, rows, jobs.size());
    // Back to the front in their order; each now runs alone (PopBatch).
    for (auto it = jobs.rbegin(); it != jobs.rend(); ++it)
      RetryAfterCrash(*it, *model_.queue, model_.name, "poison batch");
    return false;
  }
  const control::Done& d = answer.done;
  model_.stats.exchange_us += Since(handed_over);
  model_.stats.batches += 1;
  model_.stats.CountBatch(rows, input_us, d.run_us, 0);  // before any answer: statistics agree
  model_.stats.rows += static_cast<uint64_t>(rows);
  model_.stats.run_us += d.run_us;
  for (size_t b = 0; b < std::size(ModelStats::kBatchBuckets); ++b) {
    if (rows <= ModelStats::kBatchBuckets[b]) {
      model_.stats.batch_bucket[b] += 1;
      break;
    }
  }
  const auto outputs_start = Clock::now();
  if (d.status_code != 0) {
    const Status why(static_cast<StatusCode>(d.status_code), d.text);
    if (d.retry_alone && jobs.size() > 1) {
      // The inputs caused it: each request runs alone, so that only the
      // ones at fault fail. Not a crash: no poison count.
      for (auto it = jobs.rbegin(); it != jobs.rend(); ++it) {
        (*it)->alone = true;
        model_.queue->PushFront(*it);
      }
      return true;
    }
    fail_all(why);
    return true;
  }
  // The worker's answer is checked like any peer's before a byte is read.
  if (Status checked = exchange.CheckAnswer(run, d, rows); !checked.ok()) {
    spdlog::warn("{} worker {} (pid {}): {}; replacing it", model_.name, index_, process_.pid(),
                 checked.message());
    fail_all(Internal("model '" + model_.name +
                      "': the worker's answer is malformed: " + checked.message()));
    return false;
  }
  // Each response's outputs are views into the slot, borrowed for the
  // duration of `done` (inference_api.h): the slot is written again only by
  // the next batch, which this thread starts after every `done` returned.
  std::vector<int64_t> rows_per_job;
  for (const auto& job : jobs) rows_per_job.push_back(batching ? job->batch : 1);
  std::vector<std::vector<std::span<const std::byte>>> parts;
  for (size_t i = 0; i < model_.outputs.size(); ++i) {
    if (run.output_placed[i]) {
      // Of a fixed size: each share where the layout put it (one in a CUDA
      // region may have no room in the slot, and is never read).
      std::vector<std::span<const std::byte>> shares;
      for (size_t j = 0; j < jobs.size(); ++j) {
        const OutputShare& share = layout.output_shares[j][i];
        if (layout.output_in_cuda[j][i])
          shares.emplace_back();  // answered by its size: layout.output_shares
        else
          shares.emplace_back(slot_.data() + share.slot_offset, share.bytes);
      }
      parts.push_back(std::move(shares));
      continue;
    }
    if (!batching) {
      parts.push_back(
          {std::span<const std::byte>(slot_.data() + d.outputs[i].offset, d.outputs[i].bytes)});
      continue;
    }
    auto split = SplitRows(slot_.data(), d.outputs[i], model_.outputs[i].dtype, rows_per_job);
    if (!split) {
      spdlog::warn("{} worker {} (pid {}): output '{}' changed after it was answered; replacing it",
                   model_.name, index_, process_.pid(), model_.outputs[i].name);
      fail_all(Internal("model '" + model_.name + "': the worker's answer is malformed: output '" +
                        model_.outputs[i].name + "' changed after it was answered"));
      return false;
    }
    parts.push_back(std::move(*split));
  }
  for (size_t j = 0; j < jobs.size(); ++j) {
    const auto& job = jobs[j];
    InferResponse response;
    response.model = model_.name;
    response.version = std::to_string(model_.config().version);
    response.id = job->request.id;
    Status failed = Status::Ok();
    for (size_t i = 0; i < model_.outputs.size(); ++i) {
      const TensorSpec& spec = model_.outputs[i];
      const auto& wanted = job->request.outputs;
      auto asked = std::find_if(wanted.begin(), wanted.end(),
                                [&](const RequestedOutput& o) { return o.name == spec.name; });
      if (!wanted.empty() && asked == wanted.end()) continue;
      InferTensor t;
      t.name = spec.name;
      t.dtype = spec.dtype;
      t.shape = d.outputs[i].shape;
      if (batching) t.shape[0] = job->batch;
      if (layout.output_in_cuda[j][i]) {
        // The worker wrote it into the client's device memory: answered as
        // an output in a region is, and its slot bytes are not read.
        t.shm = SharedMemoryRef{asked->shm->region, asked->shm->offset,
                                layout.output_shares[j][i].bytes};
        response.outputs.push_back(std::move(t));
        continue;
      }
      t.data = TensorData::Borrowed(parts[i][j]);
      if (asked != wanted.end() && asked->class_count > 0) {
        const std::vector<std::string>* labels = nullptr;
        for (const IoConfig& io : model_.config().outputs)
          if (io.name == spec.name && !io.labels.empty()) labels = &io.labels;
        t = Classify(t, asked->class_count, batching, labels);
      }
      if (asked != wanted.end() && asked->shm) {
        Status written = model_.shared_memory != nullptr
                             ? model_.shared_memory->Write(*asked->shm, t.data.bytes())
                             : Unavailable("no shared memory here");
        if (!written.ok()) {
          failed = written.WithContext("output '" + spec.name + "'");
          break;
        }
        t.shm = SharedMemoryRef{asked->shm->region, asked->shm->offset, t.data.size()};
        t.data = TensorData();
      }
      response.outputs.push_back(std::move(t));
    }
    if (!failed.ok()) {
      job->done(failed);
      continue;
    }
    model_.stats.requests += 1;
    model_.stats.request_us += Since(job->received);
    job->done(std::move(response));
  }
  const uint64_t output_us = Since(outputs_start);
  model_.stats.output_us += output_us;
  model_.stats.AddBatchOutput(rows, output_us);
  return true;
}

void WorkerSupervisor::NoteDeath(const std::string& why) {
  if (model_.stopping) return;
  if (placement_.health.OnDeath(Clock::now()) != PlacementHealth::Change::kFailed) return;
  std::string others;
  for (const auto& q : model_.placements)
    if (q.get() != &placement_) others += (others.empty() ? "" : ", ") + q->device_name;
  spdlog::error(
      "model {}: {} has failed: its workers died {} times in a row without answering a batch "
      "(the last: {}); {}",
      model_.name, placement_.device_name, placement_.health.deaths_in_a_row(), why,
      others.empty()
          ? std::string("it has no other placement, so it keeps being retried")
          : "its work goes to " + others + " while they serve, but for a probe batch now and then");
}

void WorkerSupervisor::ReapDying(bool wait) {
  const pid_t pid = dying_.pid();
  if (pid <= 0) return;
  const std::optional<int> status = wait ? std::optional<int>(dying_.Reap(true)) : dying_.TryReap();
  if (status.has_value())
    spdlog::debug("{} worker {}: the process the hot spare replaced (pid {}) {}", model_.name,
                  index_, pid, DescribeExit(*status));
}

void WorkerSupervisor::NoteAnswered(bool probe) {
  placement_.batches += 1;
  if (placement_.health.OnAnswered() == PlacementHealth::Change::kRecovered)
    spdlog::info("model {}: {} serves again ({} answered)", model_.name, placement_.device_name,
                 probe ? "a probe batch was" : "a batch was");
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
    std::optional<control::Message> adopted;  // a hot spare's kReady
    std::optional<control::Ring> ring;        // and its stream ring
    // The start, as the ready line reports it: from before the spawn, so
    // that every phase the worker times lies inside it.
    const auto started = Clock::now();
    if (Status spawned = Spawn(&control, &adopted, &ring); !spawned.ok()) {
      if (model_.published)
        spdlog::error("{} worker {}: {}", model_.name, index_, spawned.ToString());
      {
        std::lock_guard lock(model_.state_mu);
        model_.last_worker_error = "a worker could not be started: " + spawned.message();
      }
      Settle();
      NoteDeath("a worker could not be started: " + spawned.message());
      failures = std::max(failures + 1, 2);  // cannot even start one: wait before trying again
      continue;
    }
    const pid_t pid = process_.pid();
    starting_ = true;
    // RequestStop(true) may have come after the loop's check, and seen no
    // pid to kill yet.
    if (model_.abandoning) {
      process_.Reap(true);
      break;
    }
    // A hot spare said ready (and was accepted) before it was taken: it
    // serves at once.
    Result<control::Message> ready =
        adopted.has_value() ? Result<control::Message>(std::move(*adopted))
                            : control::ReceiveKind(control.get(), options_.ready_timeout_ms,
                                                   {control::Kind::kReady, control::Kind::kDone});
    // What the worker reports is checked against the config and the other
    // workers before it gets any request.
    Status accepted = Status::Ok();
    if (ready.ok() && ready->kind == control::Kind::kReady)
      accepted = model_.AcceptSignature(ready->ready.inputs, ready->ready.outputs);
    if (!ready.ok() || ready->kind != control::Kind::kReady || !accepted.ok()) {
      std::string why = !ready.ok()                           ? ready.status().message()
                        : ready->kind == control::Kind::kDone ? ready->done.text
                                                              : accepted.message();
      if (!ready.ok() && ready.status().code() == StatusCode::kDeadlineExceeded)
        why = "no ready message within " + std::to_string(options_.ready_timeout_ms) + " ms";
      // One that closed its socket, or said why it cannot start, has exited
      // or is exiting: wait for it, to see how. One that hung, said something
      // else, or reported the wrong signature is killed.
      const bool closed = (!ready.ok() && ready.status().code() == StatusCode::kUnavailable) ||
                          (ready.ok() && ready->kind == control::Kind::kDone);
      const int status = process_.Reap(!closed);
      starting_ = false;
      if (model_.stopping) break;
      // A SIGKILL while starting is either from outside (an operator, a
      // test), which says nothing about the worker, or the kernel's OOM
      // killer (a max_batch_size whose buffers do not fit), which will
      // happen again. One is restarted at once, unless the attempt before
      // died starting too: then it counts as a failure like any other (back-off,
      // and the model settles as failed), so that an OOM never respawns in
      // a tight loop.
      // A worker that said why it cannot start is taken at its word, however
      // it then ended (a slow exit is killed after 2 s).
      const bool said_why = ready.ok() && ready->kind == control::Kind::kDone;
      const bool sigkilled =
          closed && !said_why && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      const bool free_retry = sigkilled && !last_died_starting;
      last_died_starting = true;
      // Without the worker's index or pid: the same failure of every worker
      // and every attempt is one reason, logged once by the builder.
      const std::string reason = sigkilled  ? "killed by SIGKILL while starting (out of memory?)"
                                 : said_why ? why
                                            : why + " (" + DescribeExit(status) + ")";
      if (model_.published) {
        spdlog::error("{} worker {} (pid {}) failed to start: {}", model_.name, index_, pid,
                      reason);
      } else {
        spdlog::debug("{} worker {} (pid {}) failed to start: {}", model_.name, index_, pid,
                      reason);
      }
      {
        std::lock_guard lock(model_.state_mu);
        model_.last_worker_error = "a worker failed to start: " + reason;
      }
      if (!free_retry) {
        Settle();
        NoteDeath("a worker failed to start: " + reason);
        ++failures;
      }
      continue;
    }
    last_died_starting = false;
    device_addresses_ = ready->ready.device_addresses;
    // A fresh process has no region open.
    named_regions_.clear();
    look_at_named_ = false;
    if (model_.shared_memory != nullptr)
      told_unregistrations_ = model_.shared_memory->CudaUnregistrations();
    spdlog::info(
        "{} worker {} ready: pid {} on {} in {:.0f} ms ({} MiB of its own device buffers; "
        "placed on {})",
        model_.name, index_, pid, ready->ready.text,
        std::chrono::duration<double, std::milli>(Clock::now() - started).count(),
        ready->ready.device_memory_bytes >> 20, placement_.device_name);
    // A hot spare's phases are counted here, when it takes over, and not
    // when it became ready: a spare that never serves counts no start.
    model_.stats.CountStartPhases(ready->ready.phases);
    ++model_.ready_workers;
    ++placement_.ready_workers;
    ready_ = true;
    starting_ = false;
    device_memory_bytes_ = ready->ready.device_memory_bytes;
    Settle();
    Replenish();
    WorkerExchange exchange(control.get(), slot_,
                            OutputSignature{model_.outputs, model_.batching()}, kMaxSlotBytes);
    // Its death while idle wakes this thread's wait for work (and the other
    // idle workers', which look and wait again).
    std::optional<HangupWatcher::Id> watched;
    if (model_.hangups != nullptr) {
      if (auto id = model_.hangups->Watch(control.get(),
                                          [queue = model_.queue.get()] { queue->Nudge(); });
          id.ok())
        watched = *id;
    }
    life_ = std::make_unique<control::LifeWatch>(slot_.header(), pid,
                                                 [queue = model_.queue.get()] { queue->Nudge(); });
    bool alive = true;
    std::string death = "died while idle";
    if (model_.config().decoupled) {
      bool answered = false;
      alive = ServeStreams(control.get(), ready->ready, ring, &death, &answered);
      if (answered) failures = 0;
    }
    while (alive && !model_.config().decoupled) {
      ReapDying(false);
      // A failed placement's work goes to the model's other placements
      // while one of them serves; its workers wait, but for one probe
      // batch now and then. While stopping, every worker drains the queue.
      bool probe = false;
      if (placement_.health.failed() && !model_.stopping && model_.ServedElsewhere(placement_)) {
        probe = placement_.health.ClaimProbe(Clock::now());
        if (!probe) {
          if (life_->dead() || exchange.GoneWhileIdle(100) ||
              !ReleaseRegionsIfUnregistered(exchange)) {
            spdlog::warn("{} worker {} (pid {}) on {} died while held back", model_.name, index_,
                         pid, placement_.device_name);
            death = "died while held back";
            alive = false;
          }
          continue;
        }
      }
      std::vector<std::shared_ptr<Job>> jobs =
          model_.queue->PopBatch(model_.policy, std::chrono::milliseconds(100));
      if (jobs.empty()) {
        if (probe) placement_.health.ReleaseProbe();
        if (model_.stopping) break;
        // Idle: a worker that died between batches (end-of-file on its
        // control socket) is replaced now, not when the next request finds it.
        if (life_->dead() || exchange.GoneWhileIdle(0) || !ReleaseRegionsIfUnregistered(exchange)) {
          spdlog::warn("{} worker {} (pid {}) died while idle", model_.name, index_, pid);
          alive = false;
        }
        continue;
      }
      // Requests whose clients went away while they waited are not run.
      std::erase_if(jobs, [](const std::shared_ptr<Job>& job) {
        if (!job->request.cancelled || !job->request.cancelled->load()) return false;
        job->done(Unavailable("request '" + job->request.id +
                              "' was cancelled before it ran: its client went away"));
        return true;
      });
      if (jobs.empty()) {
        if (probe) placement_.health.ReleaseProbe();
        continue;
      }
      if (!ReleaseRegionsIfUnregistered(exchange)) {
        // Gone before it got the batch: its requests go back as they were.
        for (auto it = jobs.rbegin(); it != jobs.rend(); ++it) model_.queue->PushFront(*it);
        if (probe) placement_.health.ReleaseProbe();
        spdlog::warn("{} worker {} (pid {}) was gone before it got a batch", model_.name, index_,
                     pid);
        alive = false;
        death = "died while idle";
        continue;
      }
      alive = RunBatch(exchange, jobs);
      if (alive) {
        failures = 0;
        NoteAnswered(probe);
      } else {
        death = "died serving a batch";
      }
    }
    --placement_.ready_workers;
    --model_.ready_workers;
    ready_ = false;
    if (watched) model_.hangups->Forget(*watched, control.get());
    life_.reset();
    control.Reset();  // end-of-file: a live worker exits by itself
    if (alive) {
      process_.Reap(false);
      break;  // queue closed: shutting down
    }
    ++restarts_;
    ++failures;
    ReapDying(true);  // an earlier death not yet reaped
    // With a hot spare ready, it takes over first: the dead process's exit
    // (with a CUDA context, the driver's teardown of it) is waited for
    // while the spare serves, not before.
    if (placement_.hot_spares != nullptr && placement_.hot_spares->ready_count() > 0 &&
        dying_.Adopt(process_).ok()) {
      dying_.Kill();
      // Counted now, before the spare answers anything (its exit status is
      // logged once reaped).
      NoteDeath("a worker " + death);
      continue;
    }
    const int status = process_.Reap(true);
    NoteDeath("a worker " + death + " (" + DescribeExit(status) + ")");
  }
  ReapDying(true);
  // Once the runtime stops (shutdown, or a repository load or unload retired
  // it) and no worker of it is left serving, what is still queued (a
  // request put back after its worker died) would wait for ever: answered.
  if (model_.stopping && model_.ready_workers.load() == 0)
    model_.queue->FailAll(
        Unavailable("model '" + model_.name +
                    "': its workers stopped before this request could run (the "
                    "server is stopping, or the model was reloaded or unloaded)"));
  // A runtime retired by a repository load lives on (a few bytes); the
  // slot, which may be large, goes with the last worker.
  slot_ = RequestSlot();
}

}  // namespace hearth
