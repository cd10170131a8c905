// Process users on Windows: the token's user SID (identity.h).
#include <windows.h>
// after windows.h, which it needs
#include <sddl.h>

#include <memory>
#include <string>

#include "platform/identity.h"
#include "platform/windows_error.h"

namespace hearth::platform {
namespace {

Result<std::string> TokenUserOf(HANDLE process, const std::string& what) {
  HANDLE token = nullptr;
  if (!::OpenProcessToken(process, TOKEN_QUERY, &token))
    return Unavailable(LastError("OpenProcessToken of " + what));
  DWORD bytes = 0;
  ::GetTokenInformation(token, TokenUser, nullptr, 0, &bytes);
  std::unique_ptr<std::byte[]> info(new std::byte[bytes > 0 ? bytes : 1]);
  const BOOL ok = ::GetTokenInformation(token, TokenUser, info.get(), bytes, &bytes);
  const std::string error = ok ? "" : LastError("GetTokenInformation(TokenUser) of " + what);
  ::CloseHandle(token);
  if (!ok) return Internal(error);
  char* text = nullptr;
  if (!::ConvertSidToStringSidA(reinterpret_cast<TOKEN_USER*>(info.get())->User.Sid, &text))
    return Internal(LastError("ConvertSidToStringSidA"));
  std::string sid(text);
  ::LocalFree(text);
  return sid;
}

}  // namespace

Result<std::string> CurrentUser() { return TokenUserOf(::GetCurrentProcess(), "this process"); }

Result<std::string> ProcessUser(uint32_t pid) {
  const std::string what = "process " + std::to_string(pid);
  const HANDLE process = ::OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, FALSE, pid);
  if (process == nullptr) return Unavailable(LastError("OpenProcess of " + what));
  Result<std::string> user = TokenUserOf(process, what);
  ::CloseHandle(process);
  return user;
}

}  // namespace hearth::platform
