// Who may stand behind a store socket: real `hearth store` processes, some of
// them run as an unprivileged uid (setpriv, as root), against the store's
// directory checks and the clients' check of the store's credentials; and
// stopping a store with a signal while it loads.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "support/test_store.h"

namespace hearth {
namespace {

using testing::StoreProcess;
using testing::StoreProcessOptions;
using testing::TempDir;

// An unprivileged uid with no user entry.
constexpr uid_t kOtherUid = 54329;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The environment of a client or store whose default socket path must come
// from XDG_RUNTIME_DIR (TMPDIR set too: it must not matter).
std::vector<std::string> DefaultPathEnv(const std::string& runtime_dir) {
  return {"HEARTH_SOCKET", "HEARTH_STORE_UID", "TMPDIR=/nonexistent-tmpdir",
          "XDG_RUNTIME_DIR=" + runtime_dir};
}

class StoreTrustTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::unsetenv("HEARTH_STORE_UID");
    model_ = dir_.File("model.safetensors");
    testing::WriteTestCheckpoint(model_, 3, 1000, 4);
  }
  TempDir dir_;
  std::string model_;
};

// Without $HEARTH_SOCKET and $XDG_RUNTIME_DIR the default is in /tmp, whatever
// $TMPDIR says: a store under systemd (no TMPDIR) and a shell must agree.
TEST_F(StoreTrustTest, TheDefaultSocketPathIgnoresTmpdir) {
  const std::vector<std::string> env = {"HEARTH_SOCKET", "XDG_RUNTIME_DIR",
                                        "TMPDIR=" + dir_.path()};
  std::string out;
  const int status = testing::RunWithEnv({testing::CliPath(), "list", "--help"}, env, &out);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  const std::string expected = "/tmp/hearth-" + std::to_string(::geteuid()) + "/store.sock";
  EXPECT_TRUE(Contains(out, expected)) << out;
  EXPECT_FALSE(Contains(out, dir_.path())) << out;
}

TEST_F(StoreTrustTest, ADefaultSocketDirectoryPreCreatedByAnotherUserIsRefused) {
  if (std::string why = testing::WhyNoOtherUid(); !why.empty()) GTEST_SKIP() << why;
  // A private stand-in for $XDG_RUNTIME_DIR, sticky and world-writable so that
  // another uid can create hearth/ in it before the store does (the real
  // runtime directory of whoever runs this is never touched).
  const std::string tmp = dir_.File("xdg");
  ASSERT_EQ(::mkdir(tmp.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(tmp.c_str(), 01777), 0);
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
  const std::string squatted = tmp + "/hearth";
  std::vector<std::string> mkdir = testing::AsUid(kOtherUid);
  for (const char* a : {"/bin/mkdir", "-m", "0777"}) mkdir.push_back(a);
  mkdir.push_back(squatted);
  ASSERT_EQ(testing::Run(mkdir), 0);
  ::chmod(squatted.c_str(), 0777);  // as it would be whatever our umask

  // The default path, as every hearth command computes it, is in there.
  std::string out;
  const std::vector<std::string> env = DefaultPathEnv(tmp);
  const int status = testing::RunWithEnv(
      {testing::CliPath(), "store", "--device", "cpu", "--model", "m=" + model_}, env, &out);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0) << out;
  EXPECT_TRUE(Contains(out, squatted)) << out;
  EXPECT_TRUE(Contains(out, "owner uid " + std::to_string(kOtherUid))) << out;
  EXPECT_TRUE(Contains(out, "mode 0777")) << out;
  EXPECT_FALSE(std::filesystem::exists(squatted + "/store.sock"));

  // Not writable by others but still not ours: refused too.
  ASSERT_EQ(::chmod(squatted.c_str(), 0755), 0);
  testing::RunWithEnv({testing::CliPath(), "store", "--device", "cpu"}, env, &out);
  EXPECT_TRUE(Contains(out, "owner uid " + std::to_string(kOtherUid)) && Contains(out, "mode 0755"))
      << out;
}

// A store run by another uid on a path of its own, and the clients of root.
class ForeignStoreTest : public StoreTrustTest {
 protected:
  void SetUp() override {
    if (std::string why = testing::WhyNoOtherUid(); !why.empty()) GTEST_SKIP() << why;
    StoreTrustTest::SetUp();
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
    ASSERT_EQ(::chmod(model_.c_str(), 0644), 0);
    const std::string own = dir_.File("other");
    testing::MakeDirectoryOwnedBy(own, kOtherUid);
    socket_ = own + "/store.sock";
    StoreProcessOptions options;
    options.prefix = testing::AsUid(kOtherUid);
    store_ =
        std::make_unique<StoreProcess>(socket_,
                                       std::vector<std::string>{"--device", "cpu", "--socket-mode",
                                                                "0666", "--model", "m=" + model_},
                                       options);
    ASSERT_EQ(store_->startup_error(), "");
  }
  void TearDown() override { ::unsetenv("HEARTH_STORE_UID"); }

  void ExpectRefusal(const Status& s) {
    EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), socket_)) << s.message();
    EXPECT_TRUE(Contains(s.message(), "uid " + std::to_string(kOtherUid))) << s.message();
    EXPECT_TRUE(Contains(s.message(), "pid " + std::to_string(store_->pid()))) << s.message();
  }

  std::string socket_;
  std::unique_ptr<StoreProcess> store_;
};

TEST_F(ForeignStoreTest, AttachClientRefusesItUnlessItsUidIsTrusted) {
  auto a = AttachClient(socket_).Attach("m");
  ASSERT_FALSE(a.ok()) << "attached to a store of uid " << kOtherUid;
  ExpectRefusal(a.status());
  auto list = AttachClient(socket_).ListModels();
  ASSERT_FALSE(list.ok());
  ExpectRefusal(list.status());
  auto status = AttachClient(socket_).GetStatus();
  ASSERT_FALSE(status.ok());
  ExpectRefusal(status.status());

  auto trusted = AttachClient(AttachOptions{socket_, {kOtherUid}}).Attach("m");
  ASSERT_TRUE(trusted.ok()) << trusted.status().ToString();
  EXPECT_EQ((*trusted)->tensors().size(), 5u);

  ASSERT_EQ(::setenv("HEARTH_STORE_UID", ("1," + std::to_string(kOtherUid)).c_str(), 1), 0);
  auto from_env = AttachClient(socket_).Attach("m");
  EXPECT_TRUE(from_env.ok()) << from_env.status().ToString();

  ASSERT_EQ(::setenv("HEARTH_STORE_UID", "12,abc", 1), 0);
  auto bad = AttachClient(socket_).Attach("m");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(bad.status().message(), "HEARTH_STORE_UID='12,abc'"))
      << bad.status().message();

  // Set but empty is unset (what `hearth serve`'s workers may inherit): no
  // error, and no uid trusted by it.
  ASSERT_EQ(::setenv("HEARTH_STORE_UID", "", 1), 0);
  auto uids = AttachClient::StoreUidsFromEnvironment();
  ASSERT_TRUE(uids.ok()) << uids.status().ToString();
  EXPECT_TRUE(uids->empty());
  auto empty = AttachClient(socket_).Attach("m");
  ASSERT_FALSE(empty.ok());
  ExpectRefusal(empty.status());
}

// A store that reads as the kernel's overflow uid is refused even by a client
// running as that uid, unless the uid is named: it could be any account
// outside our user namespace.
TEST_F(StoreTrustTest, TheOverflowUidIsTrustedOnlyWhenNamed) {
  if (std::string why = testing::WhyNoOtherUid(); !why.empty()) GTEST_SKIP() << why;
  const uid_t overflow = AttachClient::OverflowUid();
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
  ASSERT_EQ(::chmod(model_.c_str(), 0644), 0);
  const std::string own = dir_.File("nobody");
  testing::MakeDirectoryOwnedBy(own, overflow);
  const std::string socket = own + "/store.sock";
  StoreProcessOptions options;
  options.prefix = testing::AsUid(overflow);
  StoreProcess store(socket, {"--device", "cpu", "--model", "m=" + model_}, options);
  ASSERT_EQ(store.startup_error(), "");

  std::vector<std::string> list = testing::AsUid(overflow);
  for (const std::string& a :
       {testing::CliPath(), std::string("list"), std::string("--socket"), socket})
    list.push_back(a);
  std::string out;
  int status = testing::RunWithEnv(list, {"HEARTH_STORE_UID"}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << out;
  EXPECT_TRUE(Contains(out, "overflow uid") && Contains(out, "uid " + std::to_string(overflow)))
      << out;
  list.push_back("--store-uid");
  list.push_back(std::to_string(overflow));
  status = testing::RunWithEnv(list, {"HEARTH_STORE_UID"}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(Contains(out, "m ")) << out;
}

TEST_F(ForeignStoreTest, TheCliRefusesItAndVerifyCannotBeFooledByIt) {
  std::string out;
  int status = testing::RunWithEnv(
      {testing::CliPath(), "inspect", "--socket", socket_, "--model", "m", "--verify"},
      {"HEARTH_STORE_UID"}, &out);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_FALSE(Contains(out, "checksum ok")) << out;
  EXPECT_TRUE(Contains(out, socket_) && Contains(out, "uid " + std::to_string(kOtherUid)) &&
              Contains(out, "pid " + std::to_string(store_->pid())))
      << out;
  for (const char* command : {"list", "status"}) {
    status = testing::RunWithEnv({testing::CliPath(), command, "--socket", socket_},
                                 {"HEARTH_STORE_UID"}, &out);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << command << ": " << out;
    EXPECT_TRUE(Contains(out, "uid " + std::to_string(kOtherUid))) << command << ": " << out;
  }

  status = testing::RunWithEnv({testing::CliPath(), "inspect", "--socket", socket_, "--model", "m",
                                "--verify", "--store-uid", std::to_string(kOtherUid)},
                               {"HEARTH_STORE_UID"}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  EXPECT_TRUE(Contains(out, "checksum ok")) << out;
  status = testing::RunWithEnv({testing::CliPath(), "list", "--socket", socket_},
                               {"HEARTH_STORE_UID=" + std::to_string(kOtherUid)}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
}

TEST_F(StoreTrustTest, ASymlinkedSocketDirectoryIsRefused) {
  const std::string real = dir_.File("real");
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  const std::string link = dir_.File("link");
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  std::string out;
  const int status = testing::RunWithEnv(
      {testing::CliPath(), "store", "--socket", link + "/store.sock", "--device", "cpu"}, {}, &out);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_TRUE(Contains(out, link) && Contains(out, "symbolic link")) << out;
  EXPECT_TRUE(std::filesystem::is_empty(real));
}

TEST_F(StoreTrustTest, ASocketDirectoryOthersMayWriteIsRefused) {
  const std::string open = dir_.File("open");
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0770), 0);
  std::string out;
  const int status = testing::RunWithEnv(
      {testing::CliPath(), "store", "--socket", open + "/store.sock", "--device", "cpu"}, {}, &out);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 0);
  EXPECT_TRUE(Contains(out, open) && Contains(out, "mode 0770")) << out;
  EXPECT_TRUE(std::filesystem::is_empty(open));
}

// What sits at the socket's name and is not a socket is never followed,
// replaced or removed.
TEST_F(StoreTrustTest, ANameThatIsNotASocketIsLeftAlone) {
  const std::string run = dir_.File("run");
  ASSERT_EQ(::mkdir(run.c_str(), 0700), 0);
  const std::string target = dir_.File("precious");
  { std::ofstream(target) << "keep me"; }
  const std::string socket = run + "/store.sock";
  ASSERT_EQ(::symlink(target.c_str(), socket.c_str()), 0);
  std::string out;
  int status = testing::RunWithEnv(
      {testing::CliPath(), "store", "--socket", socket, "--device", "cpu"}, {}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_TRUE(Contains(out, "is a symbolic link, not a socket")) << out;
  EXPECT_TRUE(std::filesystem::is_symlink(socket));
  std::string kept;
  std::getline(std::ifstream(target), kept);
  EXPECT_EQ(kept, "keep me");

  ASSERT_EQ(::unlink(socket.c_str()), 0);
  { std::ofstream(socket) << "a file"; }
  status = testing::RunWithEnv({testing::CliPath(), "store", "--socket", socket, "--device", "cpu"},
                               {}, &out);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << out;
  EXPECT_TRUE(Contains(out, "is a regular file, not a socket")) << out;
  EXPECT_TRUE(std::filesystem::is_regular_file(socket));
  // Nothing of the store's (its temporary name included) is left in the directory.
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(run)) ++entries;
  EXPECT_EQ(entries, 1u);
}

// SIGTERM and SIGINT while `hearth store` loads its --model checkpoints stop
// it: it exits 128 + the signal's number, with no socket left behind. The
// load is held (HEARTH_TEST_HOLD_LOAD: it waits before reading anything until
// the store is stopping), so it cannot finish before the signal arrives; a
// signal the store ignored would leave it waiting and fail the test.
TEST_F(StoreTrustTest, ASignalDuringTheInitialLoadStopsIt) {
  for (int sig : {SIGTERM, SIGINT}) {
    const std::string socket = dir_.File("load/store.sock");
    StoreProcessOptions options;
    options.log_level = "info";
    options.wait_ready = false;
    options.env = {"HEARTH_TEST_HOLD_LOAD=" + model_};
    StoreProcess store(socket, {"--device", "cpu", "--model", "a=" + model_}, options);
    ASSERT_TRUE(store.WaitForOutput("is held by HEARTH_TEST_HOLD_LOAD", std::chrono::seconds(60)))
        << store.output();
    ASSERT_EQ(::kill(store.pid(), sig), 0);
    int status = 0;
    ASSERT_TRUE(store.WaitForExit(std::chrono::seconds(20), &status))
        << strsignal(sig) << " did not stop the load; output: " << store.output();
    ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 128 + sig) << store.output();
    EXPECT_FALSE(Contains(store.output(), "hearth store ready")) << store.output();
    EXPECT_TRUE(Contains(store.output(), "before the store was ready")) << store.output();
    EXPECT_FALSE(std::filesystem::exists(socket));
  }
}

}  // namespace
}  // namespace hearth
