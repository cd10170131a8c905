#include "checkpoint/strict_json.h"

#include <set>
#include <vector>

namespace hearth {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxJsonErrorChars = 240;

// Thrown by the parser callback to stop parsing.
struct NestingTooDeep {};

// The parser callback sees every key as it is read.
class KeyChecker {
 public:
  explicit KeyChecker(const StrictJsonErrors& errors) : errors_(errors) {}

  bool operator()(int /*depth*/, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (frames_.size() == kMaxStrictJsonDepth) throw NestingTooDeep();
        frames_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        frames_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        Frame& frame = frames_.back();
        if (!frame.keys.insert(key).second && first_duplicate_.ok()) {
          static const std::string kNone;
          first_duplicate_ = errors_.duplicate(
              frames_.size(), frames_.size() > 1 ? frames_.front().last_key : kNone, key);
        }
        frame.last_key = key;
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  }

  const Status& first_duplicate() const { return first_duplicate_; }

 private:
  struct Frame {
    std::set<std::string, std::less<>> keys;
    std::string last_key;
  };

  const StrictJsonErrors& errors_;
  std::vector<Frame> frames_;
  Status first_duplicate_;
};

}  // namespace

Result<Json> ParseStrictJson(std::string_view text, const StrictJsonErrors& errors) {
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    return errors.invalid("invalid JSON: NUL byte at offset " + std::to_string(nul));
  KeyChecker checker(errors);
  Json json;
  try {
    json = Json::parse(text.begin(), text.end(), std::ref(checker));
  } catch (const Json::exception& e) {
    std::string what = e.what();
    if (what.size() > kMaxJsonErrorChars) what = what.substr(0, kMaxJsonErrorChars) + "...";
    return errors.invalid("invalid JSON: " + what);
  } catch (const NestingTooDeep&) {
    return errors.invalid("JSON nests deeper than " + std::to_string(kMaxStrictJsonDepth) +
                          " levels");
  }
  RETURN_IF_ERROR(checker.first_duplicate());
  return json;
}

}  // namespace hearth
