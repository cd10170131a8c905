// hearth-worker: exec'd by `hearth serve`, never forked from it. Looks the
// model's backend kind up in the registry; a kind that is its own program
// (backend: python) is exec'd in this process's place with the same
// descriptors and arguments. Otherwise attaches the model version read-only,
// builds its backend, says ready with the backend's inputs and outputs, then
// runs whatever batch the server puts in the slot, until the server goes
// away (end-of-file on the control socket, or PR_SET_PDEATHSIG). A
// decoupled model's kind builds an Engine instead, which serves the
// requests the server opens (worker/engine_loop.h).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "backends/backend.h"
#include "backends/engine.h"
#include "backends/registry.h"
#include "common/proc_stat.h"
#include "hearth/attach.h"
#include "protocol/worker_protocol.h"
#include "worker/engine_loop.h"
#include "worker/session.h"

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
  pid_t parent_pid = 0;  // the server, which started this process
  // A standby: loads what it can without the device, then waits (maybe
  // long) until the server puts it to work.
  bool standby = false;
  // A zygote (backend: python): imports what the model needs, then forks
  // workers on the server's request; only a program-backed kind is one.
  bool zygote = false;
  std::string device;             // a standby's hint: the model's device
  std::vector<std::string> argv;  // as given, for a program-backed kind
};

// Fault injection (tests only; off unless the model config asks): fail the
// way a buggy model would when any F32 input element equals the trigger.
// abort, segv and hang happen here; cuda_illegal_address queues a faulting
// kernel, so that the batch's Run meets a sticky CUDA error (an error here
// means the backend cannot inject it).
Status MaybeInjectFault(const WorkerArgs& a, Backend& backend, const WorkerSession& session) {
  if (a.fault_kind.empty()) return Status::Ok();
  const float trigger = static_cast<float>(a.fault_on_value);
  bool hit = false;
  for (size_t i = 0; i < session.input_count() && !hit; ++i) {
    if (session.inputs()[i].dtype != DType::kF32) continue;
    const std::span<const std::byte> bytes = session.input(i);
    const auto* x = reinterpret_cast<const float*>(bytes.data());
    for (size_t k = 0; k < bytes.size() / 4 && !hit; ++k) hit = x[k] == trigger;
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

// The reason this worker cannot start, to the log and (as kDone) to the server.
int Die(int control_fd, const Status& s) {
  std::fprintf(stderr, "hearth-worker %d: %s\n", ::getpid(), s.ToString().c_str());
  if (control_fd >= 0) {
    // A socket closed with unread messages (the setup, when this comes
    // first) resets the connection, and the server would read that rather
    // than the reason: read them first.
    char drain[256];
    while (::recv(control_fd, drain, sizeof drain, MSG_DONTWAIT | MSG_TRUNC) > 0) {
    }
    control::Done d;
    d.status_code = static_cast<uint32_t>(s.code());
    d.text = s.message();
    (void)control::SendDone(control_fd, d);
  }
  return 1;
}

// Replaces this process with the kind's program; returns only on failure.
int ExecProgram(const WorkerArgs& a, const BackendKind& kind) {
  // The program reads the setup message itself; its parameters are in it,
  // but the interpreter is needed now: read them without consuming the
  // message (MSG_PEEK), so that the program still finds it first.
  BackendOptions options;
  {
    auto peeked = control::PeekSetup(a.control_fd, 10000);
    if (!peeked.ok())
      return Die(a.control_fd, peeked.status().WithContext("reading the model's setup"));
    options.parameters = peeked->parameters;
    options.max_batch_size = a.max_batch;
  }
  auto launch = kind.program(options);
  if (!launch.ok()) return Die(a.control_fd, launch.status());
  for (const std::string& e : launch->env) {
    const size_t eq = e.find('=');
    ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
  }
  std::vector<std::string> args = launch->argv;
  args.insert(args.end(), a.argv.begin() + 1, a.argv.end());
  std::vector<char*> argv;
  for (std::string& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  return Die(a.control_fd, ErrnoError("backend '" + kind.name + "': cannot run " + args[0], errno));
}

// Microseconds from this process's start (the kernel's start time, in clock
// ticks: up to one tick more than it was) to now; nullopt where /proc cannot say.
std::optional<uint64_t> SinceProcessStart() {
  const std::optional<ProcStat> st = ReadProcStat(0);
  if (!st.has_value()) return std::nullopt;
  const long hz = ::sysconf(_SC_CLK_TCK);
  timespec now{};
  if (hz <= 0 || ::clock_gettime(CLOCK_BOOTTIME, &now) != 0) return std::nullopt;
  const double since = static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9 -
                       static_cast<double>(st->start_ticks) / static_cast<double>(hz);
  return since > 0 ? static_cast<uint64_t>(since * 1e6) : 0;
}

int Serve(const WorkerArgs& a) {
  // Dies with the server; and if the server died before that was armed,
  // this process has another parent already: leave. (Not "parent is 1":
  // the server may itself be PID 1, in a container.)
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) return 1;
  if (a.parent_pid > 0 && ::getppid() != a.parent_pid) return 1;
  // One hardware work queue for the worker's CUDA context, whatever runs in
  // it (this process's backend, or the program exec'd next, a zygote's
  // forked workers too) instead of the driver's 8: a worker runs its kernels
  // on one stream, and the driver makes such a context in less time
  // (docs/python-backend.md). A value in the environment wins.
  ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 0);
  const BackendKind* kind = FindBackendKind(a.backend);
  if (kind == nullptr) return Die(a.control_fd, UnknownBackendKind(a.backend));
  if (kind->program) return ExecProgram(a, *kind);
  if (a.zygote)
    return Die(a.control_fd, InvalidArgument("--zygote: backend '" + a.backend +
                                             "' runs inside hearth-worker; only a program "
                                             "backend (python) forks workers from a zygote"));
  // A trimmed CUDA context: 326 instead of 524 MiB on an H200. The driver
  // still grows the stack for a kernel that needs more.
  ::setenv("HEARTH_CUDA_STACK_SIZE", "256", 0);

  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::to_string(
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count());
  };
  Device device = Device::Host();
  SlotHooks hooks;
  hooks.mapped = [&device](void* data, uint64_t bytes) {
    return RegisterHostMemory(device, data, bytes);
  };
  hooks.unmapping = [&device](void* data) { (void)UnregisterHostMemory(device, data); };
  // Up to here: the process, its linking and main.
  const std::optional<uint64_t> exec_us = SinceProcessStart();
  auto phase_start = Clock::now();
  auto opened = WorkerSession::Open(a.control_fd, a.slot_fd, 10000, hooks);
  if (!opened.ok()) return Die(a.control_fd, opened.status());
  WorkerSession& session = **opened;
  // The phases of the start, each from the end of the one before, for the
  // server's metrics (a standby's wait is none of them).
  auto phase = [&](const char* name) {
    const auto now = Clock::now();
    (void)session.AddStartPhase(
        name,
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::microseconds>(now - phase_start).count()));
    phase_start = now;
  };
  if (exec_us.has_value()) (void)session.AddStartPhase("exec", *exec_us);
  phase("setup");
  if (session.decoupled() && !kind->create_engine)
    return Die(a.control_fd,
               FailedPrecondition("the model is decoupled, and backend kind '" + a.backend +
                                  "' has no engine for decoupled models (it answers batches "
                                  "only)"));
  if (!session.decoupled() && !kind->create)
    return Die(a.control_fd,
               FailedPrecondition("backend kind '" + a.backend +
                                  "' serves decoupled models only (model_transaction_policy: "
                                  "{decoupled: true})"));
  // A standby does the host-side loading (libtorch for aoti, the CUDA
  // backend library) and nothing that touches the device, then waits: it
  // holds no context and no device memory until it is put to work.
  std::string standby_ms;
  if (a.standby) {
    const auto t = Clock::now();
    if (kind->preload) kind->preload();
    if (auto hint = Device::Parse(a.device); hint.ok()) PreloadDeviceLibrary(*hint);
    standby_ms = ms_since(t);
    phase("preload");
    if (Status started = session.WaitForStart(); !started.ok()) {
      // The server let it go (it stops, or the model was unloaded): quietly.
      if (started.code() == StatusCode::kUnavailable) return 0;
      return Die(a.control_fd, started);
    }
    phase_start = Clock::now();
  }

  // Loading libtorch beside the attach was measured slower than one after
  // the other (both fault in pages of one address space): in order.
  auto t = Clock::now();
  auto attachment = AttachClient(a.store_socket).Attach(a.model, a.version);
  const std::string attach_ms = ms_since(t);
  if (!attachment.ok()) return Die(a.control_fd, attachment.status());
  phase("attach");
  device = (*attachment)->device();
  EngineOptions options;
  options.max_batch_size = session.max_rows();
  options.allow_tf32 = a.allow_tf32;
  options.parameters = session.setup().parameters;
  options.version_dir = session.setup().version_dir;
  options.inputs = session.setup().inputs;
  options.outputs = session.setup().outputs;
  options.batching = session.batching();
  options.max_streams = session.stream_capacity();
  t = Clock::now();
  Result<std::unique_ptr<Backend>> backend = std::unique_ptr<Backend>();
  Result<std::unique_ptr<Engine>> engine = std::unique_ptr<Engine>();
  if (session.decoupled())
    engine = kind->create_engine((*attachment)->tensors(), device, options);
  else
    backend = kind->create((*attachment)->tensors(), device, options);
  const std::string backend_ms = ms_since(t);
  if (!backend.ok()) return Die(a.control_fd, backend.status());
  if (!engine.ok()) return Die(a.control_fd, engine.status());
  phase("backend");

  // Where start-up time went: attach (on a GPU, includes creating the
  // context) and the backend (streams, cuBLASLt, buffers; libtorch and the
  // package for aoti).
  std::string text =
      device.ToString() + " (attach " + attach_ms + " ms, backend " + backend_ms + " ms";
  if (a.standby) text += "; a standby, loaded " + standby_ms + " ms before";
  text += ")";
  if (session.decoupled()) {
    Engine& e = **engine;
    if (e.capacity() < session.stream_capacity())
      return Die(a.control_fd,
                 FailedPrecondition("backend kind '" + a.backend + "': its engine holds " +
                                    std::to_string(e.capacity()) +
                                    " requests at once, fewer than parameters.max_streams " +
                                    std::to_string(session.stream_capacity())));
    if (Status s = session.Ready(e.inputs(), e.outputs(), e.device_memory_bytes(), text); !s.ok())
      return Die(a.control_fd, s);
    const Status served = ServeStreams(session, e);
    if (served.ok()) return 0;
    if (served.code() == StatusCode::kDeviceLost) {
      // As for a batch (below): the server reruns what it can elsewhere.
      std::fprintf(stderr, "hearth-worker %d: %s; exiting\n", ::getpid(),
                   served.ToString().c_str());
      std::fflush(stderr);
      ::_exit(3);
    }
    return Die(a.control_fd, served);
  }
  Backend& b = **backend;
  if (device.is_cuda() && b.takes_device_addresses())
    if (Status s = session.TakeDeviceAddresses(device.index); !s.ok()) return Die(a.control_fd, s);
  if (Status s = session.Ready(b.inputs(), b.outputs(), b.device_memory_bytes(), text); !s.ok())
    return Die(a.control_fd, s);

  std::vector<const void*> inputs(b.inputs().size());
  std::vector<void*> outputs(b.outputs().size());
  std::vector<int64_t> shape;
  for (;;) {
    auto next = session.Next();
    if (!next.ok() && next.status().code() == StatusCode::kDeviceLost) {
      std::fprintf(stderr, "hearth-worker %d: %s; exiting\n", ::getpid(),
                   next.status().ToString().c_str());
      std::fflush(stderr);
      ::_exit(3);
    }
    if (!next.ok()) return Die(a.control_fd, next.status());
    if (!*next) return 0;
    const int64_t rows = session.rows();
    Status s = MaybeInjectFault(a, b, session);
    for (size_t i = 0; s.ok() && i < inputs.size(); ++i) inputs[i] = session.input_address(i);
    for (size_t i = 0; s.ok() && i < outputs.size(); ++i) {
      const IoSpec& spec = b.outputs()[i];
      shape.clear();
      if (session.batching()) shape.push_back(rows);
      shape.insert(shape.end(), spec.dims.begin(), spec.dims.end());
      auto bytes = control::FixedBytes(spec.dtype, shape, spec.name);
      if (!bytes.ok()) {
        s = bytes.status();
        break;
      }
      auto room = session.Output(i, shape, bytes->value_or(0));
      if (!room.ok()) {
        s = room.status();
        break;
      }
      auto at = session.output_address(i, *room);
      if (!at.ok()) {
        s = at.status();
        break;
      }
      outputs[i] = *at;
    }
    if (s.ok()) s = b.Run(rows, inputs, outputs);
    if (s.code() == StatusCode::kDeviceLost) {
      // The context is poisoned: no later batch could run here. Leaving
      // without an answer makes the server treat the batch as a crash (rerun
      // elsewhere, poison after repeated crashes) and start a fresh worker.
      std::fprintf(stderr, "hearth-worker %d: %s; exiting\n", ::getpid(), s.ToString().c_str());
      std::fflush(stderr);
      ::_exit(3);
    }
    if (Status answered = session.Done(s); !answered.ok()) {
      if (answered.code() != StatusCode::kDeviceLost) return 0;  // the server is gone
      std::fprintf(stderr, "hearth-worker %d: %s; exiting\n", ::getpid(),
                   answered.ToString().c_str());
      std::fflush(stderr);
      ::_exit(3);
    }
  }
}

}  // namespace
}  // namespace hearth

int main(int argc, char** argv) {
  hearth::WorkerArgs a;
  a.argv.assign(argv, argv + argc);
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
  app.add_option("--parent-pid", a.parent_pid, "the server's pid: exit at once if it is gone");
  app.add_flag("--standby", a.standby,
               "load what needs no device, then wait until the server puts this worker to work");
  app.add_option("--device", a.device, "a standby's hint: the model's device");
  app.add_flag("--zygote", a.zygote,
               "(backend: python) import what the model needs, then fork workers on request");
  app.add_option("--fault-kind", a.fault_kind);
  app.add_option("--fault-on-value", a.fault_on_value);
  CLI11_PARSE(app, argc, argv);
  return hearth::Serve(a);
}
