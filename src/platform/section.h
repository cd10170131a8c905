// The operating system's shared memory, as the store and the attach client
// use it: a section that its creator fills through a writable view, then
// hands to a peer process as a handle that maps read-only, the kernel
// refusing any writable view of it.
//
//   Linux    a memfd, sealed against every change; a peer gets a fresh
//            O_RDONLY open file description of it (over SCM_RIGHTS).
//   Windows  a pagefile-backed section (CreateFileMappingW); a peer gets a
//            handle duplicated into its process with FILE_MAP_READ access
//            only (DuplicateHandle), so that MapViewOfFile with write access
//            and VirtualProtect to a writable page both fail there. The
//            section's security descriptor grants its user (and, through
//            OWNER RIGHTS, its owner) read access only, so that a peer of the
//            same user cannot duplicate its handle into a writable one; the
//            creator's own handle keeps the access it was created with.
//
// Thread-safety: a Section is used by one thread; a ReadOnlyView's bytes may
// be read by any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "hearth/status.h"

namespace hearth::platform {

#ifdef _WIN32
using NativeHandle = void*;  // HANDLE
inline constexpr NativeHandle kNoHandle = nullptr;
#else
using NativeHandle = int;  // a descriptor
inline constexpr NativeHandle kNoHandle = -1;
#endif

// Closes `h` where it is not kNoHandle.
void CloseHandle(NativeHandle h);

class Section {
 public:
  // A zero-filled section of `bytes` (at least 1 on Windows; an empty memfd
  // on Linux), mapped read-write for its creator. `name` is for the
  // operating system's listings only.
  static Result<Section> Create(uint64_t bytes, std::string_view name);
  Section(Section&& other) noexcept;
  Section& operator=(Section&& other) noexcept;
  Section(const Section&) = delete;
  Section& operator=(const Section&) = delete;
  ~Section();

  uint64_t size() const { return size_; }
  // The creator's view; empty once sealed.
  std::span<std::byte> writable() const {
    return {base_, sealed_ ? 0 : static_cast<size_t>(size_)};
  }

  // Ends writing: the writable view is unmapped (and, on Linux, the memfd
  // sealed against writes, growth and shrinking).
  Status Seal();

  // A handle to the sealed section that maps read-only in the process
  // `peer_pid` (Windows: a handle value valid in that process, which the
  // caller sends it; Linux: a descriptor in this process, which the caller
  // sends over SCM_RIGHTS and then closes). FailedPrecondition before Seal.
  Result<NativeHandle> ShareReadOnly(uint32_t peer_pid) const;

 private:
  Section() = default;
  void Release();

  NativeHandle handle_ = kNoHandle;
  std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  bool sealed_ = false;
};

// A peer's read-only view of a section it was given.
class ReadOnlyView {
 public:
  // Maps `bytes` of the section `handle` (this process's handle, taken:
  // closed when the view goes, or on failure) read-only. InvalidArgument
  // when the section is smaller than `bytes`.
  static Result<ReadOnlyView> Map(NativeHandle handle, uint64_t bytes);
  ReadOnlyView(ReadOnlyView&& other) noexcept;
  ReadOnlyView& operator=(ReadOnlyView&& other) noexcept;
  ReadOnlyView(const ReadOnlyView&) = delete;
  ReadOnlyView& operator=(const ReadOnlyView&) = delete;
  ~ReadOnlyView();

  std::span<const std::byte> bytes() const { return {base_, static_cast<size_t>(size_)}; }
  // What this process could do to write through the section (it must be
  // able to do none): map it writable, make the view's pages writable, or
  // write through a handle with more access (Windows: a duplicate asking
  // for write access; Linux: a read-write reopen through /proc, whose
  // write the seals refuse). Each is tried and undone where it succeeds.
  struct WriteAttempts {
    bool mapped_writable = false;
    bool protection_raised = false;
    bool handle_upgraded = false;
  };
  WriteAttempts TryToWrite() const;

 private:
  ReadOnlyView() = default;
  void Release();

  NativeHandle handle_ = kNoHandle;
  const std::byte* base_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace hearth::platform
