// Attach-and-map latency, and the device memory one attached client costs.
//
//   attach_bench --socket S --model M [--iterations 1000]
//       times AttachClient::Attach + detach against a running store
//   attach_bench --context-memory --device cuda:0 --socket S --model M
//       measures device memory used by a fresh process that creates a context
//       (bare, and with CU_LIMIT_STACK_SIZE trimmed) and then attaches M
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "hearth/attach.h"
#if HEARTH_HAVE_CUDA
#include "memory/cuda_driver.h"
#endif

using namespace hearth;
extern char** environ;

namespace {

int TimeAttach(const std::string& socket, const std::string& model, int iterations) {
  AttachClient client(socket);
  std::vector<double> us;
  us.reserve(iterations);
  for (int i = 0; i < iterations + 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto a = client.Attach(model);
    const auto t1 = std::chrono::steady_clock::now();
    if (!a.ok()) return std::fprintf(stderr, "%s\n", a.status().ToString().c_str()), 1;
    if (i >= 10) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) { return us[static_cast<size_t>(p * (us.size() - 1))]; };
  std::printf("attach model=%s iterations=%d p50_us=%.1f p90_us=%.1f p99_us=%.1f\n", model.c_str(),
              iterations, pct(0.5), pct(0.9), pct(0.99));
  return 0;
}

#if HEARTH_HAVE_CUDA
// Child: create a context (optionally trimmed), optionally attach, report, wait for SIGTERM.
int ContextChild(int device, bool trim, const std::string& socket, const std::string& model) {
  if (trim) ::setenv("HEARTH_CUDA_STACK_SIZE", "256", 1);
  if (Status s = MakeContextCurrent(device); !s.ok())
    return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  std::unique_ptr<Attachment> a;
  if (!model.empty()) {
    auto r = AttachClient(socket).Attach(model);
    if (!r.ok()) return std::fprintf(stderr, "%s\n", r.status().ToString().c_str()), 1;
    a = std::move(r).value();
  }
  std::printf("ready\n");
  std::fflush(stdout);
  ::pause();
  return 0;
}

double UsedMiB(const CudaDriver& cu) {
  size_t free_b = 0, total_b = 0;
  cu.MemGetInfo(&free_b, &total_b);
  return static_cast<double>(total_b - free_b) / (1 << 20);
}

// Spawns this binary as a context child and returns the device memory it adds.
double MeasureChild(const CudaDriver& cu, const std::string& self, int device, bool trim,
                    const std::string& socket, const std::string& model) {
  const double before = UsedMiB(cu);
  int pipefd[2];
  if (::pipe(pipefd) != 0) return -1;
  std::vector<std::string> args = {self, "--child", "--device-index", std::to_string(device),
                                   "--socket", socket, "--model", model};
  if (trim) args.push_back("--trim");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  pid_t pid;
  posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  char buf[16];
  const ssize_t n = ::read(pipefd[0], buf, sizeof buf);
  ::close(pipefd[0]);
  const double after = UsedMiB(cu);
  ::kill(pid, SIGTERM);
  ::waitpid(pid, nullptr, 0);
  return n > 0 ? after - before : -1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hearth attach benchmark"};
  std::string socket, model;
  int iterations = 1000, device_index = 0;
  bool context_memory = false, child = false, trim = false;
  app.add_option("--socket", socket)->required();
  app.add_option("--model", model);
  app.add_option("--iterations", iterations);
  app.add_flag("--context-memory", context_memory);
  app.add_flag("--child", child);
  app.add_flag("--trim", trim);
  app.add_option("--device-index", device_index);
  CLI11_PARSE(app, argc, argv);
#if HEARTH_HAVE_CUDA
  if (child) return ContextChild(device_index, trim, socket, model);
  if (context_memory) {
    std::string why;
    if (!CudaAvailable(&why)) return std::printf("context-memory skipped: %s\n", why.c_str()), 0;
    if (Status s = MakeContextCurrent(device_index); !s.ok()) return 1;
    const CudaDriver& cu = **CudaDriver::Get();
    const std::string self = "/proc/self/exe";
    char path[4096];
    const ssize_t len = ::readlink(self.c_str(), path, sizeof path - 1);
    path[len > 0 ? len : 0] = '\0';
    std::printf("context_mib bare=%.0f trimmed=%.0f trimmed_attached=%.0f\n",
                MeasureChild(cu, path, device_index, false, socket, ""),
                MeasureChild(cu, path, device_index, true, socket, ""),
                MeasureChild(cu, path, device_index, true, socket, model));
    return 0;
  }
#else
  (void)child, (void)trim, (void)device_index;
  if (context_memory) return std::printf("context-memory skipped: built without CUDA\n"), 0;
#endif
  if (model.empty()) return std::fprintf(stderr, "--model is required\n"), 1;
  return TimeAttach(socket, model, iterations);
}
