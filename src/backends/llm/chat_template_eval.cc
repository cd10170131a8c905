// The renderer: runs a parsed chat template over a context with jinja2's
// scoping (a for body gets a fresh scope per iteration, `if` does not make
// one, macros see the template's top level) and the limits of
// ChatTemplateLimits.
#include <utility>

#include "backends/llm/chat_template_internal.h"

namespace hearth::llm::jinja {
namespace {

enum class Flow { kNormal, kBreak, kContinue };

// One scope of variables; lookups continue in `parent`.
struct Frame {
  explicit Frame(const Frame* parent_frame) : parent(parent_frame) {}
  const Frame* parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* FindHere(std::string_view name) const {
    for (const auto& [k, v] : vars) {
      if (k == name) return &v;
    }
    return nullptr;
  }
  void Set(const std::string& name, Value value) {
    for (auto& [k, v] : vars) {
      if (k == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }
};

class Renderer {
 public:
  Renderer(const Dict& context, RenderState& state) : context_(context), state_(state) {}

  void Run(const Program& program, std::string& out) { ExecBody(program.body, root_, out); }

 private:
  // ---- statements

  Flow ExecBody(const Body& body, Frame& frame, std::string& out) {
    for (const StmtPtr& s : body) {
      const Flow flow = Exec(*s, frame, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow Exec(const Stmt& s, Frame& frame, std::string& out) {
    RenderState::Nest nest(state_);
    try {
      return ExecUnlocated(s, frame, out);
    } catch (TemplateError& e) {
      // The innermost statement names the line of a runtime error; the
      // template's own raise_exception messages stay as written.
      if (!e.located && e.code == StatusCode::kInvalidArgument) {
        e.message = "chat template line " + std::to_string(s.line) + ": " + e.message;
        e.located = true;
      }
      throw;
    }
  }

  Flow ExecUnlocated(const Stmt& s, Frame& frame, std::string& out) {
    switch (s.type) {
      case Stmt::Type::kText:
        Append(out, s.text);
        return Flow::kNormal;
      case Stmt::Type::kOutput: {
        const Value v = Eval(*s.expr, frame);
        if (v.is_string()) {
          Append(out, v.str());
        } else {
          Append(out, PyStr(v, state_));
        }
        return Flow::kNormal;
      }
      case Stmt::Type::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (Truthy(Eval(*cond, frame))) return ExecBody(body, frame, out);
        }
        return ExecBody(s.else_body, frame, out);
      case Stmt::Type::kFor:
        return ExecFor(s, frame, out);
      case Stmt::Type::kSet:
        Assign(s.target, Eval(*s.expr, frame), frame);
        return Flow::kNormal;
      case Stmt::Type::kSetBlock: {
        std::string captured;
        ExecBody(s.body, frame, captured);
        Value v = Value::String(std::move(captured));
        if (s.expr) v = ApplyFilterChain(*s.expr, std::move(v), frame);
        Assign(s.target, std::move(v), frame);
        return Flow::kNormal;
      }
      case Stmt::Type::kMacro: {
        Callable fn;
        fn.name = s.name;
        fn.macro = &s;
        frame.Set(s.name, Value::MakeCallable(std::move(fn)));
        return Flow::kNormal;
      }
      case Stmt::Type::kFilterBlock: {
        std::string captured;
        ExecBody(s.body, frame, captured);
        const Value v = ApplyFilterChain(*s.expr, Value::String(std::move(captured)), frame);
        Append(out, PyStr(v, state_));
        return Flow::kNormal;
      }
      case Stmt::Type::kWith: {
        Frame inner(&frame);
        for (size_t i = 0; i < s.params.size(); ++i) {
          inner.Set(s.params[i], Eval(*s.defaults[i], frame));
        }
        ExecBody(s.body, inner, out);
        return Flow::kNormal;
      }
      case Stmt::Type::kScope: {
        Frame inner(&frame);
        ExecBody(s.body, inner, out);
        return Flow::kNormal;
      }
      case Stmt::Type::kBreak:
        return Flow::kBreak;
      case Stmt::Type::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  Flow ExecFor(const Stmt& s, Frame& frame, std::string& out) {
    std::vector<Value> items = Iterate(Eval(*s.expr, frame), state_, /*count=*/false);
    if (s.cond) {
      std::vector<Value> kept;
      for (Value& item : items) {
        state_.Tick();
        Frame probe(&frame);
        Assign(s.target, item, probe);
        if (Truthy(Eval(*s.cond, probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return ExecBody(s.else_body, frame, out);
    auto list = std::make_shared<List>();
    list->items = std::move(items);
    std::shared_ptr<const List> shared = list;
    for (size_t i = 0; i < shared->items.size(); ++i) {
      state_.Tick();
      Frame iteration(&frame);
      auto loop = std::make_shared<LoopState>();
      loop->items = shared;
      loop->index0 = static_cast<int64_t>(i);
      iteration.Set("loop", Value::MakeLoop(std::move(loop)));
      Assign(s.target, shared->items[i], iteration);
      if (ExecBody(s.body, iteration, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  void Assign(const Target& target, Value value, Frame& frame) {
    if (!target.attr.empty()) {
      const Value ns = Lookup(target.names[0], frame);
      if (ns.kind() != Kind::kNamespace) Fail("cannot assign attribute on non-namespace object");
      ns.ns().attrs.Set(target.attr, std::move(value));
      return;
    }
    if (!target.tuple) {
      frame.Set(target.names[0], std::move(value));
      return;
    }
    std::vector<Value> items = Iterate(value, state_);
    const size_t n = target.names.size();
    if (items.size() > n) Fail("too many values to unpack (expected " + std::to_string(n) + ")");
    if (items.size() < n) {
      Fail("not enough values to unpack (expected " + std::to_string(n) + ", got " +
           std::to_string(items.size()) + ")");
    }
    for (size_t i = 0; i < n; ++i) frame.Set(target.names[i], std::move(items[i]));
  }

  void Append(std::string& out, std::string_view text) {
    state_.CheckSize(out.size() + text.size());
    out.append(text);
  }

  // ---- expressions

  Value Lookup(const std::string& name, const Frame& frame) const {
    for (const Frame* f = &frame; f != nullptr; f = f->parent) {
      if (const Value* v = f->FindHere(name)) return *v;
    }
    if (const Value* v = context_.Find(name)) return *v;
    static const std::pair<const char*, Builtin> kGlobals[] = {
        {"raise_exception", Builtin::kRaiseException},
        {"strftime_now", Builtin::kStrftimeNow},
        {"range", Builtin::kRange},
        {"dict", Builtin::kDict},
        {"namespace", Builtin::kNamespace},
    };
    for (const auto& [global, builtin] : kGlobals) {
      if (name == global) {
        Callable fn;
        fn.name = global;
        fn.builtin = builtin;
        return Value::MakeCallable(std::move(fn));
      }
    }
    return Value::Undefined("'" + name + "' is undefined");
  }

  Value Eval(const Expr& e, Frame& frame) {
    RenderState::Nest nest(state_);
    switch (e.type) {
      case Expr::Type::kLiteral:
        return e.literal;
      case Expr::Type::kName:
        return Lookup(e.name, frame);
      case Expr::Type::kList:
      case Expr::Type::kTuple: {
        std::vector<Value> items;
        items.reserve(e.children.size());
        state_.Tick(static_cast<int64_t>(e.children.size()));
        for (const ExprPtr& child : e.children) items.push_back(Eval(*child, frame));
        return Value::MakeList(std::move(items), e.type == Expr::Type::kTuple);
      }
      case Expr::Type::kDict: {
        Dict dict;
        state_.Tick(static_cast<int64_t>(e.children.size() / 2));
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          Value key = Eval(*e.children[i], frame);
          if (!key.is_string()) Fail("dict literal keys must be strings in this renderer");
          dict.Set(key.str(), Eval(*e.children[i + 1], frame));
        }
        return Value::MakeDict(std::move(dict));
      }
      case Expr::Type::kGetAttr:
        return GetAttr(Eval(*e.children[0], frame), e.name);
      case Expr::Type::kGetItem: {
        const Value obj = Eval(*e.children[0], frame);
        return GetItem(obj, Eval(*e.children[1], frame));
      }
      case Expr::Type::kSlice: {
        const Value obj = Eval(*e.children[0], frame);
        Value parts[3] = {Value::None(), Value::None(), Value::None()};  // omitted: None
        for (int i = 0; i < 3; ++i) {
          if (e.children[i + 1]) parts[i] = Eval(*e.children[i + 1], frame);
        }
        return GetSlice(obj, parts[0], parts[1], parts[2]);
      }
      case Expr::Type::kCall:
        return EvalCall(e, frame);
      case Expr::Type::kFilter: {
        const Value operand = Eval(*e.children[0], frame);
        return ApplyOneFilter(e, operand, frame);
      }
      case Expr::Type::kTest: {
        const Value operand = Eval(*e.children[0], frame);
        Args args;
        Kwargs kwargs;
        EvalArgs(e, 1, frame, &args, &kwargs);
        const bool result = ApplyTest(e.name, operand, args, kwargs, state_);
        return Value::Bool(result != e.negated);
      }
      case Expr::Type::kNeg:
        return Negate(Eval(*e.children[0], frame), e.name == "-");
      case Expr::Type::kNot:
        return Value::Bool(!Truthy(Eval(*e.children[0], frame)));
      case Expr::Type::kAnd: {
        Value left = Eval(*e.children[0], frame);
        if (!Truthy(left)) return left;
        return Eval(*e.children[1], frame);
      }
      case Expr::Type::kOr: {
        Value left = Eval(*e.children[0], frame);
        if (Truthy(left)) return left;
        return Eval(*e.children[1], frame);
      }
      case Expr::Type::kBinary: {
        const Value left = Eval(*e.children[0], frame);
        const Value right = Eval(*e.children[1], frame);
        return Arithmetic(e.op, left, right, state_);
      }
      case Expr::Type::kConcat: {
        std::string s;
        for (const ExprPtr& child : e.children) {
          const Value v = Eval(*child, frame);
          const std::string part = PyStr(v, state_);
          state_.CheckSize(s.size() + part.size());
          s += part;
        }
        return Value::String(std::move(s));
      }
      case Expr::Type::kCompare:
        return Value::Bool(EvalCompare(e, frame));
      case Expr::Type::kCond:
        if (Truthy(Eval(*e.children[0], frame))) return Eval(*e.children[1], frame);
        if (e.children[2]) return Eval(*e.children[2], frame);
        return Value::Undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
    }
    return Value();
  }

  bool EvalCompare(const Expr& e, Frame& frame) {
    Value left = Eval(*e.children[0], frame);
    for (size_t i = 0; i < e.ops.size(); ++i) {
      Value right = Eval(*e.children[i + 1], frame);
      bool ok = false;
      switch (e.ops[i]) {
        case CompareOp::kEq:
          ok = Equal(left, right);
          break;
        case CompareOp::kNe:
          ok = !Equal(left, right);
          break;
        case CompareOp::kLt:
          ok = Compare(left, right, "<") < 0;
          break;
        case CompareOp::kLe:
          ok = Compare(left, right, "<=") <= 0;
          break;
        case CompareOp::kGt:
          ok = Compare(left, right, ">") > 0;
          break;
        case CompareOp::kGe:
          ok = Compare(left, right, ">=") >= 0;
          break;
        case CompareOp::kIn:
          ok = Contains(right, left);
          break;
        case CompareOp::kNotIn:
          ok = !Contains(right, left);
          break;
      }
      if (!ok) return false;
      left = std::move(right);
    }
    return true;
  }

  // children[first..] and kwargs of a call, filter or test.
  void EvalArgs(const Expr& e, size_t first, Frame& frame, Args* args, Kwargs* kwargs) {
    for (size_t i = first; i < e.children.size(); ++i) args->push_back(Eval(*e.children[i], frame));
    for (const auto& [key, expr] : e.kwargs) kwargs->emplace_back(key, Eval(*expr, frame));
  }

  Value ApplyOneFilter(const Expr& e, const Value& operand, Frame& frame) {
    Args args;
    Kwargs kwargs;
    EvalArgs(e, 1, frame, &args, &kwargs);
    return ApplyFilter(e.name, operand, args, kwargs, state_);
  }

  // A filter chain whose innermost operand slot is empty (set and filter
  // blocks) applied to `value`.
  Value ApplyFilterChain(const Expr& e, Value value, Frame& frame) {
    if (e.children[0]) value = ApplyFilterChain(*e.children[0], std::move(value), frame);
    return ApplyOneFilter(e, value, frame);
  }

  Value EvalCall(const Expr& e, Frame& frame) {
    const Expr& callee = *e.children[0];
    if (callee.type == Expr::Type::kGetAttr) {
      // obj.method(...): Python's methods of str, dict and the loop come
      // before keys of the same name, as getattr() finds them first.
      const Value obj = Eval(*callee.children[0], frame);
      if (obj.is_undefined()) Fail(obj.undefined_message());
      Args args;
      Kwargs kwargs;
      EvalArgs(e, 1, frame, &args, &kwargs);
      if (std::optional<Value> result = CallMethod(obj, callee.name, args, kwargs, state_)) {
        return std::move(*result);
      }
      return CallValue(GetAttr(obj, callee.name), args, kwargs);
    }
    const Value fn = Eval(callee, frame);
    Args args;
    Kwargs kwargs;
    EvalArgs(e, 1, frame, &args, &kwargs);
    return CallValue(fn, args, kwargs);
  }

  Value CallValue(const Value& fn, const Args& args, const Kwargs& kwargs) {
    if (fn.is_undefined()) Fail(fn.undefined_message());
    if (fn.kind() != Kind::kCallable) Fail("'" + TypeName(fn) + "' object is not callable");
    const Callable& callable = fn.fn();
    if (callable.builtin) return CallBuiltin(*callable.builtin, args, kwargs, state_);
    return CallMacro(*callable.macro, args, kwargs);
  }

  Value CallMacro(const Stmt& macro, const Args& args, const Kwargs& kwargs) {
    RenderState::Nest nest(state_);
    const size_t n = macro.params.size();
    if (args.size() > n) {
      Fail("macro '" + macro.name + "' takes not more than " + std::to_string(n) + " argument(s)");
    }
    for (const auto& [key, value] : kwargs) {
      bool known = false;
      for (size_t i = args.size(); i < n; ++i) known = known || macro.params[i] == key;
      if (!known) Fail("macro '" + macro.name + "' takes no keyword argument '" + key + "'");
    }
    Frame frame(&root_);
    const size_t first_default = n - macro.defaults.size();
    for (size_t i = 0; i < n; ++i) {
      const std::string& param = macro.params[i];
      if (i < args.size()) {
        frame.Set(param, args[i]);
        continue;
      }
      const Value* given = nullptr;
      for (const auto& [key, value] : kwargs) {
        if (key == param) given = &value;
      }
      if (given != nullptr) {
        frame.Set(param, *given);
      } else if (i >= first_default) {
        frame.Set(param, Eval(*macro.defaults[i - first_default], frame));
      } else {
        frame.Set(param, Value::Undefined("parameter '" + param + "' was not provided"));
      }
    }
    std::string out;
    ExecBody(macro.body, frame, out);
    return Value::String(std::move(out));
  }

  const Dict& context_;
  RenderState& state_;
  Frame root_{nullptr};
};

}  // namespace

std::string RenderProgram(const Program& program, const nlohmann::ordered_json& context,
                          RenderState& state) {
  if (!context.is_object()) Fail("chat template: the context must be a JSON object");
  const Value vars = FromJson(context, state);
  Renderer renderer(vars.dict(), state);
  std::string out;
  renderer.Run(program, out);
  return out;
}

}  // namespace hearth::llm::jinja
