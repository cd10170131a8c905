// backend: llm — the inside of chat_template.h: the values a template
// computes with, the syntax tree the parser builds, and the entry points the
// four implementation files share:
//
//   chat_template_value.cc     values: equality, ordering, arithmetic,
//                              subscripts, the context's JSON
//   chat_template_format.cc    Unicode, and what Python's str(), repr() and
//                              json.dumps print
//   chat_template_strings.cc   Python's str operations (strip, split, ...)
//   chat_template_lexer.cc     tokens, whitespace control, trim_blocks and
//                              lstrip_blocks
//   chat_template_parser.cc    the syntax tree
//   chat_template_eval.cc      the renderer: statements, expressions, scopes
//   chat_template_filters.cc   filters
//   chat_template_builtins.cc  tests, methods and global functions
//
// Errors travel as TemplateError exceptions inside these files only;
// ChatTemplate's API (chat_template.cc) turns them into a Status. Nothing
// here is thread-affine: a Program is immutable once parsed, and each render
// owns its RenderState and its values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ctime>
#include <initializer_list>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "backends/llm/chat_template.h"

namespace hearth::llm::jinja {

// A parse or render failure. `message` is what the caller sees.
struct TemplateError {
  StatusCode code = StatusCode::kInvalidArgument;
  std::string message;
  bool located = false;  // message final: has its line, or is raise_exception's own
};
[[noreturn]] void Fail(std::string message);       // InvalidArgument
[[noreturn]] void FailLimit(std::string message);  // ResourceExhausted

class Value;
struct Stmt;

struct List {
  std::vector<Value> items;
  bool tuple = false;  // prints as (a, b) instead of [a, b]
};

// Python dicts keep insertion order; keys are strings (JSON objects and the
// template's dict literals with string keys).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* Find(std::string_view key) const;
  void Set(std::string key, Value value);  // replaces in place, else appends
};

// namespace(): the one mutable object a template can make ({% set ns.x = 1 %}).
struct Namespace {
  Dict attrs;
};

// The global functions, and macros the template defines.
enum class Builtin { kRaiseException, kStrftimeNow, kRange, kDict, kNamespace };
struct Callable {
  std::string name;
  std::optional<Builtin> builtin;
  const Stmt* macro = nullptr;  // a kMacro statement of the Program being rendered
};

// `loop` inside a for body.
struct LoopState {
  std::shared_ptr<const List> items;  // what the loop iterates (after its `if`)
  int64_t index0 = 0;
  int64_t depth0 = 0;
};

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kDict,
  kNamespace,
  kCallable,
  kLoop,
};

// A template value. Cheap to copy: strings, lists and dicts are shared and
// immutable (the sandbox transformers renders in forbids changing them);
// a namespace is shared and mutable, as in Python.
//
// Integers are int64 (Python's are unbounded: overflow is an error here).
// An undefined value carries the error jinja2 would raise when it is used
// where a value is needed ("'x' is undefined").
class Value {
 public:
  Value() = default;  // undefined, without a name
  static Value Undefined(std::string hint);
  static Value None();
  static Value Bool(bool b);
  static Value Int(int64_t i);
  static Value Float(double f);
  static Value String(std::string s);
  // markupsafe's Markup (what |safe and |escape give): a string that
  // escapes the plain strings added to it.
  static Value Markup(std::string s);
  // `s` as a string that is Markup when `like` is.
  static Value StringLike(const Value& like, std::string s);
  static Value MakeList(std::vector<Value> items, bool tuple = false);
  static Value MakeDict(Dict dict);
  static Value MakeNamespace(std::shared_ptr<Namespace> ns);
  static Value MakeCallable(Callable fn);
  static Value MakeLoop(std::shared_ptr<LoopState> loop);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && b_; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }
  bool is_sequence() const { return kind_ == Kind::kList; }  // list or tuple

  bool boolean() const { return b_; }
  int64_t integer() const { return kind_ == Kind::kBool ? (b_ ? 1 : 0) : i_; }
  double number() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(integer()); }
  const std::string& str() const { return *std::get<std::shared_ptr<const std::string>>(ptr_); }
  const List& list() const { return *std::get<std::shared_ptr<const List>>(ptr_); }
  std::shared_ptr<const List> list_ptr() const {
    return std::get<std::shared_ptr<const List>>(ptr_);
  }
  const Dict& dict() const { return *std::get<std::shared_ptr<const Dict>>(ptr_); }
  Namespace& ns() const { return *std::get<std::shared_ptr<Namespace>>(ptr_); }
  const Callable& fn() const { return *std::get<std::shared_ptr<const Callable>>(ptr_); }
  const LoopState& loop() const { return *std::get<std::shared_ptr<LoopState>>(ptr_); }
  // The message of the error using this undefined value raises.
  std::string undefined_message() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool b_ = false;  // a bool's value; for a string, whether it is Markup
  int64_t i_ = 0;
  double f_ = 0;
  std::variant<std::monostate, std::shared_ptr<const std::string>, std::shared_ptr<const List>,
               std::shared_ptr<const Dict>, std::shared_ptr<Namespace>,
               std::shared_ptr<const Callable>, std::shared_ptr<LoopState>>
      ptr_;
};

// One render's budget (ChatTemplateLimits) and clock.
class RenderState {
 public:
  explicit RenderState(const ChatTemplateOptions& options) : options_(options) {}
  // Counts `n` steps of loop work against max_loop_iterations.
  void Tick(int64_t n = 1);
  // Refuses a string (or output) of `bytes` past max_output_bytes.
  void CheckSize(size_t bytes) const;
  std::tm Now() const;
  const ChatTemplateLimits& limits() const { return options_.limits; }

  // Scoped nesting of evaluation (statements, expressions, macro calls).
  class Nest {
   public:
    explicit Nest(RenderState& state);
    ~Nest() { --state_.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    RenderState& state_;
  };

 private:
  const ChatTemplateOptions& options_;
  int64_t steps_ = 0;
  int depth_ = 0;
};

using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

// ---- values (chat_template_value.cc, chat_template_format.cc)

// The context's JSON as template values (null -> None, objects keep their
// order). Integers past int64 become floats.
Value FromJson(const nlohmann::ordered_json& json, RenderState& state, int depth = 0);
bool Truthy(const Value& v);
// Python's type(v).__name__, for messages.
std::string TypeName(const Value& v);
// str(v) as {{ v }} prints it (undefined prints nothing).
std::string PyStr(const Value& v, RenderState& state);
std::string PyRepr(const Value& v, RenderState& state);
std::string PyFloatRepr(double d);

struct JsonOptions {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // Python's indent, as the string one level adds
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
// Python's json.dumps(v, ...) (transformers' tojson filter).
std::string ToJson(const Value& v, const JsonOptions& options, RenderState& state);

bool Equal(const Value& a, const Value& b);
// -1, 0, 1 as Python orders a and b; TypeError when they do not compare.
int Compare(const Value& a, const Value& b, std::string_view op);
// `item in container`.
bool Contains(const Value& container, const Value& item);
// The items a for loop (or list()) visits: list items, dict keys, string
// characters; nothing for undefined. TypeError otherwise. Counts one step per
// item unless `count` is false (a for loop counts its iterations itself).
std::vector<Value> Iterate(const Value& v, RenderState& state, bool count = true);
// len(v); TypeError for values without one.
int64_t Length(const Value& v);

enum class BinaryOp { kAdd, kSub, kMul, kDiv, kFloorDiv, kMod, kPow };
Value Arithmetic(BinaryOp op, const Value& a, const Value& b, RenderState& state);
Value Negate(const Value& v, bool minus);

// obj.name and obj[key] with jinja2's fallbacks: a missing key or attribute
// gives an undefined value naming it; using an undefined object is an error.
Value GetAttr(const Value& obj, std::string_view name);
Value GetItem(const Value& obj, const Value& key);
// obj[start:stop:step]; omitted parts are None. Python's own slicing: an error
// for what is not a str, list or tuple.
Value GetSlice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Whether `s` is UTF-8 (no stray bytes, surrogates or overlong forms);
// else the offset of the first bad sequence in *bad_offset.
bool ValidUtf8(std::string_view s, size_t* bad_offset = nullptr);
// Unicode: strings are UTF-8; lengths, indexes and slices count code points
// as Python's do. Malformed bytes count as one code point each.
std::vector<size_t> CodepointOffsets(std::string_view s);  // plus s.size() at the end
char32_t DecodeAt(std::string_view s, size_t& pos);
void AppendUtf8(std::string& out, char32_t cp);
bool IsPySpace(char32_t cp);

// ---- tokens (chat_template_lexer.cc)

enum class Tok {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type = Tok::kEof;
  std::string value;  // data, name, string (unescaped), operator
  int64_t int_value = 0;
  double float_value = 0;
  size_t offset = 0;  // in the normalized source
};

// Line and column (1-based, columns in code points) of offsets in a source.
class Positions {
 public:
  explicit Positions(std::string_view source);
  int Line(size_t offset) const;
  int Column(size_t offset) const;
  // Throws TemplateError "line L, column C: message".
  [[noreturn]] void FailAt(size_t offset, const std::string& message) const;

 private:
  std::string_view source_;
  std::vector<size_t> line_starts_;
};

// The tokens of a template whose newlines are already "\n" (ParseProgram
// normalizes them), ending with kEof. Throws TemplateError.
std::vector<Token> Lex(std::string_view source, const Positions& positions);

// ---- syntax tree (chat_template_parser.cc builds it)

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

enum class CompareOp { kEq, kNe, kLt, kLe, kGt, kGe, kIn, kNotIn };

struct Expr {
  enum class Type {
    kLiteral,  // literal
    kName,     // name
    kList,     // children: items
    kTuple,    // children: items
    kDict,     // children: key, value, key, value, ...
    kGetAttr,  // children[0].name
    kGetItem,  // children[0][children[1]]
    kSlice,    // children[0][children[1]:children[2]:children[3]] (null when omitted)
    kCall,     // children[0](children[1..], kwargs)
    kFilter,   // children[0] | name(children[1..], kwargs)
    kTest,     // children[0] is [not] name(children[1..], kwargs)
    kNeg,      // -children[0] (name "+" for unary plus)
    kNot,      // not children[0]
    kAnd,      // children[0] and children[1]
    kOr,       // children[0] or children[1]
    kBinary,   // children[0] op children[1]
    kConcat,   // children joined with ~
    kCompare,  // children[0] ops[0] children[1] ops[1] children[2] ...
    kCond,     // children[1] if children[0] else children[2] (null: undefined)
  };
  Type type;
  int line = 0;
  int column = 0;
  Value literal;
  std::string name;
  bool negated = false;
  BinaryOp op = BinaryOp::kAdd;
  std::vector<CompareOp> ops;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

// What set and for assign to: a name, a tuple of names, or ns.attr.
struct Target {
  std::vector<std::string> names;
  bool tuple = false;
  std::string attr;  // non-empty: names[0].attr (namespace assignment)
};

using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Type {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // branches (cond, body); else_body
    kFor,          // for target in expr [if cond] ... else ...
    kSet,          // set target = expr
    kSetBlock,     // set target [| filter] ... endset: expr is the filter (operand null)
    kMacro,        // macro name(params=defaults) body
    kFilterBlock,  // filter ... endfilter: expr is the filter (operand null)
    kWith,         // with names = exprs: body
    kScope,        // a body run in its own scope ({% generation %})
    kBreak,
    kContinue,
  };
  Type type;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  Target target;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::string name;                 // macro name
  std::vector<std::string> params;  // macro parameters, with names (with)
  std::vector<ExprPtr> defaults;    // macro defaults (for the last params), with values
};

struct Program {
  Body body;
};

// Parses a template as transformers configures jinja2 (trim_blocks,
// lstrip_blocks, a trailing newline dropped). Throws TemplateError
// "line L, column C: ..." on a syntax error or a filter or test this subset
// lacks.
std::unique_ptr<Program> ParseProgram(std::string_view source);
bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

// ---- rendering (chat_template_eval.cc)

std::string RenderProgram(const Program& program, const nlohmann::ordered_json& context,
                          RenderState& state);

// ---- filters, tests, methods, globals (chat_template_filters.cc,
// chat_template_builtins.cc)

Value ApplyFilter(std::string_view name, const Value& operand, const Args& args,
                  const Kwargs& kwargs, RenderState& state);
bool ApplyTest(std::string_view name, const Value& operand, const Args& args, const Kwargs& kwargs,
               RenderState& state);
// obj.name(args): nullopt when obj has no such method.
std::optional<Value> CallMethod(const Value& obj, std::string_view name, const Args& args,
                                const Kwargs& kwargs, RenderState& state);
Value CallBuiltin(Builtin builtin, const Args& args, const Kwargs& kwargs, RenderState& state);
// dict|items and dict.items(): (key, value) tuples; none for undefined.
Value Items(const Value& v);

// Positional `index` or keyword `name` of a call; nullopt when neither.
std::optional<Value> Arg(const Args& args, const Kwargs& kwargs, size_t index,
                         std::string_view name);
// Refuses positional arguments past `max_positional` and keywords not in `names`.
void CheckSignature(std::string_view what, const Args& args, const Kwargs& kwargs,
                    size_t max_positional, std::initializer_list<std::string_view> names);
std::string StrArg(const std::optional<Value>& v, std::string_view what);
inline bool IsIntLike(const Value& v) { return v.kind() == Kind::kInt || v.kind() == Kind::kBool; }

// ---- Python's str operations (chat_template_strings.cc): code points,
// case changes of ASCII letters only.

std::vector<char32_t> Decode(std::string_view s);
std::string Encode(const std::vector<char32_t>& cps, size_t from = 0, size_t to = SIZE_MAX);
inline bool IsLowerAscii(char32_t c) { return c >= 'a' && c <= 'z'; }
inline bool IsUpperAscii(char32_t c) { return c >= 'A' && c <= 'Z'; }
inline char32_t ToUpper(char32_t c) { return IsLowerAscii(c) ? c - 32 : c; }
inline char32_t ToLower(char32_t c) { return IsUpperAscii(c) ? c + 32 : c; }
inline bool IsCased(char32_t c) { return IsLowerAscii(c) || IsUpperAscii(c); }
std::string MapCase(const std::string& s, char32_t (*f)(char32_t));
std::string Capitalize(const std::string& s);  // str.capitalize()
std::string PyTitle(const std::string& s);     // str.title()
std::string JinjaTitle(const std::string& s);  // the title filter
// str.strip/lstrip/rstrip(chars): whitespace when chars is unset or None.
std::string Strip(const std::string& s, const std::optional<Value>& chars, bool left, bool right);
Value StringList(std::vector<std::string> parts);
// str.split / str.rsplit(sep, maxsplit); maxsplit < 0: no limit.
std::vector<std::string> Split(const std::string& s, const std::optional<Value>& sep,
                               int64_t maxsplit, bool from_right);
std::vector<std::string> SplitLines(const std::string& s, bool keepends);
// str.replace(old, new, count); count < 0: all. Refuses results past max_output_bytes.
std::string Replace(const std::string& s, const std::string& old_s, const std::string& new_s,
                    int64_t count, RenderState& state);
int64_t CodepointIndex(const std::string& s, size_t byte_offset);
// str.startswith / endswith with a string or a tuple of strings.
bool AffixMatch(const std::string& s, const Value& affix, bool prefix, std::string_view method);
std::string HtmlEscape(const std::string& s);  // markupsafe's escape
// jinja2's indent filter.
std::string Indent(const std::string& s, const Value& width, bool first, bool blank);
// int(text, base) and float(text) as Python reads them; nullopt where Python raises.
std::optional<int64_t> ParsePyInt(const std::string& text, int base);
std::optional<double> ParsePyFloat(const std::string& text);

}  // namespace hearth::llm::jinja
