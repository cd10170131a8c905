// `hearth`: the command-line entry point (store, inspect, make-model, and
// the store administration commands list, status, load, unload).
#include <dirent.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "checkpoint/synthetic.h"
#include "cli/cli_common.h"
#include "cli/commands.h"
#include "common/run_together.h"
#ifdef HEARTH_HAVE_GRPC
#include "grpc/kserve_grpc_server.h"
#endif
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "hearth/checksum.h"
#include "hearth/store.h"
#include "http/http_server.h"
#include "loadgen/load_generator.h"
#include "server/server.h"

namespace hearth::cli {
namespace {

std::string TimeText(int64_t unix_ms) {
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  tm local{};
  localtime_r(&t, &local);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

template <typename T>
void PrintTensorTable(const std::vector<T>& tensors) {
  size_t width = 6;
  for (const auto& t : tensors) width = std::max(width, t.name.size());
  std::printf("%-*s  %-7s  %-22s  %14s  %14s\n", static_cast<int>(width), "tensor", "dtype",
              "shape", "offset", "bytes");
  for (const auto& t : tensors) {
    std::printf("%-*s  %-7s  %-22s  %14llu  %14llu\n", static_cast<int>(width), t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.nbytes));
  }
}

// How long `hearth serve` waits for the server to stop once the front-ends
// have drained.
constexpr std::chrono::seconds kShutdownGrace{5};

// Leaves the process at once, `why` logged: nothing else is waited for.
[[noreturn]] void ExitNow(const std::string& why, int code) {
  spdlog::error("hearth serve: {}", why);
  spdlog::default_logger()->flush();
  std::fflush(stdout);
  std::fflush(stderr);
  std::_Exit(code);
}

// ---- hearth serve ---------------------------------------------------------

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

  // The models load in the background: the server listens at once, and a
  // model that is slow to load, or whose config takes long to refuse, holds
  // up no other.
  if (Status s = (*server)->Start(); !s.ok()) {
    end_waiter();
    (*server)->Shutdown();
    return Fail(s);
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
#ifdef HEARTH_HAVE_GRPC
  std::thread grpc_stopper([&] {
    if (grpc_server != nullptr) grpc_server->Stop();
  });
  (*http)->Stop();
  grpc_stopper.join();
#else
  (*http)->Stop();
#endif
  // Nothing is served now. What remains (stopping workers and builders,
  // the stores) takes milliseconds, unless a builder is blocked in the
  // kernel reading a model's files (a hung network filesystem): past
  // kShutdownGrace the process exits without it, saying so. Workers die
  // with it (PR_SET_PDEATHSIG).
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
  (*server)->Shutdown();
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

// ---- hearth inspect --------------------------------------------------------

// A checkpoint's tensors, with the shard each lies in when there are several.
void PrintCheckpointTable(const Checkpoint& ckpt) {
  if (ckpt.shards().size() == 1) return PrintTensorTable(ckpt.tensors());
  size_t width = 6;
  for (const TensorInfo& t : ckpt.tensors()) width = std::max(width, t.name.size());
  std::printf("%-*s  %-7s  %-22s  %14s  %14s  %s\n", static_cast<int>(width), "tensor", "dtype",
              "shape", "offset", "bytes", "shard");
  for (const TensorInfo& t : ckpt.tensors()) {
    std::printf("%-*s  %-7s  %-22s  %14llu  %14llu  %s\n", static_cast<int>(width), t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeString(t.shape).c_str(),
                static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.nbytes), ckpt.shards()[t.shard].name.c_str());
  }
}

int InspectCheckpoint(const std::string& path) {
  Result<Checkpoint> ckpt = Checkpoint::Open(path);
  if (!ckpt.ok()) return Fail(ckpt.status());
  for (const std::string& warning : ckpt->warnings())
    std::fprintf(stderr, "warning: %s\n", warning.c_str());
  std::vector<uint64_t> digests;
  std::vector<std::byte> block;
  for (const TensorInfo& t : ckpt->tensors()) {
    for (uint64_t off = 0; off < t.nbytes; off += kChecksumBlockBytes) {
      block.resize(std::min(kChecksumBlockBytes, t.nbytes - off));
      if (Status s = ckpt->Read(t, off, block); !s.ok()) return Fail(s);
      digests.push_back(BlockDigest(block));
    }
  }
  if (ckpt->is_directory()) std::printf("checkpoint: %s (a directory)\n", path.c_str());
  if (!ckpt->index_path().empty()) {
    std::printf("index: %s\n", ckpt->index_path().c_str());
    for (size_t i = 0; i < ckpt->shards().size(); ++i) {
      const CheckpointFile& shard = ckpt->shards()[i];
      std::printf("shard %zu: %s (%llu tensor%s, %llu bytes)\n", i + 1, shard.name.c_str(),
                  static_cast<unsigned long long>(shard.tensor_count),
                  shard.tensor_count == 1 ? "" : "s", static_cast<unsigned long long>(shard.size));
      for (const auto& [k, v] : shard.metadata)
        std::printf("shard %zu: metadata: %s = %s\n", i + 1, k.c_str(), v.c_str());
    }
  } else {
    std::printf("file: %s\n", ckpt->shards().front().path.c_str());
    for (const auto& [k, v] : ckpt->metadata())
      std::printf("metadata: %s = %s\n", k.c_str(), v.c_str());
  }
  std::printf("tensors: %zu, %llu bytes\n", ckpt->tensors().size(),
              static_cast<unsigned long long>(ckpt->tensor_bytes()));
  PrintCheckpointTable(*ckpt);
  std::printf("checksum: %s\n", ChecksumHex(CombineBlockDigests(digests)).c_str());
  return 0;
}

// Sums the Rss and Pss of this process's mappings of the arena, in KiB.
void PrintMappingMemory(const Attachment& a) {
  if (a.device().is_cuda() || a.tensors().empty()) return;
  const auto base =
      reinterpret_cast<uintptr_t>(a.tensors().front().data) - a.tensors().front().offset;
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (f == nullptr) return;
  char line[512];
  bool in_arena = false;
  unsigned long long rss = 0, pss = 0;
  while (std::fgets(line, sizeof line, f) != nullptr) {
    unsigned long long lo, hi;
    if (std::sscanf(line, "%llx-%llx ", &lo, &hi) == 2 &&
        std::strchr(line, '-') < std::strchr(line, ' ')) {
      in_arena = lo == base;
      continue;
    }
    unsigned long long kb;
    if (in_arena && std::sscanf(line, "Rss: %llu kB", &kb) == 1) rss += kb;
    if (in_arena && std::sscanf(line, "Pss: %llu kB", &kb) == 1) pss += kb;
  }
  std::fclose(f);
  std::printf("mapping: rss %llu KiB, pss %llu KiB\n", rss, pss);
}

int InspectStore(const AttachOptions& store, const std::string& model_text, bool verify,
                 bool hold) {
  Result<ModelRef> ref = ModelRef::Parse(model_text);
  if (!ref.ok()) return Fail(ref.status());
  AttachClient client(store);
  auto attached = client.Attach(ref->name, ref->version);
  if (!attached.ok()) return Fail(attached.status());
  const Attachment& a = **attached;
  std::printf("model: %s@%llu on %s (pid %d)\n", a.model().c_str(),
              static_cast<unsigned long long>(a.version()), a.device().ToString().c_str(),
              ::getpid());
  std::printf("tensors: %zu, arena %llu bytes\n", a.tensors().size(),
              static_cast<unsigned long long>(a.manifest().arena_size));
  PrintTensorTable(a.tensors());
  Result<uint64_t> mapped = a.ComputeChecksum();
  if (!mapped.ok()) return Fail(mapped.status());
  std::printf("checksum: %s\n", ChecksumHex(*mapped).c_str());
  if (verify) {
    const bool ok = *mapped == a.checksum();
    std::printf("checksum %s: mapped bytes %s, store's manifest %s\n", ok ? "ok" : "MISMATCH",
                ChecksumHex(*mapped).c_str(), ChecksumHex(a.checksum()).c_str());
    if (!ok) return 2;
  }
  PrintMappingMemory(a);
  std::fflush(stdout);
  if (hold) {
    InstallStopHandlers();
    WaitForStopSignal();
  }
  return 0;
}

// ---- administration --------------------------------------------------------

int ListModels(const AttachOptions& store) {
  auto models = AttachClient(store).ListModels();
  if (!models.ok()) return Fail(models.status());
  std::printf("%-20s %8s %-8s %8s %14s %8s  %-16s  %s\n", "model", "version", "device", "tensors",
              "bytes", "attached", "checksum", "path");
  for (const ModelSummary& m : *models) {
    std::printf("%-20s %8llu %-8s %8u %14llu %8u  %s  %s\n", m.name.c_str(),
                static_cast<unsigned long long>(m.version), m.device.ToString().c_str(),
                m.tensor_count, static_cast<unsigned long long>(m.tensor_bytes), m.attached,
                ChecksumHex(m.checksum).c_str(), m.path.c_str());
  }
  return 0;
}

int ShowStatus(const AttachOptions& store) {
  auto status = AttachClient(store).GetStatus();
  if (!status.ok()) return Fail(status.status());
  std::printf("store pid %d on %s, %u connections\n", status->pid,
              status->device.ToString().c_str(), status->connections);
  uint64_t held_bytes = 0;
  for (const ArenaInfo& a : status->arenas) held_bytes += a.bytes;
  std::printf("holds %zu arenas, %llu bytes; %llu leases\n", status->arenas.size(),
              static_cast<unsigned long long>(held_bytes),
              static_cast<unsigned long long>(status->lease_total));
  std::printf("arenas:\n");
  for (const ArenaInfo& a : status->arenas) {
    std::printf("  %s@%llu  %llu bytes  %s  attached %u\n", a.model.c_str(),
                static_cast<unsigned long long>(a.version),
                static_cast<unsigned long long>(a.bytes), a.registered ? "registered" : "unloaded",
                a.attached);
  }
  std::printf("attached clients:\n");
  for (const LeaseInfo& l : status->leases) {
    std::printf("  pid %d uid %u  %s@%llu  since %s\n", l.pid, l.uid, l.model.c_str(),
                static_cast<unsigned long long>(l.version), TimeText(l.since_ms).c_str());
  }
  if (status->lease_total > status->leases.size())
    std::printf("  ... %llu leases in all, %zu listed\n",
                static_cast<unsigned long long>(status->lease_total), status->leases.size());
  if (!status->counters.empty()) {
    std::printf("counters:\n");
    for (const auto& [name, value] : status->counters)
      std::printf("  %s %llu\n", name.c_str(), static_cast<unsigned long long>(value));
  }
  return 0;
}

// `hearth load` into each device's store, all at once (each store reads the
// checkpoint into its own staging); one line per device, in order.
int LoadEverywhere(const std::vector<std::pair<std::string, AttachOptions>>& stores,
                   const std::string& arg) {
  const size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size())
    return Fail(InvalidArgument("'" + arg + "' is not NAME=PATH"));
  std::string path = arg.substr(eq + 1);
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) != nullptr) path = resolved;
  std::vector<Result<ModelSummary>> loaded(stores.size(), Internal("not loaded"));
  std::vector<std::function<void()>> loads;
  for (size_t i = 0; i < stores.size(); ++i)
    loads.push_back(
        [&, i] { loaded[i] = AttachClient(stores[i].second).Load(arg.substr(0, eq), path); });
  RunTogether(loads);
  int rc = 0;
  for (size_t i = 0; i < stores.size(); ++i) {
    const std::string on = stores[i].first.empty() ? "" : " on " + stores[i].first;
    if (!loaded[i].ok()) {
      rc = Fail(stores[i].first.empty() ? loaded[i].status()
                                        : loaded[i].status().WithContext(stores[i].first));
      continue;
    }
    const ModelSummary& m = *loaded[i];
    std::printf("loaded %s@%llu%s (%u tensors, %llu bytes, checksum %s)\n", m.name.c_str(),
                static_cast<unsigned long long>(m.version), on.c_str(), m.tensor_count,
                static_cast<unsigned long long>(m.tensor_bytes), ChecksumHex(m.checksum).c_str());
  }
  return rc;
}

int UnloadModel(const AttachOptions& store, const std::string& model_text) {
  Result<ModelRef> ref = ModelRef::Parse(model_text);
  if (!ref.ok()) return Fail(ref.status());
  auto removed = AttachClient(store).Unload(ref->name, ref->version);
  if (!removed.ok()) return Fail(removed.status());
  std::printf("unloaded %u version(s) of %s\n", *removed, ref->name.c_str());
  return 0;
}

// ---- hearth make-model -----------------------------------------------------

Result<std::vector<int64_t>> ParseDims(const std::string& text) {
  std::vector<int64_t> dims;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data() + start, text.data() + comma, v);
    if (ec != std::errc() || ptr != text.data() + comma || v <= 0)
      return InvalidArgument("--dims '" + text + "' must be positive integers separated by commas");
    dims.push_back(v);
    start = comma + 1;
  }
  return dims;
}

int MakeModel(const std::string& kind, const std::string& dims_text, const std::string& dtype_text,
              uint64_t seed, const std::string& out, int threads, uint64_t shard_bytes) {
  Result<std::vector<int64_t>> dims = ParseDims(dims_text);
  if (!dims.ok()) return Fail(dims.status());
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Status s;
  if (kind == "mlp") {
    if (dims->size() != 3) return Fail(InvalidArgument("mlp needs --dims IN,HIDDEN,OUT"));
    std::string upper = dtype_text;
    std::transform(upper.begin(), upper.end(), upper.begin(), ::toupper);
    std::optional<DType> dtype = ParseDType(upper);
    if (!dtype || (*dtype != DType::kF32 && *dtype != DType::kF16 && *dtype != DType::kBF16))
      return Fail(InvalidArgument("--dtype '" + dtype_text + "' is not one of f32, f16, bf16"));
    s = WriteSyntheticMlp((*dims)[0], (*dims)[1], (*dims)[2], *dtype, seed, out, threads,
                          shard_bytes);
  } else {
    if (dims->size() != 1) return Fail(InvalidArgument("scale needs --dims N"));
    if (dtype_text != "f32") return Fail(InvalidArgument("scale models are f32 only"));
    s = WriteSyntheticScale((*dims)[0], seed, out, threads, shard_bytes);
  }
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

// ---- hearth bench ----------------------------------------------------------

int RunBenchCommand(const BenchOptions& options, bool as_json) {
  signal(SIGPIPE, SIG_IGN);
  Result<BenchReport> report = RunBench(options, stderr);
  if (!report.ok()) return Fail(report.status());
  const std::string text = as_json ? ReportJson(*report) + "\n" : ReportTable(*report);
  std::fputs(text.c_str(), stdout);
  if (report->errors > 0) {
    std::fprintf(stderr, "hearth bench: %llu requests failed\n",
                 static_cast<unsigned long long>(report->errors));
    return 1;
  }
  if (report->requests == 0) {
    std::fprintf(stderr, "hearth bench: no request completed in the measured window\n");
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace hearth::cli

int main(int argc, char** argv) {
  using namespace hearth;
  using namespace hearth::cli;
  CLI::App app{"hearth: one copy of a model's weights, shared read-only by many worker processes"};
  app.require_subcommand(1);
  std::string log_level = "info";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}));

  StoreClientFlags client;
  auto add_client_options = [&](CLI::App* cmd) { AddStoreClientOptions(cmd, &client); };

  const Subcommand store = AddStoreCommand(app);

  auto* serve =
      app.add_subcommand("serve", "serve a model repository over KServe v2 REST and gRPC");
  std::string repository, host = "127.0.0.1", serve_device;
  int http_port = 8000, serve_workers = 0, exec_timeout_ms = 60000;
  serve
      ->add_option("--model-repository", repository,
                   "DIR/<model>/config.yaml and DIR/<model>/<version>/ holding "
                   "model.safetensors, or a sharded checkpoint with "
                   "model.safetensors.index.json")
      ->required();
  serve->add_option("--host", host, "address to listen on")->capture_default_str();
  serve->add_option("--http-port", http_port, "port (0 = any free port)")->capture_default_str();
  bool strict_readiness = true;
  serve
      ->add_option("--strict-readiness", strict_readiness,
                   "ready (/v2/health/ready, ServerReady) only while every model of the repository "
                   "is served; false: while every served model has a worker ready")
      ->capture_default_str();
  std::string shared_memory_users;
  serve->add_option("--shared-memory-users", shared_memory_users,
                    "USER[,USER...] (names or uids) whose processes on this machine may register "
                    "shared memory, each only its own objects; 'none' turns shared memory off "
                    "(default: the server's own user)");
  GrpcSettings grpc_settings;
  int grpc_port = 8001;
  auto* grpc_port_option = serve->add_option(
      "--grpc-port", grpc_port,
      "KServe v2 gRPC port (0 = any free port, -1 = no gRPC; default 8001, or 0 when "
      "--http-port is 0)");
  serve
      ->add_option("--grpc-max-message-bytes", grpc_settings.max_message_bytes,
                   "larger gRPC messages are refused with RESOURCE_EXHAUSTED (compressed ones are "
                   "refused whatever their size)")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{1}, uint64_t{0x7fffffff}));
  serve
      ->add_option("--grpc-max-inflight-calls", grpc_settings.max_inflight_calls,
                   "ModelInfer and ModelStreamInfer calls in progress; more are refused with "
                   "RESOURCE_EXHAUSTED")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  serve
      ->add_option("--grpc-max-connections", grpc_settings.max_connections,
                   "gRPC connections open at once; more wait in the kernel's backlog")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  serve
      ->add_option("--grpc-streams-per-second", grpc_settings.streams_per_second,
                   "calls (HTTP/2 streams) one gRPC connection may open a second; a faster client "
                   "is paced")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e9));
  serve
      ->add_option("--grpc-resets-per-second", grpc_settings.resets_per_second,
                   "streams one gRPC connection may reset a second (beyond a burst of twice as "
                   "many); a client resetting faster is closed (HTTP/2 rapid reset)")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e9));
  serve->add_option("--device", serve_device,
                    "cpu, or cuda[:N]: the default GPU of KIND_GPU instance groups that list no "
                    "gpus (default: cuda if a GPU is usable, else cpu)");
  serve->add_option("--workers", serve_workers,
                    "workers per model on each of its devices (per GPU it is placed on), "
                    "overriding instance_group.count");
  int serve_load_threads = 0;
  serve
      ->add_option("--load-threads", serve_load_threads,
                   "reader threads of each load into a device's store (0 = automatic); a model's "
                   "devices load at once, each with this many")
      ->capture_default_str()
      ->check(CLI::Range(0, 256));
  int stand_in_gpus = 0;
  // Hidden: for tests and CI on machines without GPUs (docs/architecture.md).
  serve
      ->add_option("--stand-in-gpus", stand_in_gpus,
                   "for tests: host memory stands in for N GPUs, each with its own store")
      ->check(CLI::Range(0, 1024))
      ->group("");
  serve->add_option("--exec-timeout-ms", exec_timeout_ms, "a batch running longer kills its worker")
      ->capture_default_str();
  HttpOptions http_options;
  // 2 I/O threads by default: on an H200 machine (16 cores) 8 threads tripled
  // the time a one-at-a-time request spends in the server (43 -> 148 us for
  // the scale model) and did not raise throughput (bench/results/2026-11-30-h200-*).
  serve->add_option("--http-threads", http_options.threads, "HTTP I/O threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  serve
      ->add_option("--max-body-bytes", http_options.max_body_bytes, "larger request bodies get 413")
      ->capture_default_str();
  serve
      ->add_option("--max-inflight-bytes", http_options.max_inflight_bytes,
                   "request body bytes held across all connections; a body that would pass it "
                   "waits (one larger than it gets 413)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve
      ->add_option("--max-connections", http_options.max_connections,
                   "open HTTP connections; more wait in the kernel's backlog (lowered to fit the "
                   "descriptor limit)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 24));
  serve
      ->add_option("--reserved-descriptors", http_options.reserved_descriptors,
                   "descriptors never used for connections (worker restarts, the store)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  int head_timeout_ms = 10000, body_timeout_ms = 10000, idle_timeout_ms = 60000,
      drain_timeout_ms = 20000;
  serve
      ->add_option("--head-timeout-ms", head_timeout_ms,
                   "a request head must arrive within this, from its first byte")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve
      ->add_option("--body-timeout-ms", body_timeout_ms,
                   "each MiB of a request body must arrive within this")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve
      ->add_option("--idle-timeout-ms", idle_timeout_ms,
                   "a kept-alive connection idle this long is closed; also the limit on writing "
                   "one response")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve
      ->add_option("--drain-timeout-ms", drain_timeout_ms,
                   "on SIGTERM, how long requests in progress get before connections are closed")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);

  auto* inspect = app.add_subcommand(
      "inspect",
      "print a checkpoint's (file or directory) or a store's model's tensors and checksum");
  std::string file, model;
  bool verify = false, hold = false;
  inspect->add_option("checkpoint", file,
                      "a safetensors file, or a checkpoint directory (model.safetensors, or "
                      "shards with model.safetensors.index.json): lists every shard's tensors");
  add_client_options(inspect);
  inspect->add_option("--model", model, "NAME[@VERSION] to attach from the store");
  inspect->add_flag("--verify", verify,
                    "with --model: check the mapped bytes against the checksum in the store's "
                    "manifest. This proves only that the bytes are what the store claims: that "
                    "the store is the real one is the peer check's job (a store of another uid "
                    "is refused unless trusted with --store-uid); compare with `hearth inspect "
                    "CHECKPOINT` to check against a checkpoint");
  inspect->add_flag("--hold", hold, "with --model: stay attached until SIGTERM or SIGINT");

  auto* make = app.add_subcommand("make-model", "write a deterministic synthetic checkpoint");
  std::string kind, dims, dtype = "f32", out;
  uint64_t seed = 0;
  int threads = 0;
  make->add_option("kind", kind, "mlp or scale")
      ->required()
      ->check(CLI::IsMember({"mlp", "scale"}));
  make->add_option("--dims", dims, "mlp: IN,HIDDEN,OUT; scale: N")->required();
  make->add_option("--dtype", dtype, "f32, f16 or bf16 (mlp only)")->capture_default_str();
  make->add_option("--seed", seed, "random seed")->capture_default_str();
  make->add_option("--out", out, "output file (with --shard-bytes: directory)")->required();
  uint64_t shard_bytes = 0;
  make->add_option("--shard-bytes", shard_bytes,
                   "write a checkpoint directory as save_pretrained does: shards of at most "
                   "this many bytes and model.safetensors.index.json (model.safetensors alone "
                   "if one shard holds it all)");
  make->add_option("--threads", threads, "generator threads (0 = all cores)");

  auto* list = app.add_subcommand("list", "list the models a store holds");
  add_client_options(list);
  auto* status = app.add_subcommand("status", "show a store's attached clients and arenas");
  add_client_options(status);
  auto* load =
      app.add_subcommand("load", "load a checkpoint into a running store as a new version");
  std::string load_arg;
  add_client_options(load);
  load->add_option("model", load_arg,
                   "NAME=PATH: a safetensors file or a checkpoint directory (model.safetensors, "
                   "or shards with model.safetensors.index.json)")
      ->required();
  auto* unload = app.add_subcommand("unload", "remove a model (all versions, or NAME@VERSION)");
  std::string unload_arg;
  add_client_options(unload);
  unload->add_option("model", unload_arg, "NAME[@VERSION]")->required();

  auto* bench = app.add_subcommand(
      "bench",
      "drive a KServe v2 server (REST or gRPC) with random requests and report throughput and "
      "latency");
  BenchOptions bench_options;
  std::string bench_protocol = "binary", bench_arrival = "poisson";
  std::string bench_transport = "rest", bench_shared_memory = "none";
  bool bench_json = false;
  bench
      ->add_option("--url", bench_options.url,
                   "rest: http://HOST:PORT of the server; grpc: HOST:PORT (or grpc://HOST:PORT) "
                   "of its gRPC port")
      ->required();
  bench
      ->add_option("--transport", bench_transport,
                   "rest (KServe v2 over HTTP/1.1) or grpc (inference.GRPCInferenceService/"
                   "ModelInfer; needs a hearth built with gRPC)")
      ->check(CLI::IsMember({"rest", "grpc"}))
      ->capture_default_str();
  bench
      ->add_option("--shared-memory", bench_shared_memory,
                   "none (tensors in the messages), system (as perf_analyzer: inputs and "
                   "outputs in POSIX shared-memory regions registered with the server, one per "
                   "request in flight) or cuda (the same in device memory of this process, "
                   "registered by its CUDA IPC handle; needs a GPU)")
      ->check(CLI::IsMember({"none", "system", "cuda"}))
      ->capture_default_str();
  bench
      ->add_option("--shared-memory-device", bench_options.shared_memory_device,
                   "with --shared-memory cuda: the GPU (CUDA ordinal) holding the regions")
      ->capture_default_str();
  bench->add_option("--output-shared-memory-size", bench_options.output_shared_memory_size,
                    "with --shared-memory system or cuda: bytes of room per output (default: "
                    "the output's size from the model's metadata)");
  bench->add_flag("--verify", bench_options.verify,
                  "with --shared-memory system or cuda: check that every response wrote its "
                  "outputs into the region (default: each slot's first)");
  bench->add_option("--model", bench_options.model, "model name")->required();
  bench->add_option("--version", bench_options.version,
                    "model version (default: the server's choice)");
  auto* concurrency_option =
      bench
          ->add_option("--concurrency", bench_options.concurrency,
                       "closed loop: N requests in flight, each sent when the last returned")
          ->capture_default_str();
  bench
      ->add_option("--request-rate", bench_options.request_rate,
                   "open loop: R requests/s; latency counts from each request's scheduled time")
      ->excludes(concurrency_option);
  bench
      ->add_option("--arrival", bench_arrival,
                   "open loop arrivals: poisson or constant (evenly spaced)")
      ->check(CLI::IsMember({"poisson", "constant"}))
      ->capture_default_str();
  bench
      ->add_option("--max-connections", bench_options.max_connections,
                   "open loop: at most this many requests in flight (rest: connections)")
      ->capture_default_str();
  bench->add_option("--batch", bench_options.batch, "batch size of every request")
      ->capture_default_str();
  bench->add_option("--seconds", bench_options.seconds, "measured duration")->capture_default_str();
  bench->add_option("--warmup", bench_options.warmup, "unmeasured seconds before it")
      ->capture_default_str();
  bench
      ->add_option("--protocol", bench_protocol,
                   "rest bodies: binary (tensor data after a JSON header) or json; with "
                   "shared memory the body is JSON either way")
      ->check(CLI::IsMember({"binary", "json"}))
      ->capture_default_str();
  bench->add_option("--output", bench_options.outputs, "request only these outputs (default: all)");
  bench->add_option("--seed", bench_options.seed, "random seed for inputs and arrivals")
      ->capture_default_str();
  bench->add_flag("--json", bench_json, "print one JSON object instead of a table");

  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::from_str(log_level));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n %P] [%l] %v");

  if (store.command->parsed()) return store.run();
  if (serve->parsed()) {
    if (http_port < 0 || http_port > 65535) {
      return Fail(InvalidArgument("--http-port must be in [0, 65535]"));
    }
    http_options.host = host;
    http_options.port = static_cast<uint16_t>(http_port);
    http_options.head_timeout = std::chrono::milliseconds(head_timeout_ms);
    http_options.body_timeout = std::chrono::milliseconds(body_timeout_ms);
    http_options.idle_timeout = std::chrono::milliseconds(idle_timeout_ms);
    http_options.drain_timeout = std::chrono::milliseconds(drain_timeout_ms);
    // A server asked for any free HTTP port (tests, benchmarks, several
    // servers on one machine) takes any free gRPC port too, unless told one.
    const bool grpc_port_given = grpc_port_option->count() > 0;
    if (!grpc_port_given && http_port == 0) grpc_port = 0;
    if (grpc_port < -1 || grpc_port > 65535) {
      return Fail(InvalidArgument("--grpc-port must be -1 (no gRPC) or in [0, 65535]"));
    }
#ifdef HEARTH_HAVE_GRPC
    grpc_settings.port = grpc_port;
#else
    if (grpc_port_given && grpc_port != -1) {
      return Fail(Unimplemented(
          "--grpc-port " + std::to_string(grpc_port) +
          ": this hearth was built without gRPC (configured with -DHEARTH_GRPC=OFF, or without "
          "grpc++, protobuf, protoc and grpc_cpp_plugin); leave --grpc-port out or pass -1, or "
          "rebuild with Debian's libgrpc++-dev protobuf-compiler-grpc"));
    }
    grpc_settings.port = -1;
#endif
    return RunServe(repository, serve_device, serve_workers, stand_in_gpus, serve_load_threads,
                    exec_timeout_ms, strict_readiness, shared_memory_users, std::move(http_options),
                    grpc_settings);
  }
  Result<NamedStores> stores = StoresOf(client);
  if (!stores.ok()) return Fail(stores.status());
  const NamedStores& per_device = *stores;
  // Runs `command` on each device's store (a heading before each when there
  // are several); fails if any fails.
  auto on_each = [&](const std::function<int(const AttachOptions&)>& command) {
    int rc = 0;
    for (size_t i = 0; i < per_device.size(); ++i) {
      const auto& [name, options] = per_device[i];
      if (per_device.size() > 1)
        std::printf("%s== %s: %s\n", i == 0 ? "" : "\n", name.c_str(), options.socket_path.c_str());
      std::fflush(stdout);
      rc = std::max(rc, command(options));
    }
    return rc;
  };
  if (inspect->parsed()) {
    if (!file.empty() && !model.empty())
      return Fail(InvalidArgument("give either a CHECKPOINT or --model, not both"));
    if (!file.empty()) return InspectCheckpoint(file);
    if (!model.empty()) {
      if (per_device.size() > 1)
        return Fail(InvalidArgument("inspect --model attaches from one store: give one --device"));
      return InspectStore(per_device.front().second, model, verify, hold);
    }
    return Fail(InvalidArgument("inspect needs a CHECKPOINT (file or directory) or --model NAME"));
  }
  if (bench->parsed()) {
    bench_options.protocol =
        bench_protocol == "json" ? BenchProtocol::kJson : BenchProtocol::kBinary;
    bench_options.arrival =
        bench_arrival == "constant" ? BenchArrival::kConstant : BenchArrival::kPoisson;
    bench_options.transport =
        bench_transport == "grpc" ? BenchTransport::kGrpc : BenchTransport::kRest;
    bench_options.shared_memory = bench_shared_memory == "system" ? BenchSharedMemory::kSystem
                                  : bench_shared_memory == "cuda" ? BenchSharedMemory::kCuda
                                                                  : BenchSharedMemory::kNone;
    return RunBenchCommand(bench_options, bench_json);
  }
  if (make->parsed()) return MakeModel(kind, dims, dtype, seed, out, threads, shard_bytes);
  if (list->parsed()) return on_each(ListModels);
  if (status->parsed()) return on_each(ShowStatus);
  if (load->parsed()) return LoadEverywhere(per_device, load_arg);
  if (unload->parsed())
    return on_each([&](const AttachOptions& o) { return UnloadModel(o, unload_arg); });
  return 0;
}
