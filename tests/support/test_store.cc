#include "support/test_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
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
    Status s =
        writer.AddTensor("t" + std::to_string(i), DType::kF32,
                         {static_cast<int64_t>(data[i].size())}, std::as_bytes(std::span(data[i])));
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

std::vector<std::string> EnvironmentWith(const std::vector<std::string>& changes) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& change : changes) {
    const size_t eq = change.find('=');
    const std::string name = change.substr(0, eq);
    std::erase_if(env, [&](const std::string& e) { return e.rfind(name + "=", 0) == 0; });
    if (eq != std::string::npos) env.push_back(change);
  }
  return env;
}

namespace {

std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> p;
  for (std::string& s : strings) p.push_back(s.data());
  p.push_back(nullptr);
  return p;
}

// Spawns argv with stdout (and stderr, if `with_stderr`) into a new pipe;
// returns the pid and *read_end.
pid_t SpawnPiped(std::vector<std::string> argv, const std::vector<std::string>& env_changes,
                 bool with_stderr, int* read_end) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  if (with_stderr) posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDERR_FILENO);
  std::vector<std::string> env = EnvironmentWith(env_changes);
  std::vector<char*> args = Pointers(argv);
  std::vector<char*> envp = Pointers(env);
  pid_t pid;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  if (rc != 0) {
    ::close(pipefd[0]);
    throw std::runtime_error("posix_spawn " + argv[0] + " failed");
  }
  *read_end = pipefd[0];
  return pid;
}

std::string ReadAll(int fd) {
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

}  // namespace

int Run(const std::vector<std::string>& argv, std::string* out) {
  int fd;
  const pid_t pid = SpawnPiped(argv, {}, false, &fd);
  std::string text = ReadAll(fd);
  if (out != nullptr) *out = text;
  return Wait(pid);
}

int RunWithEnv(const std::vector<std::string>& argv, const std::vector<std::string>& env,
               std::string* out, std::chrono::milliseconds timeout) {
  int fd;
  const pid_t pid = SpawnPiped(argv, env, true, &fd);
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) == 0) {
      ::kill(pid, SIGKILL);
      text += "[still running after " + std::to_string(timeout.count()) + " ms: killed]";
      break;
    }
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  if (out != nullptr) *out = text;
  return Wait(pid);
}

// What a store process printed, filled by a thread that outlives the
// StoreProcess if it must (it ends when the process's output closes).
struct StoreProcess::Output {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::string text;
  bool closed = false;
};

StoreProcess::StoreProcess(std::string socket, std::vector<std::string> args,
                           StoreProcessOptions options)
    : socket_(std::move(socket)), output_(std::make_shared<Output>()) {
  std::vector<std::string> argv = options.prefix;
  for (const std::string& a : std::vector<std::string>{CliPath(), "--log-level", options.log_level,
                                                       "store", "--socket", socket_})
    argv.push_back(a);
  argv.insert(argv.end(), args.begin(), args.end());
  int fd;
  pid_ = SpawnPiped(argv, options.env, true, &fd);
  // Keep draining the store's output so its logging never blocks on a full pipe.
  std::thread([fd, out = output_] {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
      if (n <= 0) continue;
      std::lock_guard lock(out->mu);
      out->text.append(buf, static_cast<size_t>(n));
      out->cv.notify_all();
    }
    ::close(fd);
    std::lock_guard lock(out->mu);
    out->closed = true;
    out->cv.notify_all();
  }).detach();
  if (options.wait_ready && !WaitForOutput("hearth store ready", std::chrono::seconds(60))) {
    std::lock_guard lock(output_->mu);
    startup_error_ = (output_->closed ? "store exited before ready; output: "
                                      : "timed out waiting for ready; output: ") +
                     output_->text;
  }
}

std::string StoreProcess::output() const {
  std::lock_guard lock(output_->mu);
  return output_->text;
}

bool StoreProcess::WaitForOutput(const std::string& needle, std::chrono::milliseconds timeout,
                                 int count) const {
  auto occurrences = [&] {
    int n = 0;
    for (size_t at = output_->text.find(needle); at != std::string::npos;
         at = output_->text.find(needle, at + needle.size()))
      ++n;
    return n;
  };
  std::unique_lock lock(output_->mu);
  return output_->cv.wait_for(lock, timeout, [&] {
    return occurrences() >= count || output_->closed;
  }) && occurrences() >= count;
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

bool StoreProcess::WaitForExit(std::chrono::milliseconds timeout, int* status) {
  // The output closes when the process (and whatever inherited it) exits.
  {
    std::unique_lock lock(output_->mu);
    output_->cv.wait_for(lock, timeout, [&] { return output_->closed; });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    const pid_t r = ::waitpid(pid_, status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return true;
    }
    if (r < 0 && errno != EINTR) return false;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::string WhyNoOtherUid() {
  if (::geteuid() != 0) return "needs root to run a process as another uid";
  if (::access("/usr/bin/setpriv", X_OK) != 0) return "needs /usr/bin/setpriv (util-linux)";
  return "";
}

std::vector<std::string> AsUid(uid_t uid) {
  const std::string id = std::to_string(uid);
  return {"/usr/bin/setpriv", "--reuid=" + id, "--regid=" + id, "--clear-groups", "--"};
}

void MakeDirectoryOwnedBy(const std::string& path, uid_t uid) {
  if (::mkdir(path.c_str(), 0755) != 0 || ::chown(path.c_str(), uid, uid) != 0 ||
      ::chmod(path.c_str(), 0755) != 0)
    throw std::runtime_error("making " + path + " owned by uid " + std::to_string(uid) + ": " +
                             std::strerror(errno));
}

int CountFds(pid_t pid) {
  int n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

double CpuSeconds(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  // Fields after the command name, which is in parentheses and may hold spaces.
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
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

int ArenaFdCount(pid_t pid) {
  int n = 0;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string().find("memfd:hearth-arena") !=
        std::string::npos)
      ++n;
  }
  return n;
}

std::vector<ArenaMappingInfo> ArenaMappings(pid_t pid) {
  std::vector<ArenaMappingInfo> out;
  std::ifstream smaps("/proc/" + std::to_string(pid) + "/smaps");
  std::string line;
  bool in_arena = false;
  while (std::getline(smaps, line)) {
    const size_t colon = line.find(':');
    const size_t space = line.find(' ');
    const bool header = space != std::string::npos && (colon == std::string::npos || space < colon);
    if (header) {
      in_arena = line.find("memfd:hearth-arena") != std::string::npos;
      if (in_arena) {
        ArenaMappingInfo m;
        m.perms = line.substr(space + 1, 4);
        out.push_back(m);
      }
      continue;
    }
    if (!in_arena) continue;
    const std::string key = line.substr(0, colon);
    const long kib = std::strtol(line.c_str() + colon + 1, nullptr, 10);
    ArenaMappingInfo& m = out.back();
    if (key == "Size") m.size_kib = kib;
    if (key == "Rss") m.rss_kib = kib;
    if (key == "Anonymous") m.anonymous_kib = kib;
    if (key == "Private_Clean") m.private_clean_kib = kib;
    if (key == "Private_Dirty") m.private_dirty_kib = kib;
  }
  return out;
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
