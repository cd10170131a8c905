// Template values with Python's semantics: how they compare, add and index,
// and how the context's JSON becomes them (chat_template_internal.h).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {

void Fail(std::string message) {
  throw TemplateError{StatusCode::kInvalidArgument, std::move(message)};
}

void FailLimit(std::string message) {
  throw TemplateError{StatusCode::kResourceExhausted, std::move(message)};
}

const Value* Dict::Find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::Set(std::string key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

Value Value::Undefined(std::string hint) {
  Value v;
  v.ptr_ = std::make_shared<const std::string>(std::move(hint));
  return v;
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::Bool(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.b_ = b;
  return v;
}

Value Value::Int(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.i_ = i;
  return v;
}

Value Value::Float(double f) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.f_ = f;
  return v;
}

Value Value::String(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.ptr_ = std::make_shared<const std::string>(std::move(s));
  return v;
}

Value Value::Markup(std::string s) {
  Value v = String(std::move(s));
  v.b_ = true;
  return v;
}

Value Value::StringLike(const Value& like, std::string s) {
  return like.is_markup() ? Markup(std::move(s)) : String(std::move(s));
}

Value Value::MakeList(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind_ = Kind::kList;
  auto list = std::make_shared<List>();
  list->items = std::move(items);
  list->tuple = tuple;
  v.ptr_ = std::shared_ptr<const List>(std::move(list));
  return v;
}

Value Value::MakeDict(Dict dict) {
  Value v;
  v.kind_ = Kind::kDict;
  v.ptr_ = std::make_shared<const Dict>(std::move(dict));
  return v;
}

Value Value::MakeNamespace(std::shared_ptr<Namespace> ns) {
  Value v;
  v.kind_ = Kind::kNamespace;
  v.ptr_ = std::move(ns);
  return v;
}

Value Value::MakeCallable(Callable fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.ptr_ = std::make_shared<const Callable>(std::move(fn));
  return v;
}

Value Value::MakeLoop(std::shared_ptr<LoopState> loop) {
  Value v;
  v.kind_ = Kind::kLoop;
  v.ptr_ = std::move(loop);
  return v;
}

std::string Value::undefined_message() const {
  if (const auto* hint = std::get_if<std::shared_ptr<const std::string>>(&ptr_)) return **hint;
  return "value is undefined";
}

void RenderState::Tick(int64_t n) {
  steps_ += n;
  if (steps_ > options_.limits.max_loop_iterations) {
    FailLimit("chat template: more than max_loop_iterations (" +
              std::to_string(options_.limits.max_loop_iterations) + ") loop iterations");
  }
}

void RenderState::CheckSize(size_t bytes) const {
  if (bytes > options_.limits.max_output_bytes) {
    FailLimit("chat template: output or string longer than max_output_bytes (" +
              std::to_string(options_.limits.max_output_bytes) + ")");
  }
}

std::tm RenderState::Now() const {
  if (options_.now) return options_.now();
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  return tm;
}

RenderState::Nest::Nest(RenderState& state) : state_(state) {
  if (++state_.depth_ > state_.options_.limits.max_depth) {
    --state_.depth_;
    FailLimit("chat template: nesting deeper than max_depth (" +
              std::to_string(state_.options_.limits.max_depth) + ")");
  }
}

namespace {

std::string TypeQuoted(const Value& v) { return "'" + TypeName(v) + "'"; }

// object_type_repr() of jinja2: how undefined-value messages name an object.
std::string ObjectTypeRepr(const Value& v) {
  switch (v.kind()) {
    case Kind::kNone:
      return "None";
    case Kind::kNamespace:
      return "jinja2.utils.Namespace object";
    case Kind::kLoop:
      return "jinja2.runtime.LoopContext object";
    case Kind::kCallable:
      return v.fn().macro != nullptr ? "jinja2.runtime.Macro object" : "function object";
    default:
      return TypeName(v) + " object";
  }
}

Value MissingAttribute(const Value& obj, std::string_view name) {
  return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no attribute '" + std::string(name) +
                          "'");
}

Value MissingElement(const Value& obj, const Value& key) {
  std::string key_repr;
  switch (key.kind()) {
    case Kind::kInt:
      key_repr = std::to_string(key.integer());
      break;
    case Kind::kBool:
      key_repr = key.boolean() ? "True" : "False";
      break;
    case Kind::kFloat:
      key_repr = PyFloatRepr(key.number());
      break;
    case Kind::kNone:
      key_repr = "None";
      break;
    default:
      key_repr = "<" + TypeName(key) + ">";
  }
  return Value::Undefined(ObjectTypeRepr(obj) + " has no element " + key_repr);
}

Value LoopAttribute(const LoopState& loop, std::string_view name) {
  const int64_t length = static_cast<int64_t>(loop.items->items.size());
  if (name == "index") return Value::Int(loop.index0 + 1);
  if (name == "index0") return Value::Int(loop.index0);
  if (name == "revindex") return Value::Int(length - loop.index0);
  if (name == "revindex0") return Value::Int(length - loop.index0 - 1);
  if (name == "first") return Value::Bool(loop.index0 == 0);
  if (name == "last") return Value::Bool(loop.index0 == length - 1);
  if (name == "length") return Value::Int(length);
  if (name == "depth") return Value::Int(loop.depth0 + 1);
  if (name == "depth0") return Value::Int(loop.depth0);
  if (name == "previtem") {
    if (loop.index0 == 0) return Value::Undefined("there is no previous item");
    return loop.items->items[loop.index0 - 1];
  }
  if (name == "nextitem") {
    if (loop.index0 + 1 >= length) return Value::Undefined("there is no next item");
    return loop.items->items[loop.index0 + 1];
  }
  return Value::Undefined("'jinja2.runtime.LoopContext object' has no attribute '" +
                          std::string(name) + "'");
}

// Python's slice.indices(): the positions a slice visits.
std::vector<int64_t> SliceIndices(int64_t length, const Value& start_v, const Value& stop_v,
                                  const Value& step_v, bool* ok) {
  *ok = true;
  auto given = [](const Value& v) { return !v.is_none(); };
  auto as_int = [ok](const Value& v) -> int64_t {
    if (v.kind() != Kind::kInt && v.kind() != Kind::kBool) {
      *ok = false;
      return 0;
    }
    return v.integer();
  };
  int64_t step = given(step_v) ? as_int(step_v) : 1;
  if (!*ok) return {};
  if (step == 0) Fail("slice step cannot be zero");
  const int64_t lower = step > 0 ? 0 : -1;
  const int64_t upper = step > 0 ? length : length - 1;
  auto adjust = [&](const Value& v, int64_t fallback) -> int64_t {
    if (!given(v)) return fallback;
    int64_t i = as_int(v);
    if (i < 0) {
      i += length;
      if (i < lower) i = lower;
    } else if (i > upper) {
      i = upper;
    }
    return i;
  };
  int64_t start = adjust(start_v, step > 0 ? lower : upper);
  int64_t stop = adjust(stop_v, step > 0 ? upper : lower);
  if (!*ok) return {};
  std::vector<int64_t> out;
  if (step > 0) {
    for (int64_t i = start; i < stop; i += step) out.push_back(i);
  } else {
    for (int64_t i = start; i > stop; i += step) out.push_back(i);
  }
  return out;
}

bool CheckedAdd(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }
bool CheckedSub(int64_t a, int64_t b, int64_t* out) { return !__builtin_sub_overflow(a, b, out); }
bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

[[noreturn]] void FailOverflow() { Fail("integer overflow: this renderer's integers are 64-bit"); }

[[noreturn]] void FailOperands(std::string_view symbol, const Value& a, const Value& b) {
  Fail("unsupported operand type(s) for " + std::string(symbol) + ": " + TypeQuoted(a) + " and " +
       TypeQuoted(b));
}

Value Repeat(const Value& seq, int64_t times, RenderState& state) {
  if (times < 0) times = 0;
  if (seq.is_string()) {
    const std::string& s = seq.str();
    if (!s.empty() && static_cast<uint64_t>(times) > state.limits().max_output_bytes / s.size())
      state.CheckSize(state.limits().max_output_bytes + 1);
    std::string out;
    out.reserve(s.size() * times);
    for (int64_t i = 0; i < times; ++i) out += s;
    return Value::StringLike(seq, std::move(out));
  }
  const List& list = seq.list();
  if (!list.items.empty()) {
    if (static_cast<uint64_t>(times) >
        static_cast<uint64_t>(state.limits().max_loop_iterations) / list.items.size())
      state.Tick(state.limits().max_loop_iterations + 1);
    state.Tick(static_cast<int64_t>(list.items.size()) * times);
  }
  std::vector<Value> out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), list.items.begin(), list.items.end());
  return Value::MakeList(std::move(out), list.tuple);
}

double FloatFloorDiv(double a, double b, double* mod_out) {
  // CPython's float_divmod.
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) {
      mod += b;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, b);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  if (mod_out != nullptr) *mod_out = mod;
  return floordiv;
}

bool NumericEqual(const Value& a, const Value& b) {
  if (a.kind() != Kind::kFloat && b.kind() != Kind::kFloat) return a.integer() == b.integer();
  if (a.kind() == Kind::kFloat && b.kind() == Kind::kFloat) return a.number() == b.number();
  // int vs float: exact, as Python compares them.
  const int64_t i = a.kind() == Kind::kFloat ? b.integer() : a.integer();
  const double d = a.kind() == Kind::kFloat ? a.number() : b.number();
  if (!std::isfinite(d) || d != std::floor(d)) return false;
  if (d < -9223372036854775808.0 || d >= 9223372036854775808.0) return false;
  return static_cast<int64_t>(d) == i;
}

}  // namespace

// ---- conversions

Value FromJson(const nlohmann::ordered_json& json, RenderState& state, int depth) {
  if (depth > state.limits().max_depth) {
    FailLimit("chat template: the context nests deeper than max_depth (" +
              std::to_string(state.limits().max_depth) + ")");
  }
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = json.get<uint64_t>();
      if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return Value::Int(static_cast<int64_t>(u));
      return Value::Float(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(json.get<double>());
    case nlohmann::ordered_json::value_t::string: {
      const auto& s = json.get_ref<const std::string&>();
      if (!ValidUtf8(s)) Fail("chat template: a context string is not valid UTF-8");
      return Value::String(s);
    }
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(json.size());
      for (const auto& item : json) items.push_back(FromJson(item, state, depth + 1));
      return Value::MakeList(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      dict.items.reserve(json.size());
      for (auto it = json.begin(); it != json.end(); ++it) {
        if (!ValidUtf8(it.key())) Fail("chat template: a context key is not valid UTF-8");
        dict.items.emplace_back(it.key(), FromJson(it.value(), state, depth + 1));
      }
      return Value::MakeDict(std::move(dict));
    }
    default:
      Fail("chat template: the context holds a value JSON cannot express (binary)");
  }
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.boolean();
    case Kind::kInt:
      return v.integer() != 0;
    case Kind::kFloat:
      return v.number() != 0;
    case Kind::kString:
      return !v.str().empty();
    case Kind::kList:
      return !v.list().items.empty();
    case Kind::kDict:
      return !v.dict().items.empty();
    default:
      return true;
  }
}

std::string TypeName(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return v.is_markup() ? "Markup" : "str";
    case Kind::kList:
      return v.list().tuple ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kCallable:
      return v.fn().macro != nullptr ? "Macro" : "function";
    case Kind::kLoop:
      return "LoopContext";
  }
  return "object";
}

// ---- comparisons

bool Equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return NumericEqual(a, b);
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.str() == b.str();
    case Kind::kList: {
      const List& x = a.list();
      const List& y = b.list();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!Equal(x.items[i], y.items[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      const Dict& x = a.dict();
      const Dict& y = b.dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [key, value] : x.items) {
        const Value* other = y.Find(key);
        if (other == nullptr || !Equal(value, *other)) return false;
      }
      return true;
    }
    case Kind::kNamespace:
      return &a.ns() == &b.ns();
    case Kind::kCallable:
      return &a.fn() == &b.fn();
    case Kind::kLoop:
      return &a.loop() == &b.loop();
    default:
      return false;
  }
}

int Compare(const Value& a, const Value& b, std::string_view op) {
  if (a.is_undefined()) Fail(a.undefined_message());
  if (b.is_undefined()) Fail(b.undefined_message());
  if (a.is_number() && b.is_number()) {
    if (a.kind() != Kind::kFloat && b.kind() != Kind::kFloat) {
      return a.integer() < b.integer() ? -1 : a.integer() > b.integer() ? 1 : 0;
    }
    const double x = a.number();
    const double y = b.number();
    return x < y ? -1 : x > y ? 1 : 0;  // NaN compares equal here, false both ways in Python
  }
  if (a.is_string() && b.is_string()) {
    const int c = a.str().compare(b.str());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.kind() == Kind::kList && b.kind() == Kind::kList && a.list().tuple == b.list().tuple) {
    const auto& x = a.list().items;
    const auto& y = b.list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equal(x[i], y[i])) return Compare(x[i], y[i], op);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  Fail("'" + std::string(op) + "' not supported between instances of " + TypeQuoted(a) + " and " +
       TypeQuoted(b));
}

bool Contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!item.is_string()) {
        Fail("'in <string>' requires string as left operand, not " + TypeName(item));
      }
      return container.str().find(item.str()) != std::string::npos;
    case Kind::kList:
      for (const Value& v : container.list().items) {
        if (Equal(v, item)) return true;
      }
      return false;
    case Kind::kDict:
      if (item.kind() == Kind::kList || item.kind() == Kind::kDict) {
        Fail("unhashable type: " + TypeQuoted(item));
      }
      return item.is_string() && container.dict().Find(item.str()) != nullptr;
    default:
      Fail("argument of type " + TypeQuoted(container) + " is not iterable");
  }
}

std::vector<Value> Iterate(const Value& v, RenderState& state, bool count) {
  std::vector<Value> out;
  switch (v.kind()) {
    case Kind::kUndefined:
      return out;
    case Kind::kList:
      if (count) state.Tick(static_cast<int64_t>(v.list().items.size()));
      return v.list().items;
    case Kind::kDict:
      if (count) state.Tick(static_cast<int64_t>(v.dict().items.size()));
      for (const auto& item : v.dict().items) out.push_back(Value::String(item.first));
      return out;
    case Kind::kString: {
      const std::string& s = v.str();
      for (size_t pos = 0; pos < s.size();) {
        const size_t start = pos;
        DecodeAt(s, pos);
        out.push_back(Value::String(s.substr(start, pos - start)));
      }
      if (count) state.Tick(static_cast<int64_t>(out.size()));
      return out;
    }
    default:
      Fail(TypeQuoted(v) + " object is not iterable");
  }
}

int64_t Length(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString: {
      int64_t n = 0;  // code points: the bytes that do not continue a sequence
      for (char c : v.str()) n += (static_cast<unsigned char>(c) & 0xc0) != 0x80;
      return n;
    }
    case Kind::kList:
      return static_cast<int64_t>(v.list().items.size());
    case Kind::kDict:
      return static_cast<int64_t>(v.dict().items.size());
    default:
      Fail("object of type " + TypeQuoted(v) + " has no len()");
  }
}

// ---- arithmetic

Value Arithmetic(BinaryOp op, const Value& a, const Value& b, RenderState& state) {
  if (a.is_undefined()) Fail(a.undefined_message());
  if (b.is_undefined()) Fail(b.undefined_message());
  static const char* kSymbols[] = {"+", "-", "*", "/", "//", "%", "** or pow()"};
  const std::string_view symbol = kSymbols[static_cast<int>(op)];
  const bool ints = (a.kind() == Kind::kInt || a.kind() == Kind::kBool) &&
                    (b.kind() == Kind::kInt || b.kind() == Kind::kBool);
  if (a.is_number() && b.is_number()) {
    const int64_t x = a.integer();
    const int64_t y = b.integer();
    const double fx = a.number();
    const double fy = b.number();
    int64_t r = 0;
    switch (op) {
      case BinaryOp::kAdd:
        if (!ints) return Value::Float(fx + fy);
        if (!CheckedAdd(x, y, &r)) FailOverflow();
        return Value::Int(r);
      case BinaryOp::kSub:
        if (!ints) return Value::Float(fx - fy);
        if (!CheckedSub(x, y, &r)) FailOverflow();
        return Value::Int(r);
      case BinaryOp::kMul:
        if (!ints) return Value::Float(fx * fy);
        if (!CheckedMul(x, y, &r)) FailOverflow();
        return Value::Int(r);
      case BinaryOp::kDiv:
        if (fy == 0) Fail(ints ? "division by zero" : "float division by zero");
        return Value::Float(fx / fy);
      case BinaryOp::kFloorDiv:
        if (ints) {
          if (y == 0) Fail("integer division or modulo by zero");
          if (x == std::numeric_limits<int64_t>::min() && y == -1) FailOverflow();
          int64_t q = x / y;
          if (x % y != 0 && ((x < 0) != (y < 0))) --q;
          return Value::Int(q);
        }
        if (fy == 0) Fail("float floor division by zero");
        return Value::Float(FloatFloorDiv(fx, fy, nullptr));
      case BinaryOp::kMod:
        if (ints) {
          if (y == 0) Fail("integer modulo by zero");
          if (y == -1) return Value::Int(0);
          int64_t m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) m += y;
          return Value::Int(m);
        } else {
          if (fy == 0) Fail("float modulo");
          double mod = 0;
          FloatFloorDiv(fx, fy, &mod);
          return Value::Float(mod);
        }
      case BinaryOp::kPow:
        if (ints && y >= 0) {
          int64_t result = 1;
          int64_t base = x;
          for (int64_t e = y; e > 0; e >>= 1) {
            if ((e & 1) != 0 && !CheckedMul(result, base, &result)) FailOverflow();
            if (e > 1 && !CheckedMul(base, base, &base)) FailOverflow();
          }
          return Value::Int(result);
        }
        if (fx == 0 && fy < 0) Fail("0.0 cannot be raised to a negative power");
        if (fx < 0 && fy != std::floor(fy)) {
          Fail("a negative number to a fractional power is complex: not supported");
        }
        return Value::Float(std::pow(fx, fy));
    }
  }
  switch (op) {
    case BinaryOp::kAdd:
      if ((a.is_markup() || b.is_markup()) && a.is_string() && b.is_string()) {
        // Markup + str escapes the str (markupsafe's __add__ / __radd__).
        std::string out = a.is_markup() ? a.str() : HtmlEscape(a.str());
        out += b.is_markup() ? b.str() : HtmlEscape(b.str());
        state.CheckSize(out.size());
        return Value::Markup(std::move(out));
      }
      if (a.is_markup()) FailOperands(symbol, a, b);
      if (a.is_string()) {
        if (!b.is_string()) {
          Fail("can only concatenate str (not \"" + TypeName(b) + "\") to str");
        }
        state.CheckSize(a.str().size() + b.str().size());
        return Value::String(a.str() + b.str());
      }
      if (a.kind() == Kind::kList) {
        if (b.kind() != Kind::kList || b.list().tuple != a.list().tuple) {
          Fail("can only concatenate " + TypeName(a) + " (not \"" + TypeName(b) + "\") to " +
               TypeName(a));
        }
        std::vector<Value> items = a.list().items;
        state.Tick(static_cast<int64_t>(items.size() + b.list().items.size()));
        items.insert(items.end(), b.list().items.begin(), b.list().items.end());
        return Value::MakeList(std::move(items), a.list().tuple);
      }
      break;
    case BinaryOp::kMul: {
      const bool a_seq = a.is_string() || a.kind() == Kind::kList;
      const bool b_seq = b.is_string() || b.kind() == Kind::kList;
      const bool a_int = a.kind() == Kind::kInt || a.kind() == Kind::kBool;
      const bool b_int = b.kind() == Kind::kInt || b.kind() == Kind::kBool;
      if (a_seq && b_int) return Repeat(a, b.integer(), state);
      if (b_seq && a_int) return Repeat(b, a.integer(), state);
      if (a_seq || b_seq) {
        Fail("can't multiply sequence by non-int of type " + TypeQuoted(a_seq ? b : a));
      }
      break;
    }
    case BinaryOp::kMod:
      if (a.is_string()) Fail("printf-style formatting (str % args) is not supported");
      break;
    default:
      break;
  }
  FailOperands(symbol, a, b);
}

Value Negate(const Value& v, bool minus) {
  if (v.is_undefined()) Fail(v.undefined_message());
  if (v.kind() == Kind::kFloat) return Value::Float(minus ? -v.number() : v.number());
  if (v.kind() == Kind::kInt || v.kind() == Kind::kBool) {
    if (!minus) return Value::Int(v.integer());
    if (v.integer() == std::numeric_limits<int64_t>::min()) FailOverflow();
    return Value::Int(-v.integer());
  }
  Fail(std::string("bad operand type for unary ") + (minus ? "-" : "+") + ": " + TypeQuoted(v));
}

// ---- subscripts

Value GetAttr(const Value& obj, std::string_view name) {
  switch (obj.kind()) {
    case Kind::kUndefined:
      Fail(obj.undefined_message());
    case Kind::kDict: {
      const Value* v = obj.dict().Find(name);
      return v != nullptr ? *v : MissingAttribute(obj, name);
    }
    case Kind::kNamespace: {
      const Value* v = obj.ns().attrs.Find(name);
      return v != nullptr ? *v : MissingAttribute(obj, name);
    }
    case Kind::kLoop:
      return LoopAttribute(obj.loop(), name);
    default:
      return MissingAttribute(obj, name);
  }
}

Value GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) Fail(obj.undefined_message());
  if (key.is_undefined()) Fail(key.undefined_message());
  if (key.is_string() && obj.kind() != Kind::kList && obj.kind() != Kind::kString) {
    return GetAttr(obj, key.str());
  }
  const bool int_key = key.kind() == Kind::kInt || key.kind() == Kind::kBool;
  if (obj.kind() == Kind::kList && int_key) {
    const auto& items = obj.list().items;
    int64_t i = key.integer();
    if (i < 0) i += static_cast<int64_t>(items.size());
    if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[i];
  } else if (obj.kind() == Kind::kString && int_key) {
    const std::vector<size_t> offsets = CodepointOffsets(obj.str());
    const int64_t n = static_cast<int64_t>(offsets.size()) - 1;
    int64_t i = key.integer();
    if (i < 0) i += n;
    if (i >= 0 && i < n)
      return Value::StringLike(obj, obj.str().substr(offsets[i], offsets[i + 1] - offsets[i]));
  } else if (key.is_string()) {
    return MissingAttribute(obj, key.str());
  }
  return MissingElement(obj, key);
}

Value GetSlice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  // jinja2 compiles slices to Python's own subscript, without the fallbacks
  // of getitem: slicing what is not a sequence is an error.
  if (obj.is_undefined()) Fail(obj.undefined_message());
  if (obj.kind() == Kind::kDict) Fail("unhashable type: 'slice'");
  if (obj.kind() != Kind::kList && !obj.is_string()) {
    Fail("'" + TypeName(obj) + "' object is not subscriptable");
  }
  for (const Value* part : {&start, &stop, &step}) {
    if (part->is_undefined()) Fail(part->undefined_message());
  }
  bool ok = true;
  std::vector<int64_t> at;
  std::vector<size_t> offsets;
  if (obj.kind() == Kind::kList) {
    at = SliceIndices(static_cast<int64_t>(obj.list().items.size()), start, stop, step, &ok);
  } else {
    offsets = CodepointOffsets(obj.str());
    at = SliceIndices(static_cast<int64_t>(offsets.size()) - 1, start, stop, step, &ok);
  }
  if (!ok) Fail("slice indices must be integers or None or have an __index__ method");
  if (obj.kind() == Kind::kList) {
    const auto& items = obj.list().items;
    std::vector<Value> out;
    out.reserve(at.size());
    for (int64_t i : at) out.push_back(items[i]);
    return Value::MakeList(std::move(out), obj.list().tuple);
  }
  const std::string& s = obj.str();
  std::string out;
  for (int64_t i : at) out.append(s, offsets[i], offsets[i + 1] - offsets[i]);
  return Value::StringLike(obj, std::move(out));
}

}  // namespace hearth::llm::jinja
