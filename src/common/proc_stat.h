// /proc/PID/stat, the fields hearth reads: a process's state, parent and
// start time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>

namespace hearth {

struct ProcStat {
  char state = '?';  // R, S, Z, ...
  pid_t parent = 0;
  uint64_t start_ticks = 0;  // since boot, in clock ticks (sysconf(_SC_CLK_TCK))
};

// `pid`'s, or this process's with 0; nullopt if there is no such process or
// its line cannot be read.
std::optional<ProcStat> ReadProcStat(pid_t pid);

}  // namespace hearth
