// What /metrics and GET /v2/hearth/workers make of the driver's per-process
// figures: a pid's figure on its own device only, none where NVML did not
// answer, the processes of others never counted, and a spare the driver
// does not list counted as it reported itself.
#include "server/device_process_memory.h"

#include <gtest/gtest.h>

namespace hearth {
namespace {

DriverMemory OnCuda0() {
  DriverMemory driver;
  // The server itself (7), a worker (100), a spare (200), another user's
  // process (999).
  driver.by_device["cuda:0"] = {
      {7, 900ull << 20}, {100, 512ull << 20}, {200, 322ull << 20}, {999, 30ull << 30}};
  return driver;
}

TEST(DriverMemory, APidsFigureIsTheOneOnItsOwnDevice) {
  const DriverMemory driver = OnCuda0();
  EXPECT_TRUE(driver.answered());
  EXPECT_EQ(driver.Of("cuda:0", 100), 512ull << 20);
  EXPECT_EQ(driver.Of("cuda:0", 101), std::nullopt);  // not listed
  EXPECT_EQ(driver.Of("cuda:1", 100), std::nullopt);  // NVML did not answer for cuda:1
  EXPECT_EQ(driver.Of("cpu", 100), std::nullopt);
  EXPECT_EQ(driver.Of("cuda:0", -1), std::nullopt);  // a worker between two processes
  EXPECT_FALSE(DriverMemory{}.answered());
}

TEST(DriverMemory, HotSparesCountTheDriversFigureAndOnlyTheirs) {
  const DriverMemory driver = OnCuda0();
  const std::vector<HotSpareInfo> spares = {{200, 2 << 20, 1000, std::nullopt}};
  EXPECT_EQ(HotSpareDeviceMemory(driver, "cuda:0", spares), 322ull << 20);
}

TEST(DriverMemory, ASpareTheDriverDoesNotListCountsWhatItReported) {
  const DriverMemory driver = OnCuda0();
  const std::vector<HotSpareInfo> spares = {{200, 2 << 20, 1000, std::nullopt},
                                            {201, 3 << 20, 1000, std::nullopt}};
  EXPECT_EQ(HotSpareDeviceMemory(driver, "cuda:0", spares), (322ull << 20) + (3 << 20));
}

TEST(DriverMemory, WhereNvmlDidNotAnswerEverySpareCountsWhatItReported) {
  const std::vector<HotSpareInfo> spares = {{200, 2 << 20, 1000, std::nullopt},
                                            {201, 3 << 20, 1000, std::nullopt}};
  EXPECT_EQ(HotSpareDeviceMemory(DriverMemory{}, "cuda:0", spares), 5u << 20);
  EXPECT_EQ(HotSpareDeviceMemory(OnCuda0(), "cuda:1", spares), 5u << 20);
  EXPECT_EQ(HotSpareDeviceMemory(OnCuda0(), "cuda:0", {}), 0u);
}

}  // namespace
}  // namespace hearth
