// Loading the CUDA driver on Linux: dlopen of libcuda.so.1.
#include <dlfcn.h>

#include <string>

#include "memory/cuda_driver_library.h"

namespace hearth {

const char kCudaDriverLibrary[] = "libcuda.so.1";

Result<void*> OpenCudaDriverLibrary() {
  void* lib = ::dlopen(kCudaDriverLibrary, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* error = ::dlerror();
    return Unavailable(std::string("libcuda.so.1 not found: no NVIDIA driver on this machine (") +
                       (error != nullptr ? error : "dlopen failed") + ")");
  }
  return lib;
}

void* CudaDriverSymbol(void* library, const char* name) { return ::dlsym(library, name); }

}  // namespace hearth
