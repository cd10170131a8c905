/* A stand-in for libnvidia-ml.so.1, for LoadNvml's tests: one GPU at bus id
   00000000:19:00.0 with 40 processes, pid 1000+i using i+1 MiB. Built three
   ways: FAKE_NVML_V3 exports nvmlDeviceGetComputeRunningProcesses_v3 (the
   four-member nvmlProcessInfo_t), FAKE_NVML_V1 only the unsuffixed call (the
   two-member nvmlProcessInfo_v1_t), FAKE_NVML_NO_LIST neither. The layouts
   are NVML's as nvml.h declares them. */
#include <string.h>

typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
} ProcessInfoV1;

typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} ProcessInfo;

enum { kProcesses = 40 };
static int the_gpu;

int nvmlInit_v2(void) { return 0; }

const char* nvmlErrorString(int result) { return result == 6 ? "fake: Not Found" : "fake: error"; }

static int ByPciBusId(const char* id, void** device) {
  if (strcmp(id, "00000000:19:00.0") != 0) return 6; /* NVML_ERROR_NOT_FOUND */
  *device = &the_gpu;
  return 0;
}

#if defined(FAKE_NVML_V3)
int nvmlDeviceGetHandleByPciBusId_v2(const char* id, void** device) {
  return ByPciBusId(id, device);
}

int nvmlDeviceGetComputeRunningProcesses_v3(void* device, unsigned int* count, ProcessInfo* infos) {
  if (device != &the_gpu) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
  if (*count < kProcesses) {
    *count = kProcesses;
    return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
  }
  for (unsigned int i = 0; i < kProcesses; ++i) {
    infos[i].pid = 1000 + i;
    infos[i].usedGpuMemory = (i + 1ULL) << 20;
    infos[i].gpuInstanceId = 0xFFFFFFFFu;
    infos[i].computeInstanceId = 0xFFFFFFFFu;
  }
  *count = kProcesses;
  return 0;
}
#elif defined(FAKE_NVML_V1)
int nvmlDeviceGetHandleByPciBusId(const char* id, void** device) { return ByPciBusId(id, device); }

int nvmlDeviceGetComputeRunningProcesses(void* device, unsigned int* count, ProcessInfoV1* infos) {
  if (device != &the_gpu) return 2;
  if (*count < kProcesses) {
    *count = kProcesses;
    return 7;
  }
  for (unsigned int i = 0; i < kProcesses; ++i) {
    infos[i].pid = 1000 + i;
    infos[i].usedGpuMemory = (i + 1ULL) << 20;
  }
  *count = kProcesses;
  return 0;
}
#else
int nvmlDeviceGetHandleByPciBusId_v2(const char* id, void** device) {
  return ByPciBusId(id, device);
}
#endif
