// platform::Section on Windows, run under Wine by `make windows`: a section
// filled by this process and mapped read-only by two child processes, which
// see the same bytes and cannot make their view writable; a child that
// writes through its view faults alone, while this process and the others
// go on. One executable: with no argument it is the parent; "reader" and
// "writer" are its children, which read their handle value on stdin.
#include <windows.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "platform/section.h"
#include "windows_check.h"

using hearth::platform::NativeHandle;
using hearth::platform::ReadOnlyView;
using hearth::platform::Section;

namespace {

constexpr uint64_t kBytes = (uint64_t{1} << 20) + 123;

uint64_t Checksum(const std::byte* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

// The child's half: its handle value from stdin, then what `mode` does.
int Child(const std::string& mode, uint64_t expected) {
  unsigned long long value = 0;
  if (std::scanf("%llu", &value) != 1) {
    std::fprintf(stderr, "child: no handle value on stdin\n");
    return 2;
  }
  auto view =
      ReadOnlyView::Map(reinterpret_cast<NativeHandle>(static_cast<uintptr_t>(value)), kBytes);
  if (!view.ok()) {
    std::fprintf(stderr, "child: %s\n", view.status().ToString().c_str());
    return 3;
  }
  const uint64_t sum = Checksum(view->bytes().data(), view->bytes().size());
  if (sum != expected) {
    std::fprintf(stderr, "child: checksum %llu, expected %llu\n",
                 static_cast<unsigned long long>(sum), static_cast<unsigned long long>(expected));
    return 4;
  }
  const ReadOnlyView::WriteAttempts tried = view->TryToWrite();
  if (tried.mapped_writable || tried.protection_raised || tried.handle_upgraded) {
    std::fprintf(stderr,
                 "child: the read-only view could be made writable (map %d, protect %d, "
                 "handle %d)\n",
                 tried.mapped_writable, tried.protection_raised, tried.handle_upgraded);
    return 5;
  }
  if (mode == "writer") {
    // Must fault: the process ends with EXCEPTION_ACCESS_VIOLATION here,
    // with no debugger or dialog called for it.
    ::SetErrorMode(SEM_FAILCRITICALERRORS | SEM_NOGPFAULTERRORBOX);
    const_cast<volatile std::byte*>(view->bytes().data())[7] = std::byte{0x5a};
    std::fprintf(stderr, "child: a write through the read-only view went through\n");
    return 6;
  }
  return 0;
}

struct Child_ {
  PROCESS_INFORMATION pi{};
  HANDLE stdin_write = nullptr;
};

Child_ Spawn(const std::string& mode, uint64_t expected) {
  Child_ c;
  SECURITY_ATTRIBUTES inherit{sizeof(inherit), nullptr, TRUE};
  HANDLE read_end = nullptr;
  if (!::CreatePipe(&read_end, &c.stdin_write, &inherit, 0)) std::abort();
  ::SetHandleInformation(c.stdin_write, HANDLE_FLAG_INHERIT, 0);
  STARTUPINFOA si{};
  si.cb = sizeof(si);
  si.dwFlags = STARTF_USESTDHANDLES;
  si.hStdInput = read_end;
  si.hStdOutput = ::GetStdHandle(STD_OUTPUT_HANDLE);
  si.hStdError = ::GetStdHandle(STD_ERROR_HANDLE);
  char self[MAX_PATH] = {};
  ::GetModuleFileNameA(nullptr, self, MAX_PATH);
  std::string line = std::string("\"") + self + "\" " + mode + " " + std::to_string(expected);
  std::vector<char> cmd(line.begin(), line.end());
  cmd.push_back('\0');
  if (!::CreateProcessA(nullptr, cmd.data(), nullptr, nullptr, TRUE, 0, nullptr, nullptr, &si,
                        &c.pi)) {
    std::fprintf(stderr, "CreateProcess failed: %lu\n", ::GetLastError());
    std::abort();
  }
  ::CloseHandle(read_end);
  return c;
}

// Hands the child its handle value, then waits for its exit code.
DWORD Give(Child_& c, NativeHandle handle) {
  const std::string line = std::to_string(reinterpret_cast<uintptr_t>(handle)) + "\n";
  DWORD written = 0;
  ::WriteFile(c.stdin_write, line.data(), static_cast<DWORD>(line.size()), &written, nullptr);
  ::CloseHandle(c.stdin_write);
  ::WaitForSingleObject(c.pi.hProcess, 60000);
  DWORD code = 0;
  ::GetExitCodeProcess(c.pi.hProcess, &code);
  ::CloseHandle(c.pi.hProcess);
  ::CloseHandle(c.pi.hThread);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3) return Child(argv[1], std::strtoull(argv[2], nullptr, 10));

  auto made = Section::Create(kBytes, "hearth-test");
  CHECK(made.ok(), "%s", made.status().ToString().c_str());
  if (!made.ok()) return 1;
  Section& section = *made;
  CHECK(section.writable().size() == kBytes, "writable view of %zu bytes",
        section.writable().size());
  for (uint64_t i = 0; i < kBytes; ++i) section.writable()[i] = static_cast<std::byte>(i * 7 + 3);
  const uint64_t expected = Checksum(section.writable().data(), kBytes);

  // Shared only once sealed.
  auto early = section.ShareReadOnly(::GetCurrentProcessId());
  CHECK(!early.ok() && early.status().code() == hearth::StatusCode::kFailedPrecondition, "%s",
        early.status().ToString().c_str());
  CHECK(section.Seal().ok(), "seal");
  CHECK(section.writable().empty(), "writable after the seal");
  CHECK(!Section::Create(0, "empty").ok(), "a section of no bytes");

  // Two readers at once, then a writer, then a reader again.
  Child_ a = Spawn("reader", expected), b = Spawn("reader", expected);
  auto ha = section.ShareReadOnly(a.pi.dwProcessId);
  auto hb = section.ShareReadOnly(b.pi.dwProcessId);
  CHECK(ha.ok() && hb.ok(), "share: %s %s", ha.status().ToString().c_str(),
        hb.status().ToString().c_str());
  const DWORD code_a = Give(a, ha.ok() ? *ha : nullptr), code_b = Give(b, hb.ok() ? *hb : nullptr);
  CHECK(code_a == 0 && code_b == 0, "readers exited %lu and %lu", code_a, code_b);

  Child_ w = Spawn("writer", expected);
  auto hw = section.ShareReadOnly(w.pi.dwProcessId);
  CHECK(hw.ok(), "%s", hw.status().ToString().c_str());
  const DWORD code_w = Give(w, hw.ok() ? *hw : nullptr);
  CHECK(code_w == static_cast<DWORD>(EXCEPTION_ACCESS_VIOLATION), "the writer exited %#lx", code_w);

  Child_ c = Spawn("reader", expected);
  auto hc = section.ShareReadOnly(c.pi.dwProcessId);
  CHECK(hc.ok() && Give(c, *hc) == 0, "a reader after the writer's fault");

  // A view larger than the section, and no handle at all.
  auto self = section.ShareReadOnly(::GetCurrentProcessId());
  CHECK(self.ok(), "%s", self.status().ToString().c_str());
  if (self.ok()) {
    auto too_big = ReadOnlyView::Map(*self, kBytes + (uint64_t{1} << 20));
    CHECK(!too_big.ok() && too_big.status().code() == hearth::StatusCode::kInvalidArgument, "%s",
          too_big.status().ToString().c_str());
  }
  CHECK(!ReadOnlyView::Map(hearth::platform::kNoHandle, 1).ok(), "no handle");
  // A process that does not exist gets no handle.
  CHECK(!section.ShareReadOnly(0xfffffff0u).ok(), "a peer that does not exist");

  std::printf("section_windows_test: %s (%d failures)\n",
              hearth::platform::test::failures == 0 ? "passed" : "FAILED",
              hearth::platform::test::failures);
  return hearth::platform::test::failures == 0 ? 0 : 1;
}
