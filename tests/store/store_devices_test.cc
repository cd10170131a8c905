// Several devices' stores: the names `hearth store --device` takes, the
// socket each device's store binds, what a store says it holds
// (Store::HeldArenas, which hearth serve's /metrics reports per device),
// and a real `hearth store --device host0,host1` whose two stores each hold
// a copy of their own.
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "gtest/gtest.h"
#include "hearth/attach.h"
#include "hearth/store.h"
#include "support/eventually.h"
#include "support/test_store.h"

namespace hearth {
namespace {

using testing::TempDir;

TEST(StoreDevices, NamesAreCanonical) {
  auto cpu = ParseStoreDevice("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(*cpu, (StoreDevice{"cpu", Device::Host()}));
  EXPECT_EQ(*ParseStoreDevice("host"), (StoreDevice{"cpu", Device::Host()}));
  EXPECT_EQ(*ParseStoreDevice("cuda"), (StoreDevice{"cuda:0", Device::Cuda(0)}));
  EXPECT_EQ(*ParseStoreDevice("cuda:3"), (StoreDevice{"cuda:3", Device::Cuda(3)}));
  EXPECT_EQ(*ParseStoreDevice("host0"), (StoreDevice{"host0", Device::Host()}));
  EXPECT_EQ(*ParseStoreDevice("host12"), (StoreDevice{"host12", Device::Host()}));
  for (const char* bad : {"tpu", "host01", "host-1", "host1024", "hostx", "cuda:", "cuda:1x", ""}) {
    auto d = ParseStoreDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_NE(d.status().message().find("'" + std::string(bad) + "'"), std::string::npos)
        << d.status().message();
  }
}

TEST(StoreDevices, ListsEachDeviceOnce) {
  auto list = ParseStoreDevices("cuda:0,cuda:1");
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(*list,
            (std::vector<StoreDevice>{{"cuda:0", Device::Cuda(0)}, {"cuda:1", Device::Cuda(1)}}));
  auto twice = ParseStoreDevices("cuda,cuda:0");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("names cuda:0 twice"), std::string::npos);
  auto empty = ParseStoreDevices("host0,,host1");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("device ''"), std::string::npos);
  std::string many;
  for (int i = 0; i < 65; ++i) many += (i ? ",host" : "host") + std::to_string(i);
  auto too_many = ParseStoreDevices(many);
  ASSERT_FALSE(too_many.ok());
  EXPECT_NE(too_many.status().message().find("more than 64 devices"), std::string::npos);
}

TEST(StoreDevices, SocketPathPerDevice) {
  EXPECT_EQ(DeviceSocketPath("/run/h/store.sock", "cuda:1"), "/run/h/store-cuda1.sock");
  EXPECT_EQ(DeviceSocketPath("/run/h/store.sock", "cpu"), "/run/h/store-cpu.sock");
  EXPECT_EQ(DeviceSocketPath("/run/h/store.sock", "host0"), "/run/h/store-host0.sock");
  EXPECT_EQ(DeviceSocketPath("/run/h/store", "cuda:0"), "/run/h/store-cuda0");
  EXPECT_EQ(DeviceSocketPath("s.sock", "cuda:2"), "s-cuda2.sock");
  // Only the file name's suffix counts.
  EXPECT_EQ(DeviceSocketPath("/x.sock/s", "host1"), "/x.sock/s-host1");
  EXPECT_EQ(DeviceSocketPath("/run/.sock", "host1"), "/run/.sock-host1");
}

// The store's own count of what it holds: a version stays counted while a
// lease holds it after it was unloaded, and goes when the lease ends.
TEST(StoreHeld, CountsArenasUntilTheirLastLeaseEnds) {
  TempDir dir;
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 3, 1000, 7);
  StoreOptions options;
  options.socket_path = dir.File("run/store.sock");
  options.show_progress = false;
  options.models = {{"m", model}};
  auto store = Store::Create(options);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  std::thread loop([&] { EXPECT_TRUE((*store)->Run().ok()); });
  AttachClient client(options.socket_path);
  auto listed = client.ListModels();
  ASSERT_TRUE(listed.ok() && listed->size() == 1) << listed.status().ToString();
  const uint64_t one = (*listed)[0].arena_size;
  ASSERT_GT(one, 0u);
  EXPECT_EQ((*store)->HeldArenas().arenas, 1u);
  EXPECT_EQ((*store)->HeldArenas().bytes, one);
  ASSERT_TRUE(client.Load("m", model).ok());  // version 2
  EXPECT_EQ((*store)->HeldArenas().arenas, 2u);
  EXPECT_EQ((*store)->HeldArenas().bytes, 2 * one);
  {
    auto attached = client.Attach("m", 1);
    ASSERT_TRUE(attached.ok()) << attached.status().ToString();
    ASSERT_TRUE(client.Unload("m", 1).ok());
    // Unloaded, but leased: still held.
    EXPECT_EQ((*store)->HeldArenas().arenas, 2u);
  }
  // The lease ends when the store sees the connection close.
  EXPECT_TRUE(Eventually([&] { return (*store)->HeldArenas().arenas == 1; }));
  EXPECT_EQ((*store)->HeldArenas().bytes, one);
  ASSERT_TRUE(client.Unload("m", 0).ok());
  EXPECT_EQ((*store)->HeldArenas().arenas, 0u);
  EXPECT_EQ((*store)->HeldArenas().bytes, 0u);
  (*store)->Stop();
  loop.join();
}

// The memfd inodes this process maps as arenas.
std::set<std::string> MappedArenaInodes() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> inodes;
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("memfd:hearth-arena") == std::string::npos) continue;
    std::istringstream fields(line);
    std::string range, perms, offset, dev, inode;
    fields >> range >> perms >> offset >> dev >> inode;
    inodes.insert(inode);
  }
  return inodes;
}

TEST(StoreDevices, OneStorePerDeviceEachWithItsOwnCopy) {
  TempDir dir;
  const std::string model = dir.File("m.safetensors");
  testing::WriteTestCheckpoint(model, 3, 1000, 8);
  const std::string socket = dir.File("run/store.sock");
  testing::StoreProcess store(socket, {"--device", "host0,host1", "--model", "m=" + model});
  ASSERT_EQ(store.startup_error(), "");
  struct stat st;
  EXPECT_NE(::stat(socket.c_str(), &st), 0) << "no store at the plain path with several devices";
  const std::string s0 = DeviceSocketPath(socket, "host0"), s1 = DeviceSocketPath(socket, "host1");
  const std::set<std::string> before = MappedArenaInodes();
  auto a0 = AttachClient(s0).Attach("m");
  auto a1 = AttachClient(s1).Attach("m");
  ASSERT_TRUE(a0.ok()) << a0.status().ToString();
  ASSERT_TRUE(a1.ok()) << a1.status().ToString();
  EXPECT_EQ((*a0)->checksum(), (*a1)->checksum());
  EXPECT_EQ((*a0)->ComputeChecksum().value(), (*a1)->ComputeChecksum().value());
  // Two arenas, not one mapped twice.
  std::set<std::string> now = MappedArenaInodes();
  for (const std::string& i : before) now.erase(i);
  EXPECT_EQ(now.size(), 2u);
  // Each store counts its own client.
  for (const std::string& s : {s0, s1}) {
    auto status = AttachClient(s).GetStatus();
    ASSERT_TRUE(status.ok()) << status.status().ToString();
    EXPECT_EQ(status->arenas.size(), 1u);
    EXPECT_EQ(status->lease_total, 1u) << s;
  }
  a0->reset();
  a1->reset();
  const int exit = store.Stop();
  EXPECT_TRUE(WIFEXITED(exit) && WEXITSTATUS(exit) == 0) << store.output();
  EXPECT_NE(::stat(s0.c_str(), &st), 0) << "socket left behind";
  EXPECT_NE(::stat(s1.c_str(), &st), 0) << "socket left behind";
}

TEST(StoreDevices, AFailingDeviceStopsTheWholeStoreAndLeavesNoSocket) {
  TempDir dir;
  const std::string socket = dir.File("run/store.sock");
  // host1's socket path is taken by a file that is not a socket.
  std::filesystem::create_directories(dir.File("run"));
  ::chmod(dir.File("run").c_str(), 0750);
  std::ofstream(DeviceSocketPath(socket, "host1")) << "not a socket";
  testing::StoreProcessOptions options;
  options.wait_ready = false;
  testing::StoreProcess store(socket, {"--device", "host0,host1"}, options);
  int status = 0;
  ASSERT_TRUE(store.WaitForExit(std::chrono::seconds(60), &status)) << store.output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << store.output();
  EXPECT_NE(store.output().find("host1"), std::string::npos) << store.output();
  EXPECT_NE(store.output().find("not a socket"), std::string::npos) << store.output();
  struct stat st;
  EXPECT_NE(::stat(DeviceSocketPath(socket, "host0").c_str(), &st), 0)
      << "host0's socket left behind";
}

}  // namespace
}  // namespace hearth
