// The Windows tests' children: this same executable started again with the
// arguments that pick a child's mode, and its exit code once it ends.
#pragma once

#include <windows.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace hearth::platform::test {

// Starts this executable with `args` after its own path. A test that cannot
// start its child cannot go on: it exits with 1.
inline PROCESS_INFORMATION SpawnSelf(const std::string& args) {
  STARTUPINFOA si{};
  si.cb = sizeof(si);
  PROCESS_INFORMATION pi{};
  char self[MAX_PATH] = {};
  ::GetModuleFileNameA(nullptr, self, MAX_PATH);
  std::string line = std::string("\"") + self + "\" " + args;
  std::vector<char> cmd(line.begin(), line.end());
  cmd.push_back('\0');
  if (!::CreateProcessA(nullptr, cmd.data(), nullptr, nullptr, FALSE, 0, nullptr, nullptr, &si,
                        &pi)) {
    std::fprintf(stderr, "CreateProcess failed: %lu\n", ::GetLastError());
    std::exit(1);
  }
  return pi;
}

// Waits for `pi`'s process to end, at most `timeout_ms`, closes its handles
// and returns its exit code (STILL_ACTIVE if it outlived the wait, 1 if
// there is none).
inline DWORD WaitForChild(PROCESS_INFORMATION& pi, DWORD timeout_ms) {
  ::WaitForSingleObject(pi.hProcess, timeout_ms);
  DWORD code = 1;
  ::GetExitCodeProcess(pi.hProcess, &code);
  ::CloseHandle(pi.hProcess);
  ::CloseHandle(pi.hThread);
  return code;
}

}  // namespace hearth::platform::test
