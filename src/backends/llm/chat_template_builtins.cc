// The tests, methods and global functions of chat templates: jinja2 3.1's
// tests.py and defaults.py, the str and dict methods templates call, and
// transformers' raise_exception and strftime_now. Also the argument helpers
// the filters share.
#include <algorithm>
#include <ctime>
#include <limits>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {

// Positional `index` or keyword `name` of a call; nullopt when neither.
std::optional<Value> Arg(const Args& args, const Kwargs& kwargs, size_t index,
                         std::string_view name) {
  if (index < args.size()) return args[index];
  for (const auto& [key, value] : kwargs) {
    if (key == name) return value;
  }
  return std::nullopt;
}

// Refuses positional arguments past `max_positional` and keywords not in `names`.
void CheckSignature(std::string_view what, const Args& args, const Kwargs& kwargs,
                    size_t max_positional, std::initializer_list<std::string_view> names) {
  if (args.size() > max_positional) {
    Fail(std::string(what) + " takes at most " + std::to_string(max_positional) +
         " positional argument(s), got " + std::to_string(args.size()));
  }
  for (const auto& [key, value] : kwargs) {
    if (std::find(names.begin(), names.end(), key) == names.end()) {
      Fail(std::string(what) + " got an unexpected keyword argument '" + key + "'");
    }
  }
}

std::string StrArg(const std::optional<Value>& v, std::string_view what) {
  if (!v || !v->is_string()) Fail(std::string(what) + " must be a string");
  return v->str();
}

// ---- tests

bool ApplyTest(std::string_view name, const Value& v, const Args& args, const Kwargs& kwargs,
               RenderState& state) {
  auto other = [&]() -> Value {
    if (args.size() + kwargs.size() != 1)
      Fail("test '" + std::string(name) + "' takes one argument");
    return args.empty() ? kwargs[0].second : args[0];
  };
  static const char* const kOneArgument[] = {
      "eq", "equalto", "==",          "ne", "!=", "lt", "lessthan", "<",      "le",
      "<=", "gt",      "greaterthan", ">",  "ge", ">=", "in",       "sameas", "divisibleby"};
  if (std::find(std::begin(kOneArgument), std::end(kOneArgument), name) == std::end(kOneArgument) &&
      (!args.empty() || !kwargs.empty())) {
    Fail("test_" + std::string(name) + "() takes 1 positional argument but " +
         std::to_string(1 + args.size() + kwargs.size()) + " were given");
  }
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind() == Kind::kBool;
  if (name == "false") return v.kind() == Kind::kBool && !v.boolean();
  if (name == "true") return v.kind() == Kind::kBool && v.boolean();
  if (name == "integer") return v.kind() == Kind::kInt;
  if (name == "float") return v.kind() == Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.kind() == Kind::kDict;
  if (name == "iterable") {
    return v.is_undefined() || v.is_string() || v.kind() == Kind::kList ||
           v.kind() == Kind::kDict || v.kind() == Kind::kLoop;
  }
  if (name == "sequence") {
    return v.is_undefined() || v.is_string() || v.kind() == Kind::kList || v.kind() == Kind::kDict;
  }
  if (name == "callable") return v.kind() == Kind::kCallable;
  if (name == "escaped") return false;
  if (name == "eq" || name == "equalto" || name == "==") return Equal(v, other());
  if (name == "ne" || name == "!=") return !Equal(v, other());
  if (name == "lt" || name == "lessthan" || name == "<") return Compare(v, other(), "<") < 0;
  if (name == "le" || name == "<=") return Compare(v, other(), "<=") <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return Compare(v, other(), ">") > 0;
  if (name == "ge" || name == ">=") return Compare(v, other(), ">=") >= 0;
  if (name == "in") return Contains(other(), v);
  if (name == "sameas") {
    const Value o = other();
    if (v.kind() != o.kind()) return false;
    if (v.kind() == Kind::kList || v.kind() == Kind::kDict || v.kind() == Kind::kString)
      return false;  // distinct objects (two equal literals are not the same object either)
    return Equal(v, o);
  }
  if (name == "odd" || name == "even") {
    const Value r = Arithmetic(BinaryOp::kMod, v, Value::Int(2), state);
    return Truthy(r) == (name == "odd");
  }
  if (name == "divisibleby") {
    return !Truthy(Arithmetic(BinaryOp::kMod, v, other(), state));
  }
  if (name == "lower" || name == "upper") {
    const std::string s = PyStr(v, state);
    bool cased = false;
    for (size_t pos = 0; pos < s.size();) {
      const char32_t c = DecodeAt(s, pos);
      if (!IsCased(c)) continue;
      cased = true;
      if (name == "lower" ? IsUpperAscii(c) : IsLowerAscii(c)) return false;
    }
    return cased;
  }
  if (name == "filter") return v.is_string() && IsKnownFilter(v.str());
  if (name == "test") return v.is_string() && IsKnownTest(v.str());
  Fail("no test named '" + std::string(name) + "'");
}

// ---- methods

std::optional<Value> CallMethod(const Value& obj, std::string_view name, const Args& args,
                                const Kwargs& kwargs, RenderState& state) {
  if (obj.is_string()) {
    const std::string& s = obj.str();
    const std::string what = "str." + std::string(name);
    // Markup's methods escape their string arguments and give Markup.
    auto escaped = [&](const std::optional<Value>& a) -> std::optional<Value> {
      if (!obj.is_markup() || !a || !a->is_string() || a->is_markup()) return a;
      return Value::Markup(HtmlEscape(a->str()));
    };
    auto like = [&](Value list) {
      if (!obj.is_markup()) return list;
      std::vector<Value> items;
      for (const Value& item : list.list().items) items.push_back(Value::Markup(item.str()));
      return Value::MakeList(std::move(items));
    };
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      CheckSignature(what, args, kwargs, 1, {});
      return Value::StringLike(obj, Strip(s, escaped(Arg(args, kwargs, 0, "chars")),
                                          name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      CheckSignature(what, args, kwargs, 2, {"sep", "maxsplit"});
      const std::optional<Value> maxsplit = Arg(args, kwargs, 1, "maxsplit");
      if (maxsplit && !IsIntLike(*maxsplit)) Fail(what + ": maxsplit must be an int");
      return like(StringList(Split(s, Arg(args, kwargs, 0, "sep"),
                                   maxsplit ? maxsplit->integer() : -1, name == "rsplit")));
    }
    if (name == "splitlines") {
      CheckSignature(what, args, kwargs, 1, {"keepends"});
      const std::optional<Value> keepends = Arg(args, kwargs, 0, "keepends");
      return like(StringList(SplitLines(s, keepends && Truthy(*keepends))));
    }
    if (name == "startswith" || name == "endswith") {
      CheckSignature(what, args, kwargs, 1, {});
      if (args.empty()) Fail(what + " takes at least 1 argument (0 given)");
      return Value::Bool(AffixMatch(s, args[0], name == "startswith", what));
    }
    if (name == "upper" || name == "lower") {
      CheckSignature(what, args, kwargs, 0, {});
      return Value::StringLike(obj, MapCase(s, name == "upper" ? ToUpper : ToLower));
    }
    if (name == "title") {
      CheckSignature(what, args, kwargs, 0, {});
      return Value::StringLike(obj, PyTitle(s));
    }
    if (name == "capitalize") {
      CheckSignature(what, args, kwargs, 0, {});
      return Value::StringLike(obj, Capitalize(s));
    }
    if (name == "replace") {
      CheckSignature(what, args, kwargs, 3, {"count"});
      if (args.size() < 2 || !args[0].is_string() || !args[1].is_string()) {
        Fail(what + " takes two strings");
      }
      const std::optional<Value> count = Arg(args, kwargs, 2, "count");
      if (count && !IsIntLike(*count)) Fail(what + ": count must be an int");
      return Value::StringLike(obj, Replace(s, escaped(args[0])->str(), escaped(args[1])->str(),
                                            count ? count->integer() : -1, state));
    }
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
      CheckSignature(what, args, kwargs, 1, {});
      const std::string sub = StrArg(Arg(args, kwargs, 0, "sub"), what + " argument");
      const size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (at == std::string::npos) {
        if (name == "index" || name == "rindex") Fail("substring not found");
        return Value::Int(-1);
      }
      return Value::Int(CodepointIndex(s, at));
    }
    if (name == "count") {
      CheckSignature(what, args, kwargs, 1, {});
      const std::string sub = StrArg(Arg(args, kwargs, 0, "sub"), what + " argument");
      if (sub.empty()) return Value::Int(Length(obj) + 1);
      int64_t n = 0;
      for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
      return Value::Int(n);
    }
    if (name == "join") {
      CheckSignature(what, args, kwargs, 1, {});
      if (args.empty()) Fail(what + " takes exactly one argument (0 given)");
      std::string out;
      size_t i = 0;
      for (const Value& item : Iterate(args[0], state)) {
        if (!item.is_string()) {
          Fail("sequence item " + std::to_string(i) + ": expected str instance, " + TypeName(item) +
               " found");
        }
        if (i++ > 0) out += s;
        out += item.str();
        state.CheckSize(out.size());
      }
      return Value::String(std::move(out));
    }
    if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
        name == "islower" || name == "isupper") {
      CheckSignature(what, args, kwargs, 0, {});
      if (name == "islower" || name == "isupper") {
        return Value::Bool(ApplyTest(name.substr(2), obj, {}, {}, state));
      }
      if (s.empty()) return Value::Bool(false);
      for (size_t pos = 0; pos < s.size();) {
        const char32_t c = DecodeAt(s, pos);
        const bool digit = c >= '0' && c <= '9';
        const bool ok = name == "isdigit"   ? digit
                        : name == "isalpha" ? IsCased(c)
                        : name == "isalnum" ? digit || IsCased(c)
                                            : IsPySpace(c);
        if (!ok) return Value::Bool(false);
      }
      return Value::Bool(true);
    }
    if (name == "format") Fail("str.format is not supported by this renderer");
    return std::nullopt;
  }
  if (obj.kind() == Kind::kDict) {
    const Dict& dict = obj.dict();
    const std::string what = "dict." + std::string(name);
    if (name == "items") {
      CheckSignature(what, args, kwargs, 0, {});
      return Items(obj);
    }
    if (name == "keys" || name == "values") {
      CheckSignature(what, args, kwargs, 0, {});
      std::vector<Value> out;
      for (const auto& [key, value] : dict.items)
        out.push_back(name == "keys" ? Value::String(key) : value);
      return Value::MakeList(std::move(out));
    }
    if (name == "get") {
      CheckSignature(what, args, kwargs, 2, {});
      if (args.empty()) Fail("get expected at least 1 argument, got 0");
      if (args[0].is_string()) {
        if (const Value* v = dict.Find(args[0].str())) return *v;
      } else if (args[0].kind() == Kind::kList || args[0].kind() == Kind::kDict) {
        Fail("unhashable type: '" + TypeName(args[0]) + "'");
      }
      return args.size() > 1 ? args[1] : Value::None();
    }
    static const char* const kMutators[] = {"update", "pop", "popitem", "setdefault", "clear"};
    for (const char* m : kMutators) {
      if (name == m)
        Fail("access to attribute '" + std::string(name) + "' of 'dict' object is unsafe.");
    }
    return std::nullopt;
  }
  if (obj.kind() == Kind::kList) {
    if (name == "count" || name == "index") {
      CheckSignature(std::string(TypeName(obj)) + "." + std::string(name), args, kwargs, 1, {});
      if (args.empty()) Fail(std::string(name) + "() takes exactly one argument (0 given)");
      const auto& items = obj.list().items;
      int64_t n = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        if (!Equal(items[i], args[0])) continue;
        if (name == "index") return Value::Int(static_cast<int64_t>(i));
        ++n;
      }
      if (name == "index") Fail(PyRepr(args[0], state) + " is not in " + TypeName(obj));
      return Value::Int(n);
    }
    static const char* const kMutators[] = {"append", "extend", "insert", "pop",
                                            "remove", "clear",  "sort",   "reverse"};
    for (const char* m : kMutators) {
      if (name == m) {
        Fail("access to attribute '" + std::string(name) + "' of '" + TypeName(obj) +
             "' object is unsafe.");
      }
    }
    return std::nullopt;
  }
  if (obj.kind() == Kind::kLoop && name == "cycle") {
    if (args.empty()) Fail("no items for cycling given");
    return args[static_cast<size_t>(obj.loop().index0) % args.size()];
  }
  return std::nullopt;
}

// ---- globals

Value CallBuiltin(Builtin builtin, const Args& args, const Kwargs& kwargs, RenderState& state) {
  switch (builtin) {
    case Builtin::kRaiseException: {
      TemplateError error;
      error.code = StatusCode::kInvalidArgument;
      error.message = args.empty() ? "" : PyStr(args[0], state);
      error.located = true;
      throw error;
    }
    case Builtin::kStrftimeNow: {
      CheckSignature("strftime_now", args, kwargs, 1, {});
      const std::string format = StrArg(Arg(args, kwargs, 0, "format"), "strftime_now's format");
      if (format.size() > 256) Fail("strftime_now: format longer than 256 bytes");
      const std::tm tm = state.Now();
      std::string out(4096, '\0');
      const size_t n =
          format.empty() ? 0 : std::strftime(out.data(), out.size(), format.c_str(), &tm);
      if (n == 0 && !format.empty()) {
        // strftime returns 0 both for an empty result and for one too long.
        out.clear();
      } else {
        out.resize(n);
      }
      return Value::String(std::move(out));
    }
    case Builtin::kRange: {
      if (!kwargs.empty()) Fail("range() takes no keyword arguments");
      if (args.empty() || args.size() > 3) {
        Fail("range expected 1 to 3 arguments, got " + std::to_string(args.size()));
      }
      for (const Value& a : args) {
        if (!IsIntLike(a)) Fail("'" + TypeName(a) + "' object cannot be interpreted as an integer");
      }
      const int64_t start = args.size() == 1 ? 0 : args[0].integer();
      const int64_t stop = args.size() == 1 ? args[0].integer() : args[1].integer();
      const int64_t step = args.size() == 3 ? args[2].integer() : 1;
      if (step == 0) Fail("range() arg 3 must not be zero");
      const long double span = static_cast<long double>(stop) - start;
      const long double count_ld = step > 0 ? (span + step - 1) / step : (span + step + 1) / step;
      const int64_t count =
          count_ld <= 0 ? 0 : static_cast<int64_t>(std::min<long double>(count_ld, 1e18));
      // The sandbox transformers renders in refuses ranges past MAX_RANGE.
      if (count > 100000) {
        Fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
      }
      state.Tick(count);
      std::vector<Value> items;
      items.reserve(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) items.push_back(Value::Int(start + i * step));
      return Value::MakeList(std::move(items));
    }
    case Builtin::kDict:
    case Builtin::kNamespace: {
      const char* what = builtin == Builtin::kDict ? "dict" : "namespace";
      if (args.size() > 1)
        Fail(std::string(what) + " expected at most 1 argument, got " +
             std::to_string(args.size()));
      Dict dict;
      if (!args.empty()) {
        if (args[0].kind() == Kind::kDict) {
          dict = args[0].dict();
        } else if (args[0].kind() == Kind::kList) {
          for (const Value& pair : args[0].list().items) {
            if (pair.kind() != Kind::kList || pair.list().items.size() != 2 ||
                !pair.list().items[0].is_string()) {
              Fail(std::string(what) + ": expected (string key, value) pairs");
            }
            dict.Set(pair.list().items[0].str(), pair.list().items[1]);
          }
        } else {
          Fail(std::string(what) + ": '" + TypeName(args[0]) + "' object is not a mapping");
        }
      }
      for (const auto& [key, value] : kwargs) dict.Set(key, value);
      state.Tick(static_cast<int64_t>(dict.items.size()));
      if (builtin == Builtin::kDict) return Value::MakeDict(std::move(dict));
      auto ns = std::make_shared<Namespace>();
      ns->attrs = std::move(dict);
      return Value::MakeNamespace(std::move(ns));
    }
  }
  Fail("unknown builtin");
}

}  // namespace hearth::llm::jinja
