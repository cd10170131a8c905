// Stop strings over streamed text: the text ends before the first stop
// string it contains, and what may be the start of one is held back until
// the text after it says whether it is.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace hearth::llm {

class StopStrings {
 public:
  StopStrings() = default;
  // Empty strings are dropped.
  explicit StopStrings(std::vector<std::string> stops);

  // More text; returns what can be sent now. Once a stop string is found
  // (stopped()), the text before it is returned and everything after is
  // dropped.
  std::string Push(std::string_view text);
  // At the end: what was held back (nothing once stopped).
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace hearth::llm
