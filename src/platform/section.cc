// What sections are on every system (section.h): moving and destroying
// them; the rest is in section_linux.cc and section_windows.cc.
#include "platform/section.h"

#include <utility>

namespace hearth::platform {

Section::Section(Section&& other) noexcept
    : handle_(std::exchange(other.handle_, kNoHandle)),
      base_(std::exchange(other.base_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      sealed_(std::exchange(other.sealed_, false)) {}

Section& Section::operator=(Section&& other) noexcept {
  if (this != &other) {
    Release();
    handle_ = std::exchange(other.handle_, kNoHandle);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
    sealed_ = std::exchange(other.sealed_, false);
  }
  return *this;
}

Section::~Section() { Release(); }

ReadOnlyView::ReadOnlyView(ReadOnlyView&& other) noexcept
    : handle_(std::exchange(other.handle_, kNoHandle)),
      base_(std::exchange(other.base_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

ReadOnlyView& ReadOnlyView::operator=(ReadOnlyView&& other) noexcept {
  if (this != &other) {
    Release();
    handle_ = std::exchange(other.handle_, kNoHandle);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

ReadOnlyView::~ReadOnlyView() { Release(); }

}  // namespace hearth::platform
