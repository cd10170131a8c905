#include "common/trusted_path.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "hearth/unique_fd.h"

namespace hearth {
namespace {

constexpr uid_t kOtherUid = 54321;

class TrustedPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char templ[] = "/tmp/hearth-trusted-test-XXXXXX";
    ASSERT_NE(::mkdtemp(templ), nullptr);
    root_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  std::string root_;
};

TEST_F(TrustedPathTest, CreatesMissingDirectoriesWithTheMode) {
  const std::string dir = root_ + "/a/b";
  ASSERT_TRUE(EnsureTrustedDirectory(dir, 0750).ok());
  struct stat st;
  ASSERT_EQ(::stat(dir.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0027, 0u);  // at most 0750, whatever the umask took away
  EXPECT_EQ(st.st_uid, ::geteuid());
  // Again: an existing trusted directory is fine.
  EXPECT_TRUE(EnsureTrustedDirectory(dir, 0750).ok());
}

TEST_F(TrustedPathTest, RefusesAWritableDirectory) {
  const std::string dir = root_ + "/open";
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir.c_str(), 0777), 0);
  Status s = EnsureTrustedDirectory(dir, 0700);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find(dir), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("mode 0777"), std::string::npos) << s.message();
}

TEST_F(TrustedPathTest, RefusesASymlink) {
  const std::string real = root_ + "/real", link = root_ + "/link";
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  Status s = EnsureTrustedDirectory(link, 0700);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("symbolic link"), std::string::npos) << s.message();
  // A dangling one is not created through either.
  const std::string dangling = root_ + "/dangling";
  ASSERT_EQ(::symlink((root_ + "/nowhere").c_str(), dangling.c_str()), 0);
  EXPECT_FALSE(EnsureTrustedDirectory(dangling, 0700).ok());
  EXPECT_FALSE(std::filesystem::exists(root_ + "/nowhere"));
}

TEST_F(TrustedPathTest, RefusesAFile) {
  const std::string file = root_ + "/file";
  UniqueFd fd(::open(file.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  ASSERT_TRUE(fd.valid());
  EXPECT_FALSE(EnsureTrustedDirectory(file, 0700).ok());
}

TEST_F(TrustedPathTest, RefusesADirectoryOfAnotherUser) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a directory to another uid";
  const std::string dir = root_ + "/theirs";
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::chown(dir.c_str(), kOtherUid, kOtherUid), 0);
  Status s = EnsureTrustedDirectory(dir, 0700);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("owner uid " + std::to_string(kOtherUid)), std::string::npos)
      << s.message();
  // Below a directory another user can write (not sticky): refused too.
  const std::string shared = root_ + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(::chown(shared.c_str(), kOtherUid, kOtherUid), 0);
  Status below = EnsureTrustedDirectory(shared + "/mine", 0700);
  ASSERT_FALSE(below.ok());
  EXPECT_NE(below.message().find(shared), std::string::npos) << below.message();
}

TEST_F(TrustedPathTest, AcceptsOurDirectoryInAStickyWorldWritableOne) {
  const std::string sticky = root_ + "/tmp";
  ASSERT_EQ(::mkdir(sticky.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(sticky.c_str(), 01777), 0);
  EXPECT_TRUE(EnsureTrustedDirectory(sticky + "/hearth", 0700).ok());
  const std::string open = root_ + "/open";
  ASSERT_EQ(::mkdir(open.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open.c_str(), 0777), 0);
  EXPECT_FALSE(EnsureTrustedDirectory(open + "/hearth", 0700).ok());
}

TEST_F(TrustedPathTest, PrivateDirectoriesAreNewAndClosed) {
  ::setenv("XDG_RUNTIME_DIR", root_.c_str(), 1);
  auto a = MakePrivateDirectory("serve-");
  auto b = MakePrivateDirectory("serve-");
  ::unsetenv("XDG_RUNTIME_DIR");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE(*a, *b);
  EXPECT_EQ(a->rfind(root_ + "/hearth/serve-", 0), 0u) << *a;
  struct stat st;
  ASSERT_EQ(::lstat(a->c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  EXPECT_EQ(st.st_uid, ::geteuid());
}

// A long $XDG_RUNTIME_DIR would make the sockets bound inside too long for
// sun_path: with a limit, the directory is made in /tmp instead.
TEST_F(TrustedPathTest, PrivateDirectoriesFitTheLengthAsked) {
  std::string xdg = root_ + "/" + std::string(60, 'x') + "/" + std::string(60, 'y');
  std::filesystem::create_directories(xdg);
  ::chmod((root_ + "/" + std::string(60, 'x')).c_str(), 0700);
  ::chmod(xdg.c_str(), 0700);
  ::setenv("XDG_RUNTIME_DIR", xdg.c_str(), 1);
  const size_t limit = sizeof(sockaddr_un::sun_path) - 1 - 26;
  auto bounded = MakePrivateDirectory("serve-", limit);
  auto unbounded = MakePrivateDirectory("serve-");
  ::unsetenv("XDG_RUNTIME_DIR");
  ASSERT_TRUE(bounded.ok()) << bounded.status().ToString();
  ASSERT_TRUE(unbounded.ok()) << unbounded.status().ToString();
  EXPECT_EQ(bounded->rfind("/tmp/serve-", 0), 0u) << *bounded;
  EXPECT_LE(bounded->size(), limit);
  EXPECT_EQ(unbounded->rfind(xdg + "/hearth/serve-", 0), 0u) << *unbounded;
  ::rmdir(bounded->c_str());
  // A short one is still used.
  ::setenv("XDG_RUNTIME_DIR", root_.c_str(), 1);
  auto short_one = MakePrivateDirectory("serve-", limit);
  ::unsetenv("XDG_RUNTIME_DIR");
  ASSERT_TRUE(short_one.ok()) << short_one.status().ToString();
  EXPECT_EQ(short_one->rfind(root_ + "/hearth/serve-", 0), 0u) << *short_one;
}

TEST(PeerCredentials, OurOwnPeerIsTrusted) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  auto cred = GetPeerCredentials(a.get());
  ASSERT_TRUE(cred.ok());
  EXPECT_EQ(cred->uid, ::geteuid());
  EXPECT_EQ(cred->pid, ::getpid());
  EXPECT_TRUE(CheckPeerTrusted(a.get(), {}, "the store").ok());
}

// A peer of another uid (a child that drops to it before connecting) is
// refused unless named.
TEST(PeerCredentials, AnotherUidIsRefusedUnlessNamed) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a peer as another uid";
  char templ[] = "/tmp/hearth-peer-test-XXXXXX";
  ASSERT_NE(::mkdtemp(templ), nullptr);
  ASSERT_EQ(::chmod(templ, 0755), 0);
  const std::string path = std::string(templ) + "/s.sock";
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0777), 0);
  ASSERT_EQ(::listen(listener.get(), 1), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setresgid(kOtherUid, kOtherUid, kOtherUid) != 0 ||
        ::setresuid(kOtherUid, kOtherUid, kOtherUid) != 0)
      ::_exit(2);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ::_exit(3);
    char byte;
    (void)!::read(fd, &byte, 1);  // until the parent closes
    ::_exit(0);
  }
  UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(conn.valid());
  Status refused = CheckPeerTrusted(conn.get(), {}, "the store at " + path);
  EXPECT_EQ(refused.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(refused.message().find("uid " + std::to_string(kOtherUid)), std::string::npos)
      << refused.message();
  const std::vector<uint32_t> named = {kOtherUid};
  EXPECT_TRUE(CheckPeerTrusted(conn.get(), named, "the store").ok());
  conn.Reset();
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::filesystem::remove_all(templ);
}

// Another uid's symlink above the target (the scenario: it pre-creates
// /tmp/hearth as a link to /tmp, root runs --socket /tmp/hearth/run/s.sock,
// and later re-points the link) is refused; the same link owned by root, or
// by us, is followed and its target checked as before.
TEST_F(TrustedPathTest, ASymlinkAboveOwnedByAnotherUidIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to lchown a symlink to another uid";
  const std::string shared = root_ + "/shared";
  ASSERT_EQ(::mkdir(shared.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(shared.c_str(), 01777), 0);  // a stand-in for /tmp
  const std::string link = shared + "/hearth";
  ASSERT_EQ(::symlink(shared.c_str(), link.c_str()), 0);
  ASSERT_EQ(::lchown(link.c_str(), kOtherUid, kOtherUid), 0);
  Status s = EnsureTrustedDirectory(link + "/run", 0700);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.ToString();
  EXPECT_NE(
      s.message().find(link + " is a symbolic link owned by uid " + std::to_string(kOtherUid)),
      std::string::npos)
      << s.message();
  EXPECT_FALSE(std::filesystem::exists(shared + "/run")) << "created a directory through the link";

  ASSERT_EQ(::lchown(link.c_str(), ::geteuid(), ::geteuid()), 0);
  s = EnsureTrustedDirectory(link + "/run", 0700);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(std::filesystem::is_directory(shared + "/run"));
}

}  // namespace
}  // namespace hearth
