// The layout of a batch in a worker's slot: inline inputs copied by the
// server, inputs and outputs in CUDA shared-memory regions left to the
// worker as device copies at each request's rows, regions named once
// however many requests share them, and batches cut where a run's limits
// would be passed. Every run it makes passes the protocol's own check.
#include "server/batch_layout.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/shared_memory.h"

namespace hearth {
namespace {

std::shared_ptr<const CudaSharedMemoryEntry> Region(uint64_t id, uint64_t bytes = 1 << 20,
                                                    int device = 0) {
  auto e = std::make_shared<CudaSharedMemoryEntry>();
  e->id = id;
  e->info = {"r" + std::to_string(id), device, bytes};
  e->handle.fill(static_cast<uint8_t>(id));
  return e;
}

// x FP32 [-1, 4], z FP32 [-1, 2] -> y FP32 [-1, 3], w BYTES [-1, 1].
struct Model {
  std::vector<TensorSpec> inputs = {{"x", DType::kF32, {4}}, {"z", DType::kF32, {2}}};
  std::vector<TensorSpec> outputs = {{"y", DType::kF32, {3}}, {"w", DType::kBytes, {1}}};
  BatchModel model() const { return {inputs, outputs, true, false}; }
};

// A job of `rows` rows; x inline unless `x_in` names a region, z likewise,
// and y to `y_in` when given.
std::shared_ptr<Job> MakeJob(int64_t rows,
                             std::shared_ptr<const CudaSharedMemoryEntry> x_in = nullptr,
                             uint64_t x_at = 0,
                             std::shared_ptr<const CudaSharedMemoryEntry> y_in = nullptr,
                             uint64_t y_at = 0,
                             std::shared_ptr<const CudaSharedMemoryEntry> z_in = nullptr) {
  auto job = std::make_shared<Job>();
  job->batch = rows;
  auto input = [&](const std::string& name, int64_t width,
                   std::shared_ptr<const CudaSharedMemoryEntry> region, uint64_t at) {
    InferTensor t(name, DType::kF32, {rows, width});
    const uint64_t bytes = static_cast<uint64_t>(rows * width) * 4;
    if (region) {
      t.shm = SharedMemoryRef{region->info.name, at, bytes, region};
    } else {
      std::vector<std::byte> data(bytes);
      for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i + rows);
      t.data = std::move(data);
    }
    return t;
  };
  job->request.inputs.push_back(input("x", 4, x_in, x_at));
  job->request.inputs.push_back(input("z", 2, z_in, 0));
  if (y_in) {
    RequestedOutput y("y", true);
    y.shm = SharedMemoryRef{y_in->info.name, y_at, static_cast<uint64_t>(rows) * 12, y_in};
    job->request.outputs.push_back(y);
  }
  return job;
}

TEST(BatchLayout, InlineInputsAreCopiedRequestAfterRequestAndOutputsPlaced) {
  Model m;
  std::vector<std::shared_ptr<Job>> jobs = {MakeJob(2), MakeJob(3)};
  auto layout = LayOutBatch(m.model(), jobs);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const control::Run& run = layout->run;
  EXPECT_EQ(run.rows, 5);
  ASSERT_EQ(run.inputs.size(), 2u);
  EXPECT_EQ(run.inputs[0], (control::SlotTensor{0, 80, {5, 4}}));
  EXPECT_EQ(run.inputs[1], (control::SlotTensor{128, 40, {5, 2}}));
  // y is placed (fixed size); w, BYTES, is the worker's to place.
  EXPECT_EQ(run.outputs[0], (control::SlotTensor{192, 60, {5, 3}}));
  EXPECT_EQ(run.output_placed, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(run.free_offset, 256u);
  EXPECT_TRUE(run.regions.empty());
  EXPECT_TRUE(run.copies.empty());
  ASSERT_EQ(layout->host_copies.size(), 4u);
  const uint64_t at[] = {0, 32, 128, 144};
  const size_t bytes[] = {32, 48, 16, 24};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(layout->host_copies[k].slot_offset, at[k]) << k;
    EXPECT_EQ(layout->host_copies[k].bytes.size(), bytes[k]) << k;
  }
  // The copies are views of the requests' own bytes.
  EXPECT_EQ(layout->host_copies[1].bytes.data(), jobs[1]->request.inputs[0].data.data());
  EXPECT_TRUE(control::CheckDeviceCopies(run).ok());
}

TEST(BatchLayout, TheSlotStartsWithRoomOnlyForOutputsTheWorkerPlaces) {
  Model m;
  auto placing = LayOutBatch(m.model(), std::vector<std::shared_ptr<Job>>{MakeJob(2)});
  ASSERT_TRUE(placing.ok()) << placing.status().ToString();
  // w (BYTES) is the worker's to place: at least 64 KiB beyond the layout.
  EXPECT_EQ(InitialSlotBytes(placing->run), placing->run.free_offset + (64u << 10));
  Model fixed;
  fixed.outputs.pop_back();
  auto placed = LayOutBatch(fixed.model(), std::vector<std::shared_ptr<Job>>{MakeJob(2)});
  ASSERT_TRUE(placed.ok()) << placed.status().ToString();
  EXPECT_EQ(InitialSlotBytes(placed->run), placed->run.free_offset);
  control::Run large;
  large.output_placed = {0};
  large.free_offset = 10u << 20;
  EXPECT_EQ(InitialSlotBytes(large), 15u << 20);
  EXPECT_EQ(InitialSlotBytes(control::Run{}), 1u);  // never an empty slot
}

TEST(BatchLayout, CudaInputsAndOutputsAreCopiesAtEachRequestsRowsAndKeepTheirRoom) {
  Model m;
  auto a = Region(7), b = Region(9);
  // Mixed: the first request's x inline, the second's and third's in
  // regions (the same one for both), every y to a region but the first's.
  std::vector<std::shared_ptr<Job>> jobs = {MakeJob(2), MakeJob(1, a, 100, b, 40),
                                            MakeJob(3, a, 500, a, 1000)};
  auto layout = LayOutBatch(m.model(), jobs);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const control::Run& run = layout->run;
  // x keeps room for every row, whoever copies them.
  EXPECT_EQ(run.inputs[0], (control::SlotTensor{0, 96, {6, 4}}));
  ASSERT_EQ(run.regions.size(), 2u);
  EXPECT_EQ(run.regions[0].id, 7u);
  EXPECT_EQ(run.regions[1].id, 9u);
  EXPECT_EQ(run.regions[0].handle[0], 7);
  EXPECT_EQ(run.regions[0].byte_size, 1u << 20);
  const std::vector<control::DeviceCopy> want = {
      // x of request 1 (rows 2) and of request 2 (rows 3), from region a
      {0, false, 0, 32, 16, 100},
      {0, false, 0, 48, 48, 500},
      // y of request 1 to b, of request 2 to a: 12 bytes a row
      {1, true, 0, 24, 12, 40},
      {0, true, 0, 36, 36, 1000},
  };
  EXPECT_EQ(run.copies, want);
  // Only request 0's x and everyone's z are the server's to copy.
  ASSERT_EQ(layout->host_copies.size(), 4u);
  EXPECT_EQ(layout->host_copies[0].slot_offset, 0u);
  EXPECT_EQ(layout->host_copies[0].bytes.size(), 32u);
  EXPECT_EQ(layout->output_in_cuda,
            (std::vector<std::vector<bool>>{{false, false}, {true, false}, {true, false}}));
  EXPECT_TRUE(control::CheckDeviceCopies(run).ok()) << control::CheckDeviceCopies(run).ToString();
}

TEST(BatchLayout, ACompactRunGivesBytesInRegionsNoRoomInTheSlot) {
  Model m;
  auto a = Region(7), b = Region(9);
  std::vector<std::shared_ptr<Job>> jobs = {MakeJob(2), MakeJob(1, a, 100, b, 40),
                                            MakeJob(3, a, 500, a, 1000)};
  auto layout = LayOutBatch(m.model(), jobs, /*compact=*/true);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  const control::Run& run = layout->run;
  EXPECT_TRUE(run.compact);
  // The tensors are as whole as ever; their places hold only inline bytes:
  // x the first request's 32, z all 48, y the first request's 24.
  EXPECT_EQ(run.inputs[0], (control::SlotTensor{0, 96, {6, 4}}));
  EXPECT_EQ(run.inputs[1], (control::SlotTensor{64, 48, {6, 2}}));
  EXPECT_EQ(run.outputs[0], (control::SlotTensor{128, 72, {6, 3}}));
  EXPECT_EQ(control::SlotRooms(run, false), (std::vector<uint64_t>{32, 48}));
  EXPECT_EQ(control::SlotRooms(run, true), (std::vector<uint64_t>{24, 0}));
  EXPECT_EQ(run.free_offset, 192u);
  // Copies are at each request's rows of the tensor, as in a run that is
  // not compact.
  const std::vector<control::DeviceCopy> want = {{0, false, 0, 32, 16, 100},
                                                 {0, false, 0, 48, 48, 500},
                                                 {1, true, 0, 24, 12, 40},
                                                 {0, true, 0, 36, 36, 1000}};
  EXPECT_EQ(run.copies, want);
  // z's rows follow one another in its place; x's only inline rows at 0.
  ASSERT_EQ(layout->host_copies.size(), 4u);
  const uint64_t at[] = {0, 64, 80, 88};
  const size_t bytes[] = {32, 16, 8, 24};
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(layout->host_copies[k].slot_offset, at[k]) << k;
    EXPECT_EQ(layout->host_copies[k].bytes.size(), bytes[k]) << k;
  }
  // The first request's y is read at the place's start; the others' are
  // answered by their sizes.
  EXPECT_EQ(layout->output_shares[0][0].slot_offset, 128u);
  EXPECT_EQ(layout->output_shares[0][0].bytes, 24u);
  EXPECT_EQ(layout->output_shares[1][0].bytes, 12u);
  EXPECT_EQ(layout->output_shares[2][0].bytes, 36u);
  EXPECT_TRUE(control::CheckDeviceCopies(run).ok()) << control::CheckDeviceCopies(run).ToString();
  // Every place, at its room, inside the free room's start.
  for (size_t i = 0; i < run.inputs.size(); ++i)
    EXPECT_TRUE(control::CheckSlotTensor(run.inputs[i], DType::kF32, 0, run.free_offset, nullptr,
                                         "x", control::SlotRooms(run, false)[i])
                    .ok());
}

TEST(BatchLayout, AHugeInputInARegionGrowsNoCompactRunsSlot) {
  Model m;
  auto huge = Region(7, 1ull << 42);
  auto job = MakeJob(1, huge);
  job->request.inputs[0].shm->byte_size = 1ull << 40;
  job->request.inputs[0].shape = {1, int64_t{1} << 38};
  std::vector<std::shared_ptr<Job>> jobs = {job};
  auto compact = LayOutBatch(m.model(), jobs, true);
  ASSERT_TRUE(compact.ok()) << compact.status().ToString();
  EXPECT_EQ(compact->run.inputs[0].bytes, 1ull << 40);
  EXPECT_LT(compact->run.free_offset, 4096u);
  auto roomy = LayOutBatch(m.model(), jobs, false);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  EXPECT_GT(roomy->run.free_offset, 1ull << 40);
}

TEST(BatchLayout, MergedBatchesAreCutAtTheirBytesInRegions) {
  auto a = Region(7, 1ull << 32);
  auto big = [&] {
    auto job = MakeJob(1, a);
    job->request.inputs[0].shm->byte_size = 100ull << 20;
    return job;
  };
  std::vector<std::shared_ptr<Job>> jobs = {big(), big(), big(), MakeJob(1)};
  EXPECT_EQ(JobsThatFit(jobs), 2u);  // 200 MiB of the 256
  EXPECT_EQ(JobsThatFit(jobs, control::kMaxSlotBytes, 100ull << 20), 1u);
  // Alone, a request is taken whatever its size: it needs no staging.
  EXPECT_EQ(JobsThatFit(std::span(jobs).subspan(0, 1), control::kMaxSlotBytes, 1), 1u);
  // Inline requests are not held to it.
  std::vector<std::shared_ptr<Job>> inline_jobs = {MakeJob(1), MakeJob(1), MakeJob(1)};
  EXPECT_EQ(JobsThatFit(inline_jobs, control::kMaxSlotBytes, 1), 3u);
}

TEST(BatchLayout, AModelThatDoesNotBatchCopiesItsWholeTensors) {
  std::vector<TensorSpec> inputs = {{"x", DType::kF32, {4}}};
  std::vector<TensorSpec> outputs = {{"y", DType::kF32, {3}}};
  auto r = Region(1);
  auto job = std::make_shared<Job>();
  InferTensor x("x", DType::kF32, {4});
  x.shm = SharedMemoryRef{"r1", 64, 16, r};
  job->request.inputs.push_back(x);
  RequestedOutput y("y", false);
  y.shm = SharedMemoryRef{"r1", 0, 12, r};
  job->request.outputs.push_back(y);
  std::vector<std::shared_ptr<Job>> jobs = {job};
  auto layout = LayOutBatch({inputs, outputs, false, false}, jobs);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->run.inputs[0], (control::SlotTensor{0, 16, {4}}));
  EXPECT_EQ(layout->run.copies,
            (std::vector<control::DeviceCopy>{{0, false, 0, 0, 16, 64}, {0, true, 0, 0, 12, 0}}));
  EXPECT_TRUE(layout->host_copies.empty());
  EXPECT_TRUE(control::CheckDeviceCopies(layout->run).ok());
}

TEST(BatchLayout, AnOutputWithoutAKnownSizeOrWithoutRoomIsRefused) {
  std::vector<TensorSpec> inputs = {{"x", DType::kF32, {4}}};
  std::vector<TensorSpec> outputs = {{"y", DType::kF32, {3}}};
  auto r = Region(1);
  auto job = std::make_shared<Job>();
  job->request.inputs.push_back(InferTensor("x", DType::kF32, {2, 4}, std::vector<std::byte>(32)));
  job->batch = 2;
  RequestedOutput y("y", false);
  y.shm = SharedMemoryRef{"r1", 0, 23, r};  // 24 needed
  job->request.outputs.push_back(y);
  std::vector<std::shared_ptr<Job>> jobs = {job};
  auto small = LayOutBatch({inputs, outputs, true, false}, jobs);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("do not fit"), std::string::npos);
  job->request.outputs[0].shm->byte_size = 24;
  EXPECT_TRUE(LayOutBatch({inputs, outputs, true, false}, jobs).ok());
  // A decoupled model's outputs are placed by the worker, response by response.
  auto decoupled = LayOutBatch({inputs, outputs, true, true}, jobs);
  ASSERT_FALSE(decoupled.ok());
  EXPECT_NE(decoupled.status().message().find("no size known"), std::string::npos);
}

TEST(BatchLayout, BatchesAreCutWhereARunWouldNameTooManyRegions) {
  Model m;
  std::vector<std::shared_ptr<Job>> jobs;
  // 40 requests, each with its own region for x and its own for y: two
  // regions a request, so 32 fit in a run of 64.
  for (uint64_t k = 0; k < 40; ++k)
    jobs.push_back(MakeJob(1, Region(2 * k + 1), 0, Region(2 * k + 2)));
  EXPECT_EQ(JobsThatFit(jobs), 32u);
  std::span<const std::shared_ptr<Job>> first(jobs.data(), 32);
  auto layout = LayOutBatch(m.model(), first);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->run.regions.size(), control::kMaxRunRegions);
  EXPECT_TRUE(control::CheckDeviceCopies(layout->run).ok());
  // One more is over: the layout refuses it rather than send a run the
  // worker would refuse.
  std::span<const std::shared_ptr<Job>> too_many(jobs.data(), 33);
  auto refused = LayOutBatch(m.model(), too_many);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("over the limits"), std::string::npos);
  // Requests that share regions are not cut: only distinct ones count.
  auto shared = Region(500);
  std::vector<std::shared_ptr<Job>> same;
  for (int k = 0; k < 200; ++k) same.push_back(MakeJob(1, shared, 0, shared, 0));
  EXPECT_EQ(JobsThatFit(same), 200u);
  // Inline requests name none.
  std::vector<std::shared_ptr<Job>> inline_jobs(100, MakeJob(1));
  EXPECT_EQ(JobsThatFit(inline_jobs), 100u);
  EXPECT_EQ(JobsThatFit({}), 0u);
}

TEST(BatchLayout, BatchesAreCutWhereARunWouldHoldTooManyCopies) {
  Model m;
  auto r = Region(3);
  // Three copies a request (x, z, y), all in one region: 341 fit in 1024.
  std::vector<std::shared_ptr<Job>> jobs;
  for (int k = 0; k < 400; ++k) jobs.push_back(MakeJob(1, r, 0, r, 0, r));
  EXPECT_EQ(JobsThatFit(jobs), control::kMaxDeviceCopies / 3);
  std::span<const std::shared_ptr<Job>> first(jobs.data(), JobsThatFit(jobs));
  auto layout = LayOutBatch(m.model(), first);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  EXPECT_EQ(layout->run.regions.size(), 1u);
  EXPECT_EQ(layout->run.copies.size(), 3 * first.size());
  EXPECT_TRUE(control::CheckDeviceCopies(layout->run).ok());
  // A request is never cut off from itself: the first always goes.
  std::vector<std::shared_ptr<Job>> one = {jobs[0]};
  EXPECT_EQ(JobsThatFit(one), 1u);
}

}  // namespace
}  // namespace hearth

namespace hearth {
namespace {

// Sizes a client gives (a CUDA input's byte_size, up to its region's) are
// bounded before they are added: a batch is cut at the slot's input bytes,
// and sizes that would wrap a 64-bit sum fail the layout, never become a
// small one.
TEST(BatchLayout, ClientSizesAreBoundedBeforeTheyAreAdded) {
  Model m;
  auto huge = Region(7, ~0ull >> 2);
  auto big_job = [&](uint64_t bytes) {
    auto job = MakeJob(1, huge);
    job->request.inputs[0].shm->byte_size = bytes;
    return job;
  };
  // 24 bytes of inline inputs a job: two fit in 48, the third is cut off.
  std::vector<std::shared_ptr<Job>> three = {MakeJob(1), MakeJob(1), MakeJob(1)};
  EXPECT_EQ(JobsThatFit(three, 48), 2u);
  // One job alone is always taken (it fails alone if it is over).
  EXPECT_EQ(JobsThatFit(std::vector<std::shared_ptr<Job>>{big_job(1ull << 61)}, 1024), 1u);
  // A huge request after a small one is left for the next batch.
  std::vector<std::shared_ptr<Job>> mixed = {MakeJob(1), big_job(1ull << 61), MakeJob(1)};
  EXPECT_EQ(JobsThatFit(mixed, 16ull << 30), 1u);
  // Laid out anyway, sizes that would wrap are refused.
  std::vector<std::shared_ptr<Job>> wrapping = {big_job(1ull << 61), big_job(1ull << 61),
                                                big_job(1ull << 61)};
  auto refused = LayOutBatch(m.model(), wrapping);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("input 'x' of the batch comes to more than"),
            std::string::npos)
      << refused.status().ToString();
}

}  // namespace
}  // namespace hearth
