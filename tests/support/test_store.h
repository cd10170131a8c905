// Test support: a real `hearth store` process on a real socket, and helpers
// to run child processes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "hearth/status.h"

namespace hearth::testing {

// A fresh directory under $TMPDIR (or /tmp), removed in the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Writes a checkpoint of `count` F32 tensors "t0".."tN" with `floats_each`
// pseudo-random values (seeded), plus one empty and one I8 tensor.
void WriteTestCheckpoint(const std::string& path, int count, size_t floats_each, uint32_t seed);

struct StoreProcessOptions {
  // Runs the store through this command (setpriv to become another uid,
  // prlimit to lower its limits); it must exec the rest of argv.
  std::vector<std::string> prefix;
  std::string log_level = "warn";
  // "NAME=VALUE" set, or "NAME" removed, in the store's environment.
  std::vector<std::string> env;
  // Wait for "ready" in the constructor (startup_error() otherwise says why).
  bool wait_ready = true;
};

// Runs `hearth store` with the given extra arguments and waits for its
// "ready" line. Stop() sends SIGTERM and returns the exit status. Everything
// it prints (stdout and stderr) is kept: output(), WaitForOutput().
class StoreProcess {
 public:
  StoreProcess(std::string socket, std::vector<std::string> args, StoreProcessOptions options = {});
  ~StoreProcess();
  // Empty if the store printed "ready"; otherwise what it printed.
  const std::string& startup_error() const { return startup_error_; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  bool alive() const;
  // SIGTERM and wait; returns the raw wait status.
  int Stop();
  // Waits until the process has exited (true, *status = the raw wait
  // status) or `timeout` has passed (false).
  bool WaitForExit(std::chrono::milliseconds timeout, int* status);
  std::string output() const;
  // Waits until what it printed contains `needle` at least `count` times;
  // false if the timeout passes or the output ends first.
  bool WaitForOutput(const std::string& needle, std::chrono::milliseconds timeout,
                     int count = 1) const;

 private:
  struct Output;
  std::string socket_;
  pid_t pid_ = -1;
  std::string startup_error_;
  std::shared_ptr<Output> output_;
};

// posix_spawn of argv; returns the pid.
pid_t Spawn(const std::vector<std::string>& argv);
// Waits for pid; returns the raw wait status.
int Wait(pid_t pid);
// Runs argv to completion; returns the raw wait status and its stdout.
int Run(const std::vector<std::string>& argv, std::string* out = nullptr);
// The same with `env` changes (as in StoreProcessOptions) and stdout and
// stderr together in *out; a process still running after `timeout` (one
// that should have failed at once and did not) is killed.
int RunWithEnv(const std::vector<std::string>& argv, const std::vector<std::string>& env,
               std::string* out, std::chrono::milliseconds timeout = std::chrono::seconds(60));
// The environment with `changes` applied ("NAME=VALUE" sets, "NAME" removes).
std::vector<std::string> EnvironmentWith(const std::vector<std::string>& changes);

// Running processes as another uid: "" when this process can (it is root and
// setpriv is there), else why not, for GTEST_SKIP.
std::string WhyNoOtherUid();
// A command prefix that runs the rest of an argv as `uid` (and gid `uid`)
// with no supplementary groups; the uid needs no user entry.
std::vector<std::string> AsUid(uid_t uid);
// mkdir `path` (mode 0755) owned by `uid`; throws on failure.
void MakeDirectoryOwnedBy(const std::string& path, uid_t uid);

// Number of open descriptors of a process, and whether any maps or holds a hearth arena.
int CountFds(pid_t pid);
// utime + stime of a process, in seconds.
double CpuSeconds(pid_t pid);
// CountFds once it has read the same value 5 times in a row, 20 ms apart.
int StableFdCount(pid_t pid);
bool HoldsArena(pid_t pid);
// Descriptors of a process that are hearth arenas (memfd:hearth-arena).
int ArenaFdCount(pid_t pid);
// A process's mappings of hearth arenas, from /proc/PID/smaps.
struct ArenaMappingInfo {
  std::string perms;  // "r--s": read-only and shared
  long size_kib = 0, rss_kib = 0, anonymous_kib = 0, private_clean_kib = 0, private_dirty_kib = 0;
};
std::vector<ArenaMappingInfo> ArenaMappings(pid_t pid);
// VmRSS of a process in KiB.
long RssKiB(pid_t pid);

std::string CliPath();
std::string ProbePath();

}  // namespace hearth::testing
