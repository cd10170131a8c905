// Loading the CUDA driver on Windows: nvcuda.dll, which the NVIDIA display
// driver installs in System32. hearth.exe and hearth.dll import nothing from
// it, so they start on machines without an NVIDIA driver.
#include <windows.h>

#include <string>

#include "memory/cuda_driver_library.h"
#include "platform/windows_error.h"

namespace hearth {

const char kCudaDriverLibrary[] = "nvcuda.dll";

Result<void*> OpenCudaDriverLibrary() {
  // System32 only: a nvcuda.dll beside the executable or in the current
  // folder is never loaded in its place.
  HMODULE lib = ::LoadLibraryExW(L"nvcuda.dll", nullptr, LOAD_LIBRARY_SEARCH_SYSTEM32);
  if (lib == nullptr) {
    return Unavailable("no NVIDIA driver: nvcuda.dll could not be loaded (" +
                       platform::LastError("LoadLibraryExW") + ")");
  }
  return static_cast<void*>(lib);
}

void* CudaDriverSymbol(void* library, const char* name) {
  FARPROC fn = ::GetProcAddress(static_cast<HMODULE>(library), name);
  // Through void(*)(), the generic function pointer type, so that casting
  // FARPROC warns of no mismatch; the caller casts to the real type.
  return reinterpret_cast<void*>(reinterpret_cast<void (*)()>(fn));
}

}  // namespace hearth
