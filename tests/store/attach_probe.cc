// A client process for the multi-process tests. Modes:
//   check SOCKET MODEL FILE   attach and compare every tensor with FILE; exit 0 if equal
//   write SOCKET MODEL        attach and write into the first non-empty tensor (must die)
//   hold SOCKET MODEL         attach, print "attached", wait to be killed
//   half-attach SOCKET MODEL  send an attach request, then SIGKILL itself before the reply
//   fds                       print this process's open descriptors, one per line
//   context DEVICE            create a CUDA context only, print "ready", wait to be killed
#include <dirent.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "protocol/messages.h"
#include "protocol/wire.h"
#if HEARTH_HAVE_CUDA
#include "memory/cuda_driver.h"
#endif

using namespace hearth;

namespace {

int Check(const std::string& socket, const std::string& model, const std::string& file) {
  auto ckpt = Checkpoint::Open(file);
  if (!ckpt.ok()) return std::fprintf(stderr, "%s\n", ckpt.status().ToString().c_str()), 10;
  auto a = AttachClient(socket).Attach(model);
  if (!a.ok()) return std::fprintf(stderr, "%s\n", a.status().ToString().c_str()), 11;
  if ((*a)->tensors().size() != ckpt->tensors().size()) return 12;
  std::vector<std::byte> expected, actual;
  for (const TensorInfo& t : ckpt->tensors()) {
    const TensorView* v = (*a)->Find(t.name);
    if (v == nullptr || v->dtype != t.dtype || v->shape != t.shape || v->nbytes != t.nbytes) {
      std::fprintf(stderr, "tensor %s differs in metadata\n", t.name.c_str());
      return 13;
    }
    expected.resize(t.nbytes);
    actual.resize(t.nbytes);
    if (!ckpt->Read(t, 0, expected).ok()) return 14;
    if (!(*a)->CopyToHost(*v, 0, actual).ok()) return 15;
    if (expected != actual) {
      std::fprintf(stderr, "tensor %s differs in bytes\n", t.name.c_str());
      return 16;
    }
  }
  auto sum = (*a)->ComputeChecksum();
  if (!sum.ok() || *sum != (*a)->checksum()) return 17;
  std::printf("ok %zu tensors\n", ckpt->tensors().size());
  return 0;
}

int Write(const std::string& socket, const std::string& model) {
  auto a = AttachClient(socket).Attach(model);
  if (!a.ok()) return 11;
  for (const TensorView& t : (*a)->tensors()) {
    if (t.nbytes == 0) continue;
    std::printf("writing into %s\n", t.name.c_str());
    std::fflush(stdout);
    *const_cast<volatile char*>(static_cast<const volatile char*>(t.data)) = 42;
    std::printf("write succeeded\n");
    return 0;
  }
  return 12;
}

int Hold(const std::string& socket, const std::string& model) {
  auto a = AttachClient(socket).Attach(model);
  if (!a.ok()) return std::fprintf(stderr, "%s\n", a.status().ToString().c_str()), 11;
  std::printf("attached\n");
  std::fflush(stdout);
  for (;;) ::pause();
}

int HalfAttach(const std::string& socket, const std::string& model) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", socket.c_str());
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return 11;
  protocol::AttachRequest req{ModelRef{model, 0}};
  if (!protocol::SendMessage(fd, protocol::MessageType::kAttach, protocol::EncodeAttach(req)).ok())
    return 12;
  ::kill(::getpid(), SIGKILL);
  return 13;
}

int ListFds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 11;
  const int own = ::dirfd(d);
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    if (std::atoi(e->d_name) == own) continue;
    std::printf("%s\n", e->d_name);
  }
  ::closedir(d);
  return 0;
}

int Context(int device) {
#if HEARTH_HAVE_CUDA
  if (Status s = MakeContextCurrent(device); !s.ok())
    return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 11;
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) ::pause();
#else
  (void)device;
  return 12;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> a(argv + 1, argv + argc);
  if (a.size() == 4 && a[0] == "check") return Check(a[1], a[2], a[3]);
  if (a.size() == 3 && a[0] == "write") return Write(a[1], a[2]);
  if (a.size() == 3 && a[0] == "hold") return Hold(a[1], a[2]);
  if (a.size() == 3 && a[0] == "half-attach") return HalfAttach(a[1], a[2]);
  if (a.size() == 1 && a[0] == "fds") return ListFds();
  if (a.size() == 2 && a[0] == "context") return Context(std::atoi(a[1].c_str()));
  std::fprintf(stderr, "usage: attach_probe check|write|hold|half-attach|fds ...\n");
  return 2;
}
