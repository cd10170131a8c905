// The operating system's part of CudaDriver::Get(): opening the driver's
// library (libcuda.so.1 on Linux, nvcuda.dll on Windows) and finding the few
// entry points taken by name before cuGetProcAddress can be used.
//
// One implementation per system: cuda_driver_posix.cc (dlopen, dlsym) and
// cuda_driver_windows.cc (LoadLibraryExW, GetProcAddress). No link-time
// dependency on the driver either way.
#pragma once

#include "hearth/status.h"

namespace hearth {

// The library's file name, for messages ("libcuda.so.1", "nvcuda.dll").
extern const char kCudaDriverLibrary[];

// Loads the driver's library once; it is never unloaded (pointers into it
// are used until exit, from destructors of static objects too).
// Unavailable, saying that there is no NVIDIA driver and why, when it cannot
// be loaded.
Result<void*> OpenCudaDriverLibrary();

// The address of the exported `name` in `library`, or nullptr.
void* CudaDriverSymbol(void* library, const char* name);

}  // namespace hearth
