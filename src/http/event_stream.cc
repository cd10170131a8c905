#include "http/event_stream.h"

#include <cstdio>

namespace hearth::rest {

std::string FrameEvents(std::string_view events, bool chunked) {
  if (!chunked) return std::string(events);
  char size[20];
  const int n = std::snprintf(size, sizeof(size), "%zx\r\n", events.size());
  std::string framed;
  framed.reserve(static_cast<size_t>(n) + events.size() + 2);
  framed.append(size, static_cast<size_t>(n));
  framed += events;
  framed += "\r\n";
  return framed;
}

}  // namespace hearth::rest
