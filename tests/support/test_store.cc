#include "support/test_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "hearth/checkpoint.h"

extern char** environ;

namespace hearth::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/hearth-test-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void WriteTestCheckpoint(const std::string& path, int count, size_t floats_each, uint32_t seed) {
  static std::vector<std::vector<float>> keep;  // must outlive Write()
  CheckpointWriter writer;
  writer.SetMetadata("purpose", "test");
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<std::vector<float>> data(count);
  for (int i = 0; i < count; ++i) {
    data[i].resize(floats_each + static_cast<size_t>(i));  // odd sizes exercise alignment
    for (float& f : data[i]) f = dist(rng);
    Status s = writer.AddTensor("t" + std::to_string(i), DType::kF32,
                                {static_cast<int64_t>(data[i].size())},
                                std::as_bytes(std::span(data[i])));
    if (!s.ok()) throw std::runtime_error(s.ToString());
  }
  static const std::byte kInt8[5] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4},
                                     std::byte{5}};
  if (Status s = writer.AddTensor("bytes", DType::kI8, {5}, kInt8); !s.ok())
    throw std::runtime_error(s.ToString());
  if (Status s = writer.AddTensor("empty", DType::kF32, {0, 4}, std::span<const std::byte>());
      !s.ok())
    throw std::runtime_error(s.ToString());
  if (Status s = writer.Write(path); !s.ok()) throw std::runtime_error(s.ToString());
}

pid_t Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ) != 0)
    throw std::runtime_error("posix_spawn " + argv[0] + " failed");
  return pid;
}

int Wait(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

int Run(const std::vector<std::string>& argv, std::string* out) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    throw std::runtime_error("posix_spawn " + argv[0] + " failed");
  }
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) text.append(buf, static_cast<size_t>(n));
  }
  ::close(pipefd[0]);
  if (out != nullptr) *out = text;
  return Wait(pid);
}

StoreProcess::StoreProcess(std::string socket, std::vector<std::string> args)
    : socket_(std::move(socket)) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  std::vector<std::string> argv = {CliPath(), "--log-level", "warn", "store", "--socket", socket_};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<char*> cargs;
  for (const std::string& a : argv) cargs.push_back(const_cast<char*>(a.c_str()));
  cargs.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDERR_FILENO);
  const int rc = posix_spawn(&pid_, cargs[0], &actions, nullptr, cargs.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  if (rc != 0) throw std::runtime_error("posix_spawn hearth store failed");
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (text.find("ready") == std::string::npos) {
    pollfd p{pipefd[0], POLLIN, 0};
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          deadline - std::chrono::steady_clock::now())
                                          .count());
    if (left <= 0 || ::poll(&p, 1, left) <= 0) {
      startup_error_ = "timed out waiting for ready; output: " + text;
      break;
    }
    char buf[4096];
    const ssize_t n = ::read(pipefd[0], buf, sizeof buf);
    if (n <= 0) {
      startup_error_ = "store exited before ready; output: " + text;
      break;
    }
    text.append(buf, static_cast<size_t>(n));
  }
  // Keep draining the store's output so its logging never blocks on a full pipe.
  std::thread([fd = pipefd[0]] {
    char buf[4096];
    while (::read(fd, buf, sizeof buf) > 0) {
    }
    ::close(fd);
  }).detach();
}

StoreProcess::~StoreProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    Wait(pid_);
  }
}

bool StoreProcess::alive() const {
  return pid_ > 0 && ::kill(pid_, 0) == 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0;
}

int StoreProcess::Stop() {
  ::kill(pid_, SIGTERM);
  const int status = Wait(pid_);
  pid_ = -1;
  return status;
}

int CountFds(pid_t pid) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

int StableFdCount(pid_t pid) {
  int last = CountFds(pid), same = 0;
  while (same < 5) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const int now = CountFds(pid);
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

bool HoldsArena(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  for (const auto& e : std::filesystem::directory_iterator(proc + "/fd")) {
    std::error_code ec;
    const auto target = std::filesystem::read_symlink(e.path(), ec).string();
    if (target.find("memfd:hearth-arena") != std::string::npos) return true;
  }
  std::ifstream maps(proc + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("memfd:hearth-arena") != std::string::npos) return true;
  }
  return false;
}

long RssKiB(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

std::string CliPath() { return HEARTH_CLI_PATH; }
std::string ProbePath() { return HEARTH_PROBE_PATH; }

}  // namespace hearth::testing
