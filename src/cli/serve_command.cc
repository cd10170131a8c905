// `hearth serve`: a model repository served over KServe v2 REST and gRPC,
// until SIGTERM or SIGINT drains it.
#include <dirent.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "cli/cli_common.h"
#include "cli/commands.h"
#ifdef HEARTH_HAVE_GRPC
#include "grpc/kserve_grpc_server.h"
#endif
#include "http/http_server.h"
#include "server/server.h"

namespace hearth::cli {
namespace {

// How long `hearth serve` waits for the server to stop once the front-ends
// have drained.
constexpr std::chrono::seconds kShutdownGrace{5};
// How long it waits, of that, for a model loader blocked in the kernel.
constexpr std::chrono::milliseconds kBuilderGrace{1000};

// The run directory the server made, once it has: an exit without
// Shutdown removes it (its stores, which die with this process, leave their
// sockets in it).
std::mutex g_run_dir_mu;
std::string g_run_dir;

// Leaves the process at once, `why` logged, the run directory removed:
// nothing else is waited for.
[[noreturn]] void ExitNow(const std::string& why, int code) {
  spdlog::error("hearth serve: {}", why);
  {
    std::lock_guard lock(g_run_dir_mu);
    std::error_code ec;
    if (!g_run_dir.empty()) std::filesystem::remove_all(g_run_dir, ec);
  }
  spdlog::default_logger()->flush();
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

std::string ExecutableDir() {
  char path[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return ".";
  path[n] = '\0';
  std::string s(path);
  return s.substr(0, s.rfind('/'));
}

// Raises the soft descriptor limit (toward the hard one) to what the HTTP
// front-end's connections and reserve need on top of the descriptors open now
// (the store, the workers). Where the hard limit is lower, HttpServer::Start
// serves fewer connections and says why.
void RaiseDescriptorLimitFor(const HttpOptions& options) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
  rlim_t open = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(dir)) open += entry->d_name[0] != '.' ? 1 : 0;
    ::closedir(dir);
  }
  const rlim_t wanted = open + static_cast<rlim_t>(options.max_connections) +
                        static_cast<rlim_t>(options.reserved_descriptors);
  if (rl.rlim_cur >= wanted) return;
  const rlim_t raised = rl.rlim_max == RLIM_INFINITY ? wanted : std::min(rl.rlim_max, wanted);
  if (raised <= rl.rlim_cur) return;
  const rlim_t before = rl.rlim_cur;
  rl.rlim_cur = raised;
  if (::setrlimit(RLIMIT_NOFILE, &rl) == 0) {
    spdlog::info(
        "raised the soft descriptor limit (RLIMIT_NOFILE) from {} to {} for {} HTTP "
        "connections",
        before, raised, options.max_connections);
  }
}

// `hearth serve`'s gRPC front-end: port -1 is off (and the only choice of a
// hearth built without gRPC).
struct GrpcSettings {
  int port = -1;
  uint64_t max_message_bytes = uint64_t{64} << 20;
  int max_inflight_calls = 1024;
  int max_connections = 1024;
  double streams_per_second = 100000;
  double resets_per_second = 200;
};

int RunServe(const std::string& repository, const std::string& device_text, int workers,
             int stand_in_gpus, int load_threads, int exec_timeout_ms, bool strict_readiness,
             const std::string& shared_memory_users, HttpOptions http_options,
             const GrpcSettings& grpc) {
  // SIGTERM and SIGINT stay blocked in every thread (threads inherit the mask)
  // and are taken by sigwait below, whichever thread the kernel would have
  // picked; workers get an empty mask at spawn. First of all: probing for a
  // GPU starts the CUDA driver's threads, which must inherit the mask too
  // (one that did not would take a SIGTERM and end the process there).
  signal(SIGPIPE, SIG_IGN);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  // This process's CUDA context (its stores' arenas) runs no kernel: a small
  // per-thread stack shrinks it, from 524 to 326 MiB on an H200. Set before
  // anything touches CUDA; a value in the environment wins.
  ::setenv("HEARTH_CUDA_STACK_SIZE", "256", 0);
  ServerOptions options;
  options.repository = repository;
  options.workers = workers;
  options.exec_timeout_ms = exec_timeout_ms;
  options.strict_readiness = strict_readiness;
  if (!shared_memory_users.empty()) {
    Result<std::vector<uid_t>> users = ParseUsers(shared_memory_users);
    if (!users.ok()) return Fail(users.status());
    options.shared_memory_users = std::move(*users);
  }
  options.worker_path = ExecutableDir() + "/hearth-worker";
  // options.run_dir stays empty: the server makes itself a private one (0700, mkdtemp).
  options.stand_in_gpus = stand_in_gpus;
  options.load_threads = load_threads;
  if (stand_in_gpus > 0) {
    // Host memory stands in for the GPUs: CUDA is never asked.
    Result<Device> device = device_text.empty() ? Device::Cuda(0) : Device::Parse(device_text);
    if (!device.ok()) return Fail(device.status());
    if (!device->is_cuda())
      return Fail(InvalidArgument(
          "--stand-in-gpus stands in for GPUs: give --device cuda:N (the default GPU) or leave "
          "--device out, not --device " +
          device_text));
    if (device->index >= stand_in_gpus)
      return Fail(InvalidArgument("--device " + device->ToString() + " is not one of the " +
                                  std::to_string(stand_in_gpus) + " --stand-in-gpus"));
    spdlog::warn(
        "--stand-in-gpus {}: host memory stands in for GPUs 0 to {} (for tests: no GPU is used)",
        stand_in_gpus, stand_in_gpus - 1);
    options.device = *device;
  } else if (device_text.empty()) {
    std::string why;
    if (!CudaAvailable(&why)) spdlog::info("no usable GPU ({}); serving from host memory", why);
    options.device = DefaultDevice();
  } else {
    Result<Device> device = Device::Parse(device_text);
    if (!device.ok()) return Fail(device.status());
    // Asked for by name, a GPU that cannot be had is said so: the models'
    // KIND_GPU groups run on the host in its place, as they do on a machine
    // without GPUs when --device is left out (and CUDA shared memory is
    // still refused by a GPU server's own rules).
    std::string why;
    if (device->is_cuda() && !CudaAvailable(&why))
      spdlog::warn("--device {}: no usable GPU ({}); KIND_GPU instance groups run on the host",
                   device_text, why);
    options.device = *device;
  }
  auto server = Server::Create(options);
  if (!server.ok()) return Fail(server.status());
  auto http = HttpServer::Create(server->get(), http_options);
  if (!http.ok()) return Fail(http.status());
#ifdef HEARTH_HAVE_GRPC
  std::unique_ptr<GrpcServer> grpc_server;
  if (grpc.port >= 0) {
    GrpcOptions grpc_options;
    grpc_options.host = http_options.host;
    grpc_options.port = static_cast<uint16_t>(grpc.port);
    grpc_options.max_message_bytes = grpc.max_message_bytes;
    grpc_options.max_inflight_calls = grpc.max_inflight_calls;
    grpc_options.max_connections = grpc.max_connections;
    grpc_options.streams_per_second = grpc.streams_per_second;
    grpc_options.resets_per_second = grpc.resets_per_second;
    grpc_options.drain_timeout = http_options.drain_timeout;
    grpc_options.server_name = http_options.server_name;
    auto created = GrpcServer::Create(server->get(), std::move(grpc_options));
    if (!created.ok()) return Fail(created.status());
    grpc_server = std::move(*created);
  }
#else
  if (grpc.port >= 0) return Fail(Unimplemented("this hearth was built without gRPC"));
#endif

  // A signal may come at any time, start-up included (loads, workers that
  // take long to be ready): one thread takes it and wakes this one, which
  // drains HTTP and gRPC, then stops the server (its builders included). A
  // second signal while that goes on exits at once.
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  int stop_signal = 0;          // guarded by stop_mu
  bool models_settled = false;  // guarded by stop_mu
  std::atomic<bool> waiter_quit{false};
  std::thread signal_waiter([&] {
    int number = 0;
    sigwait(&stop_signals, &number);
    if (waiter_quit.load()) return;
    {
      std::lock_guard lock(stop_mu);
      stop_signal = number;
    }
    stop_cv.notify_all();
    sigwait(&stop_signals, &number);
    if (waiter_quit.load()) return;
    ExitNow(std::string(strsignal(number)) + " again while shutting down: exiting now",
            128 + number);
  });
  // Ends the waiter (it takes this signal as one it was not sent).
  auto end_waiter = [&] {
    waiter_quit.store(true);
    pthread_kill(signal_waiter.native_handle(), SIGTERM);
    signal_waiter.join();
  };

  // The HTTP and gRPC addresses are taken first: one in use fails the start
  // before any model begins to load. Clients that connect meanwhile wait in
  // the backlog.
  if (Status s = (*http)->Bind(); !s.ok()) {
    end_waiter();
    return Fail(s);
  }
#ifdef HEARTH_HAVE_GRPC
  if (grpc_server != nullptr) {
    if (Status s = grpc_server->Bind(); !s.ok()) {
      end_waiter();
      return Fail(s);
    }
  }
#endif
  // The models load in the background: the server listens at once, and a
  // model that is slow to load, or whose config takes long to refuse, holds
  // up no other.
  if (Status s = (*server)->Start(); !s.ok()) {
    end_waiter();
    (*server)->Shutdown();
    return Fail(s);
  }
  {
    std::lock_guard lock(g_run_dir_mu);
    g_run_dir = (*server)->RunDirectory();
  }
  RaiseDescriptorLimitFor(http_options);
  if (Status s = (*http)->Start(); !s.ok()) {
    end_waiter();
    (*server)->Shutdown();
    return Fail(s);
  }
#ifdef HEARTH_HAVE_GRPC
  if (grpc_server != nullptr) {
    if (Status s = grpc_server->Start(); !s.ok()) {
      (*http)->Stop();
      end_waiter();
      (*server)->Shutdown();
      return Fail(s);
    }
    spdlog::info("hearth serve: KServe v2 gRPC on {}:{}", http_options.host, grpc_server->port());
  } else {
    spdlog::info("hearth serve: gRPC is off (--grpc-port -1)");
  }
#else
  spdlog::info("hearth serve: this hearth was built without gRPC: serving REST only");
#endif
  spdlog::info("hearth serve listening on http://{}:{}; the models load in the background",
               http_options.host, (*http)->port());
  // The ready line (what scripts wait for) once every model is up or has
  // failed once, or at the ready timeout.
  std::thread settle_waiter([&] {
    (void)(*server)->WaitForModels();  // kUnavailable only once stopping
    {
      std::lock_guard lock(stop_mu);
      models_settled = true;
    }
    stop_cv.notify_all();
  });
  int signal_number = 0;
  {
    std::unique_lock lock(stop_mu);
    stop_cv.wait(lock, [&] { return stop_signal != 0 || models_settled; });
    if (stop_signal == 0) {
      spdlog::info(
          "hearth serve ready on http://{}:{} ({})", http_options.host, (*http)->port(),
          (*server)->Ready() ? "all models ready" : "some models are not ready: see above");
    } else {
      spdlog::info("{} during start-up: stopping", strsignal(stop_signal));
    }
    stop_cv.wait(lock, [&] { return stop_signal != 0; });
    signal_number = stop_signal;
  }
  spdlog::info(
      "{}: shutting down: finishing the requests that have arrived, refusing new ones (a second "
      "signal exits at once)",
      strsignal(signal_number));
  // Drains (no new connections, 503 for requests that arrive now, every
  // connection closed without a reset) before the server stops its workers.
  // gRPC drains at the same time (no new calls; open streams answer what
  // they have read, then end).
  // A request still running past the drain deadline (a worker that hangs,
  // a model with no worker to run it) holds the drain until it is answered:
  // then the server is stopped under it, which answers it (its worker
  // stopped, or the queue closed), and the drain ends.
  std::once_flag shutdown_once;
  bool shut_down = true;
  const auto shutdown = [&] {
    std::call_once(shutdown_once, [&] { shut_down = (*server)->Shutdown(kBuilderGrace); });
    return shut_down;
  };
  std::mutex drained_mu;
  std::condition_variable drained_cv;
  bool drained = false;
  std::thread drain_watch([&] {
    std::unique_lock lock(drained_mu);
    if (drained_cv.wait_for(lock, http_options.drain_timeout + kShutdownGrace,
                            [&] { return drained; }))
      return;
    lock.unlock();
    spdlog::warn(
        "requests are still running {} ms after the signal: killing the workers under them",
        (http_options.drain_timeout + kShutdownGrace).count());
    (*server)->KillWorkers();
    if (!shutdown()) ExitNow("stopped, without the model loaders named above", 0);
  });
#ifdef HEARTH_HAVE_GRPC
  std::thread grpc_stopper([&] {
    if (grpc_server != nullptr) grpc_server->Stop();
  });
  (*http)->Stop();
  grpc_stopper.join();
#else
  (*http)->Stop();
#endif
  {
    std::lock_guard lock(drained_mu);
    drained = true;
  }
  drained_cv.notify_all();
  drain_watch.join();
  // Nothing is served now. What remains (stopping workers and builders,
  // the stores) takes milliseconds. A builder blocked in the kernel reading
  // a model's files (a hung network filesystem) is waited for
  // kBuilderGrace, then left: the server stops its workers and the process
  // exits without it. Anything else that holds the stop past kShutdownGrace
  // is left too, saying so. Workers die with the process (PR_SET_PDEATHSIG).
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(done_mu);
    if (!done_cv.wait_for(lock, kShutdownGrace, [&] { return done; })) {
      ExitNow("the server did not stop within " + std::to_string(kShutdownGrace.count()) +
                  " s of the last request (a model's loader blocked reading its files?): "
                  "exiting without it",
              1);
    }
  });
  if (!shutdown()) ExitNow("stopped, without the model loaders named above", 0);
  {
    std::lock_guard lock(done_mu);
    done = true;
  }
  done_cv.notify_all();
  watchdog.join();
  end_waiter();
  settle_waiter.join();
  return 0;
}

// What the command line sets.
struct ServeFlags {
  std::string repository, host = "127.0.0.1", device;
  int http_port = 8000, workers = 0, exec_timeout_ms = 60000;
  bool strict_readiness = true;
  std::string shared_memory_users;
  GrpcSettings grpc;
  int grpc_port = 8001;
  CLI::Option* grpc_port_option = nullptr;
  int load_threads = 0;
  int stand_in_gpus = 0;
  HttpOptions http;
  int head_timeout_ms = 10000, body_timeout_ms = 10000, idle_timeout_ms = 60000,
      drain_timeout_ms = 20000;
  std::string server_name = "hearth";
};

int RunServeCommand(ServeFlags& f) {
  if (f.http_port < 0 || f.http_port > 65535) {
    return Fail(InvalidArgument("--http-port must be in [0, 65535]"));
  }
  if (f.server_name.empty()) return Fail(InvalidArgument("--server-name must not be empty"));
  f.http.host = f.host;
  f.http.server_name = f.server_name;
  f.http.port = static_cast<uint16_t>(f.http_port);
  f.http.head_timeout = std::chrono::milliseconds(f.head_timeout_ms);
  f.http.body_timeout = std::chrono::milliseconds(f.body_timeout_ms);
  f.http.idle_timeout = std::chrono::milliseconds(f.idle_timeout_ms);
  f.http.drain_timeout = std::chrono::milliseconds(f.drain_timeout_ms);
  // A server asked for any free HTTP port (tests, benchmarks, several
  // servers on one machine) takes any free gRPC port too, unless told one.
  const bool grpc_port_given = f.grpc_port_option->count() > 0;
  if (!grpc_port_given && f.http_port == 0) f.grpc_port = 0;
  if (f.grpc_port < -1 || f.grpc_port > 65535) {
    return Fail(InvalidArgument("--grpc-port must be -1 (no gRPC) or in [0, 65535]"));
  }
#ifdef HEARTH_HAVE_GRPC
  f.grpc.port = f.grpc_port;
#else
  if (grpc_port_given && f.grpc_port != -1) {
    return Fail(Unimplemented(
        "--grpc-port " + std::to_string(f.grpc_port) +
        ": this hearth was built without gRPC (configured with -DHEARTH_GRPC=OFF, or without "
        "grpc++, protobuf, protoc and grpc_cpp_plugin); leave --grpc-port out or pass -1, or "
        "rebuild with Debian's libgrpc++-dev protobuf-compiler-grpc"));
  }
  f.grpc.port = -1;
#endif
  return RunServe(f.repository, f.device, f.workers, f.stand_in_gpus, f.load_threads,
                  f.exec_timeout_ms, f.strict_readiness, f.shared_memory_users, std::move(f.http),
                  f.grpc);
}

}  // namespace

Subcommand AddServeCommand(CLI::App& app) {
  auto* serve =
      app.add_subcommand("serve", "serve a model repository over KServe v2 REST and gRPC");
  auto flags = std::make_shared<ServeFlags>();
  ServeFlags& f = *flags;
  serve
      ->add_option("--model-repository", f.repository,
                   "DIR/<model>/config.yaml and DIR/<model>/<version>/ holding "
                   "model.safetensors, or a sharded checkpoint with "
                   "model.safetensors.index.json")
      ->required();
  serve->add_option("--host", f.host, "address to listen on")->capture_default_str();
  serve->add_option("--http-port", f.http_port, "port (0 = any free port)")->capture_default_str();
  serve
      ->add_option("--server-name", f.server_name,
                   "the name server metadata gives (REST GET /v2, gRPC ServerMetadata)")
      ->capture_default_str();
  serve
      ->add_option("--strict-readiness", f.strict_readiness,
                   "ready (/v2/health/ready, ServerReady) only while every model of the repository "
                   "is served; false: while every served model has a worker ready")
      ->capture_default_str();
  serve->add_option("--shared-memory-users", f.shared_memory_users,
                    "USER[,USER...] (names or uids) whose processes on this machine may register "
                    "shared memory, each only its own objects; 'none' turns shared memory off "
                    "(default: the server's own user)");
  flags->grpc_port_option = serve->add_option(
      "--grpc-port", f.grpc_port,
      "KServe v2 gRPC port (0 = any free port, -1 = no gRPC; default 8001, or 0 when "
      "--http-port is 0)");
  serve
      ->add_option("--grpc-max-message-bytes", f.grpc.max_message_bytes,
                   "larger gRPC messages are refused with RESOURCE_EXHAUSTED; a compressed "
                   "inference message also when it inflates past it (measured as it inflates, "
                   "never inflated whole first)")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{0x7fffffff}));
  serve
      ->add_option("--grpc-max-inflight-calls", f.grpc.max_inflight_calls,
                   "ModelInfer and ModelStreamInfer calls in progress; more are refused with "
                   "RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  serve
      ->add_option("--grpc-max-connections", f.grpc.max_connections,
                   "gRPC connections open at once; more wait in the kernel's backlog")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  serve
      ->add_option("--grpc-streams-per-second", f.grpc.streams_per_second,
                   "calls (HTTP/2 streams) one gRPC connection may open a second; a faster client "
                   "is paced")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e9));
  serve
      ->add_option("--grpc-resets-per-second", f.grpc.resets_per_second,
                   "streams one gRPC connection may reset a second (beyond a burst of twice as "
                   "many); a client resetting faster is closed (HTTP/2 rapid reset)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e9));
  serve->add_option("--device", f.device,
                    "cpu, or cuda[:N]: the default GPU of KIND_GPU instance groups that list no "
                    "gpus (default: cuda if a GPU is usable, else cpu)");
  serve
      ->add_option("--workers", f.workers,
                   "workers per model on each of its devices (per GPU it is placed on), "
                   "overriding instance_group.count")
      ->check(CLI::Range(1, 1024));
  serve
      ->add_option("--load-threads", f.load_threads,
                   "reader threads of each load into a device's store (0 = automatic); a model's "
                   "devices load at once, each with this many")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  // Hidden: for tests and CI on machines without GPUs (docs/architecture.md).
  serve
      ->add_option("--stand-in-gpus", f.stand_in_gpus,
                   "for tests: host memory stands in for N GPUs, each with its own store")
      ->check(CLI::Range(0, 1024))
      ->group("");
  serve
      ->add_option("--exec-timeout-ms", f.exec_timeout_ms,
                   "a batch running longer kills its worker")
      ->capture_default_str()
      ->check(CLI::Range(1, 24 * 3600 * 1000));
  // 2 I/O threads by default: on an H200 machine (16 cores) 8 threads tripled
  // the time a one-at-a-time request spends in the server (43 -> 148 us for
  // the scale model) and did not raise throughput (bench/results/2026-11-30-h200-*).
  serve->add_option("--http-threads", f.http.threads, "HTTP I/O threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  serve->add_option("--max-body-bytes", f.http.max_body_bytes, "larger request bodies get 413")
      ->capture_default_str()
      ->check(AtLeast(1));
  serve
      ->add_option("--max-inflight-bytes", f.http.max_inflight_bytes,
                   "request body bytes held across all connections; a body that would pass it "
                   "waits (one larger than it gets 413)")
      ->capture_default_str()
      ->check(AtLeast(1));
  serve
      ->add_option("--max-connections", f.http.max_connections,
                   "open HTTP connections; more wait in the kernel's backlog (lowered to fit the "
                   "descriptor limit)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  serve
      ->add_option("--reserved-descriptors", f.http.reserved_descriptors,
                   "descriptors never used for connections (worker restarts, the store)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  serve
      ->add_option("--head-timeout-ms", f.head_timeout_ms,
                   "a request head must arrive within this, from its first byte")
      ->capture_default_str()
      ->check(AtLeast(1));
  serve
      ->add_option("--body-timeout-ms", f.body_timeout_ms,
                   "each MiB of a request body must arrive within this")
      ->capture_default_str()
      ->check(AtLeast(1));
  serve
      ->add_option("--idle-timeout-ms", f.idle_timeout_ms,
                   "a kept-alive connection idle this long is closed; also the limit on writing "
                   "one response")
      ->capture_default_str()
      ->check(AtLeast(1));
  serve
      ->add_option("--drain-timeout-ms", f.drain_timeout_ms,
                   "on SIGTERM, how long requests in progress get before connections are closed")
      ->capture_default_str()
      ->check(AtLeast(0));
  return {serve, [flags] { return RunServeCommand(*flags); }};
}

}  // namespace hearth::cli
