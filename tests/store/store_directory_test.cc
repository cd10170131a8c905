// Checkpoint directories in the store: every shard of a sharded checkpoint
// loaded into one arena, as one version with one checksum, through the loader
// itself, a real `hearth store` process and its socket.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "checkpoint/synthetic.h"
#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "hearth/checkpoint.h"
#include "hearth/store.h"
#include "store/loader.h"
#include "support/test_store.h"

namespace hearth {
namespace {

namespace fs = std::filesystem;
using testing::StoreProcess;
using testing::StoreProcessOptions;
using testing::TempDir;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The same tensors as one file and as a directory of shards. The largest
// tensor spans two checksum blocks; the names are spread over the shards
// out of name order.
class CheckpointDirectoryStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    one_ = dir_.File("one.safetensors");
    sharded_ = dir_.File("sharded");
    CheckpointWriter writer;
    writer.SetMetadata("format", "pt");
    auto add = [&](const std::string& name, DType dtype, std::vector<int64_t> shape,
                   uint32_t salt) {
      Status status = writer.AddTensor(
          name, dtype, std::move(shape), [salt](uint64_t offset, std::span<std::byte> out) {
            for (size_t i = 0; i < out.size(); ++i)
              out[i] = static_cast<std::byte>(((offset + i) * 2654435761u + salt) >> 13);
            return Status::Ok();
          });
      ASSERT_TRUE(status.ok()) << status.ToString();
    };
    add("z.big", DType::kF32, {5, 1 << 20}, 1);  // 20 MiB: two blocks
    add("a.embed", DType::kBF16, {300, 64}, 2);
    add("m.layers.0.weight", DType::kF16, {64, 64}, 3);
    add("m.layers.1.weight", DType::kF16, {64, 64}, 4);
    add("b.empty", DType::kI64, {0, 3}, 5);
    add("c.norm", DType::kF32, {64}, 6);
    ASSERT_TRUE(writer.Write(one_, 2).ok());
    Status status = writer.WriteDirectory(sharded_, 16 << 10, 2);
    ASSERT_TRUE(status.ok()) << status.ToString();
    Result<Checkpoint> sharded = Checkpoint::Open(sharded_);
    ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();
    ASSERT_GE(sharded->shards().size(), 3u);
  }

  TempDir dir_;
  std::string one_;
  std::string sharded_;
};

TEST_F(CheckpointDirectoryStoreTest, LoaderPutsEveryShardInOneArenaWithTheChecksumOfOneFile) {
  Result<LoadedModel> one = LoadCheckpoint(one_, Device::Host());
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  uint64_t last_done = 0, last_total = 0;
  LoadOptions options;
  options.threads = 3;
  options.progress = [&](uint64_t done, uint64_t total) {
    EXPECT_LE(done, total);
    last_done = done;
    last_total = total;
  };
  Result<LoadedModel> sharded = LoadCheckpoint(sharded_, Device::Host(), options);
  ASSERT_TRUE(sharded.ok()) << sharded.status().ToString();

  const Manifest& a = one->manifest;
  const Manifest& b = sharded->manifest;
  EXPECT_EQ(b.checksum, a.checksum);
  EXPECT_EQ(b.arena_size, a.arena_size);
  ASSERT_EQ(b.tensors.size(), a.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(b.tensors[i].name, a.tensors[i].name);
    EXPECT_EQ(b.tensors[i].dtype, a.tensors[i].dtype);
    EXPECT_EQ(b.tensors[i].shape, a.tensors[i].shape);
    EXPECT_EQ(b.tensors[i].offset, a.tensors[i].offset) << "the arena's layout is by name";
    EXPECT_EQ(b.tensors[i].nbytes, a.tensors[i].nbytes);
  }
  Manifest named = b;  // the loader leaves naming to its caller
  named.model = "m";
  named.version = 1;
  Status valid = ValidateManifest(named);
  EXPECT_TRUE(valid.ok()) << valid.ToString();
  EXPECT_EQ(sharded->arena->size(), b.arena_size);
  Result<Checkpoint> checkpoint = Checkpoint::Open(sharded_);
  ASSERT_TRUE(checkpoint.ok());
  EXPECT_EQ(last_total, checkpoint->tensor_bytes()) << "progress counts every shard's bytes";
  EXPECT_EQ(last_done, last_total);
}

TEST_F(CheckpointDirectoryStoreTest, LoaderStopsWhenCancelledAndNamesTheDirectoryOnErrors) {
  std::atomic<bool> cancel{true};
  LoadOptions options;
  options.cancel = &cancel;
  Result<LoadedModel> cancelled = LoadCheckpoint(sharded_, Device::Host(), options);
  ASSERT_FALSE(cancelled.ok());
  EXPECT_EQ(cancelled.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(Contains(cancelled.status().message(), "interrupted"))
      << cancelled.status().ToString();

  // A shard that shrank after the index was written: the load names it and the tensor.
  Result<Checkpoint> checkpoint = Checkpoint::Open(sharded_);
  ASSERT_TRUE(checkpoint.ok());
  const TensorInfo* big = checkpoint->Find("z.big");
  ASSERT_NE(big, nullptr);
  const CheckpointFile& shard = checkpoint->shards()[big->shard];
  ASSERT_EQ(::truncate(shard.path.c_str(), static_cast<off_t>(shard.size - 1)), 0);
  Result<LoadedModel> truncated = LoadCheckpoint(sharded_, Device::Host());
  ASSERT_FALSE(truncated.ok());
  EXPECT_TRUE(Contains(truncated.status().message(), shard.path)) << truncated.status().ToString();
}

// `hearth store --model m=DIR`: one version, one arena, and an attached
// process sees exactly the bytes of the one-file checkpoint.
TEST_F(CheckpointDirectoryStoreTest, StoreServesAShardedDirectoryAsOneVersion) {
  const std::string socket = dir_.File("run/store.sock");
  StoreProcess store(socket, {"--device", "cpu", "--model", "m=" + sharded_});
  ASSERT_EQ(store.startup_error(), "");
  for (const std::string& against : {sharded_, one_}) {
    const int status =
        testing::Wait(testing::Spawn({testing::ProbePath(), "check", socket, "m", against}));
    ASSERT_TRUE(WIFEXITED(status)) << "probe died with signal " << WTERMSIG(status);
    EXPECT_EQ(WEXITSTATUS(status), 0) << "attached bytes differ from " << against;
  }
  auto models = AttachClient(socket).ListModels();
  ASSERT_TRUE(models.ok()) << models.status().ToString();
  ASSERT_EQ(models->size(), 1u);
  const ModelSummary& m = models->front();
  EXPECT_EQ(m.name, "m");
  EXPECT_EQ(m.version, 1u);
  EXPECT_EQ(m.path, sharded_);
  EXPECT_EQ(m.tensor_count, 6u);
  Result<LoadedModel> reference = LoadCheckpoint(one_, Device::Host());
  ASSERT_TRUE(reference.ok());
  EXPECT_EQ(m.checksum, reference->manifest.checksum);
  EXPECT_EQ(m.tensor_bytes, Checkpoint::Open(one_)->tensor_bytes());
  auto status = AttachClient(socket).GetStatus();
  ASSERT_TRUE(status.ok());
  ASSERT_EQ(status->arenas.size(), 1u) << "all shards in one arena";
  EXPECT_EQ(status->arenas[0].model, "m");
}

// `hearth load` of directories into a running store: good ones become
// versions; a broken one fails with the file and tensor named, and the store
// serves on.
TEST_F(CheckpointDirectoryStoreTest, LoadingDirectoriesIntoARunningStore) {
  const std::string socket = dir_.File("run/store.sock");
  StoreProcess store(socket, {"--device", "cpu"});
  ASSERT_EQ(store.startup_error(), "");
  std::string out;
  ASSERT_EQ(testing::Run({testing::CliPath(), "load", "--socket", socket, "m=" + sharded_}, &out),
            0)
      << out;
  EXPECT_TRUE(Contains(out, "loaded m@1 (6 tensors")) << out;

  const std::string broken = dir_.File("broken");
  fs::copy(sharded_, broken);
  const std::string index = broken + "/" + std::string(kSafetensorsIndexFileName);
  Result<Checkpoint> checkpoint = Checkpoint::Open(broken);
  ASSERT_TRUE(checkpoint.ok());
  const std::string last = checkpoint->shards().back().name;
  ASSERT_TRUE(fs::remove(broken + "/" + last));
  auto missing = AttachClient(socket).Load("broken", broken);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(
      Contains(missing.status().message(), index + ": shard '" + last + "', listed for tensor"))
      << missing.status().ToString();

  // A FIFO in place of a shard: refused at once, never opened.
  ASSERT_EQ(::mkfifo((broken + "/" + last).c_str(), 0600), 0);
  auto fifo = AttachClient(socket).Load("broken", broken);
  ASSERT_FALSE(fifo.ok());
  EXPECT_TRUE(Contains(fifo.status().message(), broken + "/" + last + ": is a FIFO"))
      << fifo.status().ToString();

  ASSERT_EQ(testing::Run({testing::CliPath(), "load", "--socket", socket, "m=" + sharded_}, &out),
            0)
      << out;
  EXPECT_TRUE(Contains(out, "loaded m@2")) << out;
  auto models = AttachClient(socket).ListModels();
  ASSERT_TRUE(models.ok());
  EXPECT_EQ(models->size(), 2u) << "m@1 and m@2; nothing of 'broken'";
  EXPECT_TRUE(store.alive());
}

// A signal while `hearth store` loads a directory stops the load (held before
// it reads anything, so it cannot finish first) and the store.
TEST_F(CheckpointDirectoryStoreTest, ASignalDuringTheLoadOfADirectoryStopsIt) {
  const std::string socket = dir_.File("held/store.sock");
  StoreProcessOptions options;
  options.log_level = "info";
  options.wait_ready = false;
  options.env = {"HEARTH_TEST_HOLD_LOAD=" + sharded_};
  StoreProcess store(socket, {"--device", "cpu", "--model", "m=" + sharded_}, options);
  ASSERT_TRUE(store.WaitForOutput("is held by HEARTH_TEST_HOLD_LOAD", std::chrono::seconds(60)))
      << store.output();
  ASSERT_EQ(::kill(store.pid(), SIGTERM), 0);
  int status = 0;
  ASSERT_TRUE(store.WaitForExit(std::chrono::seconds(20), &status)) << store.output();
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << store.output();
  EXPECT_FALSE(fs::exists(socket));
}

// Store::CancelLoads answers a later load of a directory kUnavailable.
TEST_F(CheckpointDirectoryStoreTest, CancelLoadsAnswersLaterDirectoryLoadsUnavailable) {
  StoreOptions options;
  options.socket_path = dir_.File("run/store.sock");
  options.show_progress = false;
  auto store = Store::Create(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::thread loop([&] { EXPECT_TRUE((*store)->Run().ok()); });
  AttachClient client(options.socket_path);
  auto before = client.Load("m", sharded_);
  EXPECT_TRUE(before.ok()) << before.status().ToString();
  (*store)->CancelLoads();
  auto after = client.Load("m", sharded_);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::kUnavailable) << after.status().ToString();
  (*store)->Stop();
  loop.join();
}

}  // namespace
}  // namespace hearth
