#include "memory/cuda_driver.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "memory/cuda_driver_library.h"

namespace hearth {
namespace {

std::string ErrorText(PFN_cuGetErrorName_v6000 get_name, PFN_cuGetErrorString_v6000 get_string,
                      CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (get_name == nullptr || get_name(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (get_string == nullptr || get_string(result, &text) != CUDA_SUCCESS) text = nullptr;
  // The toolkit's stub libcuda (found when its stubs/ folder is on the
  // library path) names none of its errors, not even its own.
  if (name == nullptr && result == CUDA_ERROR_STUB_LIBRARY) {
    name = "CUDA_ERROR_STUB_LIBRARY";
    text = "libcuda.so.1 is the CUDA toolkit's stub library, not an NVIDIA driver";
  }
  std::string out = name != nullptr ? name : "CUresult " + std::to_string(static_cast<int>(result));
  if (text != nullptr) out += std::string(" (") + text + ")";
  return out;
}

// Resolves `symbol` (the base name, e.g. "cuMemcpyHtoDAsync") at
// kCudaDriverAbiVersion. The legacy-stream flag is explicit: with
// CU_GET_PROC_ADDRESS_DEFAULT the driver would pick per-thread-default-stream
// variants (_ptds/_ptsz) only if *this* file were built with
// --default-stream per-thread, which would be easy to change by accident.
template <typename Fn>
void Resolve(PFN_cuGetProcAddress_v12000 get_proc, const char* symbol, Fn* out,
             std::string* missing) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  CUresult result =
      get_proc(symbol, &fn, kCudaDriverAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
  if (result != CUDA_SUCCESS || fn == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
    return;
  }
  *out = reinterpret_cast<Fn>(fn);
}

Result<const CudaDriver*> LoadDriver() {
  ASSIGN_OR_RETURN(void* lib, OpenCudaDriverLibrary());

  static CudaDriver driver;
  // cuInit, the error helpers and cuGetProcAddress_v2 are taken by name:
  // they are needed before (or to report) initialisation, and these exact
  // names are exported by every driver since CUDA 12.0.
  driver.Init = reinterpret_cast<PFN_cuInit_v2000>(CudaDriverSymbol(lib, "cuInit"));
  driver.GetErrorName =
      reinterpret_cast<PFN_cuGetErrorName_v6000>(CudaDriverSymbol(lib, "cuGetErrorName"));
  driver.GetErrorString =
      reinterpret_cast<PFN_cuGetErrorString_v6000>(CudaDriverSymbol(lib, "cuGetErrorString"));
  auto get_proc =
      reinterpret_cast<PFN_cuGetProcAddress_v12000>(CudaDriverSymbol(lib, "cuGetProcAddress_v2"));
  if (driver.Init == nullptr || get_proc == nullptr) {
    return Unavailable(std::string(kCudaDriverLibrary) +
                       " has no cuInit or cuGetProcAddress_v2: the NVIDIA driver is older than "
                       "CUDA 12.0");
  }

  CUresult init = driver.Init(0);
  if (init != CUDA_SUCCESS) {
    return Unavailable("cuInit failed: " +
                       ErrorText(driver.GetErrorName, driver.GetErrorString, init));
  }

  std::string missing;
  CudaDriver& d = driver;
  Resolve(get_proc, "cuGetErrorName", &d.GetErrorName, &missing);
  Resolve(get_proc, "cuGetErrorString", &d.GetErrorString, &missing);
  Resolve(get_proc, "cuInit", &d.Init, &missing);
  Resolve(get_proc, "cuDriverGetVersion", &d.DriverGetVersion, &missing);
  Resolve(get_proc, "cuDeviceGet", &d.DeviceGet, &missing);
  Resolve(get_proc, "cuDeviceGetCount", &d.DeviceGetCount, &missing);
  Resolve(get_proc, "cuDeviceGetAttribute", &d.DeviceGetAttribute, &missing);
  Resolve(get_proc, "cuDeviceTotalMem", &d.DeviceTotalMem, &missing);
  Resolve(get_proc, "cuDevicePrimaryCtxRetain", &d.DevicePrimaryCtxRetain, &missing);
  Resolve(get_proc, "cuDevicePrimaryCtxRelease", &d.DevicePrimaryCtxRelease, &missing);
  Resolve(get_proc, "cuCtxSetCurrent", &d.CtxSetCurrent, &missing);
  Resolve(get_proc, "cuCtxGetCurrent", &d.CtxGetCurrent, &missing);
  Resolve(get_proc, "cuCtxSetLimit", &d.CtxSetLimit, &missing);
  Resolve(get_proc, "cuCtxGetLimit", &d.CtxGetLimit, &missing);
  Resolve(get_proc, "cuCtxSynchronize", &d.CtxSynchronize, &missing);
  Resolve(get_proc, "cuMemGetAllocationGranularity", &d.MemGetAllocationGranularity, &missing);
  Resolve(get_proc, "cuMemCreate", &d.MemCreate, &missing);
  Resolve(get_proc, "cuMemRelease", &d.MemRelease, &missing);
  Resolve(get_proc, "cuMemExportToShareableHandle", &d.MemExportToShareableHandle, &missing);
  Resolve(get_proc, "cuMemImportFromShareableHandle", &d.MemImportFromShareableHandle, &missing);
  Resolve(get_proc, "cuMemGetAllocationPropertiesFromHandle",
          &d.MemGetAllocationPropertiesFromHandle, &missing);
  Resolve(get_proc, "cuMemRetainAllocationHandle", &d.MemRetainAllocationHandle, &missing);
  Resolve(get_proc, "cuMemAddressReserve", &d.MemAddressReserve, &missing);
  Resolve(get_proc, "cuMemAddressFree", &d.MemAddressFree, &missing);
  Resolve(get_proc, "cuMemMap", &d.MemMap, &missing);
  Resolve(get_proc, "cuMemUnmap", &d.MemUnmap, &missing);
  Resolve(get_proc, "cuMemSetAccess", &d.MemSetAccess, &missing);
  Resolve(get_proc, "cuMemGetInfo", &d.MemGetInfo, &missing);
  Resolve(get_proc, "cuMemHostAlloc", &d.MemHostAlloc, &missing);
  Resolve(get_proc, "cuMemFreeHost", &d.MemFreeHost, &missing);
  Resolve(get_proc, "cuStreamCreate", &d.StreamCreate, &missing);
  Resolve(get_proc, "cuStreamDestroy", &d.StreamDestroy, &missing);
  Resolve(get_proc, "cuStreamSynchronize", &d.StreamSynchronize, &missing);
  Resolve(get_proc, "cuEventCreate", &d.EventCreate, &missing);
  Resolve(get_proc, "cuEventRecord", &d.EventRecord, &missing);
  Resolve(get_proc, "cuEventQuery", &d.EventQuery, &missing);
  Resolve(get_proc, "cuEventSynchronize", &d.EventSynchronize, &missing);
  Resolve(get_proc, "cuEventDestroy", &d.EventDestroy, &missing);
  Resolve(get_proc, "cuMemcpyHtoDAsync", &d.MemcpyHtoDAsync, &missing);
  Resolve(get_proc, "cuMemcpyHtoD", &d.MemcpyHtoD, &missing);
  Resolve(get_proc, "cuMemcpyDtoH", &d.MemcpyDtoH, &missing);
  Resolve(get_proc, "cuMemcpyAsync", &d.MemcpyAsync, &missing);
  Resolve(get_proc, "cuMemAlloc", &d.MemAlloc, &missing);
  Resolve(get_proc, "cuMemFree", &d.MemFree, &missing);
  Resolve(get_proc, "cuMemGetAddressRange", &d.MemGetAddressRange, &missing);
  Resolve(get_proc, "cuIpcGetMemHandle", &d.IpcGetMemHandle, &missing);
  Resolve(get_proc, "cuIpcOpenMemHandle", &d.IpcOpenMemHandle, &missing);
  Resolve(get_proc, "cuIpcCloseMemHandle", &d.IpcCloseMemHandle, &missing);
  if (!missing.empty()) {
    return Unavailable(std::string(kCudaDriverLibrary) + " lacks " + missing + " at the CUDA " +
                       std::to_string(kCudaDriverAbiVersion / 1000) +
                       ".0 ABI: the NVIDIA driver is too old");
  }

  int version = 0;
  if (d.DriverGetVersion(&version) == CUDA_SUCCESS) {
    spdlog::debug("CUDA driver loaded: supports CUDA {}.{}", version / 1000, version % 1000 / 10);
  }
  return static_cast<const CudaDriver*>(&driver);
}

// Per-thread stack size requested through HEARTH_CUDA_STACK_SIZE, or 0 when
// the variable is unset or empty.
Result<size_t> StackSizeFromEnvironment() {
  const char* text = std::getenv("HEARTH_CUDA_STACK_SIZE");
  if (text == nullptr || *text == '\0') return size_t{0};
  std::string_view view(text);
  size_t value = 0;
  auto [end, ec] = std::from_chars(view.data(), view.data() + view.size(), value);
  if (ec != std::errc() || end != view.data() + view.size() || value == 0) {
    return InvalidArgument("HEARTH_CUDA_STACK_SIZE='" + std::string(view) +
                           "' is not a positive byte count");
  }
  return value;
}

struct PrimaryContexts {
  std::mutex mu;
  std::unordered_map<int, CUcontext> by_device;
};

}  // namespace

Result<const CudaDriver*> CudaDriver::Get() {
  // A function-local static: initialised once, thread-safely; a failure is
  // remembered too, so a machine without a driver pays for one attempt to load it only.
  static const Result<const CudaDriver*> driver = LoadDriver();
  return driver;
}

Status CuCheck(const CudaDriver& cu, CUresult result, std::string_view what) {
  if (result == CUDA_SUCCESS) return Status::Ok();
  StatusCode code = StatusCode::kInternal;
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      code = StatusCode::kResourceExhausted;
      break;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_SUPPORTED:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_STUB_LIBRARY:
      code = StatusCode::kUnavailable;
      break;
    case CUDA_ERROR_NOT_PERMITTED:
      code = StatusCode::kPermissionDenied;
      break;
    case CUDA_ERROR_INVALID_DEVICE:
      code = StatusCode::kInvalidArgument;
      break;
    default:
      break;
  }
  return Status(code,
                std::string(what) + ": " + ErrorText(cu.GetErrorName, cu.GetErrorString, result));
}

void CuLogIfError(const CudaDriver& cu, CUresult result, std::string_view what) noexcept {
  if (result == CUDA_SUCCESS) return;
  try {
    std::string text = CuCheck(cu, result, what).message();
    if (result == CUDA_ERROR_DEINITIALIZED) {
      spdlog::debug("{}", text);
    } else {
      spdlog::error("{}", text);
    }
  } catch (...) {
    // Logging must not throw out of a destructor; the failure is dropped.
  }
}

Status MakeContextCurrent(int device) {
  ASSIGN_OR_RETURN(const CudaDriver* cu, CudaDriver::Get());
  // Leaked on purpose: destructors of static arenas and mappings may call
  // this during exit, after function-local statics would be gone.
  static PrimaryContexts* const contexts = new PrimaryContexts;

  CUcontext context = nullptr;
  {
    std::lock_guard<std::mutex> lock(contexts->mu);
    auto it = contexts->by_device.find(device);
    if (it != contexts->by_device.end()) {
      context = it->second;
    } else {
      int count = 0;
      RETURN_IF_ERROR(CuCheck(*cu, cu->DeviceGetCount(&count), "cuDeviceGetCount"));
      if (device < 0 || device >= count) {
        return InvalidArgument("cuda:" + std::to_string(device) +
                               " does not exist: this machine has " + std::to_string(count) +
                               " CUDA device(s)");
      }
      ASSIGN_OR_RETURN(size_t stack_size, StackSizeFromEnvironment());
      CUdevice dev = 0;
      RETURN_IF_ERROR(CuCheck(*cu, cu->DeviceGet(&dev, device), "cuDeviceGet"));
      // Retained once per device and never released: every arena, mapping
      // and worker kernel of this process lives in this context, and
      // releasing the last reference would destroy it under them.
      RETURN_IF_ERROR(CuCheck(*cu, cu->DevicePrimaryCtxRetain(&context, dev),
                              "cuDevicePrimaryCtxRetain(cuda:" + std::to_string(device) + ")"));
      Status status = CuCheck(*cu, cu->CtxSetCurrent(context), "cuCtxSetCurrent");
      if (status.ok() && stack_size != 0) {
        // The driver reserves local memory for this per-thread stack for
        // every thread the device can hold at once, so it is most of a bare
        // context's device memory. It applies to the whole (shared) primary
        // context; kernels that need more still get it at launch.
        status = CuCheck(*cu, cu->CtxSetLimit(CU_LIMIT_STACK_SIZE, stack_size),
                         "cuCtxSetLimit(CU_LIMIT_STACK_SIZE, " + std::to_string(stack_size) + ")");
      }
      if (!status.ok()) {
        (void)cu->CtxSetCurrent(nullptr);
        (void)cu->DevicePrimaryCtxRelease(dev);
        return status;
      }
      contexts->by_device.emplace(device, context);
      return Status::Ok();
    }
  }

  CUcontext current = nullptr;
  RETURN_IF_ERROR(CuCheck(*cu, cu->CtxGetCurrent(&current), "cuCtxGetCurrent"));
  if (current != context) {
    RETURN_IF_ERROR(CuCheck(*cu, cu->CtxSetCurrent(context), "cuCtxSetCurrent"));
  }
  return Status::Ok();
}

}  // namespace hearth
