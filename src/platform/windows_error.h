// GetLastError() as the text of a Status message (Windows only).
#pragma once

#include <windows.h>

#include <string>

namespace hearth::platform {

// "what: <the system's message> (error N)".
inline std::string LastError(const std::string& what) {
  const DWORD code = ::GetLastError();
  char text[512] = {};
  DWORD n = ::FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, nullptr,
                             code, 0, text, sizeof(text), nullptr);
  while (n > 0 && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' ')) text[--n] = 0;
  return what + ": " + (n > 0 ? std::string(text, n) : std::string("unknown error")) + " (error " +
         std::to_string(code) + ")";
}

}  // namespace hearth::platform
