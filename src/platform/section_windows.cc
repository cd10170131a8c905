// Sections on Windows: pagefile-backed file mappings (section.h).
#include <windows.h>
// after windows.h, which it needs
#include <sddl.h>

#include <memory>
#include <string>
#include <utility>

#include "platform/identity.h"
#include "platform/section.h"
#include "platform/windows_error.h"

namespace hearth::platform {

namespace {

// A section's security descriptor: read (map for reading, query) for its
// user and its owner, nothing else for anyone.
struct SectionSecurity {
  PSECURITY_DESCRIPTOR descriptor = nullptr;
  ~SectionSecurity() { ::LocalFree(descriptor); }
};

Status MakeSectionSecurity(SectionSecurity& out) {
  ASSIGN_OR_RETURN(const std::string sid, CurrentUser());
  const std::string read = std::to_string(SECTION_MAP_READ | SECTION_QUERY);
  const std::string sddl = "D:P(A;;" + read + ";;;OW)(A;;" + read + ";;;" + sid + ")";
  if (!::ConvertStringSecurityDescriptorToSecurityDescriptorA(sddl.c_str(), SDDL_REVISION_1,
                                                              &out.descriptor, nullptr))
    return Internal(LastError("ConvertStringSecurityDescriptorToSecurityDescriptorA"));
  return Status::Ok();
}

}  // namespace

void CloseHandle(NativeHandle h) {
  if (h != kNoHandle) ::CloseHandle(h);
}

Result<Section> Section::Create(uint64_t bytes, std::string_view /*name*/) {
  if (bytes == 0) return InvalidArgument("a section needs at least one byte");
  SectionSecurity security;
  RETURN_IF_ERROR(MakeSectionSecurity(security));
  SECURITY_ATTRIBUTES attributes{sizeof(attributes), security.descriptor, FALSE};
  const HANDLE h = ::CreateFileMappingW(INVALID_HANDLE_VALUE, &attributes, PAGE_READWRITE,
                                        static_cast<DWORD>(bytes >> 32),
                                        static_cast<DWORD>(bytes & 0xffffffffu), nullptr);
  if (h == nullptr)
    return ResourceExhausted(
        LastError("CreateFileMappingW of " + std::to_string(bytes) + " bytes"));
  Section s;
  s.handle_ = h;
  s.size_ = bytes;
  void* p = ::MapViewOfFile(h, FILE_MAP_WRITE, 0, 0, static_cast<SIZE_T>(bytes));
  if (p == nullptr) return ResourceExhausted(LastError("MapViewOfFile (read-write)"));
  s.base_ = static_cast<std::byte*>(p);
  return s;
}

void Section::Release() {
  if (base_ != nullptr) ::UnmapViewOfFile(base_);
  base_ = nullptr;
  CloseHandle(handle_);
  handle_ = kNoHandle;
}

Status Section::Seal() {
  if (sealed_) return Status::Ok();
  if (base_ != nullptr && !::UnmapViewOfFile(base_)) return Internal(LastError("UnmapViewOfFile"));
  base_ = nullptr;
  sealed_ = true;
  return Status::Ok();
}

Result<NativeHandle> Section::ShareReadOnly(uint32_t peer_pid) const {
  if (!sealed_) return FailedPrecondition("a section is shared only once sealed");
  const HANDLE peer = ::OpenProcess(PROCESS_DUP_HANDLE, FALSE, peer_pid);
  if (peer == nullptr)
    return Unavailable(LastError("OpenProcess of the peer " + std::to_string(peer_pid)));
  HANDLE dup = nullptr;
  // FILE_MAP_READ only: the peer's handle maps nothing writable, and a
  // duplicate of it can ask for no more access than it has.
  const BOOL ok =
      ::DuplicateHandle(::GetCurrentProcess(), handle_, peer, &dup, FILE_MAP_READ, FALSE, 0);
  const std::string error = ok ? "" : LastError("DuplicateHandle into the peer");
  ::CloseHandle(peer);
  if (!ok) return Internal(error);
  return dup;
}

Result<ReadOnlyView> ReadOnlyView::Map(NativeHandle handle, uint64_t bytes) {
  ReadOnlyView v;
  v.handle_ = handle;  // closed by v on every return
  if (handle == kNoHandle) return InvalidArgument("no section handle");
  void* p = ::MapViewOfFile(handle, FILE_MAP_READ, 0, 0, 0);
  if (p == nullptr) return InvalidArgument(LastError("MapViewOfFile (read-only)"));
  v.base_ = static_cast<const std::byte*>(p);
  MEMORY_BASIC_INFORMATION info{};
  if (::VirtualQuery(p, &info, sizeof(info)) == 0) return Internal(LastError("VirtualQuery"));
  if (info.RegionSize < bytes)
    return InvalidArgument("the section holds " + std::to_string(info.RegionSize) +
                           " bytes, fewer than the " + std::to_string(bytes) + " expected");
  v.size_ = bytes;
  return v;
}

void ReadOnlyView::Release() {
  if (base_ != nullptr) ::UnmapViewOfFile(base_);
  base_ = nullptr;
  CloseHandle(handle_);
  handle_ = kNoHandle;
}

ReadOnlyView::WriteAttempts ReadOnlyView::TryToWrite() const {
  WriteAttempts tried;
  if (void* w = ::MapViewOfFile(handle_, FILE_MAP_WRITE, 0, 0, 0)) {
    ::UnmapViewOfFile(w);
    tried.mapped_writable = true;
  }
  if (base_ != nullptr && size_ > 0) {
    DWORD old = 0;
    if (::VirtualProtect(const_cast<std::byte*>(base_), static_cast<SIZE_T>(size_), PAGE_READWRITE,
                         &old)) {
      ::VirtualProtect(const_cast<std::byte*>(base_), static_cast<SIZE_T>(size_), old, &old);
      tried.protection_raised = true;
    }
  }
  HANDLE more = nullptr;
  if (::DuplicateHandle(::GetCurrentProcess(), handle_, ::GetCurrentProcess(), &more,
                        FILE_MAP_READ | FILE_MAP_WRITE, FALSE, 0)) {
    ::CloseHandle(more);
    tried.handle_upgraded = true;
  }
  return tried;
}

}  // namespace hearth::platform
