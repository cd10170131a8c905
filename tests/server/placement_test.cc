// Placement of a model's instances over the GPUs (Triton's instance_group
// meaning), and when a placement is taken for failed.
#include "server/placement.h"

#include "gtest/gtest.h"

namespace hearth {
namespace {

PlacementContext Gpus(int visible, int default_gpu = 0) {
  PlacementContext c;
  c.gpus = true;
  c.visible_gpus = visible;
  c.default_gpu = default_gpu;
  return c;
}

using Placements = std::vector<Placement>;

TEST(PlaceInstances, CountInstancesOnEachListedGpu) {
  auto p = PlaceInstances({{2, true, {0, 1}}}, Gpus(2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{0, 2}, {1, 2}}));
  // Listed in any order: placements come by ordinal.
  p = PlaceInstances({{1, true, {3, 0}}}, Gpus(4));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{0, 1}, {3, 1}}));
}

TEST(PlaceInstances, GroupsAddUpPerDevice) {
  auto p = PlaceInstances({{2, true, {0, 1}}, {1, true, {1}}, {3, true, {}}}, Gpus(2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{0, 5}, {1, 3}}));
}

TEST(PlaceInstances, NoGpusMeansTheDefaultGpu) {
  auto p = PlaceInstances({{3, true, {}}}, Gpus(2, 1));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{1, 3}}));
}

TEST(PlaceInstances, CpuGroupsGoToTheHostFirst) {
  auto p = PlaceInstances({{2, true, {1}}, {3, false, {}}}, Gpus(2));
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{-1, 3}, {1, 2}}));
}

TEST(PlaceInstances, AServerWithoutGpusRunsEveryInstanceOnTheHost) {
  PlacementContext host;  // gpus = false
  auto p = PlaceInstances({{2, true, {0, 1}}, {3, false, {}}, {1, true, {}}}, host);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{-1, 2 * 2 + 3 + 1}}));
  // GPU ordinals are not checked where no GPU is used.
  p = PlaceInstances({{1, true, {7}}}, host);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{-1, 1}}));
}

TEST(PlaceInstances, WorkersOverrideIsPerPlacement) {
  PlacementContext c = Gpus(2);
  c.workers_per_placement = 4;
  auto p = PlaceInstances({{1, true, {0, 1}}, {3, false, {}}}, c);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{-1, 4}, {0, 4}, {1, 4}}));
  PlacementContext host;
  host.workers_per_placement = 4;
  p = PlaceInstances({{1, true, {0, 1}}}, host);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(*p, (Placements{{-1, 4}}));
}

TEST(PlaceInstances, AGpuThatIsNotThereNamesTheGroupTheGpuAndTheCount) {
  auto p = PlaceInstances({{1, true, {0}}, {2, true, {0, 2}}}, Gpus(2));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(),
            "instance_group[1].gpus names GPU 2, but 2 GPUs are visible (GPUs 0 to 1), by the "
            "CUDA driver");
  PlacementContext c = Gpus(1);
  c.gpu_source = "--stand-in-gpus";
  p = PlaceInstances({{1, true, {1}}}, c);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().message(),
            "instance_group[0].gpus names GPU 1, but 1 GPU is visible (GPU 0), by "
            "--stand-in-gpus");
  c = Gpus(0);
  c.gpu_source = "the CUDA driver: no CUDA device";
  p = PlaceInstances({{1, true, {0}}}, c);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().message(),
            "instance_group[0].gpus names GPU 0, but 0 GPUs are visible, by the CUDA driver: no "
            "CUDA device");
}

TEST(PlaceInstances, TheDefaultGpuMustBeThereForAGroupThatListsNone) {
  auto p = PlaceInstances({{1, true, {0}}, {1, true, {}}}, Gpus(2, 3));
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("instance_group[1] lists no gpus, so it goes to the "
                                      "server's default GPU 3 (--device), but 2 GPUs are visible"),
            std::string::npos)
      << p.status().message();
  // Unused, it is not checked.
  EXPECT_TRUE(PlaceInstances({{1, true, {0}}}, Gpus(2, 3)).ok());
}

TEST(PlaceInstances, AtMostMaxModelWorkersInAll) {
  std::vector<int> gpus;
  for (int g = 0; g < 5; ++g) gpus.push_back(g);
  EXPECT_TRUE(PlaceInstances({{204, true, gpus}}, Gpus(5)).ok());  // 1020
  auto p = PlaceInstances({{205, true, gpus}}, Gpus(5));           // 1025
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("more than 1024 workers"), std::string::npos);
}

using Health = PlacementHealth;
using std::chrono::milliseconds;

TEST(PlacementHealth, FailsAfterDeathsInARowWithNoBatchAnswered) {
  EXPECT_EQ(Health::FailAfter(1), 4);  // never under a poison request's 3
  EXPECT_EQ(Health::FailAfter(2), 4);
  EXPECT_EQ(Health::FailAfter(4), 8);
  Health h(2);
  const auto t = Health::Clock::time_point{} + std::chrono::hours(1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(h.OnDeath(t), Health::Change::kNone);
  EXPECT_EQ(h.OnAnswered(), Health::Change::kNone);  // resets the count
  EXPECT_EQ(h.deaths_in_a_row(), 0);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(h.OnDeath(t), Health::Change::kNone);
  EXPECT_FALSE(h.failed());
  EXPECT_EQ(h.OnDeath(t), Health::Change::kFailed);
  EXPECT_TRUE(h.failed());
  EXPECT_EQ(h.times_failed(), 1u);
  EXPECT_EQ(h.OnDeath(t), Health::Change::kNone);  // failed once, reported once
  EXPECT_EQ(h.OnAnswered(), Health::Change::kRecovered);
  EXPECT_FALSE(h.failed());
  EXPECT_EQ(h.times_failed(), 1u);
}

TEST(PlacementHealth, OneProbeAtATimeOnceDueLaterAfterEachDeath) {
  Health h(1);
  const auto t0 = Health::Clock::time_point{} + std::chrono::hours(1);
  EXPECT_FALSE(h.ClaimProbe(t0));  // not failed: no probe
  for (int i = 0; i < Health::FailAfter(1); ++i) (void)h.OnDeath(t0);
  ASSERT_TRUE(h.failed());
  EXPECT_FALSE(h.ClaimProbe(t0 + milliseconds(999)));
  EXPECT_TRUE(h.ClaimProbe(t0 + milliseconds(1000)));
  EXPECT_FALSE(h.ClaimProbe(t0 + milliseconds(1000)));  // held by the first
  h.ReleaseProbe();                                     // it found no batch
  EXPECT_TRUE(h.ClaimProbe(t0 + milliseconds(1001)));
  // The probe's worker died: the next one waits twice as long.
  const auto t1 = t0 + milliseconds(1500);
  EXPECT_EQ(h.OnDeath(t1), Health::Change::kNone);
  EXPECT_FALSE(h.ClaimProbe(t1 + milliseconds(1999)));
  EXPECT_TRUE(h.ClaimProbe(t1 + milliseconds(2000)));
  // Up to 30 s, not more.
  auto t = t1;
  for (int i = 0; i < 10; ++i) (void)h.OnDeath(t);
  EXPECT_FALSE(h.ClaimProbe(t + milliseconds(29999)));
  EXPECT_TRUE(h.ClaimProbe(t + milliseconds(30000)));
  EXPECT_EQ(h.OnAnswered(), Health::Change::kRecovered);
  EXPECT_FALSE(h.ClaimProbe(t + milliseconds(60000)));
  // Failed again: the first probe is 1 s away again.
  for (int i = 0; i < Health::FailAfter(1); ++i) (void)h.OnDeath(t);
  EXPECT_EQ(h.times_failed(), 2u);
  EXPECT_TRUE(h.ClaimProbe(t + milliseconds(1000)));
}

}  // namespace
}  // namespace hearth
