#include "common/proc_stat.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace hearth {

std::optional<ProcStat> ReadProcStat(pid_t pid) {
  char path[64];
  if (pid == 0)
    std::snprintf(path, sizeof path, "/proc/self/stat");
  else
    std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  std::FILE* f = std::fopen(path, "re");
  if (f == nullptr) return std::nullopt;
  char line[1024];
  const size_t n = std::fread(line, 1, sizeof line - 1, f);
  std::fclose(f);
  line[n] = '\0';
  // After the command's name, whatever it holds: " S PPID ...", field 3 on.
  const char* rest = std::strrchr(line, ')');
  ProcStat st;
  int parent = 0;
  if (rest == nullptr || std::sscanf(rest + 1, " %c %d", &st.state, &parent) != 2)
    return std::nullopt;
  st.parent = parent;
  // Field 22, starttime; `rest` is at the end of field 2.
  int field = 2;
  for (const char* c = rest + 1; *c != '\0'; ++c) {
    if (*c != ' ') continue;
    if (++field == 22) {
      st.start_ticks = std::strtoull(c + 1, nullptr, 10);
      break;
    }
  }
  if (field != 22) return std::nullopt;
  return st;
}

}  // namespace hearth
