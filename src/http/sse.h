// Server-sent events, as the streaming endpoints write them: one
// `data: <payload>\n\n` event per response. Payloads are JSON written on one
// line (a newline in a string is escaped) or `[DONE]`; an event never holds
// a raw CR or LF, so no payload can end an event early or start another.
#pragma once

#include <string>
#include <string_view>

namespace hearth {

inline constexpr std::string_view kEventStreamType = "text/event-stream";

// Appends one event carrying `payload` (no CR or LF in it) to `out`.
inline void AppendSseEvent(std::string& out, std::string_view payload) {
  out.reserve(out.size() + payload.size() + 8);
  out += "data: ";
  out += payload;
  out += "\n\n";
}

inline std::string SseEvent(std::string_view payload) {
  std::string out;
  AppendSseEvent(out, payload);
  return out;
}

}  // namespace hearth
