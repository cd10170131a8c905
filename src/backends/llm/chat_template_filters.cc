// The filters of chat templates: jinja2 3.1's filters.py, with
// transformers' tojson. The names IsKnownFilter accepts are in
// chat_template_parser.cc; each has its case in ApplyFilter.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {
namespace {

// make_attrgetter(): "a.b.0" -> item["a"]["b"][0].
Value GetAttrPath(const Value& item, const Value& attribute) {
  if (IsIntLike(attribute)) return GetItem(item, attribute);
  if (!attribute.is_string()) Fail("attribute must be a string or an integer");
  Value v = item;
  const std::string& path = attribute.str();
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? dot : dot - start);
    const bool digits = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
    v = digits ? GetItem(v, Value::Int(std::strtoll(part.c_str(), nullptr, 10)))
               : GetItem(v, Value::String(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

// The sort/unique/min/max key: lowercased strings unless case-sensitive.
Value SortKey(const Value& item, const std::optional<Value>& attribute, bool case_sensitive) {
  Value key = attribute ? GetAttrPath(item, *attribute) : item;
  if (!case_sensitive && key.is_string()) return Value::String(MapCase(key.str(), ToLower));
  return key;
}

}  // namespace

Value Items(const Value& v) {
  if (v.is_undefined()) return Value::MakeList({});
  if (v.kind() != Kind::kDict) Fail("Can only get item pairs from a mapping.");
  std::vector<Value> pairs;
  for (const auto& [key, value] : v.dict().items) {
    pairs.push_back(Value::MakeList({Value::String(key), value}, true));
  }
  return Value::MakeList(std::move(pairs));
}

namespace {

Value FirstOrLast(const Value& v, bool last, RenderState& state) {
  if (v.kind() == Kind::kList) {
    const auto& items = v.list().items;
    if (!items.empty()) return last ? items.back() : items.front();
  } else if (!v.is_undefined()) {
    std::vector<Value> items = Iterate(v, state);
    if (!items.empty()) return last ? items.back() : items.front();
  }
  return Value::Undefined(last ? "No last item, sequence was empty."
                               : "No first item, sequence was empty.");
}

Value Select(const Value& seq, const Args& args, const Kwargs& kwargs, bool attr, bool keep,
             RenderState& state) {
  std::vector<Value> out;
  // jinja2 looks at nothing when the value is false: none|selectattr(...) is empty.
  if (!Truthy(seq)) return Value::MakeList({});
  size_t next = 0;
  std::optional<Value> attribute;
  if (attr) {
    if (args.empty()) Fail("selectattr/rejectattr need an attribute");
    attribute = args[next++];
  }
  std::optional<std::string> test;
  if (next < args.size()) {
    if (!args[next].is_string()) Fail("the test name must be a string");
    test = args[next++].str();
    if (!IsKnownTest(*test)) Fail("no test named '" + *test + "'");
  }
  const Args test_args(args.begin() + static_cast<std::ptrdiff_t>(next), args.end());
  for (const Value& item : Iterate(seq, state)) {
    const Value probe = attribute ? GetAttrPath(item, *attribute) : item;
    const bool passed = test ? ApplyTest(*test, probe, test_args, kwargs, state) : Truthy(probe);
    if (passed == keep) out.push_back(item);
  }
  return Value::MakeList(std::move(out));
}

Value Round(const Value& v, int64_t precision, const std::string& method) {
  if (!v.is_number()) Fail("round: a number is required, not " + TypeName(v));
  const double x = v.number();
  if (method == "common" && IsIntLike(v)) {
    // round(int, n) stays an int.
    if (precision >= 0) return Value::Int(v.integer());
    if (precision < -18) return Value::Int(0);
    int64_t scale = 1;
    for (int64_t i = 0; i < -precision; ++i) scale *= 10;
    const int64_t q = v.integer() / scale;
    const int64_t r = v.integer() % scale;
    int64_t rounded = q;  // half to even, as Python
    if (2 * std::abs(r) > scale || (2 * std::abs(r) == scale && (q % 2 != 0)))
      rounded += v.integer() < 0 ? -1 : 1;
    return Value::Int(rounded * scale);
  }
  if (method == "common") {
    if (!std::isfinite(x)) return Value::Float(x);
    if (precision >= 0) {
      if (precision > 300) return Value::Float(x);
      char buf[512];
      std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), x);
      return Value::Float(std::strtod(buf, nullptr));
    }
    const double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value::Float(std::nearbyint(x / scale) * scale);
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  if (method == "ceil") return Value::Float(std::ceil(x * scale) / scale);
  if (method == "floor") return Value::Float(std::floor(x * scale) / scale);
  Fail("method must be common, ceil or floor");
}

Value MinMax(const Value& seq, const Args& args, const Kwargs& kwargs, bool max,
             RenderState& state) {
  CheckSignature(max ? "max" : "min", args, kwargs, 2, {"case_sensitive", "attribute"});
  const std::optional<Value> cs = Arg(args, kwargs, 0, "case_sensitive");
  const std::optional<Value> attribute = Arg(args, kwargs, 1, "attribute");
  const bool case_sensitive = cs && Truthy(*cs);
  std::optional<Value> best;
  Value best_key;
  for (const Value& item : Iterate(seq, state)) {
    Value key = SortKey(item, attribute, case_sensitive);
    if (!best || Compare(key, best_key, max ? ">" : "<") == (max ? 1 : -1)) {
      best = item;
      best_key = std::move(key);
    }
  }
  if (!best) return Value::Undefined("No aggregated item, sequence was empty.");
  return *best;
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False), positional in that order.
Value ToJsonFilter(const Value& v, const Args& args, const Kwargs& kwargs, RenderState& state) {
  CheckSignature("tojson", args, kwargs, 4, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions options;
  if (auto a = Arg(args, kwargs, 0, "ensure_ascii")) options.ensure_ascii = Truthy(*a);
  if (auto indent = Arg(args, kwargs, 1, "indent"); indent && !indent->is_none()) {
    if (indent->is_string()) {
      options.indent = indent->str();
    } else if (IsIntLike(*indent)) {
      options.indent =
          std::string(static_cast<size_t>(std::max<int64_t>(0, indent->integer())), ' ');
    } else {
      Fail("tojson: indent must be an int or a string");
    }
    options.item_separator = ",";
  }
  if (auto sep = Arg(args, kwargs, 2, "separators"); sep && !sep->is_none()) {
    if (sep->kind() != Kind::kList || sep->list().items.size() != 2 ||
        !sep->list().items[0].is_string() || !sep->list().items[1].is_string()) {
      Fail("tojson: separators must be a pair of strings");
    }
    options.item_separator = sep->list().items[0].str();
    options.key_separator = sep->list().items[1].str();
  }
  if (auto sort = Arg(args, kwargs, 3, "sort_keys")) options.sort_keys = Truthy(*sort);
  return Value::String(ToJson(v, options, state));
}

}  // namespace

Value ApplyFilter(std::string_view name, const Value& v, const Args& args, const Kwargs& kwargs,
                  RenderState& state) {
  auto str = [&]() { return PyStr(v, state); };
  if (name == "tojson") return ToJsonFilter(v, args, kwargs, state);
  if (name == "trim") {
    CheckSignature(name, args, kwargs, 1, {"chars"});
    return Value::StringLike(v, Strip(str(), Arg(args, kwargs, 0, "chars"), true, true));
  }
  if (name == "length" || name == "count") {
    CheckSignature(name, args, kwargs, 0, {});
    return Value::Int(Length(v));
  }
  if (name == "upper" || name == "lower") {
    CheckSignature(name, args, kwargs, 0, {});
    return Value::StringLike(v, MapCase(str(), name == "upper" ? ToUpper : ToLower));
  }
  if (name == "capitalize") {
    CheckSignature(name, args, kwargs, 0, {});
    return Value::StringLike(v, Capitalize(str()));
  }
  if (name == "title") {
    CheckSignature(name, args, kwargs, 0, {});
    return Value::String(JinjaTitle(str()));
  }
  if (name == "string") {
    CheckSignature(name, args, kwargs, 0, {});
    return v.is_string() ? v : Value::String(str());
  }
  if (name == "safe") return v.is_markup() ? v : Value::Markup(str());
  if (name == "e" || name == "escape") {
    return v.is_markup() ? v : Value::Markup(HtmlEscape(str()));
  }
  if (name == "items") {
    CheckSignature(name, args, kwargs, 0, {});
    return Items(v);
  }
  if (name == "first" || name == "last") {
    CheckSignature(name, args, kwargs, 0, {});
    return FirstOrLast(v, name == "last", state);
  }
  if (name == "list") {
    CheckSignature(name, args, kwargs, 0, {});
    return Value::MakeList(Iterate(v, state));
  }
  if (name == "default" || name == "d") {
    CheckSignature(name, args, kwargs, 2, {"default_value", "boolean"});
    const std::optional<Value> fallback = Arg(args, kwargs, 0, "default_value");
    const std::optional<Value> boolean = Arg(args, kwargs, 1, "boolean");
    if (v.is_undefined() || (boolean && Truthy(*boolean) && !Truthy(v))) {
      return fallback ? *fallback : Value::String("");
    }
    return v;
  }
  if (name == "join") {
    CheckSignature(name, args, kwargs, 2, {"d", "attribute"});
    const std::optional<Value> sep = Arg(args, kwargs, 0, "d");
    const std::optional<Value> attribute = Arg(args, kwargs, 1, "attribute");
    const std::string separator = sep ? PyStr(*sep, state) : "";
    std::string out;
    bool first = true;
    for (const Value& item : Iterate(v, state)) {
      if (!first) out += separator;
      first = false;
      out += PyStr(attribute ? GetAttrPath(item, *attribute) : item, state);
      state.CheckSize(out.size());
    }
    return Value::String(std::move(out));
  }
  if (name == "replace") {
    CheckSignature(name, args, kwargs, 3, {"old", "new", "count"});
    const std::optional<Value> count = Arg(args, kwargs, 2, "count");
    if (count && !count->is_none() && !IsIntLike(*count)) Fail("replace: count must be an int");
    return Value::String(Replace(str(), PyStr(Arg(args, kwargs, 0, "old").value_or(Value()), state),
                                 PyStr(Arg(args, kwargs, 1, "new").value_or(Value()), state),
                                 count && !count->is_none() ? count->integer() : -1, state));
  }
  if (name == "indent") {
    CheckSignature(name, args, kwargs, 3, {"width", "first", "blank"});
    // jinja2 appends a newline to the value itself: only strings indent.
    if (v.is_undefined()) Fail(v.undefined_message());
    if (!v.is_string()) {
      Fail("unsupported operand type(s) for +=: '" + TypeName(v) + "' and 'str'");
    }
    const std::optional<Value> width = Arg(args, kwargs, 0, "width");
    const std::optional<Value> first = Arg(args, kwargs, 1, "first");
    const std::optional<Value> blank = Arg(args, kwargs, 2, "blank");
    return Value::StringLike(v, Indent(str(), width ? *width : Value::Int(4),
                                       first && Truthy(*first), blank && Truthy(*blank)));
  }
  if ((name == "int" || name == "float") && v.is_undefined()) {
    Fail(v.undefined_message());  // int(Undefined) raises; jinja2 catches only TypeError/ValueError
  }
  if (name == "int") {
    CheckSignature(name, args, kwargs, 2, {"default", "base"});
    const Value fallback = Arg(args, kwargs, 0, "default").value_or(Value::Int(0));
    const std::optional<Value> base_v = Arg(args, kwargs, 1, "base");
    const int64_t base = base_v && IsIntLike(*base_v) ? base_v->integer() : 10;
    if (v.is_string()) {
      if (auto i = ParsePyInt(v.str(), static_cast<int>(base))) return Value::Int(*i);
      if (auto f = ParsePyFloat(v.str()); f && std::isfinite(*f) && std::fabs(*f) < 9.2e18)
        return Value::Int(static_cast<int64_t>(*f));
      return fallback;
    }
    if (IsIntLike(v)) return Value::Int(v.integer());
    if (v.kind() == Kind::kFloat && std::isfinite(v.number()) && std::fabs(v.number()) < 9.2e18)
      return Value::Int(static_cast<int64_t>(v.number()));
    return fallback;
  }
  if (name == "float") {
    CheckSignature(name, args, kwargs, 1, {"default"});
    const Value fallback = Arg(args, kwargs, 0, "default").value_or(Value::Float(0.0));
    if (v.is_number()) return Value::Float(v.number());
    if (v.is_string()) {
      if (auto f = ParsePyFloat(v.str())) return Value::Float(*f);
    }
    return fallback;
  }
  if (name == "abs") {
    CheckSignature(name, args, kwargs, 0, {});
    if (v.kind() == Kind::kFloat) return Value::Float(std::fabs(v.number()));
    if (IsIntLike(v)) return Negate(v, v.integer() < 0);
    Fail("bad operand type for abs(): '" + TypeName(v) + "'");
  }
  if (name == "round") {
    CheckSignature(name, args, kwargs, 2, {"precision", "method"});
    const std::optional<Value> precision = Arg(args, kwargs, 0, "precision");
    const std::optional<Value> method = Arg(args, kwargs, 1, "method");
    if (precision && !IsIntLike(*precision)) Fail("round: precision must be an int");
    return Round(v, precision ? precision->integer() : 0,
                 method ? StrArg(method, "round: method") : "common");
  }
  if (name == "reverse") {
    CheckSignature(name, args, kwargs, 0, {});
    if (v.is_string()) {
      std::vector<char32_t> cps = Decode(v.str());
      std::reverse(cps.begin(), cps.end());
      return Value::String(Encode(cps));
    }
    std::vector<Value> items = Iterate(v, state);
    std::reverse(items.begin(), items.end());
    return Value::MakeList(std::move(items));
  }
  if (name == "sort") {
    CheckSignature(name, args, kwargs, 3, {"reverse", "case_sensitive", "attribute"});
    const std::optional<Value> reverse = Arg(args, kwargs, 0, "reverse");
    const std::optional<Value> cs = Arg(args, kwargs, 1, "case_sensitive");
    const std::optional<Value> attribute = Arg(args, kwargs, 2, "attribute");
    std::vector<Value> items = Iterate(v, state);
    std::vector<std::pair<Value, size_t>> keyed;
    for (size_t i = 0; i < items.size(); ++i)
      keyed.emplace_back(SortKey(items[i], attribute, cs && Truthy(*cs)), i);
    state.Tick(static_cast<int64_t>(items.size()));
    const bool descending = reverse && Truthy(*reverse);
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
      return descending ? Compare(b.first, a.first, "<") < 0 : Compare(a.first, b.first, "<") < 0;
    });
    std::vector<Value> out;
    for (const auto& [key, index] : keyed) out.push_back(items[index]);
    return Value::MakeList(std::move(out));
  }
  if (name == "dictsort") {
    CheckSignature(name, args, kwargs, 3, {"case_sensitive", "by", "reverse"});
    const std::optional<Value> cs = Arg(args, kwargs, 0, "case_sensitive");
    const std::optional<Value> by = Arg(args, kwargs, 1, "by");
    const std::optional<Value> reverse = Arg(args, kwargs, 2, "reverse");
    const std::string by_what = by ? StrArg(by, "dictsort: by") : "key";
    if (by_what != "key" && by_what != "value")
      Fail("You can only sort by either \"key\" or \"value\"");
    const Value pairs = Items(v);
    std::vector<Value> items = pairs.list().items;
    const size_t pos = by_what == "key" ? 0 : 1;
    const bool descending = reverse && Truthy(*reverse);
    const bool case_sensitive = cs && Truthy(*cs);
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      const Value ka = SortKey(a.list().items[pos], std::nullopt, case_sensitive);
      const Value kb = SortKey(b.list().items[pos], std::nullopt, case_sensitive);
      return descending ? Compare(kb, ka, "<") < 0 : Compare(ka, kb, "<") < 0;
    });
    return Value::MakeList(std::move(items));
  }
  if (name == "unique") {
    CheckSignature(name, args, kwargs, 2, {"case_sensitive", "attribute"});
    const std::optional<Value> cs = Arg(args, kwargs, 0, "case_sensitive");
    const std::optional<Value> attribute = Arg(args, kwargs, 1, "attribute");
    std::vector<Value> out;
    std::vector<Value> seen;
    for (const Value& item : Iterate(v, state)) {
      Value key = SortKey(item, attribute, cs && Truthy(*cs));
      bool dup = false;
      for (const Value& s : seen) {
        state.Tick();
        if (Equal(s, key)) {
          dup = true;
          break;
        }
      }
      if (dup) continue;
      seen.push_back(std::move(key));
      out.push_back(item);
    }
    return Value::MakeList(std::move(out));
  }
  if (name == "max" || name == "min") return MinMax(v, args, kwargs, name == "max", state);
  if (name == "sum") {
    CheckSignature(name, args, kwargs, 2, {"attribute", "start"});
    const std::optional<Value> attribute = Arg(args, kwargs, 0, "attribute");
    Value total = Arg(args, kwargs, 1, "start").value_or(Value::Int(0));
    for (const Value& item : Iterate(v, state)) {
      total = Arithmetic(BinaryOp::kAdd, total, attribute ? GetAttrPath(item, *attribute) : item,
                         state);
    }
    return total;
  }
  if (name == "map") {
    std::vector<Value> out;
    if (!Truthy(v)) return Value::MakeList({});  // as select: a false value maps to nothing
    std::optional<Value> attribute;
    std::optional<Value> fallback;
    for (const auto& [key, value] : kwargs) {
      if (key == "attribute") attribute = value;
      if (key == "default") fallback = value;
    }
    if (attribute) {
      if (!args.empty()) Fail("map: positional arguments with attribute=");
      for (const Value& item : Iterate(v, state)) {
        Value got = GetAttrPath(item, *attribute);
        if (got.is_undefined() && fallback && !fallback->is_none()) got = *fallback;
        out.push_back(std::move(got));
      }
      return Value::MakeList(std::move(out));
    }
    if (args.empty() || !args[0].is_string()) Fail("map: a filter name or attribute= is required");
    const std::string filter = args[0].str();
    if (!IsKnownFilter(filter)) Fail("no filter named '" + filter + "'");
    const Args rest(args.begin() + 1, args.end());
    for (const Value& item : Iterate(v, state)) {
      out.push_back(ApplyFilter(filter, item, rest, kwargs, state));
    }
    return Value::MakeList(std::move(out));
  }
  if (name == "select" || name == "reject") {
    return Select(v, args, kwargs, false, name == "select", state);
  }
  if (name == "selectattr" || name == "rejectattr") {
    return Select(v, args, kwargs, true, name == "selectattr", state);
  }
  if (name == "wordcount") {
    CheckSignature(name, args, kwargs, 0, {});
    int64_t words = 0;
    bool in_word = false;
    const std::string s = str();
    for (size_t pos = 0; pos < s.size();) {
      const char32_t c = DecodeAt(s, pos);
      const bool word_char =
          (c >= '0' && c <= '9') || IsCased(c) || c == '_' || (c >= 0x80 && !IsPySpace(c));
      if (word_char && !in_word) ++words;
      in_word = word_char;
    }
    return Value::Int(words);
  }
  Fail("no filter named '" + std::string(name) + "'");
}

}  // namespace hearth::llm::jinja
