// Test support: a real `hearth store` process on a real socket, and helpers
// to run child processes.
#pragma once

#include <sys/types.h>

#include <cstdint>
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

// Runs `hearth store` with the given extra arguments and waits for its
// "ready" line. Stop() sends SIGTERM and returns the exit status.
class StoreProcess {
 public:
  StoreProcess(std::string socket, std::vector<std::string> args);
  ~StoreProcess();
  // Empty if the store printed "ready"; otherwise what it printed.
  const std::string& startup_error() const { return startup_error_; }
  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  bool alive() const;
  // SIGTERM and wait; returns the raw wait status.
  int Stop();

 private:
  std::string socket_;
  pid_t pid_ = -1;
  std::string startup_error_;
};

// posix_spawn of argv; returns the pid.
pid_t Spawn(const std::vector<std::string>& argv);
// Waits for pid; returns the raw wait status.
int Wait(pid_t pid);
// Runs argv to completion; returns the raw wait status and its stdout.
int Run(const std::vector<std::string>& argv, std::string* out = nullptr);

// Number of open descriptors of a process, and whether any maps or holds a hearth arena.
int CountFds(pid_t pid);
// CountFds once it has read the same value 5 times in a row, 20 ms apart.
int StableFdCount(pid_t pid);
bool HoldsArena(pid_t pid);
// VmRSS of a process in KiB.
long RssKiB(pid_t pid);

std::string CliPath();
std::string ProbePath();

}  // namespace hearth::testing
