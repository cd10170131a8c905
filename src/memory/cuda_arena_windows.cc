// CUDA arenas on Windows: the parts of cuda_shareable.h that know Windows.
// An arena's allocation is created with CU_MEM_HANDLE_TYPE_WIN32; each
// export is a new NT handle, moved into the importer's process as host
// sections are (platform/section_windows.cc); the importer maps it with
// read access only (cuda_mapping.cc).
//
// Written against the CUDA 12 headers and compiled by `make windows`, but
// never run: Wine has no nvcuda.dll and this machine no GPU (docs/windows.md).
#include <windows.h>
// after windows.h, which they need
#include <sddl.h>
#include <winternl.h>

#include <cstdint>
#include <string>

#include "memory/arena_kinds.h"
#include "memory/cuda_shareable.h"
#include "platform/identity.h"
#include "platform/windows_error.h"

namespace hearth {
namespace {

// The driver keeps the pointer it is given in win32HandleMetaData and reads
// it when it makes NT handles for the allocation, so the attributes and their
// descriptor are made once and never freed.
Result<void*> MakeHandleMetadata() {
  ASSIGN_OR_RETURN(const std::string sid, platform::CurrentUser());
  // Protected DACL: all access for this user, none for anyone else, so that
  // only processes of this user can open or duplicate an exported handle.
  // (Unlike a host section's, the descriptor cannot make the handle
  // read-only: a CUDA allocation has no read-only handle. Read-only is each
  // importer's own cuMemSetAccess(PROT_READ), as on Linux.)
  const std::string sddl = "D:P(A;;GA;;;" + sid + ")";
  PSECURITY_DESCRIPTOR descriptor = nullptr;
  if (!::ConvertStringSecurityDescriptorToSecurityDescriptorA(sddl.c_str(), SDDL_REVISION_1,
                                                              &descriptor, nullptr)) {
    return Internal(platform::LastError("ConvertStringSecurityDescriptorToSecurityDescriptorA"));
  }
  // cuda.h names this field a POBJECT_ATTRIBUTES (the programming guide
  // says LPSECURITYATTRIBUTES); NVIDIA's own VMM samples pass an
  // OBJECT_ATTRIBUTES holding the descriptor, as here.
  auto* attributes = new OBJECT_ATTRIBUTES;
  InitializeObjectAttributes(attributes, nullptr, 0, nullptr, descriptor);
  return static_cast<void*>(attributes);
}

}  // namespace

Result<void*> CudaWin32HandleMetadata() {
  static const Result<void*> metadata = MakeHandleMetadata();
  return metadata;
}

Result<uint64_t> ExportCudaAllocationTo(const CudaDriver& cu, CUmemGenericAllocationHandle handle,
                                        uint32_t peer_pid) {
  const HANDLE peer = ::OpenProcess(PROCESS_DUP_HANDLE, FALSE, peer_pid);
  if (peer == nullptr) {
    return Unavailable(platform::LastError("OpenProcess of the peer " + std::to_string(peer_pid)));
  }
  // For CU_MEM_HANDLE_TYPE_WIN32 the driver writes a HANDLE through the
  // pointer (and the importer passes that HANDLE itself as the pointer).
  HANDLE exported = nullptr;
  Status status =
      CuCheck(cu, cu.MemExportToShareableHandle(&exported, handle, kCudaShareableHandleType, 0),
              "cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_WIN32)");
  if (status.ok() && exported == nullptr) {
    status = Internal("cuMemExportToShareableHandle returned no handle");
  }
  if (!status.ok()) {
    ::CloseHandle(peer);
    return status;
  }
  HANDLE dup = nullptr;
  // DUPLICATE_CLOSE_SOURCE: this process's copy is closed whether or not the
  // duplicate is made, so none is left behind here. The peer's handle has
  // the access the driver gave the export; the arena's descriptor admits
  // only this user to it.
  const BOOL ok = ::DuplicateHandle(::GetCurrentProcess(), exported, peer, &dup, 0, FALSE,
                                    DUPLICATE_SAME_ACCESS | DUPLICATE_CLOSE_SOURCE);
  const std::string error = ok ? "" : platform::LastError("DuplicateHandle into the peer");
  ::CloseHandle(peer);
  if (!ok) return Internal(error);
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(dup));
}

Result<std::unique_ptr<ArenaMapping>> MapCudaArena(uint64_t handle, int device, uint64_t size) {
  const HANDLE h = reinterpret_cast<HANDLE>(static_cast<uintptr_t>(handle));
  Result<std::unique_ptr<ArenaMapping>> mapping =
      ImportCudaArena(h, "handle " + std::to_string(handle), device, size);
  // The imported CUDA handle holds the allocation: the NT handle is not needed.
  ::CloseHandle(h);
  return mapping;
}

}  // namespace hearth
