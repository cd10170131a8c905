// Where a GPU process's start-up time goes when N of them start at once, as
// hearth serve's workers do. The parent never touches CUDA; it forks N
// children at one instant and each child times, from that instant:
//   init     dlopen libcuda + cuInit
//   context  the primary context retained and current (HEARTH_CUDA_STACK_SIZE
//            trims it when set)
//   stream   the first cuStreamCreate
//   attach   (with --socket/--model) attaching the model from a store: import
//            and map of the shared weights
//
//   context_startup --processes 1,8,24 [--socket S --model M]
//
// Prints, per process count, the median and the slowest child's time at the
// end of each stage, and the median duration of each stage.
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "hearth/attach.h"
#include "memory/cuda_driver.h"

namespace hearth {
namespace {

constexpr int kStages = 4;
constexpr std::array<const char*, kStages> kStageNames{"init", "context", "stream", "attach"};

using Clock = std::chrono::steady_clock;

// Stage end times in ms since `start`; -1 for a stage not run, -2 on failure.
std::array<double, kStages> RunChild(Clock::time_point start, const std::string& socket,
                                     const std::string& model) {
  std::array<double, kStages> t{-1, -1, -1, -1};
  auto since = [&] {
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  };
  auto driver = CudaDriver::Get();
  if (!driver.ok()) {
    std::fprintf(stderr, "%s\n", driver.status().ToString().c_str());
    t[0] = -2;
    return t;
  }
  t[0] = since();
  if (Status s = MakeContextCurrent(0); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    t[1] = -2;
    return t;
  }
  t[1] = since();
  CUstream stream = nullptr;
  if ((*driver)->StreamCreate(&stream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS) {
    t[2] = -2;
    return t;
  }
  t[2] = since();
  if (!socket.empty()) {
    auto attachment = AttachClient(socket).Attach(model);
    if (!attachment.ok()) {
      std::fprintf(stderr, "%s\n", attachment.status().ToString().c_str());
      t[3] = -2;
      return t;
    }
    t[3] = since();
  }
  return t;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::string counts_text = "1,8,24", socket, model;
  CLI::App app{"context_startup: CUDA start-up of N processes started at once"};
  app.add_option("--processes", counts_text, "process counts, comma-separated");
  app.add_option("--socket", socket, "store socket: also attach --model");
  app.add_option("--model", model);
  CLI11_PARSE(app, argc, argv);
  if (socket.empty() != model.empty()) {
    std::fprintf(stderr, "context_startup: --socket and --model go together\n");
    return 2;
  }
  std::stringstream in(counts_text);
  for (std::string item; std::getline(in, item, ',');) {
    const int n = std::stoi(item);
    std::vector<int> read_ends(static_cast<size_t>(n));  // one pipe per child
    std::vector<pid_t> children;
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < n; ++i) {
      int fds[2];
      if (::pipe(fds) != 0) return 1;
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::close(fds[0]);
        const auto t = RunChild(start, socket, model);
        (void)!::write(fds[1], t.data(), sizeof(t));
        std::_Exit(0);
      }
      ::close(fds[1]);
      read_ends[static_cast<size_t>(i)] = fds[0];
      children.push_back(pid);
    }
    std::array<std::vector<double>, kStages> ends, durations;
    int failed = 0;
    for (int i = 0; i < n; ++i) {
      std::array<double, kStages> t{};
      const ssize_t got = ::read(read_ends[static_cast<size_t>(i)], t.data(), sizeof(t));
      ::close(read_ends[static_cast<size_t>(i)]);
      if (got != static_cast<ssize_t>(sizeof(t))) {
        ++failed;
        continue;
      }
      double previous = 0;
      for (int s = 0; s < kStages; ++s) {
        if (t[static_cast<size_t>(s)] == -2) ++failed;
        if (t[static_cast<size_t>(s)] < 0) break;
        ends[static_cast<size_t>(s)].push_back(t[static_cast<size_t>(s)]);
        durations[static_cast<size_t>(s)].push_back(t[static_cast<size_t>(s)] - previous);
        previous = t[static_cast<size_t>(s)];
      }
    }
    for (pid_t pid : children) ::waitpid(pid, nullptr, 0);
    std::printf("processes=%d failed=%d", n, failed);
    for (int s = 0; s < kStages; ++s) {
      const auto& e = ends[static_cast<size_t>(s)];
      if (e.empty()) continue;
      std::printf(" %s_end_ms_p50=%.0f %s_end_ms_max=%.0f %s_ms_p50=%.0f", kStageNames[s],
                  Median(e), kStageNames[s], *std::max_element(e.begin(), e.end()), kStageNames[s],
                  Median(durations[static_cast<size_t>(s)]));
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace hearth

int main(int argc, char** argv) { return hearth::Main(argc, argv); }
