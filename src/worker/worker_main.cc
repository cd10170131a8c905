// hearth-worker: exec'd by `hearth serve`, never forked from it. Attaches one
// model version read-only, builds its backend, maps its request slot, says
// ready, then runs whatever batch the server puts in the slot, until the
// server goes away (end-of-file on the control socket, or PR_SET_PDEATHSIG).
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "hearth/attach.h"
#include "worker/control.h"

namespace hearth {
namespace {

struct WorkerArgs {
  std::string store_socket, model, backend;
  uint64_t version = 0;
  int max_batch = 1;
  bool allow_tf32 = false;
  int control_fd = -1, slot_fd = -1;
  std::string fault_kind;
  double fault_on_value = 0;
  uint64_t slot_bytes = 0;
};

// Fault injection (tests only; off unless the model config asks): fail the
// way a buggy model would when any F32 input element equals the trigger.
// abort, segv and hang happen here; cuda_illegal_address queues a faulting
// kernel, so that the batch's Run meets a sticky CUDA error (an error here
// means the backend cannot inject it).
Status MaybeInjectFault(const WorkerArgs& a, Backend& backend, const control::SlotLayout& layout,
                        const std::vector<const void*>& inputs, int64_t batch) {
  if (a.fault_kind.empty()) return Status::Ok();
  const std::vector<IoSpec>& specs = backend.inputs();
  const float trigger = static_cast<float>(a.fault_on_value);
  bool hit = false;
  for (size_t i = 0; i < specs.size() && !hit; ++i) {
    if (specs[i].dtype != DType::kF32) continue;
    const auto* x = static_cast<const float*>(inputs[i]);
    const uint64_t n = layout.input_bytes_per_sample[i] / 4 * static_cast<uint64_t>(batch);
    for (uint64_t k = 0; k < n && !hit; ++k) hit = x[k] == trigger;
  }
  if (!hit) return Status::Ok();
  std::fprintf(stderr, "hearth-worker %d: fault injection: %s\n", ::getpid(), a.fault_kind.c_str());
  if (a.fault_kind == "abort") std::abort();
  if (a.fault_kind == "segv") ::raise(SIGSEGV);
  if (a.fault_kind == "hang") {
    for (;;) ::pause();
  }
  if (a.fault_kind == "cuda_illegal_address") return backend.InjectDeviceFault();
  return Status::Ok();
}

int Die(int control_fd, const Status& s) {
  std::fprintf(stderr, "hearth-worker %d: %s\n", ::getpid(), s.ToString().c_str());
  if (control_fd >= 0) {
    control::Message m;
    m.kind = control::Kind::kDone;
    m.status_code = static_cast<uint32_t>(s.code());
    m.text = s.message();
    (void)control::Send(control_fd, m);
  }
  return 1;
}

int Serve(const WorkerArgs& a) {
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() == 1) return 1;
  // A trimmed CUDA context: 326 instead of 524 MiB on an H200. The driver
  // still grows the stack for a kernel that needs more.
  ::setenv("HEARTH_CUDA_STACK_SIZE", "256", 0);

  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count());
  };
  // The parameters were queued on the control socket before this process
  // was started: they are config-sized, and argv is no place for them.
  auto parameters = control::ReceiveParameters(a.control_fd, 10000);
  if (!parameters.ok())
    return Die(a.control_fd, parameters.status().WithContext("reading the model's parameters"));
  auto t = Clock::now();
  auto attachment = AttachClient(a.store_socket).Attach(a.model, a.version);
  const std::string attach_ms = ms_since(t);
  if (!attachment.ok()) return Die(a.control_fd, attachment.status());
  BackendOptions options;
  options.max_batch_size = a.max_batch;
  options.allow_tf32 = a.allow_tf32;
  options.parameters = std::move(parameters).value();
  t = Clock::now();
  auto backend =
      CreateBackend(a.backend, (*attachment)->tensors(), (*attachment)->device(), options);
  const std::string backend_ms = ms_since(t);
  if (!backend.ok()) return Die(a.control_fd, backend.status());

  std::vector<control::SlotTensor> in_tensors, out_tensors;
  for (const IoSpec& s : (*backend)->inputs()) {
    auto bytes = s.bytes_per_sample();
    if (!bytes.ok()) return Die(a.control_fd, bytes.status().WithContext("input"));
    in_tensors.push_back({s.name, *bytes});
  }
  for (const IoSpec& s : (*backend)->outputs()) {
    auto bytes = s.bytes_per_sample();
    if (!bytes.ok()) return Die(a.control_fd, bytes.status().WithContext("output"));
    out_tensors.push_back({s.name, *bytes});
  }
  auto made = control::SlotLayout::Make(in_tensors, out_tensors, a.max_batch);
  if (!made.ok()) return Die(a.control_fd, made.status());
  const control::SlotLayout layout = std::move(made).value();
  if (layout.total > a.slot_bytes)
    return Die(a.control_fd, InvalidArgument("slot of " + std::to_string(a.slot_bytes) +
                                             " bytes is smaller than the " +
                                             std::to_string(layout.total) + " this model needs"));
  void* slot = ::mmap(nullptr, a.slot_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, a.slot_fd, 0);
  if (slot == MAP_FAILED) return Die(a.control_fd, ErrnoError("mapping the request slot", errno));
  ::close(a.slot_fd);
  const Device device = (*attachment)->device();
  t = Clock::now();
  if (Status s = RegisterHostMemory(device, slot, a.slot_bytes); !s.ok())
    return Die(a.control_fd, s);
  const std::string register_ms = ms_since(t);

  auto* base = static_cast<std::byte*>(slot);
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (uint64_t off : layout.input_offsets) inputs.push_back(base + off);
  for (uint64_t off : layout.output_offsets) outputs.push_back(base + off);

  control::Message ready;
  ready.kind = control::Kind::kReady;
  ready.device_memory_bytes = (*backend)->device_memory_bytes();
  // Where start-up time went: attach (on a GPU, includes creating the context),
  // backend (streams, cuBLASLt, buffers), registering the slot.
  ready.text = device.ToString() + " (attach " + attach_ms + " ms, backend " + backend_ms +
               " ms, slot " + register_ms + " ms)";
  if (!control::Send(a.control_fd, ready).ok()) return 1;

  for (;;) {
    auto m = control::Receive(a.control_fd, -1);
    if (!m.ok()) return m.status().code() == StatusCode::kUnavailable ? 0 : Die(-1, m.status());
    if (m->kind != control::Kind::kRun)
      return Die(a.control_fd, InvalidArgument("unexpected control message"));
    control::Message done;
    done.kind = control::Kind::kDone;
    done.seq = m->seq;
    done.batch = m->batch;
    const auto started = std::chrono::steady_clock::now();
    Status s = m->batch < 1 || m->batch > a.max_batch
                   ? InvalidArgument("batch " + std::to_string(m->batch) + " outside [1, " +
                                     std::to_string(a.max_batch) + "]")
                   : MaybeInjectFault(a, **backend, layout, inputs, m->batch);
    if (s.ok()) s = (*backend)->Run(m->batch, inputs, outputs);
    if (s.code() == StatusCode::kDeviceLost) {
      // The context is poisoned: no later batch could run here. Leaving
      // without an answer makes the server treat the batch as a crash (rerun
      // elsewhere, poison after repeated crashes) and start a fresh worker.
      std::fprintf(stderr, "hearth-worker %d: %s; exiting\n", ::getpid(), s.ToString().c_str());
      std::fflush(stderr);
      ::_exit(3);
    }
    done.run_us = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                            std::chrono::steady_clock::now() - started)
                                            .count());
    if (!s.ok()) {
      done.status_code = static_cast<uint32_t>(s.code());
      done.text = s.message();
    }
    if (!control::Send(a.control_fd, done).ok()) return 0;
  }
}

}  // namespace
}  // namespace hearth

int main(int argc, char** argv) {
  hearth::WorkerArgs a;
  CLI::App app{
      "hearth-worker: runs one model on weights attached from a store (started by hearth serve)"};
  app.add_option("--store-socket", a.store_socket)->required();
  app.add_option("--model", a.model)->required();
  app.add_option("--version", a.version);
  app.add_option("--backend", a.backend)->required();
  app.add_option("--max-batch", a.max_batch)->required();
  app.add_flag("--allow-tf32", a.allow_tf32);
  app.add_option("--control-fd", a.control_fd)->required();
  app.add_option("--slot-fd", a.slot_fd)->required();
  app.add_option("--slot-bytes", a.slot_bytes)->required();
  app.add_option("--fault-kind", a.fault_kind);
  app.add_option("--fault-on-value", a.fault_on_value);
  CLI11_PARSE(app, argc, argv);
  return hearth::Serve(a);
}
