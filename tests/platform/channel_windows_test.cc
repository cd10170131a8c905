// platform::Listener, Connect and Channel on Windows, run under Wine by
// `make windows`: a store-like parent serves a section to two client
// processes over its per-user pipe, each client checked by the process id
// the kernel gives; a second listener on the same name is refused (no
// squatting); a client sending a frame over the limit is dropped alone and
// the next client is served. One executable: "client" and "bigframe" are
// its children's modes.
#include <windows.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "platform/local_channel.h"
#include "platform/section.h"
#include "windows_check.h"
#include "windows_child.h"

using namespace hearth::platform;
using hearth::platform::test::SpawnSelf;
using hearth::platform::test::WaitForChild;

namespace {

constexpr uint64_t kBytes = 300000;
constexpr DWORD kWaitMs = 60000;  // for a child to end

uint64_t Checksum(const std::byte* p, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  for (uint64_t i = 0; i < n; ++i) h = (h ^ static_cast<uint64_t>(p[i])) * 1099511628211ull;
  return h;
}

std::vector<std::byte> Bytes(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

std::string Text(const std::vector<std::byte>& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

// A client: hello, then the section's handle value, size and checksum;
// answers with the checksum it read.
int Client(const std::string& name) {
  auto channel = Connect(name);
  if (!channel.ok()) {
    std::fprintf(stderr, "client: %s\n", channel.status().ToString().c_str());
    return 2;
  }
  if (!channel->Send(Bytes("hello")).ok()) return 3;
  auto offer = channel->Receive(256);
  if (!offer.ok()) return 4;
  unsigned long long handle = 0, bytes = 0, sum = 0;
  if (std::sscanf(Text(*offer).c_str(), "%llu %llu %llu", &handle, &bytes, &sum) != 3) return 5;
  auto view =
      ReadOnlyView::Map(reinterpret_cast<NativeHandle>(static_cast<uintptr_t>(handle)), bytes);
  if (!view.ok()) {
    std::fprintf(stderr, "client: %s\n", view.status().ToString().c_str());
    return 6;
  }
  const uint64_t got = Checksum(view->bytes().data(), view->bytes().size());
  if (!channel->Send(Bytes(std::to_string(got))).ok()) return 7;
  return got == sum ? 0 : 8;
}

// A client whose first frame claims a gigabyte.
int BigFrame(const std::string& name) {
  auto channel = Connect(name);
  if (!channel.ok()) return 2;
  std::vector<std::byte> big(2048, std::byte{1});
  (void)channel->Send(big);  // over the server's limit of 1024
  return 0;
}

// Serves one client: its hello, the section, its checksum.
void Serve(Listener& listener, const Section& section, uint64_t expected,
           const std::vector<DWORD>& pids) {
  auto channel = listener.Accept();
  CHECK(channel.ok(), "%s", channel.status().ToString().c_str());
  if (!channel.ok()) return;
  bool known = false;
  for (DWORD pid : pids) known = known || pid == channel->peer_pid();
  CHECK(known, "the client's pid %u is none of the children's", channel->peer_pid());
  auto hello = channel->Receive(1024);
  CHECK(hello.ok() && Text(*hello) == "hello", "hello");
  auto handle = section.ShareReadOnly(channel->peer_pid());
  CHECK(handle.ok(), "%s", handle.status().ToString().c_str());
  if (!handle.ok()) return;
  const std::string offer = std::to_string(reinterpret_cast<uintptr_t>(*handle)) + " " +
                            std::to_string(kBytes) + " " + std::to_string(expected);
  CHECK(channel->Send(Bytes(offer)).ok(), "offer");
  auto answer = channel->Receive(64);
  CHECK(answer.ok() && Text(*answer) == std::to_string(expected), "the client read %s",
        answer.ok() ? Text(*answer).c_str() : answer.status().ToString().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "client") return Client(argv[2]);
  if (argc == 3 && std::string(argv[1]) == "bigframe") return BigFrame(argv[2]);

  const std::string name = "channel-test-" + std::to_string(::GetCurrentProcessId());
  CHECK(!PipePath("a/b").ok(), "a name with a slash");
  CHECK(!PipePath("").ok(), "an empty name");
  auto path = PipePath(name);
  CHECK(path.ok() && path->rfind("\\\\.\\pipe\\hearth-S-1-", 0) == 0, "%s",
        path.ok() ? path->c_str() : path.status().ToString().c_str());

  auto listener = Listener::Listen(name);
  CHECK(listener.ok(), "%s", listener.status().ToString().c_str());
  if (!listener.ok()) return 1;
  // The name is taken: a second listener (another store, or an impostor
  // that came first) is refused.
  auto second = Listener::Listen(name);
  CHECK(!second.ok() && second.status().code() == hearth::StatusCode::kFailedPrecondition, "%s",
        second.status().ToString().c_str());

  auto made = Section::Create(kBytes, "channel-test");
  CHECK(made.ok(), "%s", made.status().ToString().c_str());
  if (!made.ok()) return 1;
  for (uint64_t i = 0; i < kBytes; ++i) made->writable()[i] = static_cast<std::byte>(i * 13 + 1);
  const uint64_t expected = Checksum(made->writable().data(), kBytes);
  CHECK(made->Seal().ok(), "seal");

  // Two clients at once.
  PROCESS_INFORMATION a = SpawnSelf("client " + name), b = SpawnSelf("client " + name);
  Serve(*listener, *made, expected, {a.dwProcessId, b.dwProcessId});
  Serve(*listener, *made, expected, {a.dwProcessId, b.dwProcessId});
  const DWORD code_a = WaitForChild(a, kWaitMs), code_b = WaitForChild(b, kWaitMs);
  CHECK(code_a == 0 && code_b == 0, "clients exited %lu and %lu", code_a, code_b);

  // A frame over the limit fails that channel alone; the next client is served.
  PROCESS_INFORMATION big = SpawnSelf("bigframe " + name);
  auto bad = listener->Accept();
  CHECK(bad.ok(), "%s", bad.status().ToString().c_str());
  if (bad.ok()) {
    auto frame = bad->Receive(1024);
    CHECK(!frame.ok() && frame.status().code() == hearth::StatusCode::kInvalidArgument &&
              frame.status().message() == "a frame of 2048 bytes, more than the limit of 1024",
          "%s", frame.status().ToString().c_str());
  }
  WaitForChild(big, kWaitMs);
  PROCESS_INFORMATION c = SpawnSelf("client " + name);
  Serve(*listener, *made, expected, {c.dwProcessId});
  CHECK(WaitForChild(c, kWaitMs) == 0, "a client after the bad one");

  std::printf("channel_windows_test: %s (%d failures)\n",
              hearth::platform::test::failures == 0 ? "passed" : "FAILED",
              hearth::platform::test::failures);
  return hearth::platform::test::failures == 0 ? 0 : 1;
}
