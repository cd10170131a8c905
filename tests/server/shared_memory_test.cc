// System shared-memory regions: registration checks the object and the
// range, reads and writes stay inside the registered range, a shrunk object
// fails the request and never the server, and a request to a served model
// takes its input from a region and writes its output to one. CUDA regions:
// registration checks the handle's size, the device and the size; names are
// unique across both kinds and both count towards one limit; an entry
// outlives its unregistration while a request holds it; a server checks a
// request's CUDA inputs and outputs before it queues it, and a server on the
// host refuses CUDA regions.
#include "server/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <future>
#include <string>

#include "gtest/gtest.h"
#include "protocol/worker_protocol.h"
#include "server/local_peer.h"
#include "server/server.h"
#include "support/loopback.h"
#include "support/test_store.h"

namespace hearth {
namespace {

// A POSIX shared-memory object of `bytes`, removed at the end.
struct ShmObject {
  std::string key;
  int fd = -1;
  ShmObject(uint64_t bytes, mode_t mode = 0600) {
    key = "/hearth-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
    fd = ::shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, mode);
    EXPECT_GE(fd, 0) << key;
    EXPECT_EQ(::fchmod(fd, mode), 0);
    EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  }
  ~ShmObject() {
    ::close(fd);
    ::shm_unlink(key.c_str());
  }
  static inline int counter = 0;
};

using testing::LoopbackLink;

uid_t Me() { return ::geteuid(); }
SharedMemoryAccess Mine() { return {{Me()}}; }

TEST(SharedMemoryRegistry, RegistrationChecksTheObjectAndTheRange) {
  SharedMemoryRegistry r(Mine());
  ShmObject obj(4096);
  EXPECT_EQ(r.Register("a", obj.key, 0, 8192, Me()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", obj.key, 4000, 97, Me()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", "/hearth-test-none", 0, 8, Me()).code(), StatusCode::kNotFound);
  EXPECT_EQ(r.Register("a", "../etc/passwd", 0, 8, Me()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", "/x/y", 0, 8, Me()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("", obj.key, 0, 8, Me()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", obj.key, 0, 0, Me()).code(), StatusCode::kInvalidArgument);
  ShmObject open_to_all(64, 0666);
  EXPECT_EQ(r.Register("b", open_to_all.key, 0, 8, Me()).code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(r.Register("a", obj.key, 1024, 2048, Me()).ok());
  EXPECT_EQ(r.Register("a", obj.key, 0, 8, Me()).code(), StatusCode::kAlreadyExists);
  auto listed = r.List("");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].key, obj.key);
  EXPECT_EQ((*listed)[0].offset, 1024u);
  EXPECT_EQ(r.List("zz").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(r.Unregister("a").ok());
  EXPECT_EQ(r.Unregister("a").code(), StatusCode::kNotFound);
}

// The server may open what its client may not: a region's object must be
// its client's own, a regular file its owner may read and write.
TEST(SharedMemoryRegistry, AClientNamesOnlyItsOwnObjects) {
  SharedMemoryRegistry r(SharedMemoryAccess{{Me(), 12345}});
  ShmObject mine(4096);
  // The client is of another user than the object's.
  Status s = r.Register("a", mine.key, 0, 64, 12345);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("belongs to uid " + std::to_string(Me()) +
                             ", not to the client's user (uid 12345)"),
            std::string::npos)
      << s.message();
  // A user the server does not let use shared memory, even for its own.
  s = r.Register("a", mine.key, 0, 64, 777);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("uid 777) may not use shared memory"), std::string::npos)
      << s.message();
  EXPECT_EQ(r.RegisterCuda("c", std::vector<std::byte>(control::kCudaIpcHandleBytes), 0, 64,
                           std::vector<int>{0}, 777)
                .code(),
            StatusCode::kPermissionDenied);
  // Shared memory off: nobody.
  SharedMemoryRegistry off(SharedMemoryAccess{});
  s = off.Register("a", mine.key, 0, 64, Me());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(s.message().find("shared memory is off"), std::string::npos) << s.message();
  // Its owner may not write it: nor may the server for it.
  ShmObject read_only(4096, 0400);
  s = r.Register("a", read_only.key, 0, 64, Me());
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(r.Register("a", mine.key, 0, 64, Me()).ok());
  EXPECT_TRUE(r.List("").ok() && r.List("")->size() == 1u);
}

TEST(SharedMemoryRegistry, ObjectsOfAnotherUserAreRefusedEvenWhereTheServerCanOpenThem) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give an object to another user";
  SharedMemoryRegistry r(SharedMemoryAccess{{0, 12345}});
  ShmObject roots(4096);  // root's, 0600: what uid 12345 cannot open itself
  Status s = r.Register("steal", roots.key, 0, 4096, 12345);
  EXPECT_EQ(s.code(), StatusCode::kPermissionDenied) << s.message();
  ShmObject theirs(4096);
  ASSERT_EQ(::fchown(theirs.fd, 12345, 12345), 0);
  EXPECT_EQ(r.Register("theirs", theirs.key, 0, 64, 0).code(), StatusCode::kPermissionDenied);
  s = r.Register("theirs", theirs.key, 0, 64, 12345);
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(SharedMemoryRegistry, LinksDirectoriesAndFifosAreRefusedWithTheirReason) {
  SharedMemoryRegistry r(Mine());
  ShmObject target(4096);
  const std::string base = "hearth-test-" + std::to_string(::getpid());
  const std::string link = "/dev/shm/" + base + "-link";
  const std::string dir = "/dev/shm/" + base + "-dir";
  const std::string fifo = "/dev/shm/" + base + "-fifo";
  ASSERT_EQ(::symlink(("/dev/shm" + target.key).c_str(), link.c_str()), 0);
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const Status via_link = r.Register("a", "/" + base + "-link", 0, 64, Me());
  const Status a_dir = r.Register("a", "/" + base + "-dir", 0, 64, Me());
  // A FIFO opens without a peer (O_NONBLOCK) and is refused, not waited on.
  const Status a_fifo = r.Register("a", "/" + base + "-fifo", 0, 64, Me());
  ::unlink(link.c_str());
  ::rmdir(dir.c_str());
  ::unlink(fifo.c_str());
  EXPECT_EQ(via_link.code(), StatusCode::kPermissionDenied) << via_link.message();
  EXPECT_NE(via_link.message().find("symbolic link"), std::string::npos) << via_link.message();
  EXPECT_EQ(a_dir.code(), StatusCode::kInvalidArgument) << a_dir.message();
  EXPECT_NE(a_dir.message().find("directory"), std::string::npos) << a_dir.message();
  EXPECT_EQ(a_fifo.code(), StatusCode::kInvalidArgument) << a_fifo.message();
  EXPECT_NE(a_fifo.message().find("not a regular object"), std::string::npos) << a_fifo.message();
}

TEST(SharedMemoryRegistry, ReadsAndWritesStayInsideAndAShrunkObjectFailsTheRequest) {
  SharedMemoryRegistry r(Mine());
  ShmObject obj(4096);
  ASSERT_TRUE(r.Register("a", obj.key, 1024, 1024, Me()).ok());
  const std::string text = "hello";
  ASSERT_TRUE(r.Write({"a", 16, 8}, std::as_bytes(std::span(text.data(), text.size()))).ok());
  char raw[5];
  ASSERT_EQ(::pread(obj.fd, raw, 5, 1024 + 16), 5);
  EXPECT_EQ(std::string(raw, 5), text);
  auto back = r.Read({"a", 16, 5});
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(std::memcmp(back->data(), text.data(), 5), 0);
  // Past the region, or more than the room given.
  EXPECT_EQ(r.Read({"a", 1020, 8}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Write({"a", 0, 2}, std::as_bytes(std::span(text.data(), 5))).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Read({"b", 0, 1}).status().code(), StatusCode::kNotFound);
  // The client shrinks its object: the request fails, nothing grows it back.
  ASSERT_EQ(::ftruncate(obj.fd, 1030), 0);
  EXPECT_EQ(r.Read({"a", 16, 5}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Write({"a", 16, 8}, std::as_bytes(std::span(text.data(), 5))).code(),
            StatusCode::kInvalidArgument);
  struct stat st {};
  ASSERT_EQ(::fstat(obj.fd, &st), 0);
  EXPECT_EQ(st.st_size, 1030);
}

std::vector<std::byte> Handle(size_t n = control::kCudaIpcHandleBytes, uint8_t fill = 0xab) {
  return std::vector<std::byte>(n, static_cast<std::byte>(fill));
}

TEST(SharedMemoryRegistry, CudaRegistrationChecksTheHandleTheDeviceAndTheSize) {
  SharedMemoryRegistry r(Mine());
  const std::vector<int> gpus = {0, 2};
  auto code = [&](const std::string& name, size_t handle, int64_t device, uint64_t bytes) {
    return r.RegisterCuda(name, Handle(handle), device, bytes, gpus, Me());
  };
  for (size_t n : {size_t{0}, size_t{63}, size_t{65}, size_t{88}}) {
    Status s = code("c", n, 0, 64);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << n;
    EXPECT_NE(s.message().find("of 64 bytes, not " + std::to_string(n)), std::string::npos)
        << s.message();
  }
  Status negative = code("c", 64, -1, 64);
  EXPECT_EQ(negative.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.message().find("device_id -1 is negative"), std::string::npos);
  Status unused = code("c", 64, 1, 64);
  EXPECT_EQ(unused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unused.message().find("device_id 1 is not a GPU this server uses (0, 2)"),
            std::string::npos)
      << unused.message();
  EXPECT_EQ(code("c", 64, 0, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("c", 64, 0, control::kMaxSlotBytes).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(code("", 64, 0, 64).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(std::string(kMaxRegionNameBytes + 1, 'n'), 64, 0, 64).code(),
            StatusCode::kInvalidArgument);
  Status no_gpu = r.RegisterCuda("c", Handle(), 0, 64, {}, Me());
  EXPECT_EQ(no_gpu.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_gpu.message().find("this server has no GPU"), std::string::npos) << no_gpu.message();
  // Nothing of the refused ones was kept.
  auto none = r.ListCuda("");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());

  ASSERT_TRUE(code("c", 64, 2, 4096).ok());
  ASSERT_TRUE(code(std::string(kMaxRegionNameBytes, 'n'), 64, 0, 8).ok());
  EXPECT_EQ(code("c", 64, 0, 64).code(), StatusCode::kAlreadyExists);
  auto listed = r.ListCuda("c");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "c");
  EXPECT_EQ((*listed)[0].device_id, 2);
  EXPECT_EQ((*listed)[0].byte_size, 4096u);
  EXPECT_EQ(r.ListCuda("")->size(), 2u);
  EXPECT_EQ(r.ListCuda("zz").status().code(), StatusCode::kNotFound);
  // CUDA regions are not system ones, for listing or unregistering.
  EXPECT_TRUE(r.List("")->empty());
  EXPECT_EQ(r.Unregister("c").code(), StatusCode::kNotFound);
  EXPECT_TRUE(r.UnregisterCuda("c").ok());
  Status gone = r.UnregisterCuda("c");
  EXPECT_EQ(gone.code(), StatusCode::kNotFound);
  EXPECT_NE(gone.message().find("no CUDA shared-memory region named 'c'"), std::string::npos);
  EXPECT_TRUE(r.UnregisterCuda("").ok());
  EXPECT_TRUE(r.ListCuda("")->empty());
}

TEST(SharedMemoryRegistry, SystemAndCudaRegionsShareTheirNamesAndTheirLimit) {
  SharedMemoryRegistry r(Mine());
  ShmObject obj(4096);
  const std::vector<int> gpus = {0};
  ASSERT_TRUE(r.Register("sys", obj.key, 0, 64, Me()).ok());
  Status taken = r.RegisterCuda("sys", Handle(), 0, 64, gpus, Me());
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(taken.message().find("a system shared-memory region named 'sys'"), std::string::npos)
      << taken.message();
  ASSERT_TRUE(r.RegisterCuda("dev", Handle(), 0, 64, gpus, Me()).ok());
  taken = r.Register("dev", obj.key, 0, 64, Me());
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists);
  EXPECT_NE(taken.message().find("a CUDA shared-memory region named 'dev'"), std::string::npos)
      << taken.message();
  // Unregistering all of one kind leaves the other.
  EXPECT_TRUE(r.Unregister("").ok());
  EXPECT_EQ(r.ListCuda("")->size(), 1u);
  ASSERT_TRUE(r.Register("sys", obj.key, 0, 64, Me()).ok());
  EXPECT_TRUE(r.UnregisterCuda("").ok());
  EXPECT_EQ(r.List("")->size(), 1u);

  // One limit for both kinds: 1 system region and the rest CUDA.
  for (size_t k = 1; k < kMaxSharedMemoryRegions; ++k)
    ASSERT_TRUE(r.RegisterCuda("c" + std::to_string(k), Handle(), 0, 64, gpus, Me()).ok()) << k;
  Status full = r.RegisterCuda("one-more", Handle(), 0, 64, gpus, Me());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("1024 shared-memory regions"), std::string::npos);
  EXPECT_EQ(r.Register("one-more", obj.key, 0, 64, Me()).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(r.UnregisterCuda("c1").ok());
  EXPECT_TRUE(r.Register("one-more", obj.key, 0, 64, Me()).ok());
}

TEST(SharedMemoryRegistry, ACudaRegionIsFoundInsideItsRangeAndOutlivesItsName) {
  SharedMemoryRegistry r(Mine());
  ShmObject obj(4096);
  ASSERT_TRUE(r.Register("sys", obj.key, 0, 64, Me()).ok());
  ASSERT_TRUE(r.RegisterCuda("c", Handle(64, 0x11), 0, 1000, std::vector<int>{0}, Me()).ok());
  auto found = r.FindCuda({"c", 900, 100}, "input 'x'");
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_NE(*found, nullptr);
  const std::shared_ptr<const CudaSharedMemoryEntry> held = *found;
  EXPECT_EQ(held->info.byte_size, 1000u);
  EXPECT_EQ(held->handle[0], 0x11);
  EXPECT_EQ(held->handle[63], 0x11);
  auto outside = r.FindCuda({"c", 901, 100}, "input 'x'");
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.status().message().find("input 'x': [901, +100) lies outside CUDA region 'c'"),
            std::string::npos)
      << outside.status().message();
  EXPECT_FALSE(r.FindCuda({"c", UINT64_MAX, 2}, "x").ok());
  // A system region's name, or none: not a CUDA region (no error).
  auto system = r.FindCuda({"sys", 0, 8}, "x");
  ASSERT_TRUE(system.ok());
  EXPECT_EQ(*system, nullptr);
  EXPECT_EQ(*r.FindCuda({"none", 0, 8}, "x"), nullptr);
  // Unregistered and registered again: the held entry is the old one, and
  // the new one has a new id.
  ASSERT_TRUE(r.UnregisterCuda("c").ok());
  ASSERT_TRUE(r.RegisterCuda("c", Handle(64, 0x22), 0, 10, std::vector<int>{0}, Me()).ok());
  auto again = r.FindCuda({"c", 0, 10}, "x");
  ASSERT_TRUE(again.ok());
  ASSERT_NE(*again, nullptr);
  EXPECT_NE((*again)->id, held->id);
  EXPECT_EQ((*again)->handle[0], 0x22);
  EXPECT_EQ(held->handle[0], 0x11);
  EXPECT_EQ(held->info.byte_size, 1000u);
}

// The scale model (x FP32 [8] -> y FP32 [1], batches of up to 4) on the
// host, in a new repository under `tmp`.
std::string ScaleRepository(testing::TempDir& tmp) {
  const std::string repo = tmp.File("repo");
  EXPECT_EQ(::mkdir(repo.c_str(), 0700), 0);
  EXPECT_EQ(::mkdir((repo + "/scale").c_str(), 0700), 0);
  EXPECT_EQ(::mkdir((repo + "/scale/1").c_str(), 0700), 0);
  std::string out;
  EXPECT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed", "4",
                          "--out", repo + "/scale/1/model.safetensors"},
                         &out),
            0)
      << out;
  std::ofstream(repo + "/scale/config.yaml")
      << "backend: scale\nmax_batch_size: 4\n"
         "input:\n  - {name: x, data_type: TYPE_FP32, dims: [8]}\n"
         "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
         "instance_group:\n  - {count: 1, kind: KIND_CPU}\n";
  return repo;
}

TEST(ServerSharedMemory, AnInputFromARegionAndAnOutputToOne) {
  LoopbackLink link;
  testing::TempDir tmp;
  const std::string repo = ScaleRepository(tmp);
  ServerOptions options;
  options.repository = repo;
  const std::string cli = testing::CliPath();
  options.worker_path = cli.substr(0, cli.rfind('/')) + "/hearth-worker";
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_TRUE((*server)->WaitForModels().ok());

  auto ask = [&](InferRequest r) {
    std::promise<Result<InferResponse>> p;
    // Outputs may be borrowed: keep what the test reads.
    (*server)->Infer(std::move(r), [&](Result<InferResponse> got) {
      if (got.ok())
        for (auto& t : got->outputs)
          t.data = std::vector<std::byte>(t.data.bytes().begin(), t.data.bytes().end());
      p.set_value(std::move(got));
    });
    return p.get_future().get();
  };
  auto request = [&](bool from_shm) {
    InferRequest r;
    r.model = "scale";
    InferTensor x;
    x.name = "x";
    x.dtype = DType::kF32;
    x.shape = {2, 8};
    if (from_shm) {
      x.shm = SharedMemoryRef{"in", 0, 64};
    } else {
      std::vector<std::byte> bytes(64);
      for (int i = 0; i < 16; ++i) {
        const float v = static_cast<float>(i);
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      }
      x.data = std::move(bytes);
    }
    r.inputs.push_back(std::move(x));
    return r;
  };
  auto inline_answer = ask(request(false));
  ASSERT_TRUE(inline_answer.ok()) << inline_answer.status().ToString();

  ShmObject in(4096), result(4096);
  for (int i = 0; i < 16; ++i) {
    const float v = static_cast<float>(i);
    ASSERT_EQ(::pwrite(in.fd, &v, 4, 4 * i), 4);
  }
  ASSERT_TRUE((*server)->RegisterSystemSharedMemory(link.client, "in", in.key, 0, 64).ok());
  ASSERT_TRUE((*server)->RegisterSystemSharedMemory(link.client, "out", result.key, 512, 64).ok());
  InferRequest r = request(true);
  RequestedOutput y("y", false);
  y.shm = SharedMemoryRef{"out", 8, 8};
  r.outputs.push_back(y);
  auto answer = ask(std::move(r));
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  ASSERT_EQ(answer->outputs.size(), 1u);
  const InferTensor& t = answer->outputs[0];
  ASSERT_TRUE(t.shm.has_value());
  EXPECT_EQ(t.shm->byte_size, 8u);
  EXPECT_TRUE(t.data.empty());
  float got[2], want[2];
  ASSERT_EQ(::pread(result.fd, got, 8, 512 + 8), 8);
  std::memcpy(want, inline_answer->outputs[0].data.data(), 8);
  EXPECT_EQ(got[0], want[0]);
  EXPECT_EQ(got[1], want[1]);

  // Too little room for the output fails that request alone.
  InferRequest small = request(true);
  RequestedOutput y4("y", false);
  y4.shm = SharedMemoryRef{"out", 0, 4};
  small.outputs.push_back(y4);
  auto refused = ask(std::move(small));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("do not fit"), std::string::npos)
      << refused.status().ToString();
  EXPECT_TRUE(ask(request(false)).ok());
  (*server)->Shutdown();
}

ServerOptions Options(const std::string& repo, Device device) {
  ServerOptions options;
  options.repository = repo;
  const std::string cli = testing::CliPath();
  options.worker_path = cli.substr(0, cli.rfind('/')) + "/hearth-worker";
  options.device = device;
  return options;
}

TEST(ServerCudaSharedMemory, AServerOnTheHostRefusesCudaRegions) {
  LoopbackLink link;
  testing::TempDir tmp;
  auto server = Server::Create(Options(ScaleRepository(tmp), Device::Host()));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  Status s = (*server)->RegisterCudaSharedMemory(link.client, "c", Handle(), 0, 64);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("this server has no GPU"), std::string::npos) << s.message();
  // The handle's size is checked first, as on any server.
  s = (*server)->RegisterCudaSharedMemory(link.client, "c", Handle(12), 0, 64);
  EXPECT_NE(s.message().find("of 64 bytes, not 12"), std::string::npos) << s.message();
  auto status = (*server)->CudaSharedMemoryStatus("");
  ASSERT_TRUE(status.ok());
  EXPECT_TRUE(status->empty());
  EXPECT_TRUE((*server)->UnregisterCudaSharedMemory("").ok());
  EXPECT_EQ((*server)->UnregisterCudaSharedMemory("c").code(), StatusCode::kNotFound);
  const auto ext = (*server)->Extensions();
  EXPECT_EQ(std::count(ext.begin(), ext.end(), "cuda_shared_memory"), 0);
}

// A server whose device is a GPU (none is needed: its model runs on the
// host) takes CUDA regions; a request naming one is checked before it is
// queued, each fault named, and refused for a model on the host; the
// server serves on.
TEST(ServerCudaSharedMemory, RequestsNamingCudaRegionsAreCheckedBeforeTheyAreQueued) {
  LoopbackLink link;
  testing::TempDir tmp;
  auto server = Server::Create(Options(ScaleRepository(tmp), Device::Cuda(0)));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_TRUE((*server)->WaitForModels().ok());
  const auto ext = (*server)->Extensions();
  EXPECT_EQ(std::count(ext.begin(), ext.end(), "cuda_shared_memory"), 1);

  Status unused = (*server)->RegisterCudaSharedMemory(link.client, "dev", Handle(), 1, 4096);
  EXPECT_NE(unused.message().find("device_id 1 is not a GPU this server uses (0)"),
            std::string::npos)
      << unused.message();
  ASSERT_TRUE((*server)->RegisterCudaSharedMemory(link.client, "dev", Handle(), 0, 4096).ok());
  ShmObject obj(4096);
  Status taken = (*server)->RegisterSystemSharedMemory(link.client, "dev", obj.key, 0, 64);
  EXPECT_EQ(taken.code(), StatusCode::kAlreadyExists);
  auto listed = (*server)->CudaSharedMemoryStatus("dev");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].device_id, 0);
  EXPECT_EQ((*listed)[0].byte_size, 4096u);

  auto ask = [&](InferRequest r) {
    std::promise<Result<InferResponse>> p;
    (*server)->Infer(std::move(r), [&](Result<InferResponse> got) {
      if (got.ok())
        for (auto& t : got->outputs)
          t.data = std::vector<std::byte>(t.data.bytes().begin(), t.data.bytes().end());
      p.set_value(std::move(got));
    });
    return p.get_future().get();
  };
  // x of 2 rows inline, or at `offset` of "dev" (byte_size bytes).
  auto request = [&](std::optional<SharedMemoryRef> x_in = std::nullopt,
                     DType dtype = DType::kF32) {
    InferRequest r;
    r.model = "scale";
    InferTensor x("x", dtype, {2, 8});
    if (x_in)
      x.shm = x_in;
    else
      x.data = std::vector<std::byte>(64);
    r.inputs.push_back(std::move(x));
    return r;
  };
  auto with_y = [](InferRequest r, uint64_t offset, uint64_t byte_size, uint32_t classes = 0) {
    RequestedOutput y("y", false);
    y.class_count = classes;
    y.shm = SharedMemoryRef{"dev", offset, byte_size};
    r.outputs.push_back(y);
    return r;
  };
  auto refused = [&](InferRequest r, const std::string& says) {
    auto got = ask(std::move(r));
    ASSERT_FALSE(got.ok()) << says;
    EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << got.status().ToString();
    EXPECT_NE(got.status().message().find(says), std::string::npos) << got.status().message();
  };
  refused(request(SharedMemoryRef{"dev", 4090, 64}),
          "input 'x': [4090, +64) lies outside CUDA region 'dev' (4096 bytes)");
  refused(request(SharedMemoryRef{"dev", 0, 60}),
          "input 'x': shared_memory_byte_size is 60 but shape [2,8] of FP32 needs 64");
  refused(request(SharedMemoryRef{"dev", 0, 64}, DType::kBytes),
          "input 'x': a BYTES input cannot be in CUDA shared memory");
  refused(with_y(request(), 4000, 200), "output 'y': [4000, +200) lies outside CUDA region 'dev'");
  refused(with_y(request(), 0, 4), "output 'y': its 8 bytes do not fit in the 4 bytes");
  refused(with_y(request(), 0, 8, 1), "output 'y' cannot go to CUDA shared-memory region 'dev'");
  // Well-formed, but the model's workers are on the host.
  refused(request(SharedMemoryRef{"dev", 0, 64}),
          "input 'x' is in CUDA shared-memory region 'dev', but model 'scale' runs its workers on "
          "the host (cpu)");
  refused(with_y(request(), 0, 8), "output 'y' is in CUDA shared-memory region 'dev'");
  // Nothing of that reached a worker, and the server serves on.
  auto fine = ask(request());
  ASSERT_TRUE(fine.ok()) << fine.status().ToString();
  EXPECT_EQ(fine->outputs.size(), 1u);
  ASSERT_TRUE((*server)->UnregisterCudaSharedMemory("dev").ok());
  auto unknown = ask(request(SharedMemoryRef{"dev", 0, 64}));
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound) << unknown.status().ToString();
  (*server)->Shutdown();
}

}  // namespace
}  // namespace hearth
