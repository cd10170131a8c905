// CudaDriver: the CUDA driver API, resolved at run time.
//
// hearth never links libcuda: the same binary must start on a machine without
// an NVIDIA driver. CudaDriver::Get() loads the driver's library once per
// process (libcuda.so.1, or nvcuda.dll on Windows: cuda_driver_library.h),
// calls cuInit(0), and resolves every entry point below through
// cuGetProcAddress at the ABI of CUDA 12.0 (kCudaDriverAbiVersion), so each
// pointer has exactly the signature of the PFN_*_vNNNN typedef it is stored as
// (cudaTypedefs.h), whatever newer versions the installed driver also offers.
//
// Only code built with HEARTH_HAVE_CUDA may include this header (it includes
// cuda.h); everything else asks CudaAvailable() in hearth/arena.h.
//
// Thread-safety: Get(), CuCheck() and MakeContextCurrent() may be called from
// any thread. The CudaDriver is immutable after Get() and lives until exit.
#pragma once

#if !defined(HEARTH_HAVE_CUDA) || !HEARTH_HAVE_CUDA
#error "memory/cuda_driver.h is only for code built with HEARTH_HAVE_CUDA"
#endif

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string_view>

#include "hearth/status.h"

namespace hearth {

// The CUDA version whose ABI every entry point is requested at. 12.0 has
// every call hearth uses, and any driver that can run CUDA 12 code serves it.
inline constexpr int kCudaDriverAbiVersion = 12000;

// Function pointers into the driver. Member X is the driver's cuX at the ABI
// named in its type (e.g. MemcpyHtoDAsync is cuMemcpyHtoDAsync_v2, 64-bit
// sizes). Calls that take no explicit stream use the legacy default stream.
struct CudaDriver {
  // Errors.
  PFN_cuGetErrorName_v6000 GetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 GetErrorString = nullptr;
  // Initialisation and devices.
  PFN_cuInit_v2000 Init = nullptr;
  PFN_cuDriverGetVersion_v2020 DriverGetVersion = nullptr;
  PFN_cuDeviceGet_v2000 DeviceGet = nullptr;
  PFN_cuDeviceGetCount_v2000 DeviceGetCount = nullptr;
  PFN_cuDeviceGetAttribute_v2000 DeviceGetAttribute = nullptr;
  PFN_cuDeviceTotalMem_v3020 DeviceTotalMem = nullptr;
  // Contexts.
  PFN_cuDevicePrimaryCtxRetain_v7000 DevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 DevicePrimaryCtxRelease = nullptr;
  PFN_cuCtxSetCurrent_v4000 CtxSetCurrent = nullptr;
  PFN_cuCtxGetCurrent_v4000 CtxGetCurrent = nullptr;
  PFN_cuCtxSetLimit_v3010 CtxSetLimit = nullptr;
  PFN_cuCtxGetLimit_v3010 CtxGetLimit = nullptr;
  PFN_cuCtxSynchronize_v2000 CtxSynchronize = nullptr;
  // Virtual memory management.
  PFN_cuMemGetAllocationGranularity_v10020 MemGetAllocationGranularity = nullptr;
  PFN_cuMemCreate_v10020 MemCreate = nullptr;
  PFN_cuMemRelease_v10020 MemRelease = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 MemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 MemImportFromShareableHandle = nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 MemGetAllocationPropertiesFromHandle = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 MemRetainAllocationHandle = nullptr;
  PFN_cuMemAddressReserve_v10020 MemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 MemAddressFree = nullptr;
  PFN_cuMemMap_v10020 MemMap = nullptr;
  PFN_cuMemUnmap_v10020 MemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 MemSetAccess = nullptr;
  PFN_cuMemGetInfo_v3020 MemGetInfo = nullptr;
  // Pinned host memory.
  PFN_cuMemHostAlloc_v2020 MemHostAlloc = nullptr;
  PFN_cuMemFreeHost_v2000 MemFreeHost = nullptr;
  // Streams, events, copies.
  PFN_cuStreamCreate_v2000 StreamCreate = nullptr;
  PFN_cuStreamDestroy_v4000 StreamDestroy = nullptr;
  PFN_cuStreamSynchronize_v2000 StreamSynchronize = nullptr;
  PFN_cuEventCreate_v2000 EventCreate = nullptr;
  PFN_cuEventRecord_v2000 EventRecord = nullptr;
  PFN_cuEventQuery_v2000 EventQuery = nullptr;
  PFN_cuEventSynchronize_v2000 EventSynchronize = nullptr;
  PFN_cuEventDestroy_v4000 EventDestroy = nullptr;
  PFN_cuMemcpyHtoDAsync_v3020 MemcpyHtoDAsync = nullptr;
  // From pageable memory it returns once the bytes are staged, possibly
  // before they reach the device: synchronize before another process reads them.
  PFN_cuMemcpyHtoD_v3020 MemcpyHtoD = nullptr;
  PFN_cuMemcpyDtoH_v3020 MemcpyDtoH = nullptr;
  PFN_cuMemcpyAsync_v4000 MemcpyAsync = nullptr;  // unified addressing: any direction
  // Device memory, and other processes' device memory (CUDA IPC).
  PFN_cuMemAlloc_v3020 MemAlloc = nullptr;
  PFN_cuMemFree_v3020 MemFree = nullptr;
  PFN_cuMemGetAddressRange_v3020 MemGetAddressRange = nullptr;
  PFN_cuIpcGetMemHandle_v4010 IpcGetMemHandle = nullptr;  // of a cuMemAlloc allocation
  PFN_cuIpcOpenMemHandle_v11000 IpcOpenMemHandle = nullptr;
  PFN_cuIpcCloseMemHandle_v4010 IpcCloseMemHandle = nullptr;

  // The driver, loaded and initialised (cuInit(0)) on the first call; later
  // calls return the same pointer, or the same error. Unavailable when
  // the driver's library is missing, too old, or cuInit fails (e.g. no device).
  static Result<const CudaDriver*> Get();
};

// OK for CUDA_SUCCESS; otherwise "what: CUDA_ERROR_NAME (driver's text)" with
// a code chosen from the error (out of memory -> ResourceExhausted, ...).
Status CuCheck(const CudaDriver& cu, CUresult result, std::string_view what);

// For calls whose failure cannot be returned (destructors): logs a failed
// `result` with spdlog; CUDA_ERROR_DEINITIALIZED (the driver is already torn
// down at process exit, and has freed everything) only at debug level.
void CuLogIfError(const CudaDriver& cu, CUresult result, std::string_view what) noexcept;

// Makes `device`'s primary context current on the calling thread; the CUDA
// runtime API shares that same context. The first call for a device in this
// process retains the primary context (kept until exit) and, if the
// environment variable HEARTH_CUDA_STACK_SIZE holds a byte count, sets
// CU_LIMIT_STACK_SIZE to it (a smaller per-thread stack shrinks the context's
// device memory; by default the limit is left alone). Later calls are one
// cuCtxGetCurrent, plus a cuCtxSetCurrent if another context was current.
// InvalidArgument if `device` is not an ordinal of this machine.
Status MakeContextCurrent(int device);

}  // namespace hearth
