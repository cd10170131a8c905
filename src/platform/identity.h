// Who a process runs as, in the form the platform names users: a SID's text
// on Windows ("S-1-5-21-..."). Linux's peers are checked by uid through
// SO_PEERCRED (common/trusted_path.h); these are the Windows side for now.
#pragma once

#include <cstdint>
#include <string>

#include "hearth/status.h"

namespace hearth::platform {

#ifdef _WIN32
// The user of the process `pid` (Unavailable when it cannot be opened), or
// of this process.
Result<std::string> ProcessUser(uint32_t pid);
Result<std::string> CurrentUser();
#endif

}  // namespace hearth::platform
