// Multi-process tests of the store and the attach client on host memory:
// a real `hearth store` process, real clients, real sockets.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#include "support/raw_connection.h"
#include "support/test_store.h"

extern char** environ;

namespace hearth {
namespace {

using testing::HoldsArena;
using testing::StoreProcess;
using testing::TempDir;

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_path_ = dir_.File("model.safetensors");
    testing::WriteTestCheckpoint(model_path_, 6, 100000, 1);
    socket_ = dir_.File("run/store.sock");
    store_ = std::make_unique<StoreProcess>(
        socket_, std::vector<std::string>{"--device", "cpu", "--model", "m=" + model_path_});
    ASSERT_EQ(store_->startup_error(), "");
  }

  // Polls the store's status until `pred` holds or 10 s pass.
  template <typename Pred>
  StoreStatus WaitForStatus(Pred pred) {
    StoreStatus last;
    for (int i = 0; i < 1000; ++i) {
      auto s = AttachClient(socket_).GetStatus();
      if (s.ok()) {
        last = *s;
        if (pred(last)) return last;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return last;
  }

  TempDir dir_;
  std::string model_path_;
  std::string socket_;
  std::unique_ptr<StoreProcess> store_;
};

TEST_F(StoreTest, EightProcessesSeeEveryTensorAsInTheFile) {
  std::vector<pid_t> pids;
  for (int i = 0; i < 8; ++i)
    pids.push_back(testing::Spawn({testing::ProbePath(), "check", socket_, "m", model_path_}));
  for (pid_t pid : pids) {
    const int status = testing::Wait(pid);
    ASSERT_TRUE(WIFEXITED(status)) << "probe died with signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0);
  }
}

TEST_F(StoreTest, SocketAndDirectoryPermissions) {
  struct stat st;
  ASSERT_EQ(::stat(socket_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  ASSERT_EQ(::stat(dir_.File("run").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750u);
}

TEST_F(StoreTest, AttachedTensorsMatchTheManifestAndAreReadOnly) {
  auto a = AttachClient(socket_).Attach("m");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->model(), "m");
  EXPECT_EQ((*a)->version(), 1u);
  EXPECT_FALSE((*a)->device().is_cuda());
  ASSERT_EQ((*a)->tensors().size(), 8u);
  for (const TensorView& t : (*a)->tensors()) {
    EXPECT_EQ(t.offset % 256, 0u) << t.name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data) % 256, 0u) << t.name;
  }
  auto sum = (*a)->ComputeChecksum();
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, (*a)->checksum());
  // The mapping is PROT_READ: mprotect to writable must fail (the descriptor is O_RDONLY).
  const TensorView* t0 = (*a)->Find("t0");
  ASSERT_NE(t0, nullptr);
  const uintptr_t page = reinterpret_cast<uintptr_t>(t0->data) & ~uintptr_t{4095};
  EXPECT_NE(::mprotect(reinterpret_cast<void*>(page), 4096, PROT_READ | PROT_WRITE), 0);
}

TEST_F(StoreTest, WritingThroughTheMappingKillsOnlyTheWriter) {
  const pid_t holder = testing::Spawn({testing::ProbePath(), "hold", socket_, "m"});
  WaitForStatus([](const StoreStatus& s) { return s.leases.size() == 1; });
  const int status = testing::Wait(testing::Spawn({testing::ProbePath(), "write", socket_, "m"}));
  ASSERT_TRUE(WIFSIGNALED(status)) << "the write did not fault; exit " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGSEGV);
  EXPECT_TRUE(store_->alive());
  EXPECT_EQ(::kill(holder, 0), 0) << "the other client must keep running";
  const int check = testing::Wait(testing::Spawn({testing::ProbePath(), "check", socket_, "m", model_path_}));
  EXPECT_TRUE(WIFEXITED(check) && WEXITSTATUS(check) == 0);
  ::kill(holder, SIGKILL);
  testing::Wait(holder);
}

TEST_F(StoreTest, LeasesEndWhenClientsDieMidAttachOrWhileAttached) {
  for (int i = 0; i < 20; ++i) {
    const int status = testing::Wait(testing::Spawn({testing::ProbePath(), "half-attach", socket_, "m"}));
    ASSERT_TRUE(WIFSIGNALED(status));
  }
  std::vector<pid_t> holders;
  for (int i = 0; i < 4; ++i) holders.push_back(testing::Spawn({testing::ProbePath(), "hold", socket_, "m"}));
  StoreStatus s = WaitForStatus([](const StoreStatus& st) { return st.leases.size() == 4; });
  ASSERT_EQ(s.leases.size(), 4u);
  for (const LeaseInfo& l : s.leases) {
    EXPECT_EQ(l.model, "m");
    EXPECT_EQ(l.uid, ::getuid());
    EXPECT_NE(std::find(holders.begin(), holders.end(), l.pid), holders.end());
    EXPECT_GT(l.since_ms, 0);
  }
  for (pid_t pid : holders) {
    ::kill(pid, SIGKILL);
    testing::Wait(pid);
  }
  s = WaitForStatus([](const StoreStatus& st) { return st.leases.empty() && st.connections == 1; });
  EXPECT_TRUE(s.leases.empty());
  EXPECT_EQ(s.connections, 1u) << "only the status connection itself";
  ASSERT_EQ(s.arenas.size(), 1u);
  EXPECT_EQ(s.arenas[0].attached, 0u);
  EXPECT_TRUE(store_->alive());
}

TEST_F(StoreTest, UnloadedVersionIsGoneAtOnceAndFreedAfterItsLastClient) {
  AttachClient client(socket_);
  const std::string second = dir_.File("second.safetensors");
  testing::WriteTestCheckpoint(second, 3, 1 << 20, 2);
  auto loaded = client.Load("m", second);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded->version, 2u);
  auto latest = client.Attach("m");
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ((*latest)->version(), 2u);
  latest->reset();

  auto held = client.Attach("m", 2);
  ASSERT_TRUE(held.ok());

  auto removed = client.Unload("m", 2);
  ASSERT_TRUE(removed.ok()) << removed.status().ToString();
  EXPECT_EQ(*removed, 1u);
  auto list = client.ListModels();
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].version, 1u);
  auto again = client.Attach("m", 2);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), StatusCode::kNotFound);

  StoreStatus s = *client.GetStatus();
  ASSERT_EQ(s.arenas.size(), 2u);
  int unloaded = 0;
  for (const ArenaInfo& a : s.arenas) {
    if (!a.registered) {
      ++unloaded;
      EXPECT_EQ(a.version, 2u);
      EXPECT_EQ(a.attached, 1u);
    }
  }
  EXPECT_EQ(unloaded, 1);
  // The old version's bytes stay readable while attached.
  auto sum = (*held)->ComputeChecksum();
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, (*held)->checksum());

  held->reset();
  s = WaitForStatus([](const StoreStatus& st) { return st.arenas.size() == 1; });
  ASSERT_EQ(s.arenas.size(), 1u);
  EXPECT_EQ(s.arenas[0].version, 1u);
  // Version 1 stays registered; drop it too, then nothing of either may remain in the store.
  ASSERT_TRUE(client.Unload("m").ok());
  s = WaitForStatus([](const StoreStatus& st) { return st.arenas.empty(); });
  EXPECT_TRUE(s.arenas.empty());
  EXPECT_FALSE(HoldsArena(store_->pid())) << "the store still holds a memfd after the last detach";
  EXPECT_FALSE(HoldsArena(::getpid()));
}

// load-v2: a version is reused (nothing read, no new version) only while
// the store holds it, read from the same path, and the files there are the
// ones it read; rewritten files, another path or an unloaded version load
// anew, or with reuse_only are refused with FAILED_PRECONDITION saying why.
TEST_F(StoreTest, LoadV2ReusesAVersionOnlyWhileItsFilesAreUnchanged) {
  AttachClient client(socket_);
  auto versions = [&] {
    std::vector<uint64_t> out;
    auto list = client.ListModels();
    EXPECT_TRUE(list.ok()) << list.status().ToString();
    for (const ModelSummary& m : list.ok() ? *list : std::vector<ModelSummary>{})
      if (m.name == "n") out.push_back(m.version);
    return out;
  };
  auto refused = [](const Result<StoreLoad>& r, const std::string& says) {
    ASSERT_FALSE(r.ok()) << "reused " << r->reused << " version " << r->model.version;
    EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status().ToString();
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
  };
  // The model the store loaded at start is reused too.
  auto preloaded = client.LoadOrReuse("m", model_path_, 1);
  ASSERT_TRUE(preloaded.ok()) << preloaded.status().ToString();
  EXPECT_TRUE(preloaded->reused);
  EXPECT_EQ(preloaded->model.version, 1u);

  const std::string path = dir_.File("n.safetensors");
  testing::WriteTestCheckpoint(path, 3, 4096, 5);
  auto first = client.LoadOrReuse("n", path, 0);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(first->reused);
  EXPECT_EQ(first->model.version, 1u);
  for (bool reuse_only : {false, true}) {
    auto again = client.LoadOrReuse("n", path, 1, reuse_only);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_TRUE(again->reused);
    EXPECT_EQ(again->model.version, 1u);
    EXPECT_EQ(again->model.checksum, first->model.checksum);
  }
  EXPECT_EQ(versions(), (std::vector<uint64_t>{1}));
  EXPECT_EQ(client.GetStatus()->arenas.size(), 2u) << "a reuse holds nothing more";

  // The same name and path, other bytes: not version 1's files any more.
  testing::WriteTestCheckpoint(path, 3, 4096, 6);
  refused(client.LoadOrReuse("n", path, 1, /*reuse_only=*/true), "has changed since version 1");
  EXPECT_EQ(versions(), (std::vector<uint64_t>{1})) << "reuse_only loads nothing";
  auto second = client.LoadOrReuse("n", path, 1);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_FALSE(second->reused);
  EXPECT_EQ(second->model.version, 2u);
  EXPECT_NE(second->model.checksum, first->model.checksum);
  auto reused = client.LoadOrReuse("n", path, 2);
  ASSERT_TRUE(reused.ok()) << reused.status().ToString();
  EXPECT_TRUE(reused->reused);
  EXPECT_EQ(reused->model.version, 2u);
  EXPECT_EQ(versions(), (std::vector<uint64_t>{1, 2}));

  // Another path holding the same bytes is another checkpoint.
  const std::string copy = dir_.File("copy.safetensors");
  std::filesystem::copy_file(path, copy);
  refused(client.LoadOrReuse("n", copy, 2, /*reuse_only=*/true), "was loaded from " + path);
  auto third = client.LoadOrReuse("n", copy, 2);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_FALSE(third->reused);
  EXPECT_EQ(third->model.version, 3u);

  // A version unloaded is not reused, whatever the files.
  ASSERT_TRUE(client.Unload("n", 2).ok());
  refused(client.LoadOrReuse("n", path, 2, /*reuse_only=*/true), "no model 'n@2'");
  auto fourth = client.LoadOrReuse("n", path, 2);
  ASSERT_TRUE(fourth.ok()) << fourth.status().ToString();
  EXPECT_FALSE(fourth->reused);
  EXPECT_EQ(fourth->model.version, 4u);
  EXPECT_EQ(fourth->model.checksum, second->model.checksum);

  // Files that cannot be read are an error, reusing or not, naming them.
  std::filesystem::remove(path);
  for (bool reuse_only : {false, true}) {
    auto gone = client.LoadOrReuse("n", path, 4, reuse_only);
    ASSERT_FALSE(gone.ok());
    EXPECT_NE(gone.status().code(), StatusCode::kFailedPrecondition) << gone.status().ToString();
    EXPECT_NE(gone.status().message().find(path), std::string::npos) << gone.status().message();
  }
  EXPECT_EQ(versions(), (std::vector<uint64_t>{1, 3, 4}));
  EXPECT_TRUE(store_->alive());
}

// A store of protocol 1.1 knows no load-v2: it answers the frame with
// "unknown message type" and closes, as its frame check does. The client
// then asks `load` (never reused); with reuse_only it loads nothing.
TEST(StoreProtocolRevisions, AStoreOf11IsAskedLoadInsteadOfLoadV2) {
  TempDir dir;
  const std::string path = dir.File("old.sock");
  UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(listener.get(), 4), 0);
  std::vector<std::string> asked;
  auto refuse_load_v2 = [&] {
    UniqueFd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    std::vector<std::byte> frame(protocol::kFrameHeaderBytes + protocol::kMaxFramePayload);
    const ssize_t n = ::recv(c.get(), frame.data(), frame.size(), 0);
    asked.push_back(n >= 8 && frame[6] == std::byte{14} ? "load-v2" : "something else");
    ASSERT_TRUE(
        protocol::SendMessage(c.get(), protocol::MessageType::kError,
                              protocol::EncodeError(InvalidArgument("unknown message type 14")))
            .ok());
  };
  std::thread old_store([&] {
    refuse_load_v2();
    UniqueFd c(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    auto m = protocol::ReceiveMessage(c.get());
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    asked.push_back(protocol::MessageTypeName(m->type));
    auto req = protocol::DecodeLoad(m->payload);
    ASSERT_TRUE(req.ok()) << req.status().ToString();
    ModelSummary loaded;
    loaded.name = req->name;
    loaded.version = 3;
    loaded.path = req->path;
    ASSERT_TRUE(protocol::SendMessage(c.get(), protocol::MessageType::kLoaded,
                                      protocol::EncodeLoaded(loaded))
                    .ok());
    refuse_load_v2();
  });
  auto loaded = AttachClient(path).LoadOrReuse("m", "/m.safetensors", 2);
  auto reuse_only = AttachClient(path).LoadOrReuse("m", "/m.safetensors", 2, /*reuse_only=*/true);
  old_store.join();
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_FALSE(loaded->reused);
  EXPECT_EQ(loaded->model.version, 3u);
  ASSERT_FALSE(reuse_only.ok());
  EXPECT_EQ(reuse_only.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(reuse_only.status().message().find("protocol 1.1"), std::string::npos)
      << reuse_only.status().message();
  EXPECT_EQ(asked, (std::vector<std::string>{"load-v2", "load", "load-v2"}));
}

TEST_F(StoreTest, TenThousandAttachDetachCyclesLeakNothing) {
  AttachClient client(socket_);
  auto warm = client.Attach("m");
  ASSERT_TRUE(warm.ok());
  warm->reset();
  WaitForStatus([](const StoreStatus& st) { return st.leases.empty(); });
  const int fds_before = testing::StableFdCount(store_->pid());
  const int own_fds_before = testing::CountFds(::getpid());
  // The store holds its one arena descriptor and, once sealed, no mapping of it.
  EXPECT_EQ(testing::ArenaFdCount(store_->pid()), 1);
  EXPECT_TRUE(testing::ArenaMappings(store_->pid()).empty());
  for (int i = 0; i < 10000; ++i) {
    auto a = client.Attach("m");
    ASSERT_TRUE(a.ok()) << "cycle " << i << ": " << a.status().ToString();
    if (i == 0) {
      // While attached: one shared read-only mapping, no private copy of a page.
      const auto maps = testing::ArenaMappings(::getpid());
      ASSERT_EQ(maps.size(), 1u);
      EXPECT_EQ(maps[0].perms, "r--s");
      EXPECT_EQ(maps[0].anonymous_kib, 0);
      EXPECT_EQ(maps[0].private_dirty_kib, 0);
    }
  }
  StoreStatus s = WaitForStatus([](const StoreStatus& st) { return st.leases.empty() && st.connections == 1; });
  EXPECT_TRUE(s.leases.empty());
  ASSERT_EQ(s.arenas.size(), 1u);
  EXPECT_EQ(s.arenas[0].attached, 0u);
  EXPECT_EQ(testing::StableFdCount(store_->pid()), fds_before);
  EXPECT_EQ(testing::CountFds(::getpid()), own_fds_before);
  // Nothing of the 10000 exports stayed behind on either side. (Heap leaks in
  // the store are the sanitizer build's to find: its RSS is the allocator's.)
  EXPECT_EQ(testing::ArenaFdCount(store_->pid()), 1);
  EXPECT_TRUE(testing::ArenaMappings(store_->pid()).empty());
  EXPECT_TRUE(testing::ArenaMappings(::getpid()).empty());
  EXPECT_EQ(testing::ArenaFdCount(::getpid()), 0);
}

// Raw protocol abuse: each case must get an error reply and a closed
// connection, and the store must go on serving.
using testing::Frame;
using testing::RawConnection;

TEST_F(StoreTest, MalformedMessagesCloseOnlyTheirConnection) {
  using protocol::kMagic;
  const uint16_t attach = static_cast<uint16_t>(protocol::MessageType::kAttach);
  const uint16_t load_v2 = static_cast<uint16_t>(protocol::MessageType::kLoadV2);
  auto LoadV2Frame = [](const std::vector<std::byte>& payload) {
    return protocol::EncodeFrames(protocol::MessageType::kLoadV2, payload)[0];
  };
  std::vector<std::byte> unknown_flags = protocol::EncodeLoadV2({"m", model_path_, 1, false});
  unknown_flags.back() = std::byte{2};
  struct Case {
    const char* name;
    std::vector<std::byte> frame;
    const char* expect;
  };
  std::vector<Case> cases = {
      {"short frame", std::vector<std::byte>(7, std::byte{1}), "truncated frame"},
      {"bad magic", Frame(0x12345678, 1, attach, 0, 0, 0), "magic"},
      {"future version", Frame(kMagic, 99, attach, 0, 0, 0), "version 99"},
      {"unknown type", Frame(kMagic, 1, 999, 0, 0, 0), "unknown message type"},
      {"oversized total", Frame(kMagic, 1, attach, 1u << 30, 0, 4), "exceeds the limit"},
      {"oversized frame", Frame(kMagic, 1, attach, 100000, 0, 64 * 1024), "frame"},
      {"first frame not at 0", Frame(kMagic, 1, attach, 10, 5, 5), "offset 0"},
      {"more bytes than declared", Frame(kMagic, 1, attach, 2, 0, 8), "more bytes"},
      {"attach payload truncated", Frame(kMagic, 1, attach, 3, 0, 3), "runs past"},
      {"reply type from a client", Frame(kMagic, 1, static_cast<uint16_t>(protocol::MessageType::kManifest), 0, 0, 0), "may not send"},
      {"status with payload", Frame(kMagic, 1, static_cast<uint16_t>(protocol::MessageType::kStatus), 1, 0, 1), "must be empty"},
      {"oversized load-v2", Frame(kMagic, 1, load_v2, 1u << 30, 0, 4), "exceeds the limit"},
      {"load-v2 without its new fields", LoadV2Frame(protocol::EncodeLoad({"m", model_path_})),
       "reuse_version"},
      {"load-v2 with unknown flags", LoadV2Frame(unknown_flags), "unknown flags 2"},
      {"load-v2 reuse_only without a version",
       LoadV2Frame(protocol::EncodeLoadV2({"m", model_path_, 0, true})),
       "reuse_only without a reuse_version"},
      {"loaded-v2 from a client",
       Frame(kMagic, 1, static_cast<uint16_t>(protocol::MessageType::kLoadedV2), 0, 0, 0),
       "may not send"},
  };
  for (const Case& c : cases) {
    RawConnection conn(socket_);
    ASSERT_TRUE(conn.connected());
    conn.SendRaw(c.frame);
    const std::string error = conn.ExpectErrorAndClose();
    EXPECT_NE(error.find(c.expect), std::string::npos) << c.name << ": got '" << error << "'";
  }
  {
    // A descriptor from a client is refused.
    RawConnection conn(socket_);
    int pipefd[2];
    ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
    conn.SendRaw(protocol::EncodeFrames(protocol::MessageType::kStatus, {})[0], pipefd[0]);
    EXPECT_NE(conn.ExpectErrorAndClose().find("descriptor"), std::string::npos);
    ::close(pipefd[0]);
    ::close(pipefd[1]);
  }
  {
    // A message that stops half-way and a client that vanishes.
    RawConnection conn(socket_);
    conn.SendRaw(Frame(kMagic, 1, attach, 100, 0, 50));
  }
  // Requests that are well-formed but wrong get an error and keep the connection.
  auto missing = AttachClient(socket_).Attach("no-such-model");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("no-such-model"), std::string::npos);
  auto bad_load = AttachClient(socket_).Load("x", dir_.File("missing.safetensors"));
  ASSERT_FALSE(bad_load.ok());
  EXPECT_NE(bad_load.status().message().find("missing.safetensors"), std::string::npos);

  EXPECT_TRUE(store_->alive());
  const int check = testing::Wait(testing::Spawn({testing::ProbePath(), "check", socket_, "m", model_path_}));
  EXPECT_TRUE(WIFEXITED(check) && WEXITSTATUS(check) == 0);
  StoreStatus s = WaitForStatus([](const StoreStatus& st) { return st.connections == 1; });
  EXPECT_EQ(s.connections, 1u);
}

TEST_F(StoreTest, ChildrenInheritOnlyTheDescriptorsTheyAreHanded) {
  // Descriptors this test process itself inherited without close-on-exec
  // (from the shell or the test runner) legitimately pass on; hearth's own must not.
  std::string expected = "0\n1\n2\n3\n";
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(e.path().filename().string());
    if (fd <= 3) continue;
    const int flags = ::fcntl(fd, F_GETFD);
    if (flags >= 0 && !(flags & FD_CLOEXEC)) expected += std::to_string(fd) + "\n";
  }
  auto a = AttachClient(socket_).Attach("m");
  ASSERT_TRUE(a.ok());
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  int handed[2];
  ASSERT_EQ(::pipe2(handed, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipefd[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, handed[0], 3);
  std::string probe = testing::ProbePath();
  char* argv[] = {probe.data(), const_cast<char*>("fds"), nullptr};
  pid_t pid;
  ASSERT_EQ(posix_spawn(&pid, argv[0], &actions, nullptr, argv, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(pipefd[1]);
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(pipefd[0]);
  ::close(handed[0]);
  ::close(handed[1]);
  testing::Wait(pid);
  EXPECT_EQ(out, expected) << "the child inherited more than stdio and the handed descriptor";
}

TEST_F(StoreTest, SigtermRemovesTheSocketAndExitsCleanly) {
  auto a = AttachClient(socket_).Attach("m");
  ASSERT_TRUE(a.ok());
  const int status = store_->Stop();
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_FALSE(std::filesystem::exists(socket_));
  // The mapping outlives the store.
  auto sum = (*a)->ComputeChecksum();
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(*sum, (*a)->checksum());
}

TEST_F(StoreTest, SecondStoreOnTheSameSocketIsRefusedAndStaleSocketsAreReplaced) {
  StoreProcess second(socket_, {"--device", "cpu"});
  EXPECT_NE(second.startup_error().find("another store is serving"), std::string::npos)
      << second.startup_error();
  store_->Stop();
  // Leave a stale socket file behind, as a crashed store would.
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket_.c_str());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::close(fd);
  StoreProcess third(socket_, {"--device", "cpu", "--model", "m=" + model_path_});
  EXPECT_EQ(third.startup_error(), "");
  EXPECT_TRUE(AttachClient(socket_).Attach("m").ok());
}

TEST_F(StoreTest, MalformedCheckpointIsRejectedByNameAndTheStoreKeepsServing) {
  const std::string bad = dir_.File("bad.safetensors");
  {
    std::FILE* f = std::fopen(bad.c_str(), "wb");
    const char text[] = "\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":1}        ";
    std::fwrite(text, 1, sizeof text - 1, f);
    std::fclose(f);
  }
  auto loaded = AttachClient(socket_).Load("bad", bad);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loaded.status().message().find("bad.safetensors"), std::string::npos)
      << loaded.status().message();
  auto list = AttachClient(socket_).ListModels();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 1u);
}

// Peers of another uid: refused unless allowed; never allowed to load or unload.
// Needs root to become another user.
TEST_F(StoreTest, PeerCredentialsAreChecked) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client under another uid";
  const std::string open_dir = dir_.File("open");
  ::mkdir(open_dir.c_str(), 0755);
  const std::string strict_socket = open_dir + "/strict.sock";
  const std::string allow_socket = open_dir + "/allow.sock";
  StoreProcess strict(strict_socket, {"--device", "cpu", "--socket-mode", "0666", "--model", "m=" + model_path_});
  ASSERT_EQ(strict.startup_error(), "");
  StoreProcess allow(allow_socket, {"--device", "cpu", "--socket-mode", "0666", "--allow-uid", "65534", "--model", "m=" + model_path_});
  ASSERT_EQ(allow.startup_error(), "");
  ::chmod(dir_.path().c_str(), 0755);

  // Runs fn as uid 65534 in a forked child (no CUDA in this process) and returns its exit code.
  auto as_nobody = [](auto fn) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(100);
      ::_exit(fn());
    }
    const int status = testing::Wait(pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 200;
  };
  EXPECT_EQ(as_nobody([&] {
              auto a = AttachClient(strict_socket).Attach("m");
              if (!a.ok() && a.status().code() == StatusCode::kPermissionDenied) return 0;
              std::fprintf(stderr, "strict store answered: %s\n", a.ok() ? "attached" : a.status().ToString().c_str());
              return 1;
            }), 0);
  EXPECT_EQ(as_nobody([&] {
              auto a = AttachClient(allow_socket).Attach("m");
              return a.ok() ? 0 : 1;
            }), 0);
  EXPECT_EQ(as_nobody([&] {
              auto u = AttachClient(allow_socket).Unload("m");
              return !u.ok() && u.status().code() == StatusCode::kPermissionDenied ? 0 : 1;
            }), 0);
  EXPECT_TRUE(AttachClient(allow_socket).Attach("m").ok());
}

}  // namespace
}  // namespace hearth
