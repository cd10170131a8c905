// The store and the attach client on Windows, run under Wine by `make
// windows`: this process is the store (hearth::Store on its per-user pipe,
// serving a synthetic MLP from a file and one from a sharded directory);
// its children attach through AttachClient.
//
//   - two clients attach at once and see the manifest's checksum, and a
//     third attaches through hearth.dll's C ABI (LoadLibrary, as a program
//     of another language would);
//   - a client that writes through its view dies of an access violation,
//     while a client attached before it and the store go on (the holder
//     reads its view again after the writer has died, and a new client
//     attaches after it);
//   - a name another process listens on already (an impostor that came
//     first) is refused by Store::Create; a bad pipe name is refused;
//   - a cuda:0 store where CUDA cannot be used (no nvcuda.dll under Wine)
//     is refused by Store::Create, naming why, and a CUDA arena's handle
//     is closed by the mapping that refuses it;
//   - bad frames (not the protocol's, over the frame limit, over the
//     message limit, carrying a handle) drop that client alone: the store
//     answers the next one.
// What Wine cannot make: a process of another user (every process runs as
// one user there), so the refusal of another user's client or store is not
// run here (docs/windows.md).
//
// One executable: "attach", "capi", "hold", "write" and "squat" are its children's
// modes. Processes wait for each other on named events and process exits,
// never on time.
#include <windows.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/synthetic.h"
#include "hearth/arena.h"
#include "hearth/attach.h"
#include "hearth/checksum.h"
#include "hearth/hearth.h"
#include "hearth/store.h"
#include "platform/local_channel.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "tests/platform/windows_check.h"
#include "tests/platform/windows_child.h"

using namespace hearth;
using hearth::platform::test::SpawnSelf;
using hearth::platform::test::WaitForChild;

namespace {

constexpr DWORD kWaitMs = 120000;  // for a child to end

std::string EventName(const std::string& pipe, const char* what) {
  return "Local\\" + pipe + "-" + what;
}

HANDLE MakeEvent(const std::string& name) {
  return ::CreateEventA(nullptr, TRUE, FALSE, name.c_str());
}

// A client: attaches `model` and checks its bytes against the checksum the
// store's manifest states and the one the parent expects.
int Attach(const std::string& pipe, const std::string& model, uint64_t expected) {
  auto a = AttachClient(pipe).Attach(model);
  if (!a.ok()) {
    std::fprintf(stderr, "attach: %s\n", a.status().ToString().c_str());
    return 2;
  }
  auto sum = (*a)->ComputeChecksum();
  if (!sum.ok() || *sum != (*a)->checksum() || *sum != expected) {
    std::fprintf(stderr, "attach: checksum %llx, manifest %llx, expected %llx\n",
                 sum.ok() ? static_cast<unsigned long long>(*sum) : 0ull,
                 static_cast<unsigned long long>((*a)->checksum()),
                 static_cast<unsigned long long>(expected));
    return 3;
  }
  return 0;
}

// The same through hearth.dll, found beside this executable: the checksum
// the store stated, and the same recomputed over the tensors' bytes.
template <typename F>
F Find(HMODULE dll, const char* name) {
  // Through void*: FARPROC's type is no function's.
  return reinterpret_cast<F>(reinterpret_cast<void*>(::GetProcAddress(dll, name)));
}

int CApi(const std::string& pipe, const std::string& model, uint64_t expected) {
  const HMODULE dll = ::LoadLibraryA("hearth.dll");
  if (dll == nullptr) {
    std::fprintf(stderr, "capi: LoadLibrary(hearth.dll) failed: %lu\n", ::GetLastError());
    return 2;
  }
  auto attach = Find<decltype(&hearth_attach)>(dll, "hearth_attach");
  auto checksum = Find<decltype(&hearth_checksum)>(dll, "hearth_checksum");
  auto count = Find<decltype(&hearth_tensor_count)>(dll, "hearth_tensor_count");
  auto info = Find<decltype(&hearth_tensor_info_at)>(dll, "hearth_tensor_info_at");
  auto detach = Find<decltype(&hearth_detach)>(dll, "hearth_detach");
  auto last_error = Find<decltype(&hearth_last_error)>(dll, "hearth_last_error");
  auto worker_open = Find<decltype(&hearth_worker_open)>(dll, "hearth_worker_open");
  if (!attach || !checksum || !count || !info || !detach || !last_error || !worker_open) return 3;
  hearth_attachment* a = nullptr;
  if (attach(pipe.c_str(), model.c_str(), 0, &a) != HEARTH_OK) {
    std::fprintf(stderr, "capi: %s\n", last_error());
    return 4;
  }
  std::vector<uint64_t> digests;
  for (size_t i = 0; i < count(a); ++i) {
    hearth_tensor_info t{};
    if (info(a, i, &t) != HEARTH_OK) return 5;
    for (uint64_t off = 0; off < t.nbytes; off += kChecksumBlockBytes)
      digests.push_back(BlockDigest(std::span(static_cast<const std::byte*>(t.data) + off,
                                              std::min(kChecksumBlockBytes, t.nbytes - off))));
  }
  const bool same = checksum(a) == expected && CombineBlockDigests(digests) == expected;
  detach(a);
  // The worker interface is Linux's: refused, saying so.
  hearth_worker* w = nullptr;
  const bool refused = worker_open(0, 0, 0, &w) == HEARTH_ERROR_UNAVAILABLE &&
                       std::string(last_error()).find("Linux only") != std::string::npos;
  return same && refused ? 0 : 6;
}

// Attaches, says so, waits until the writer has died, and reads again.
int Hold(const std::string& pipe, const std::string& model, uint64_t expected) {
  auto a = AttachClient(pipe).Attach(model);
  if (!a.ok()) return 2;
  const HANDLE attached = ::OpenEventA(EVENT_MODIFY_STATE, FALSE, EventName(pipe, "held").c_str());
  const HANDLE writer_gone = ::OpenEventA(SYNCHRONIZE, FALSE, EventName(pipe, "gone").c_str());
  if (attached == nullptr || writer_gone == nullptr) return 4;
  ::SetEvent(attached);
  if (::WaitForSingleObject(writer_gone, 120000) != WAIT_OBJECT_0) return 5;
  auto sum = (*a)->ComputeChecksum();
  return sum.ok() && *sum == expected ? 0 : 3;
}

// Attaches and writes into the first tensor: must die of an access violation.
int Write(const std::string& pipe, const std::string& model) {
  auto a = AttachClient(pipe).Attach(model);
  if (!a.ok()) return 2;
  auto* p = static_cast<volatile unsigned char*>(const_cast<void*>((*a)->tensors()[0].data));
  p[0] = static_cast<unsigned char>(p[0] + 1);
  return 9;  // the write went through
}

// Listens on `pipe` first (an impostor), until told to go.
int Squat(const std::string& pipe) {
  auto l = platform::Listener::Listen(pipe);
  if (!l.ok()) return 2;
  const HANDLE ready = ::OpenEventA(EVENT_MODIFY_STATE, FALSE, EventName(pipe, "squat").c_str());
  const HANDLE done = ::OpenEventA(SYNCHRONIZE, FALSE, EventName(pipe, "unsquat").c_str());
  if (ready == nullptr || done == nullptr) return 4;
  ::SetEvent(ready);
  return ::WaitForSingleObject(done, 120000) == WAIT_OBJECT_0 ? 0 : 5;
}

std::string TempPath(const std::string& leaf) {
  char dir[MAX_PATH] = {};
  ::GetTempPathA(MAX_PATH, dir);
  return std::string(dir) + leaf;
}

// A raw client that sends `frame` (a channel frame) and expects to be
// dropped: an error reply naming `why`, or (when `why` is empty) none.
void SendBad(const std::string& pipe, const std::vector<std::byte>& frame, const std::string& why) {
  auto c = platform::Connect(pipe);
  CHECK(c.ok(), "%s", c.status().ToString().c_str());
  if (!c.ok()) return;
  (void)c->Send(frame);  // may fail once the store has dropped us
  auto reply = protocol::Receive(*c);
  if (why.empty()) {
    CHECK(!reply.ok(), "a reply to a frame the store cannot read");
    return;
  }
  CHECK(reply.ok() && reply->type == protocol::MessageType::kError, "%s",
        reply.ok() ? "not an error" : reply.status().ToString().c_str());
  if (reply.ok()) {
    const Status s = protocol::DecodeError(reply->payload);
    CHECK(s.message().find(why) != std::string::npos, "'%s' does not say '%s'", s.message().c_str(),
          why.c_str());
  }
  // And the store closed it.
  CHECK(!protocol::Receive(*c).ok(), "the connection stayed open");
}

// A channel frame: a handle value, then a protocol frame.
std::vector<std::byte> Framed(uint64_t handle, std::vector<std::byte> frame) {
  std::vector<std::byte> out(8 + frame.size());
  for (int b = 0; b < 8; ++b) out[b] = std::byte((handle >> (8 * b)) & 0xff);
  std::memcpy(out.data() + 8, frame.data(), frame.size());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "attach" && argc == 5)
    return Attach(argv[2], argv[3], std::strtoull(argv[4], nullptr, 16));
  if (mode == "capi" && argc == 5)
    return CApi(argv[2], argv[3], std::strtoull(argv[4], nullptr, 16));
  if (mode == "hold" && argc == 5)
    return Hold(argv[2], argv[3], std::strtoull(argv[4], nullptr, 16));
  if (mode == "write" && argc == 4) return Write(argv[2], argv[3]);
  if (mode == "squat" && argc == 3) return Squat(argv[2]);

  const std::string pipe = "store-test-" + std::to_string(::GetCurrentProcessId());
  const std::string file = TempPath(pipe + ".safetensors");
  const std::string dir = TempPath(pipe + "-sharded");
  CHECK(WriteSyntheticMlp(64, 96, 32, DType::kF32, 7, file, 2).ok(), "writing %s", file.c_str());
  Status sharded = WriteSyntheticMlp(64, 96, 32, DType::kF32, 8, dir, 2, 16 * 1024);
  CHECK(sharded.ok(), "%s", sharded.ToString().c_str());

  // A bad name, and a name an impostor holds, are refused.
  {
    StoreOptions o;
    o.socket_path = "a/b";
    auto s = Store::Create(o);
    CHECK(!s.ok() && s.status().code() == StatusCode::kInvalidArgument, "%s",
          s.status().ToString().c_str());
    const std::string squatted = pipe + "-squatted";
    const HANDLE ready = MakeEvent(EventName(squatted, "squat"));
    const HANDLE done = MakeEvent(EventName(squatted, "unsquat"));
    PROCESS_INFORMATION squatter = SpawnSelf("squat " + squatted);
    ::WaitForSingleObject(ready, 120000);
    o.socket_path = squatted;
    o.models = {{"mlp", file}};
    s = Store::Create(o);
    CHECK(!s.ok() && s.status().code() == StatusCode::kFailedPrecondition, "%s",
          s.status().ToString().c_str());
    ::SetEvent(done);
    CHECK(WaitForChild(squatter, kWaitMs) == 0, "the squatter");
    // A client of the impostor's pipe checks whose it is: ours here (Wine
    // has one user), so only the refusal of a bad name is run.
  }

  // A CUDA store where CUDA cannot be used (Wine has no nvcuda.dll) fails
  // at Create, saying why; the store below then serves from this same
  // process. Mapping a CUDA arena fails the same way, and closes the handle
  // it was given, as a mapping of any handle must.
  {
    std::string why;
    if (CudaAvailable(&why)) {
      std::printf("store_windows_test: CUDA is usable here; its refusal is not run\n");
    } else {
      std::printf("store_windows_test: CUDA is not usable here: %s\n", why.c_str());
      CHECK(why.find("nvcuda.dll could not be loaded") != std::string::npos ||
                why.find("cuInit") != std::string::npos || why == "built without CUDA support",
            "the reason names neither nvcuda.dll nor cuInit: %s", why.c_str());
      StoreOptions o;
      o.socket_path = pipe + "-cuda";
      o.device = Device::Cuda(0);
      o.models = {{"mlp", file}};
      o.show_progress = false;
      auto s = Store::Create(o);
      CHECK(!s.ok() && s.status().code() == StatusCode::kUnavailable &&
                s.status().message().find(why) != std::string::npos,
            "a cuda:0 store: %s", s.ok() ? "made" : s.status().ToString().c_str());
      const HANDLE event = ::CreateEventA(nullptr, TRUE, FALSE, nullptr);
      auto m = ArenaMapping::MapHandle(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(event)),
                                       Device::Cuda(0), 4096);
      CHECK(!m.ok() && m.status().message().find(why) != std::string::npos,
            "mapping a cuda:0 arena: %s", m.ok() ? "mapped" : m.status().ToString().c_str());
      DWORD flags = 0;
      CHECK(!::GetHandleInformation(event, &flags), "the handle given to MapHandle is still open");
    }
  }

  StoreOptions options;
  options.socket_path = pipe;
  options.device = Device::Host();
  options.models = {{"mlp", file}, {"sharded", dir}};
  options.show_progress = false;
  auto store = Store::Create(options);
  CHECK(store.ok(), "%s", store.status().ToString().c_str());
  if (!store.ok()) return 1;
  std::thread serving([&] { CHECK((*store)->Run().ok(), "Run"); });

  AttachClient client(pipe);
  auto models = client.ListModels();
  CHECK(models.ok() && models->size() == 2, "%s", models.status().ToString().c_str());
  if (!models.ok() || models->size() != 2) return 1;
  char mlp_sum[32], sharded_sum[32];
  std::snprintf(mlp_sum, sizeof mlp_sum, "%llx",
                static_cast<unsigned long long>((*models)[0].checksum));
  std::snprintf(sharded_sum, sizeof sharded_sum, "%llx",
                static_cast<unsigned long long>((*models)[1].checksum));
  CHECK((*models)[0].name == "mlp" && (*models)[1].name == "sharded", "model names");

  // Two clients at once, of each model.
  {
    PROCESS_INFORMATION a = SpawnSelf("attach " + pipe + " mlp " + mlp_sum);
    PROCESS_INFORMATION b = SpawnSelf("attach " + pipe + " mlp " + mlp_sum);
    PROCESS_INFORMATION c = SpawnSelf("attach " + pipe + " sharded " + sharded_sum);
    PROCESS_INFORMATION d = SpawnSelf("capi " + pipe + " mlp " + mlp_sum);
    const DWORD ca = WaitForChild(a, kWaitMs), cb = WaitForChild(b, kWaitMs),
                cc = WaitForChild(c, kWaitMs), cd = WaitForChild(d, kWaitMs);
    CHECK(ca == 0 && cb == 0 && cc == 0 && cd == 0, "attaches exited %lu, %lu, %lu, %lu", ca, cb,
          cc, cd);
  }

  // A writer faults alone.
  {
    const HANDLE held = MakeEvent(EventName(pipe, "held"));
    const HANDLE gone = MakeEvent(EventName(pipe, "gone"));
    PROCESS_INFORMATION holder = SpawnSelf("hold " + pipe + " mlp " + mlp_sum);
    CHECK(::WaitForSingleObject(held, 120000) == WAIT_OBJECT_0, "the holder attached");
    PROCESS_INFORMATION writer = SpawnSelf("write " + pipe + " mlp");
    const DWORD wrote = WaitForChild(writer, kWaitMs);
    CHECK(wrote == EXCEPTION_ACCESS_VIOLATION,
          "the writer exited %#lx, not with an access violation", wrote);
    ::SetEvent(gone);
    CHECK(WaitForChild(holder, kWaitMs) == 0,
          "the holder read its view again after the writer died");
    PROCESS_INFORMATION after = SpawnSelf("attach " + pipe + " mlp " + mlp_sum);
    CHECK(WaitForChild(after, kWaitMs) == 0, "a client after the writer");
  }

  // Bad frames drop their client alone.
  {
    auto hello = protocol::EncodeFrames(protocol::MessageType::kListModels, {});
    std::vector<std::byte> junk = hello[0];
    junk[0] = std::byte{0x58};  // not the magic
    SendBad(pipe, Framed(0, junk), "magic");
    SendBad(pipe, Framed(0x44, hello[0]), "handle");
    std::vector<std::byte> huge = hello[0];
    huge[8] = huge[9] = huge[10] = std::byte{0xff};  // a total of 16 MiB
    huge[11] = std::byte{0x00};
    SendBad(pipe, Framed(0, huge), "limit");
    SendBad(pipe, std::vector<std::byte>(protocol::kMaxChannelFrame + 1), "");
    auto unknown = protocol::EncodeFrames(protocol::MessageType::kManifest, {});
    SendBad(pipe, Framed(0, unknown[0]), "may not send");
    PROCESS_INFORMATION next = SpawnSelf("attach " + pipe + " mlp " + mlp_sum);
    CHECK(WaitForChild(next, kWaitMs) == 0, "a client after the bad frames");
  }

  auto status = client.GetStatus();
  CHECK(status.ok() && status->counters["protocol_errors"] >= 4, "%s",
        status.ok() ? std::to_string(status->counters["protocol_errors"]).c_str()
                    : status.status().ToString().c_str());

  (*store)->Stop();
  serving.join();
  ::DeleteFileA(file.c_str());
  std::printf("store_windows_test: %s (%d failures)\n",
              hearth::platform::test::failures == 0 ? "passed" : "FAILED",
              hearth::platform::test::failures);
  return hearth::platform::test::failures == 0 ? 0 : 1;
}
