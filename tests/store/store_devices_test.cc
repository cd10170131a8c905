// Several devices' stores: the names `hearth store --device` takes, the
// socket each device's store binds, and what a store says it holds
// (Store::HeldArenas, which hearth serve's /metrics reports per device).

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

}  // namespace
}  // namespace hearth
