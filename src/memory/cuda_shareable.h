// How a CUDA arena's allocation leaves the store: the shareable handle type
// it is created with, and what differs per system around it. Only for code
// built with HEARTH_HAVE_CUDA (it needs cuda.h).
//
//  - Linux: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; an export is a
//    descriptor sent over SCM_RIGHTS (cuda_arena.cc, cuda_mapping.cc).
//  - Windows: CU_MEM_HANDLE_TYPE_WIN32, created with a security descriptor
//    that admits this user only; an export is an NT handle duplicated into
//    the importer's process, as host sections are (cuda_arena_windows.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "hearth/arena.h"
#include "memory/cuda_driver.h"

namespace hearth {

#ifdef _WIN32
inline constexpr CUmemAllocationHandleType kCudaShareableHandleType = CU_MEM_HANDLE_TYPE_WIN32;
inline constexpr CUdevice_attribute kCudaShareableHandleSupported =
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_WIN32_HANDLE_SUPPORTED;
inline constexpr char kCudaShareableHandleKind[] = "Win32 handles";

// What CUmemAllocationProp::win32HandleMetaData points at: an
// OBJECT_ATTRIBUTES whose security descriptor admits this user only. Built
// once and kept until exit (the driver may read it whenever it exports).
Result<void*> CudaWin32HandleMetadata();

// Exports `handle` (cuMemExportToShareableHandle) and moves the NT handle
// into the process `peer_pid`, closing this process's copy: the handle's
// value there, which the caller sends it. Needs the allocation's device
// context current.
Result<uint64_t> ExportCudaAllocationTo(const CudaDriver& cu, CUmemGenericAllocationHandle handle,
                                        uint32_t peer_pid);
#else
inline constexpr CUmemAllocationHandleType kCudaShareableHandleType =
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
inline constexpr CUdevice_attribute kCudaShareableHandleSupported =
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
inline constexpr char kCudaShareableHandleKind[] = "POSIX file descriptors";
#endif

// A read-only mapping of the allocation `shareable` names, as
// cuMemImportFromShareableHandle takes it (a descriptor's value, or an NT
// handle, in the pointer). `what` names it in errors ("descriptor 7"). The
// caller keeps `shareable` and closes it afterwards, whatever the result:
// the imported CUDA handle holds the allocation on its own.
Result<std::unique_ptr<ArenaMapping>> ImportCudaArena(void* shareable, const std::string& what,
                                                      int device, uint64_t size);

}  // namespace hearth
