// GpuProcessMemory over fake NVML tables: an absent library or a failing
// NVML leaves every figure unknown (and is asked once), lists that need a
// bigger array are read whole, errors are errors, and a GPU is read at most
// once per max_age. LoadNvml over real fake libraries (fake_nvml.c): which
// entry point it takes, and the struct layout they fill.
#include "common/gpu_process_memory.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace hearth {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

nvml::Device DeviceAt(uintptr_t n) { return reinterpret_cast<nvml::Device>(n); }

// A fake driver: GPUs by PCI bus id, each with its processes, and a record of
// the calls made. `processes` fills arrays as NVML does: the count in, the
// count out, NVML_ERROR_INSUFFICIENT_SIZE with the number needed.
struct FakeNvml {
  struct Gpu {
    std::vector<nvml::ProcessInfoV2> processes;
    nvml::Return error = nvml::kSuccess;  // what the list call answers instead
    int grow_each_call = 0;               // processes that start between calls
    bool outgrow_array = false;           // always one more than the array holds
  };
  std::map<std::string, Gpu> gpus;
  nvml::Return init_result = nvml::kSuccess;
  int loads = 0, inits = 0, lookups = 0;
  std::vector<unsigned int> capacities;  // of each list call

  NvmlApi Api(bool v1 = false) {
    NvmlApi api;
    api.init = [this] {
      ++inits;
      return init_result;
    };
    api.device_by_pci_bus_id = [this](const char* id, nvml::Device* device) {
      ++lookups;
      auto it = gpus.find(id);
      if (it == gpus.end()) return nvml::Return{6};  // NVML_ERROR_NOT_FOUND
      *device = DeviceAt(1 + std::distance(gpus.begin(), it));
      return nvml::kSuccess;
    };
    api.error_string = [](nvml::Return r) { return r == 999 ? "Unknown Error" : "Not Found"; };
    if (v1) {
      api.processes_name = "nvmlDeviceGetComputeRunningProcesses";
      api.processes_v1 = [this](nvml::Device d, unsigned int* count, nvml::ProcessInfoV1* out) {
        return Fill(d, count, out);
      };
    } else {
      api.processes_name = "nvmlDeviceGetComputeRunningProcesses_v3";
      api.processes = [this](nvml::Device d, unsigned int* count, nvml::ProcessInfoV2* out) {
        return Fill(d, count, out);
      };
    }
    return api;
  }

  template <typename Info>
  nvml::Return Fill(nvml::Device d, unsigned int* count, Info* out) {
    capacities.push_back(*count);
    auto it = gpus.begin();
    std::advance(it, reinterpret_cast<uintptr_t>(d) - 1);
    Gpu& gpu = it->second;
    if (gpu.error != nvml::kSuccess) return gpu.error;
    for (int i = 0; i < gpu.grow_each_call; ++i) {
      const unsigned int pid = 90000 + static_cast<unsigned int>(gpu.processes.size());
      gpu.processes.push_back({pid, 1 << 20, ~0u, ~0u});
    }
    while (gpu.outgrow_array && gpu.processes.size() <= *count)
      gpu.processes.push_back({static_cast<unsigned int>(gpu.processes.size() + 1), 1, ~0u, ~0u});
    const size_t n = gpu.processes.size();
    if (n > *count) {
      *count = static_cast<unsigned int>(n);
      return nvml::kErrorInsufficientSize;
    }
    for (size_t i = 0; i < n; ++i) {
      out[i].pid = gpu.processes[i].pid;
      out[i].usedGpuMemory = gpu.processes[i].usedGpuMemory;
    }
    *count = static_cast<unsigned int>(n);
    return nvml::kSuccess;
  }

  // A GpuProcessMemory over this fake, its clock `now`.
  std::unique_ptr<GpuProcessMemory> Reader(Clock::time_point* now, bool v1 = false,
                                           unsigned int max_processes = 4096) {
    GpuProcessMemoryOptions options;
    options.max_processes = max_processes;
    options.now = [now] { return *now; };
    return std::make_unique<GpuProcessMemory>(
        [this, v1]() -> Result<NvmlApi> {
          ++loads;
          return Api(v1);
        },
        options);
  }
};

constexpr char kBus0[] = "00000000:19:00.0";
constexpr char kBus1[] = "00000000:3b:00.0";

TEST(GpuProcessMemory, WithoutTheLibraryEveryFigureIsUnknownAndTheLoadIsTriedOnce) {
  int loads = 0;
  GpuProcessMemory reader([&]() -> Result<NvmlApi> {
    ++loads;
    return Unavailable("libnvidia-ml.so.1 cannot be loaded");
  });
  for (int i = 0; i < 3; ++i) {
    Result<ProcessMemory> m = reader.OnDevice(kBus0);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ(m.status().message(), "libnvidia-ml.so.1 cannot be loaded");
  }
  EXPECT_EQ(loads, 1);
}

TEST(GpuProcessMemory, ALibraryThatIsNotThereIsUnavailableNotAnAbort) {
  Result<NvmlApi> api = LoadNvml("libhearth-no-such-nvml.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(api.status().message().find("libhearth-no-such-nvml.so.1 cannot be loaded"),
            std::string::npos)
      << api.status().message();
}

TEST(GpuProcessMemory, AFailedInitIsKeptAndNothingElseIsCalled) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, 5 << 20, ~0u, ~0u}};
  fake.init_result = 9;  // NVML_ERROR_DRIVER_NOT_LOADED
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  for (int i = 0; i < 2; ++i) {
    Result<ProcessMemory> m = reader->OnDevice(kBus0);
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(m.status().message().find("nvmlInit_v2 failed: NVML error 9"), std::string::npos)
        << m.status().message();
    now += 5s;
  }
  EXPECT_EQ(fake.loads, 1);
  EXPECT_EQ(fake.inits, 1);
  EXPECT_EQ(fake.lookups, 0);
  EXPECT_TRUE(fake.capacities.empty());
}

TEST(GpuProcessMemory, ReadsEachProcessOfTheGpuAtTheBusId) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, 400ull << 20, ~0u, ~0u}, {200, 322ull << 20, ~0u, ~0u}};
  fake.gpus[kBus1].processes = {{300, 1ull << 30, ~0u, ~0u}};
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(*m, (ProcessMemory{{100, 400ull << 20}, {200, 322ull << 20}}));
  m = reader->OnDevice(kBus1);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(*m, (ProcessMemory{{300, 1ull << 30}}));
  EXPECT_EQ(fake.inits, 1);
}

TEST(GpuProcessMemory, AListLongerThanTheFirstArrayIsReadWhole) {
  FakeNvml fake;
  ProcessMemory want;
  for (unsigned int i = 0; i < 100; ++i) {
    fake.gpus[kBus0].processes.push_back({1000 + i, (i + 1ull) << 20, ~0u, ~0u});
    want[1000 + i] = (i + 1ull) << 20;
  }
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(*m, want);
  // 32 first; then room for the 100 NVML asked for.
  ASSERT_EQ(fake.capacities.size(), 2u);
  EXPECT_EQ(fake.capacities[0], 32u);
  EXPECT_GE(fake.capacities[1], 100u);
}

TEST(GpuProcessMemory, AListThatGrowsBetweenReadsIsReadOnceItFits) {
  FakeNvml fake;
  for (unsigned int i = 0; i < 40; ++i) fake.gpus[kBus0].processes.push_back({i + 1, 1, ~0u, ~0u});
  fake.gpus[kBus0].grow_each_call = 3;  // three more at each call
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->size(), fake.gpus[kBus0].processes.size());
  EXPECT_EQ(fake.capacities, (std::vector<unsigned int>{32, 64}));  // 43 needed, then 46
}

TEST(GpuProcessMemory, MoreProcessesThanTheLimitIsAnErrorNotAnEndlessGrowth) {
  FakeNvml fake;
  for (unsigned int i = 0; i < 50; ++i) fake.gpus[kBus0].processes.push_back({i + 1, 1, ~0u, ~0u});
  Clock::time_point now{};
  auto reader = fake.Reader(&now, /*v1=*/false, /*max_processes=*/40);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(m.status().message().find("50 processes, more than the limit of 40"), std::string::npos)
      << m.status().message();
  EXPECT_EQ(fake.capacities, (std::vector<unsigned int>{32}));
}

TEST(GpuProcessMemory, AListThatKeepsOutgrowingTheArrayGivesUpAfterAFewReads) {
  FakeNvml fake;
  fake.gpus[kBus0].outgrow_array = true;
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("the list of processes grew at each of 4 reads"),
            std::string::npos)
      << m.status().message();
  EXPECT_EQ(fake.capacities, (std::vector<unsigned int>{32, 64, 128, 256}));
}

TEST(GpuProcessMemory, ErrorsOfNvmlMakeTheGpuUnknown) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, 1, ~0u, ~0u}};
  fake.gpus[kBus0].error = 999;  // NVML_ERROR_UNKNOWN
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(m.status().message(),
            "nvmlDeviceGetComputeRunningProcesses_v3 of the GPU at 00000000:19:00.0: NVML error "
            "999 (Unknown Error)");
  // No GPU at that bus id.
  m = reader->OnDevice("00000000:ff:00.0");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(),
            "no NVML device at PCI bus id 00000000:ff:00.0: NVML error 6 (Not Found)");
}

TEST(GpuProcessMemory, AProcessWhoseFigureTheDriverLacksIsLeftOutAndAPidIsSummed) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, nvml::kValueNotAvailable, ~0u, ~0u},
                                {200, 3 << 20, 1, 0},  // one pid in two MIG instances
                                {200, 4 << 20, 2, 0}};
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(*m, (ProcessMemory{{200, 7 << 20}}));
}

TEST(GpuProcessMemory, TheUnsuffixedCallFillsTheV1Layout) {
  FakeNvml fake;
  for (unsigned int i = 0; i < 33; ++i)
    fake.gpus[kBus0].processes.push_back({500 + i, (i + 1ull) << 20, ~0u, ~0u});
  Clock::time_point now{};
  auto reader = fake.Reader(&now, /*v1=*/true);
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->size(), 33u);
  EXPECT_EQ(m->at(500), 1ull << 20);
  EXPECT_EQ(m->at(532), 33ull << 20);
}

TEST(GpuProcessMemory, AGpuIsReadAtMostOncePerMaxAgeErrorsIncluded) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, 1 << 20, ~0u, ~0u}};
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  ASSERT_TRUE(reader->OnDevice(kBus0).ok());
  fake.gpus[kBus0].processes[0].usedGpuMemory = 2 << 20;
  now += 999ms;
  Result<ProcessMemory> m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->at(100), 1u << 20);  // the answer of a moment ago
  EXPECT_EQ(fake.capacities.size(), 1u);
  now += 1ms;
  m = reader->OnDevice(kBus0);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->at(100), 2u << 20);
  EXPECT_EQ(fake.capacities.size(), 2u);
  // An error is kept as long, then read again.
  fake.gpus[kBus0].error = 999;
  now += 1s;
  EXPECT_FALSE(reader->OnDevice(kBus0).ok());
  fake.gpus[kBus0].error = nvml::kSuccess;
  now += 500ms;
  EXPECT_FALSE(reader->OnDevice(kBus0).ok());
  EXPECT_EQ(fake.capacities.size(), 3u);
  now += 500ms;
  EXPECT_TRUE(reader->OnDevice(kBus0).ok());
  EXPECT_EQ(fake.capacities.size(), 4u);
}

TEST(GpuProcessMemory, AListLackingAnExpectedProcessIsReadAgainSooner) {
  FakeNvml fake;
  fake.gpus[kBus0].processes = {{100, 1 << 20, ~0u, ~0u}};
  Clock::time_point now{};
  auto reader = fake.Reader(&now);
  const std::vector<int64_t> both = {100, 200};
  ASSERT_TRUE(reader->OnDevice(kBus0).ok());
  EXPECT_EQ(fake.capacities.size(), 1u);
  // Pid 200 starts and makes its context: a list 50 ms old is still served...
  fake.gpus[kBus0].processes.push_back({200, 3 << 20, ~0u, ~0u});
  now += 50ms;
  Result<ProcessMemory> m = reader->OnDevice(kBus0, both);
  ASSERT_TRUE(m.ok());
  EXPECT_FALSE(m->contains(200));
  EXPECT_EQ(fake.capacities.size(), 1u);
  // ...and read again at 100 ms, not at a second.
  now += 50ms;
  m = reader->OnDevice(kBus0, both);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->at(200), 3u << 20);
  EXPECT_EQ(fake.capacities.size(), 2u);
  // A list that has every expected pid is kept its whole second.
  now += 900ms;
  ASSERT_TRUE(reader->OnDevice(kBus0, both).ok());
  EXPECT_EQ(fake.capacities.size(), 2u);
  // A pid NVML never lists (another PID namespace) costs one read per 100 ms.
  const std::vector<int64_t> stranger = {300};
  now += 100ms;  // the list is a second old: read
  ASSERT_TRUE(reader->OnDevice(kBus0, stranger).ok());
  EXPECT_EQ(fake.capacities.size(), 3u);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(reader->OnDevice(kBus0, stranger).ok());
  EXPECT_EQ(fake.capacities.size(), 3u);
  now += 100ms;
  ASSERT_TRUE(reader->OnDevice(kBus0, stranger).ok());
  EXPECT_EQ(fake.capacities.size(), 4u);
}

// The fake libraries (fake_nvml.c) list 40 processes, pids 1000..1039, pid
// 1000+i with i+1 MiB, on one GPU, bus id 00000000:19:00.0.
void ExpectTheFakeLibrarysList(const char* library, const char* call) {
  Result<NvmlApi> api = LoadNvml(library);
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  EXPECT_EQ(api->processes_name, call);
  GpuProcessMemory reader([&]() -> Result<NvmlApi> { return *api; });
  Result<ProcessMemory> m = reader.OnDevice(kBus0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->size(), 40u);
  for (unsigned int i = 0; i < 40; ++i) EXPECT_EQ(m->at(1000 + i), (i + 1ull) << 20) << i;
  Result<ProcessMemory> other = reader.OnDevice(kBus1);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("NVML error 6 (fake: Not Found)"), std::string::npos)
      << other.status().message();
}

TEST(LoadNvml, TakesTheV3CallWhereTheLibraryHasIt) {
  ExpectTheFakeLibrarysList(HEARTH_FAKE_NVML_V3, "nvmlDeviceGetComputeRunningProcesses_v3");
}

TEST(LoadNvml, FallsBackToTheUnsuffixedCallAndItsLayout) {
  ExpectTheFakeLibrarysList(HEARTH_FAKE_NVML_V1, "nvmlDeviceGetComputeRunningProcesses");
}

TEST(LoadNvml, ALibraryWithoutTheListCallIsUnavailableNamingIt) {
  Result<NvmlApi> api = LoadNvml(HEARTH_FAKE_NVML_NO_LIST);
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(api.status().message().find("lacks nvmlDeviceGetComputeRunningProcesses"),
            std::string::npos)
      << api.status().message();
}

}  // namespace
}  // namespace hearth
