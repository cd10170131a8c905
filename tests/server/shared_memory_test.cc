// System shared-memory regions: registration checks the object and the
// range, reads and writes stay inside the registered range, a shrunk object
// fails the request and never the server, and a request to a served model
// takes its input from a region and writes its output to one.
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
#include "server/server.h"
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

TEST(SharedMemoryRegistry, RegistrationChecksTheObjectAndTheRange) {
  SharedMemoryRegistry r;
  ShmObject obj(4096);
  EXPECT_EQ(r.Register("a", obj.key, 0, 8192).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", obj.key, 4000, 97).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", "/hearth-test-none", 0, 8).code(), StatusCode::kNotFound);
  EXPECT_EQ(r.Register("a", "../etc/passwd", 0, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", "/x/y", 0, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("", obj.key, 0, 8).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Register("a", obj.key, 0, 0).code(), StatusCode::kInvalidArgument);
  ShmObject open_to_all(64, 0666);
  EXPECT_EQ(r.Register("b", open_to_all.key, 0, 8).code(), StatusCode::kPermissionDenied);
  ASSERT_TRUE(r.Register("a", obj.key, 1024, 2048).ok());
  EXPECT_EQ(r.Register("a", obj.key, 0, 8).code(), StatusCode::kAlreadyExists);
  auto listed = r.List("");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].key, obj.key);
  EXPECT_EQ((*listed)[0].offset, 1024u);
  EXPECT_EQ(r.List("zz").status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(r.Unregister("a").ok());
  EXPECT_EQ(r.Unregister("a").code(), StatusCode::kNotFound);
}

TEST(SharedMemoryRegistry, ReadsAndWritesStayInsideAndAShrunkObjectFailsTheRequest) {
  SharedMemoryRegistry r;
  ShmObject obj(4096);
  ASSERT_TRUE(r.Register("a", obj.key, 1024, 1024).ok());
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

TEST(ServerSharedMemory, AnInputFromARegionAndAnOutputToOne) {
  testing::TempDir tmp;
  const std::string repo = tmp.File("repo");
  ASSERT_EQ(::mkdir(repo.c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((repo + "/scale").c_str(), 0700), 0);
  ASSERT_EQ(::mkdir((repo + "/scale/1").c_str(), 0700), 0);
  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "make-model", "scale", "--dims", "8", "--seed", "4",
                          "--out", repo + "/scale/1/model.safetensors"},
                         &out),
            0)
      << out;
  std::ofstream(repo + "/scale/config.yaml")
      << "backend: scale\nmax_batch_size: 4\n"
         "input:\n  - {name: x, data_type: TYPE_FP32, dims: [8]}\n"
         "output:\n  - {name: y, data_type: TYPE_FP32, dims: [1]}\n"
         "instance_group:\n  - {count: 1, kind: KIND_CPU}\n";
  ServerOptions options;
  options.repository = repo;
  const std::string cli = testing::CliPath();
  options.worker_path = cli.substr(0, cli.rfind('/')) + "/hearth-worker";
  auto server = Server::Create(options);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());

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
  ASSERT_TRUE((*server)->RegisterSystemSharedMemory("in", in.key, 0, 64).ok());
  ASSERT_TRUE((*server)->RegisterSystemSharedMemory("out", result.key, 512, 64).ok());
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

}  // namespace
}  // namespace hearth
